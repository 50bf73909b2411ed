"""Types shared by every aggregation rule: what a client contributes and what a round produces.

Rules are pure: ``(global params, client updates, state) -> (new params, new state, meta to broadcast)``.
Parameters are plain ``dict[str, np.ndarray]`` so rules need neither NVFlare nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

Params = dict[str, np.ndarray]


class AggregationError(ValueError):
    """A round cannot be aggregated (no usable update, zero total weight, mismatched keys or shapes)."""


@dataclass(frozen=True)
class ClientUpdate:
    """One client's contribution to a round.

    ``params`` are the client's full model after local training (same keys and shapes as the global model);
    ``num_samples`` is the client's training-set size, the FedAvg weight; ``meta`` carries the rule-specific
    namespaced keys (for example ``scaffold.ctrl.diff``).
    """

    site: str
    params: Mapping[str, np.ndarray]
    num_samples: int
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundContext:
    """What a rule may know about the round besides the updates: its index and the whole site population."""

    round_num: int
    num_rounds: int
    population: tuple[str, ...]


@dataclass(frozen=True)
class AggregationResult:
    """A rule's output: the next global model, the rule's next state, and meta to broadcast with the model."""

    params: Params
    state: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class AggregationRule(Protocol):
    """The interface the controller drives. State is returned, never mutated, so it can be checkpointed.

    A rule may also define ``update_problems(update, global_params, state) -> list[str]``: its own checks of a
    client's update (e.g. a control variate's keys and shapes); a non-empty list rejects that site's result.
    """

    name: str
    required_meta: tuple[str, ...]  # meta every client result must carry
    broadcast_keys: tuple[str, ...]  # meta keys broadcast_meta() sends besides the round bookkeeping

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]: ...

    def broadcast_meta(self, state: Mapping[str, Any]) -> dict[str, Any]: ...

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult: ...
