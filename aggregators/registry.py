"""Aggregation rules by name: the name used by the job builder, the exported config and the CLI."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from aggregators.attack_adaptive import AttackAdaptive
from aggregators.contracts.hparams import HParams
from aggregators.dp_fedavg import DPFedAvg
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
# Client-level differential privacy: clipped, noised sum under FedAvg or a FedOpt server optimizer.
RULES[DPFedAvg.name] = DPFedAvg


def unknown_setting_problem(owner: str, given: Iterable[str], allowed: Sequence[str]) -> str | None:
    """One line for the keys of ``given`` outside ``allowed`` (``None`` when there are none), worded alike for the
    server rules, the client algorithms and the job's own settings."""
    unknown = [key for key in given if key not in allowed]
    if not unknown:
        return None
    names = ", ".join(repr(key) for key in unknown)
    what = "setting" if len(unknown) == 1 else "settings"
    return f"{owner} has no {what} {names}; " + (f"allowed: {', '.join(allowed)}" if allowed else "it takes none")


def rule_settings(rule_cls: type) -> tuple[str, ...] | None:
    """The hyperparameters a rule's constructor takes, from its declaration (`aggregators.contracts.hparams.HParams`,
    as for the client algorithms), in declaration order (``None`` for a rule that declares none that way: its
    constructor checks its own arguments)."""
    if not (isinstance(rule_cls, type) and issubclass(rule_cls, HParams)):
        return None
    return rule_cls.names()


def rule_args_problem(name: str, kwargs: Iterable[str]) -> str | None:
    """Why ``kwargs`` cannot be the hyperparameters of the rule ``name`` (keys it does not declare), or ``None``."""
    allowed = rule_settings(_rule_class(name))
    return None if allowed is None else unknown_setting_problem(name, kwargs, allowed)


def _rule_class(name: str) -> type:
    try:
        return RULES[name]
    except KeyError:
        raise AggregationError(f"unknown aggregation rule '{name}'; choose one of {sorted(RULES)}") from None


def build_rule(name: str, **kwargs: Any) -> AggregationRule:
    """Instantiate the rule called ``name`` with its hyperparameters; unknown names list the valid ones, unknown
    hyperparameters the declared ones."""
    rule_cls = _rule_class(name)
    problem = rule_args_problem(name, kwargs)
    if problem:
        raise AggregationError(f"bad hyperparameters for rule '{name}': {problem}")
    try:
        return rule_cls(**kwargs)
    except TypeError as exc:
        raise AggregationError(f"bad hyperparameters for rule '{name}': {exc}") from None
