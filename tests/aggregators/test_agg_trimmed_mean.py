"""Coordinate-wise trimmed mean (Yin et al. 2018): floor(beta*n) dropped on each side, closed-form values."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.registry import build_rule
from aggregators.trimmed_mean import TrimmedMean, trimmed_mean, trimmed_mean_params
from aggregators.types import AggregationError, ClientUpdate

GLOBAL = {"w": np.array([0.0, 0.0], np.float32), "t": np.array(0, np.int64)}


def _update(site: str, w: list[float], n: int = 1) -> ClientUpdate:
    return ClientUpdate(site=site, params={"w": np.array(w, np.float32), "t": np.array(n, np.int64)}, num_samples=n)


def test_trims_one_each_side_of_four() -> None:
    values = np.array([[1.0, -50.0], [2.0, 0.0], [3.0, 1.0], [100.0, 2.0]])
    # beta=0.25, n=4 -> k=1: coordinate 0 keeps {2, 3}, coordinate 1 keeps {0, 1}
    np.testing.assert_allclose(trimmed_mean(values, 0.25), [2.5, 0.5], atol=1e-12)


def test_beta_zero_is_the_uniform_mean_and_floor_is_used() -> None:
    values = np.array([[1.0], [2.0], [6.0]])
    np.testing.assert_allclose(trimmed_mean(values, 0.0), [3.0], atol=1e-12)
    np.testing.assert_allclose(trimmed_mean(values, 0.3), [3.0], atol=1e-12)  # floor(0.9) = 0: nothing trimmed
    np.testing.assert_allclose(trimmed_mean(values, 0.34), [2.0], atol=1e-12)  # floor(1.02) = 1


def test_params_step_and_uniform_weighting() -> None:
    updates = [_update("a", [1, 1], n=100), _update("b", [2, 2]), _update("c", [3, 3]), _update("d", [90, -90])]
    result = trimmed_mean_params(GLOBAL, updates, 0.25)
    np.testing.assert_allclose(result["w"], [2.5, 1.5], atol=1e-6)  # sample counts do not weight the deltas


def test_nothing_left_is_an_error_and_beta_is_validated() -> None:
    with pytest.raises(AggregationError, match="nothing is left"):
        trimmed_mean(np.zeros((2, 1)), 0.5)  # only reachable by calling the function directly
    with pytest.raises(AggregationError, match="beta"):
        TrimmedMean(beta=0.5)
    assert isinstance(build_rule("trimmed_mean", beta=0.2), TrimmedMean)
