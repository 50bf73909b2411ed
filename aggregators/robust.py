"""What the Byzantine-robust rules (median, trimmed mean, Krum, attack-adaptive) share.

Which entries a robust statistic applies to: every floating-point entry of the model except BatchNorm running
statistics (names ending in ``running_mean`` / ``running_var``). The rules see plain numpy dicts and cannot ask the
model which tensors are trainable, so the split is by name; for the bundle's models (LeNet-5, the simple CNN, the
MLP) every float entry is a trainable parameter. The rest — BatchNorm statistics and integer buffers such as
``num_batches_tracked`` — is averaged with sample weights as in FedAvg, integers rounded back (docs/algorithms.md,
rules every algorithm follows,
rule 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from aggregators.functional import by_site, sample_weights, weighted_average_params
from aggregators.types import AggregationError, ClientUpdate


def client_deltas(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], keys: Sequence[str]
) -> list[dict[str, np.ndarray]]:
    """Per client, Delta_i = y_i - x over ``keys`` in float64 (the global model and the updates are not modified)."""
    deltas = []
    for update in updates:
        missing = [key for key in keys if key not in update.params]
        if missing:
            raise AggregationError(f"site '{update.site}' lacks parameter keys {missing[:5]}")
        base = {key: np.asarray(global_params[key], np.float64) for key in keys}
        deltas.append({key: np.asarray(update.params[key], np.float64) - base[key] for key in keys})
    return deltas


def finite_updates(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], keys: Sequence[str], rule: str
) -> tuple[list[ClientUpdate], list[dict[str, np.ndarray]], list[str]]:
    """Updates in site order with their deltas, minus any client whose delta holds NaN/Inf (returned by name)."""
    updates = by_site(updates)
    if not updates:
        raise AggregationError(f"{rule}: no client update to aggregate")
    deltas = client_deltas(global_params, updates, keys)
    keep = [all(np.all(np.isfinite(d[key])) for key in keys) for d in deltas]
    dropped = [u.site for u, ok in zip(updates, keep, strict=True) if not ok]
    kept_updates = [u for u, ok in zip(updates, keep, strict=True) if ok]
    if not kept_updates:
        raise AggregationError(f"{rule}: every client delta contains NaN or Inf (sites {dropped})")
    return kept_updates, [d for d, ok in zip(deltas, keep, strict=True) if ok], dropped


def stacked(deltas: Sequence[Mapping[str, np.ndarray]], key: str) -> np.ndarray:
    """The clients' deltas of one entry stacked on a new leading client axis: shape (n, *param_shape)."""
    return np.stack([np.asarray(d[key], np.float64) for d in deltas])


def assemble(
    global_params: Mapping[str, np.ndarray],
    robust_step: Mapping[str, np.ndarray],
    buffer_updates: Sequence[ClientUpdate],
) -> dict[str, np.ndarray]:
    """x + robust step on the robust keys, sample-weighted mean of ``buffer_updates`` elsewhere; dtypes preserved."""
    others = {key: value for key, value in global_params.items() if key not in robust_step}
    result = weighted_average_params(buffer_updates, sample_weights(buffer_updates), others) if others else {}
    for key, step in robust_step.items():
        like = np.asarray(global_params[key])
        result[key] = (like.astype(np.float64) + step).astype(like.dtype)
    return {key: result[key] for key in global_params}
