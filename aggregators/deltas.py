"""Helpers shared by the rules that step the global model from the clients' deltas (FedOpt, FedNova, FedAtt, FedAdp).

Two jobs:

- which entries are trainable. Corrections, moments, attention and angles apply to trainable parameters only;
  buffers (BatchNorm running statistics, ``num_batches_tracked``) are averaged (docs/algorithms.md, rules every
  algorithm follows, rule 2). Clients
  name their trainable parameters under ``train.param_keys``; without that meta every float entry counts as
  trainable (hand-made updates in tests, foreign clients) and integer entries are always buffers.
- streaming sums. Sums run key by key and client by client through one scratch buffer, in the parameter's own
  float type (float32 for float32 models, as Flower and NVFlare do; the rounding is that of storing the result),
  so the extra memory is O(largest tensor), never O(clients x model), and the cost is that of a plain numpy
  weighted sum. The result does not depend on arrival order (callers sort updates by site).
- delta statistics. Angles (FedAdp) and distances (FedAtt) need inner products of the client deltas y_i - x; they
  are accumulated in float64 over cache-sized chunks, reading every client array once (`delta_alignment`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.functional import is_float_array, weighted_average_params
from aggregators.types import AggregationError, ClientUpdate

V = TypeVar("V")


def param_keys_problems(value: Any, global_params: Mapping[str, np.ndarray]) -> list[str]:
    """Why a client's ``train.param_keys`` cannot be used (empty list: it can, or it is absent)."""
    key = meta_keys.PARAM_KEYS
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(k, str) for k in value):
        return [f"'{key}' must be a list of parameter names, got {type(value).__name__}"]
    unknown = sorted(set(value) - set(global_params))
    if unknown:
        return [f"'{key}' names entries that are not in the model: {unknown[:5]}"]
    integer = sorted(k for k in value if not is_float_array(global_params[k]))
    if integer:
        return [f"'{key}' names integer buffers {integer[:5]}; trainable parameters are floating point"]
    return []


#: Float buffers that are statistics, not parameters (BatchNorm), by name suffix.
STATISTICS_SUFFIXES = ("running_mean", "running_var")


def model_trainable_keys(global_params: Mapping[str, np.ndarray]) -> list[str]:
    """What counts as trainable when no site says: float entries that are not BatchNorm statistics."""
    return [k for k, v in global_params.items() if is_float_array(v) and not k.endswith(STATISTICS_SUFFIXES)]


def agreed_param_keys(reported: Mapping[str, Any]) -> tuple[frozenset[str] | None, dict[str, str]]:
    """The round's trainable set from the sites' ``train.param_keys``, and why each other site's report is refused.

    ``reported`` maps each site to its ``train.param_keys`` (``None``: not reported), already checked one by one
    with `param_keys_problems`. Every site runs the job's model, so the trainable set is a property of the
    job, not of a site: the set most sites report is the job's, and a site reporting another one (another model
    version, a layer frozen by hand, foreign code) is refused by name. A tie trusts no set: the server cannot tell
    which side is right, so every site is refused. A site that reports nothing while others report a set is
    refused too: its update may move entries the others hold fixed. When no site reports, the set is ``None``
    (`model_trainable_keys` applies). Only the round's own results decide, so a resumed job decides as an
    uninterrupted one would (docs/reliability.md).
    """
    key = meta_keys.PARAM_KEYS
    sets = {site: frozenset(value) for site, value in reported.items() if value is not None}
    if not sets:
        return None, {}
    ranked = Counter(sets.values()).most_common()
    chosen, votes = ranked[0]
    if len(ranked) > 1 and ranked[1][1] == votes:
        reason = f"'{key}': {len(ranked)} different sets, none reported by more sites than another; none is trusted"
        return None, dict.fromkeys(reported, reason)
    problems = {}
    for site, value in reported.items():
        if value is None:
            problems[site] = f"'{key}' is missing while {votes} site(s) report the trainable parameters"
        elif sets[site] != chosen:
            missing, extra = sorted(chosen - sets[site]), sorted(sets[site] - chosen)
            problems[site] = (
                f"'{key}' differs from the set {votes} of {len(reported)} sites report "
                f"(missing {missing[:5]}, unexpected {extra[:5]})"
            )
    return chosen, problems


