"""Aggregation rules by name: the name used by the job builder, the exported config and the CLI."""

from __future__ import annotations

from typing import Any

from aggregators.attack_adaptive import AttackAdaptive
from aggregators.fedadp import FedAdp
from aggregators.fedatt import FedAtt
from aggregators.fedavg import FedAvg
from aggregators.feddyn import FedDyn
from aggregators.fedmos import FedMoS
from aggregators.fednova import FedNova
from aggregators.fedopt import FEDOPT_RULES
from aggregators.krum import Krum
from aggregators.median import Median
from aggregators.scaffold import Scaffold
from aggregators.trimmed_mean import TrimmedMean
from aggregators.types import AggregationError, AggregationRule

RULES: dict[str, type] = {FedAvg.name: FedAvg, Scaffold.name: Scaffold}
RULES[FedDyn.name] = FedDyn
# FedMoS: server momentum and client selection by data share.
RULES[FedMoS.name] = FedMoS
# Server optimizers and re-weighting rules: FedAdam, FedYogi, FedAdagrad, FedAvgM, FedNova, FedAtt, FedAdp.
RULES.update({rule.name: rule for rule in (*FEDOPT_RULES, FedNova, FedAtt, FedAdp)})
# Byzantine-robust rules.
RULES.update({rule.name: rule for rule in (Median, TrimmedMean, Krum, AttackAdaptive)})


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
