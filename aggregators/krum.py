"""Krum and Multi-Krum: keep the update(s) closest to their nearest neighbours.

Reference: Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries: Byzantine Tolerant Gradient
Descent", NeurIPS 2017 (Krum: Section 4, Eq. of the score; Multi-Krum: Section 5).

With n clients of which at most f are Byzantine, the score of client i is

    s(i) = sum of ||Delta_i - Delta_j||^2 over the n - f - 2 clients j != i closest to i

Krum (m = 1) applies the delta with the lowest score; Multi-Krum applies the uniform mean of the m lowest-scored
deltas (scores computed once). Requires n - f - 2 >= 1 (the paper assumes 2f + 2 < n); otherwise the round fails with
an error naming f and n. Ties are broken by site name. Distances run over every robust entry (see
`aggregators.robust`) flattened into one vector, in float64. BatchNorm statistics and integer buffers are the
sample-weighted mean of the SELECTED clients; clients whose delta holds NaN/Inf are dropped first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from aggregators.contracts.hparams import hparam
from aggregators.deltas import trainable_keys
from aggregators.robust import assemble, finite_updates, stacked
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)


def krum_scores(vectors: np.ndarray, num_byzantine: int) -> np.ndarray:
    """s(i) for each row of ``vectors`` (n x d): summed squared distances to its n - f - 2 nearest other rows."""
    n = vectors.shape[0]
    neighbours = n - num_byzantine - 2
    if neighbours < 1:
        raise AggregationError(f"krum: needs n - f - 2 >= 1 clients, got n={n} with f={num_byzantine}")
    squared = np.sum((vectors[:, None, :] - vectors[None, :, :]) ** 2, axis=-1)
    # Row i without its own zero distance, ascending: the first `neighbours` entries are its nearest others.
    others = np.sort(squared + np.diag(np.full(n, np.inf)), axis=1)[:, :neighbours]
    return others.sum(axis=1)


def krum_select(vectors: np.ndarray, num_byzantine: int, num_selected: int) -> list[int]:
    """Indices of the ``num_selected`` lowest scores (stable: ties keep the input order)."""
    if num_selected > vectors.shape[0]:
        raise AggregationError(f"krum: cannot select m={num_selected} of n={vectors.shape[0]} clients")
    return sorted(np.argsort(krum_scores(vectors, num_byzantine), kind="stable")[:num_selected].tolist())


def krum_params(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], num_byzantine: int, num_selected: int
) -> tuple[dict[str, np.ndarray], list[str]]:
    """The (Multi-)Krum step as a pure function; also returns the selected sites."""
    keys = trainable_keys(global_params, updates)
    kept, deltas, _ = finite_updates(global_params, updates, keys, Krum.name)
    flat = np.stack([np.concatenate([np.ravel(d[key]) for key in keys]) for d in deltas])
    chosen = krum_select(flat, num_byzantine, num_selected)
    step = {key: stacked([deltas[i] for i in chosen], key).mean(axis=0) for key in keys}
    selected = [kept[i] for i in chosen]
    return assemble(global_params, step, selected), [u.site for u in selected]


@dataclass(frozen=True)
class Krum(RuleHParams, AggregationRule):
    """Krum (``num_selected=1``) or Multi-Krum (``num_selected=m``); ``num_byzantine`` is the assumed f."""

    num_byzantine: int = hparam(1, low=0, note="f, the Byzantine clients assumed")
    num_selected: int = hparam(1, low=1, note="m, the updates averaged; 1 is Krum")

    name: ClassVar[str] = "krum"
    secure_sum: ClassVar[str] = "scores every individual update by its distances to the others"
    translation_equivariant: ClassVar[str | None] = ""  # distances between the y_i only
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        params, selected = krum_params(global_params, updates, self.num_byzantine, self.num_selected)
        return AggregationResult(params=params, state={**state, "selected": selected})
