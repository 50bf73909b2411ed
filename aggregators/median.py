"""Coordinate-wise median: a Byzantine-robust replacement for the weighted mean.

Reference: Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", ICML 2018, arXiv:1803.01498, Definition 1 (coordinate-wise median), Algorithm 1 (option I).

    x_{t+1}[c] = x_t[c] + median_{i in S} Delta_i[c]        for every coordinate c

with numpy's median (the mean of the two middle values for an even number of clients). Uniform over the clients:
sample counts are ignored, as in the paper (a client cannot buy influence by claiming more samples). Clients whose
delta holds NaN/Inf are dropped first; BatchNorm statistics and integer buffers are averaged with sample weights
(see `aggregators.robust`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from aggregators.deltas import trainable_keys
from aggregators.robust import assemble, finite_updates, stacked
from aggregators.types import AggregationRule, ClientUpdate, Params, RoundContext, RuleHParams


def median_params(global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate]) -> dict[str, np.ndarray]:
    """The coordinate-wise median step as a pure function; inputs are never modified."""
    keys = trainable_keys(global_params, updates)
    kept, deltas, _ = finite_updates(global_params, updates, keys, Median.name)
    step = {key: np.median(stacked(deltas, key), axis=0) for key in keys}
    return assemble(global_params, step, kept)


@dataclass(frozen=True)
class Median(RuleHParams, AggregationRule):
    """Coordinate-wise median of the client updates (stateless, no hyperparameters)."""

    name: ClassVar[str] = "median"
    secure_sum: ClassVar[str] = "takes the coordinate-wise median of the individual updates"
    translation_equivariant: ClassVar[str | None] = ""  # coordinate-wise order statistics of the y_i
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None

    def aggregate_params(
        self, global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], context: RoundContext
    ) -> Params:
        return median_params(global_params, updates)
