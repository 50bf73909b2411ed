"""Coordinate-wise trimmed mean: drop the largest and smallest values of every coordinate, average the rest.

Reference: Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical
Rates", ICML 2018, arXiv:1803.01498, Definition 2 (coordinate-wise beta-trimmed mean), Algorithm 1 (option II).

    k = floor(beta * n);   x_{t+1}[c] = x_t[c] + mean of the sorted Delta_(k+1)[c] .. Delta_(n-k)[c]

``beta`` in [0, 0.5) is the fraction trimmed on EACH side; ``beta = 0`` is the uniform mean. Uniform over the
clients (sample counts ignored, as in the paper). ``2k < n`` is required, otherwise nothing would be left; the
round then fails with an error naming ``beta`` and ``n``. Clients whose delta holds NaN/Inf are dropped first;
BatchNorm statistics and integer buffers are averaged with sample weights (see `aggregators.robust`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from aggregators.contracts.hparams import hparam
from aggregators.deltas import trainable_keys
from aggregators.robust import assemble, finite_updates, stacked
from aggregators.types import AggregationError, AggregationRule, ClientUpdate, Params, RoundContext, RuleHParams


def trimmed_mean(values: np.ndarray, beta: float) -> np.ndarray:
    """Mean over axis 0 after removing the floor(beta*n) smallest and largest entries of every coordinate."""
    n = values.shape[0]
    k = math.floor(beta * n)
    if 2 * k >= n:
        raise AggregationError(f"trimmed_mean: beta={beta} trims {k} of {n} clients on each side, nothing is left")
    ordered = np.sort(values, axis=0)
    return ordered[k : n - k].mean(axis=0)


def trimmed_mean_params(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], beta: float
) -> dict[str, np.ndarray]:
    """The trimmed-mean step as a pure function; inputs are never modified."""
    keys = trainable_keys(global_params, updates)
    kept, deltas, _ = finite_updates(global_params, updates, keys, TrimmedMean.name)
    step = {key: trimmed_mean(stacked(deltas, key), beta) for key in keys}
    return assemble(global_params, step, kept)


@dataclass(frozen=True)
class TrimmedMean(RuleHParams, AggregationRule):
    """Coordinate-wise trimmed mean; ``beta`` is the fraction trimmed on each side (default 0.1)."""

    beta: float = hparam(0.1, low=0, high=0.5, high_open=True, note="the fraction trimmed on each side")

    name: ClassVar[str] = "trimmed_mean"
    secure_sum: ClassVar[str] = "sorts the individual updates per coordinate to drop the extremes"
    translation_equivariant: ClassVar[str | None] = ""  # coordinate-wise order statistics of the y_i
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None

    def aggregate_params(
        self, global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], context: RoundContext
    ) -> Params:
        return trimmed_mean_params(global_params, updates, self.beta)
