"""Aggregation rules by name: the name used by the job builder, the exported config and the CLI."""

from __future__ import annotations

from typing import Any

from aggregators.fedavg import FedAvg
from aggregators.feddyn import FedDyn
from aggregators.scaffold import Scaffold
from aggregators.types import AggregationError, AggregationRule

RULES: dict[str, type] = {FedAvg.name: FedAvg, Scaffold.name: Scaffold}
RULES[FedDyn.name] = FedDyn


def build_rule(name: str, **kwargs: Any) -> AggregationRule:
    """Instantiate the rule called ``name`` with its hyperparameters; unknown names list the valid ones."""
    try:
        rule_cls = RULES[name]
    except KeyError:
        raise AggregationError(f"unknown aggregation rule '{name}'; choose one of {sorted(RULES)}") from None
    try:
        return rule_cls(**kwargs)
    except TypeError as exc:
        raise AggregationError(f"bad hyperparameters for rule '{name}': {exc}") from None
