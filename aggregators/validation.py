"""Checks a client result must pass before any rule sees it (docs/design.md, decision 8).

Each check returns human-readable problems naming the key; the controller rejects the site with them and
carries on with the others. The global model never absorbs an update that failed here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from aggregators.functional import is_float_array


def param_problems(global_params: Mapping[str, np.ndarray], params: Mapping[str, Any]) -> list[str]:
    """Missing or unexpected keys, wrong shapes, non-arrays and non-finite values, one line per problem."""
    problems = []
    missing = sorted(set(global_params) - set(params))
    unexpected = sorted(set(params) - set(global_params))
    if missing:
        problems.append(f"missing parameter keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected parameter keys {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    for key in sorted(set(global_params) & set(params)):
        problems.extend(_array_problems(key, global_params[key], params[key]))
    return problems


def _array_problems(key: str, expected: np.ndarray, value: Any) -> list[str]:
    if not isinstance(value, np.ndarray | np.generic):
        return [f"parameter '{key}' is a {type(value).__name__}, expected a numpy array"]
    if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer) or value.dtype == bool):
        return [f"parameter '{key}' has dtype {value.dtype}, expected a real number type"]
    if np.shape(value) != np.shape(expected):
        return [f"parameter '{key}' has shape {np.shape(value)}, expected {np.shape(expected)}"]
    if is_float_array(value) and not np.all(np.isfinite(value)):
        return [f"parameter '{key}' contains NaN or Inf"]
    return []


def meta_problems(meta: Mapping[str, Any], required: Iterable[str]) -> list[str]:
    """Required meta keys that are absent."""
    return [f"required meta key '{key}' is missing" for key in required if key not in meta]


def num_samples_problems(num_samples: Any) -> list[str]:
    """The sample count must be a non-negative integer (it is the aggregation weight)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int | np.integer):
        return [f"sample count must be an integer, got {num_samples!r}"]
    if num_samples < 0:
        return [f"sample count must be non-negative, got {num_samples}"]
    return []
