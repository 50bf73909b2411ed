"""Pure aggregation math: numpy dicts in, numpy dicts out. No NVFlare import anywhere in this package."""

from aggregators.fedavg import FedAvg, fedavg_params
from aggregators.registry import RULES, build_rule
from aggregators.types import AggregationError, AggregationResult, AggregationRule, ClientUpdate, Params, RoundContext

__all__ = [
    "RULES",
    "AggregationError",
    "AggregationResult",
    "AggregationRule",
    "ClientUpdate",
    "FedAvg",
    "Params",
    "RoundContext",
    "build_rule",
    "fedavg_params",
]
