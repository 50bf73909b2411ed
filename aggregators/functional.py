"""Pure numpy helpers shared by the aggregation rules."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, get_args

import numpy as np

from aggregators.types import AggregationError, ClientUpdate

#: How a rule may weight the sites' models: by sample count (p_i = n_i / n) or uniformly (1 / |S|).
Weighting = Literal["samples", "uniform"]
WEIGHTINGS = get_args(Weighting)


def sample_weights(updates: Sequence[ClientUpdate]) -> np.ndarray:
    """Normalised sample weights p_i = n_i / sum_j n_j over the participants (float64)."""
    if not updates:
        raise AggregationError("no client update to aggregate")
    counts = np.array([u.num_samples for u in updates], dtype=np.float64)
    if np.any(counts < 0) or counts.sum() <= 0:
        raise AggregationError(f"sample counts must be non-negative with a positive total, got {counts.tolist()}")
    return counts / counts.sum()


def is_float_array(value: np.ndarray) -> bool:
    """True for floating-point arrays; integer buffers (e.g. ``num_batches_tracked``) need separate handling."""
    return np.issubdtype(np.asarray(value).dtype, np.floating)


def weighted_sum(
    arrays: Sequence[np.ndarray],
    weights: Sequence[float],
    like: np.ndarray,
    *,
    minus: np.ndarray | None = None,
    dtype: np.dtype | type | None = None,
) -> np.ndarray:
    """The one weighted-sum kernel of the rules: sum_i w_i * (a_i - minus) (``minus=None``: sum_i w_i * a_i).

    Accumulated in ``dtype`` (default: ``like``'s dtype) through one scratch buffer: no per-client temporaries, memory
    O(model). With ``minus`` the differences are formed before weighting, so a coordinate that no client moved sums
    to exactly 0 whatever the precision (FedOpt's pseudo-gradient).
    """
    like = np.asarray(like)
    accumulate = np.dtype(dtype or like.dtype)
    total = np.zeros(like.shape, dtype=accumulate)
    scratch = np.empty(like.shape, dtype=accumulate)
    for weight, array in zip(weights, arrays, strict=True):
        if np.shape(array) != like.shape:
            # Never let numpy broadcast a wrongly shaped client array over the parameter.
            raise AggregationError(f"client array of shape {np.shape(array)} for a parameter of shape {like.shape}")
        if minus is None:
            np.multiply(np.asarray(array, dtype=accumulate), float(weight), out=scratch)
        else:
            np.subtract(array, minus, out=scratch, dtype=accumulate)
            scratch *= float(weight)
        total += scratch
    return total


def weighted_mean(arrays: Sequence[np.ndarray], weights: np.ndarray, like: np.ndarray) -> np.ndarray:
    """sum_i w_i * a_i accumulated in float64, returned with the dtype and shape of ``like``.

    Integer arrays are averaged in float and rounded back to their integer dtype (docs/algorithms.md, rules every
    algorithm follows, rule 2):
    adding or averaging ``int64`` counters directly would either overflow the meaning or truncate.
    """
    total = weighted_sum(arrays, weights, like, dtype=np.float64)
    if is_float_array(like):
        return total.astype(np.asarray(like).dtype)
    return np.asarray(np.rint(total)).astype(np.asarray(like).dtype)


def weighted_average_params(
    updates: Sequence[ClientUpdate], weights: np.ndarray, like: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Key-by-key weighted mean of the clients' parameters, typed like the global model ``like``."""
    missing = sorted({key for u in updates for key in like if key not in u.params})
    if missing:
        raise AggregationError(f"client updates lack parameter keys {missing[:5]}")
    return {key: weighted_mean([u.params[key] for u in updates], weights, value) for key, value in like.items()}


def by_site(updates: Sequence[ClientUpdate]) -> list[ClientUpdate]:
    """Updates in site order: float sums then do not depend on the order results arrived in (bit-for-bit)."""
    return sorted(updates, key=lambda u: u.site)
