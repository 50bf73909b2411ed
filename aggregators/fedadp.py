"""FedAdp: adaptive weighting by the angle between each client's update and the global update.

Reference: Wu, Wang, "Fast-Convergent Federated Learning with Adaptive Weighting", IEEE TCCN 2021,
arXiv:2012.00661 (docs/server_rules.md, FedAdp). Per round, over the flattened trainable deltas Delta_i = y_i - x:

    Delta        = sum_i (D_i / sum_j D_j) Delta_i                (D_i: the client's sample count)
    theta_i      = arccos(<Delta, Delta_i> / (||Delta|| ||Delta_i||))   (0 when a norm is 0; cosine clipped to [-1, 1])
    theta~_i     = theta_i at the site's first participation, else ((c-1)/c) theta~_i + (1/c) theta_i, c = the
                   number of rounds THIS site has taken part in (not the global round index: Plato's choice gives a
                   site first seen in round 20 a weight of 1/20 on its next observation)
    f(theta~)    = alpha * (1 - exp(-exp(-alpha (theta~ - 1))))      (Gompertz, alpha = 5)
    psi_i        = D_i e^{f(theta~_i)} / sum_j D_j e^{f(theta~_j)}
    x           <- x + sum_i psi_i Delta_i

The paper's "gradients" are -Delta_i / eta_l; a common positive scale does not change an angle, so the deltas are
used directly, every layer with the same scale (Plato divides all but the first layer by -lr, which distorts the
angle). Buffers are not part of the angle and are averaged with the sample weights D_i / sum_j D_j. The per-site
smoothed angles and participation counts are the rule's state (checkpointed). With all angles equal, psi_i is the
FedAvg weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from aggregators.contracts.hparams import hparam
from aggregators.deltas import average_buffers, delta_alignment, split_keys, trainable_keys
from aggregators.functional import by_site, sample_weights, weighted_step
from aggregators.types import AggregationResult, AggregationRule, ClientUpdate, RoundContext, RuleHParams


def gompertz(theta: np.ndarray, alpha: float) -> np.ndarray:
    """f(theta) = alpha * (1 - exp(-exp(-alpha * (theta - 1))))."""
    return alpha * (1.0 - np.exp(-np.exp(-alpha * (np.asarray(theta, dtype=np.float64) - 1.0))))


def update_angles(
    sites: Sequence[str], angles: np.ndarray, smoothed: Mapping[str, float], counts: Mapping[str, int]
) -> tuple[dict[str, float], dict[str, int]]:
    """Each participant's smoothed angle and participation count after this round; others keep theirs."""
    new_smoothed, new_counts = dict(smoothed), dict(counts)
    for site, angle in zip(sites, angles, strict=True):
        count = int(counts.get(site, 0)) + 1
        previous = float(smoothed.get(site, 0.0))
        new_smoothed[site] = float(angle) if count == 1 else ((count - 1) / count) * previous + float(angle) / count
        new_counts[site] = count
    return new_smoothed, new_counts


def adaptive_weights(samples: np.ndarray, smoothed_angles: np.ndarray, alpha: float) -> np.ndarray:
    """psi_i = D_i e^{f(theta~_i)} / sum_j D_j e^{f(theta~_j)} (computed with the largest exponent factored out)."""
    exponents = gompertz(smoothed_angles, alpha)
    scaled = np.asarray(samples, dtype=np.float64) * np.exp(exponents - exponents.max())
    return scaled / scaled.sum()


def client_angles(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], weights: np.ndarray, keys: Sequence[str]
) -> np.ndarray:
    """theta_i between the weighted mean delta and each client's delta, over the flattened ``keys``.

    <Delta, Delta_i>, ||Delta_i||^2 and ||Delta||^2 are summed over the keys in float64 (one streamed read of every
    client array, ``aggregators/deltas.delta_alignment``).
    """
    dots, norms, global_norm = np.zeros(len(updates)), np.zeros(len(updates)), 0.0
    for key in keys:
        key_dots, key_norms, key_global = delta_alignment(global_params[key], [u.params[key] for u in updates], weights)
        dots, norms, global_norm = dots + key_dots, norms + key_norms, global_norm + key_global
    denominator = np.sqrt(norms) * math.sqrt(global_norm)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosines = np.where(denominator > 0, dots / np.where(denominator > 0, denominator, 1.0), 1.0)
    return np.arccos(np.clip(cosines, -1.0, 1.0))


@dataclass(frozen=True)
class FedAdp(RuleHParams, AggregationRule):
    """FedAdp server rule. ``alpha`` is the Gompertz steepness (paper: 5; unrelated to FedDyn's alpha)."""

    alpha: float = hparam(5.0, low=0, low_open=True, note="the Gompertz steepness")

    name: ClassVar[str] = "fedadp"
    secure_sum: ClassVar[str] = "weights every site by the angle between its own update and the mean update"
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {"angles": {}, "counts": {}}

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        p = sample_weights(updates)
        trainable = trainable_keys(global_params, updates)
        sites = [u.site for u in updates]
        angles = client_angles(global_params, updates, p, trainable)
        smoothed, counts = update_angles(sites, angles, state["angles"], state["counts"])
        psi = adaptive_weights(p, np.array([smoothed[s] for s in sites]), self.alpha)
        params = average_buffers(global_params, updates, p, split_keys(global_params, trainable))
        for key in trainable:
            params[key] = weighted_step(global_params[key], [u.params[key] for u in updates], psi)
        ordered = {key: params[key] for key in global_params}
        return AggregationResult(params=ordered, state={"angles": smoothed, "counts": counts})
