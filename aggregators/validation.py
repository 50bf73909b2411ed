"""Checks a client result must pass before any rule sees it (docs/design.md, decision 8).

Each check returns human-readable problems naming the key; the controller rejects the site with them and
carries on with the others. The global model never absorbs an update that failed here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from aggregators.functional import is_float_array
from aggregators.types import AggregationError


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


def check_number(
    rule: str,
    name: str,
    value: Any,
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """A rule's real-valued hyperparameter: a finite int/float (not a bool) in the given interval, else an error
    naming the rule, the field and the interval."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AggregationError(f"{rule}: {name} must be a finite number, got {value!r}")
    if value < low or value > high or (low_open and value == low) or (high_open and value == high):
        bounds = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise AggregationError(f"{rule}: {name} must lie in {bounds}, got {value}")


def check_int(rule: str, name: str, value: object, minimum: int) -> None:
    """A rule's integer hyperparameter (not a bool) of at least ``minimum``, else an error naming rule and field."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise AggregationError(f"{rule}: {name} must be an integer >= {minimum}, got {value!r}")