def trainable_keys(global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate]) -> list[str]:
    """The trainable entries of the model, in the global model's key order.

    The one definition of "trainable" for every rule: the sites' agreed ``train.param_keys``
    (`agreed_param_keys`; the round engine has already rejected every site that disagrees), or, when none
    reports it, `model_trainable_keys`.
    """
    chosen, problems = agreed_param_keys({u.site: u.meta.get(meta_keys.PARAM_KEYS) for u in updates})
    if problems:
        named = "; ".join(f"{site}: {problem}" for site, problem in sorted(problems.items()))
        raise AggregationError(f"the sites disagree on their trainable parameters: {named}")
    if chosen is None:
        return model_trainable_keys(global_params)
    return [k for k in global_params if k in chosen]


CHUNK = 1 << 14  # elements per client in one delta block: 10 clients x 16K x 8 bytes stays in cache


def _delta_blocks(x: np.ndarray, arrays: Sequence[np.ndarray]) -> Iterator[np.ndarray]:
    """The clients' deltas y_i - x of one tensor as float64 blocks (clients x up to CHUNK elements), one reused
    buffer: every client array is read once and nothing of the model's size is allocated."""
    flat_x = np.asarray(x).reshape(-1)
    flats = [np.asarray(a).reshape(-1) for a in arrays]
    if any(f.size != flat_x.size for f in flats):
        raise AggregationError(f"client array sizes {[f.size for f in flats]} for a parameter of size {flat_x.size}")
    block = np.empty((len(flats), min(CHUNK, max(flat_x.size, 1))))
    for start in range(0, flat_x.size, CHUNK):
        stop = min(start + CHUNK, flat_x.size)
        rows = block[:, : stop - start]
        for i, flat in enumerate(flats):
            np.subtract(flat[start:stop], flat_x[start:stop], out=rows[i])
        yield rows


def delta_sq_norms(x: np.ndarray, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """||y_i - x||^2 for every client over one tensor (float64, streamed)."""
    result = np.zeros(len(arrays))
    for rows in _delta_blocks(x, arrays):
        result += np.einsum("ij,ij->i", rows, rows)
    return result


def delta_alignment(
    x: np.ndarray, arrays: Sequence[np.ndarray], weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float]:
    """(<Delta_i, Delta>, ||Delta_i||^2, ||Delta||^2) over one tensor, Delta_i = y_i - x, Delta = sum_i w_i Delta_i.

    Float64, one streamed read of every client array; O(clients) work per element (the weighted mean of each block,
    then its inner product with every row), not the O(clients^2) of a full Gram matrix.
    """
    dots, norms, mean_norm = np.zeros(len(arrays)), np.zeros(len(arrays)), 0.0
    weights = np.asarray(weights, dtype=np.float64)
    # einsum's own loops, not BLAS: these products are small, and a multi-threaded BLAS call on a busy machine
    # measured up to 70x slower than the whole aggregation should take.
    for rows in _delta_blocks(x, arrays):
        mean = np.einsum("i,ij->j", weights, rows)
        dots += np.einsum("ij,j->i", rows, mean)
        norms += np.einsum("ij,ij->i", rows, rows)
        mean_norm += float(np.einsum("j,j->", mean, mean))
    return dots, norms, mean_norm


def average_buffers(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], weights: np.ndarray, keys: Sequence[str]
) -> dict[str, np.ndarray]:
    """Weighted mean of the non-trainable entries ``keys`` (integer buffers averaged in float and rounded back)."""
    return weighted_average_params(updates, weights, {k: global_params[k] for k in keys})


def split_keys(global_params: Mapping[str, np.ndarray], trainable: Sequence[str]) -> list[str]:
    """The entries that are not in ``trainable``: the buffers, in the global model's key order."""
    chosen = set(trainable)
    return [k for k in global_params if k not in chosen]


def shared_entries(params: Mapping[str, V], local_keys: Iterable[str]) -> dict[str, V]:
    """``params`` without the site-local entries (``--local-keys``: FedPer, FedBN, FedRep's head), in the same key
    order: what a site sends and what the server validates, agrees keys on and aggregates
    (docs/personalization.md, "Partial sharing")."""
    local = set(local_keys)
    return {key: value for key, value in params.items() if key not in local}


def leaked_local_keys(params: Mapping[str, Any], local_keys: Iterable[str]) -> list[str]:
    """The site-local entries present in a site's result, sorted (a result must carry none)."""
    return sorted(set(params) & set(local_keys))
