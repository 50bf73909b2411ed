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


#: Elements per block of the streamed sums: the accumulator and the scratch row (float64: 256 KiB each) stay in the
#: CPU cache while every client's slice streams through them, so a sum costs one read of each client array.
BLOCK = 1 << 15


def weighted_sum(
    arrays: Sequence[np.ndarray],
    weights: Sequence[float],
    like: np.ndarray,
    *,
    minus: np.ndarray | None = None,
    plus: np.ndarray | None = None,
    dtype: np.dtype | type | None = None,
    out_dtype: np.dtype | type | None = None,
) -> np.ndarray:
    """The one weighted-sum kernel of the rules: plus + sum_i w_i * (a_i - minus) (``minus=None``: sum_i w_i * a_i;
    ``plus=None``: no offset).

    Accumulated in ``dtype`` (default: ``like``'s dtype) and returned as ``out_dtype`` (default: the accumulation
    dtype), shaped like ``like``. The sum runs block by block (`BLOCK` elements): per block, every client's
    slice is weighted into one cache-resident scratch row and added to a cache-resident accumulator, so each
    client array is read once, nothing per client is allocated and the extra memory is two blocks. Every element
    sees exactly the operations of the unblocked sum in the same order (0 + w_1 a_1 + w_2 a_2 + ...), so the
    result does not depend on the block size. With ``minus`` the differences are formed before weighting, so a
    coordinate that no client moved sums to exactly 0 whatever the precision (FedOpt's pseudo-gradient). ``plus``
    is added to each block's finished sum, so x + sum_i w_i (y_i - x) gives x back bit for bit when no y_i moved
    (`weighted_step`).
    """
    like = np.asarray(like)
    accumulate = np.dtype(dtype or like.dtype)
    flats = [_flat_like(array, like) for array in arrays]
    scale = [float(w) for w in weights]
    if len(scale) != len(flats):
        raise AggregationError(f"{len(flats)} client arrays but {len(scale)} weights")
    flat_minus = None if minus is None else _flat_like(minus, like)
    flat_plus = None if plus is None else _flat_like(plus, like)
    out = np.empty(like.size, dtype=np.dtype(out_dtype or accumulate))
    total = np.empty(min(BLOCK, like.size), dtype=accumulate)
    scratch = np.empty_like(total)
    for start in range(0, like.size, BLOCK):
        stop = min(start + BLOCK, like.size)
        acc, tmp = total[: stop - start], scratch[: stop - start]
        acc.fill(0)
        for weight, flat in zip(scale, flats, strict=True):
            if flat_minus is None:
                np.multiply(flat[start:stop], weight, out=tmp, dtype=accumulate)
            else:
                np.subtract(flat[start:stop], flat_minus[start:stop], out=tmp, dtype=accumulate)
                tmp *= weight
            acc += tmp
        if flat_plus is not None:
            acc += flat_plus[start:stop]
        out[start:stop] = acc
    return out.reshape(like.shape)


def weighted_step(x: np.ndarray, arrays: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """x + sum_i w_i (y_i - x), typed and shaped like ``x``: the step of the rules that move the model along a
    weighted sum of the clients' deltas (FedNova, FedAdp, FedAtt).

    The deltas are formed before they are weighted and x is added last, so a model that no client moved comes back
    bit for bit whatever the weights sum to: the rearranged (1 - sum_i w_i) x + sum_i w_i y_i rounded x by an ulp
    in about a third of its coordinates, which server momentum then carried on round after round. Accumulated in
    x's own float type, as before: float64 accumulation of the deltas measured 2-3x slower than this float32 sum
    (benchmarks/aggregation.py), and the exactness does not need it.
    """
    x = np.asarray(x)
    return weighted_sum(arrays, weights, x, minus=x, plus=x)


def _flat_like(array: np.ndarray, like: np.ndarray) -> np.ndarray:
    if np.shape(array) != like.shape:
        # Never let numpy broadcast a wrongly shaped client array over the parameter.
        raise AggregationError(f"client array of shape {np.shape(array)} for a parameter of shape {like.shape}")
    return np.asarray(array).reshape(-1)


def weighted_mean(arrays: Sequence[np.ndarray], weights: np.ndarray, like: np.ndarray) -> np.ndarray:
    """sum_i w_i * a_i accumulated in float64, returned with the dtype and shape of ``like``.

    Integer arrays are averaged in float and rounded back to their integer dtype (docs/algorithms.md, rules every
    algorithm follows, rule 2):
    adding or averaging ``int64`` counters directly would either overflow the meaning or truncate.
    """
    like = np.asarray(like)
    if is_float_array(like):
        return weighted_sum(arrays, weights, like, dtype=np.float64, out_dtype=like.dtype)
    total = weighted_sum(arrays, weights, like, dtype=np.float64)
    return np.asarray(np.rint(total)).astype(like.dtype)


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
