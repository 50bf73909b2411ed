"""Coordinate-wise median (Yin et al. 2018): closed-form values, buffers by sample weight, NaN clients dropped."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.median import median_params
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext

CONTEXT = RoundContext(round_num=0, num_rounds=1, population=())


def _update(site: str, w: list[float], n: int = 1, tracked: int = 0, running: float = 0.0) -> ClientUpdate:
    params = {
        "w": np.array(w, np.float32),
        "bn.running_mean": np.array([running], np.float32),
        "bn.num_batches_tracked": np.array(tracked, np.int64),
    }
    return ClientUpdate(site=site, params=params, num_samples=n)


GLOBAL = {
    "w": np.array([1.0, 1.0], np.float32),
    "bn.running_mean": np.array([0.0], np.float32),
    "bn.num_batches_tracked": np.array(0, np.int64),
}


def test_odd_count_takes_the_middle_value_per_coordinate() -> None:
    updates = [_update("a", [1, 9]), _update("b", [5, 2]), _update("c", [100, 3])]
    result = median_params(GLOBAL, updates)
    np.testing.assert_allclose(result["w"], [5.0, 3.0], atol=1e-6)
    assert result["w"].dtype == np.float32


def test_even_count_averages_the_two_middle_values() -> None:
    updates = [_update(s, [v, 0]) for s, v in zip("abcd", [1.0, 2.0, 3.0, 100.0], strict=True)]
    np.testing.assert_allclose(median_params(GLOBAL, updates)["w"], [2.5, 0.0], atol=1e-6)


def test_buffers_take_the_sample_weighted_mean_not_the_median() -> None:
    updates = [
        _update("a", [0, 0], n=1, tracked=10, running=0.0),
        _update("b", [0, 0], n=1, tracked=10, running=1.0),
        _update("c", [0, 0], n=2, tracked=21, running=4.0),
    ]
    result = median_params(GLOBAL, updates)
    # (1*0 + 1*1 + 2*4) / 4 = 2.25 (the median would be 1.0); int: (10 + 10 + 42) / 4 = 15.5 -> rint 16
    np.testing.assert_allclose(result["bn.running_mean"], [2.25], atol=1e-6)
    assert result["bn.num_batches_tracked"] == 16 and result["bn.num_batches_tracked"].dtype == np.int64


def test_nan_client_is_dropped_and_all_nan_is_an_error() -> None:
    updates = [_update("a", [1, 1]), _update("b", [3, 3]), _update("c", [np.nan, 0])]
    np.testing.assert_allclose(median_params(GLOBAL, updates)["w"], [2.0, 2.0], atol=1e-6)
    with pytest.raises(AggregationError, match="NaN"):
        median_params(GLOBAL, [_update("c", [np.nan, 0])])


def test_rule_is_registered_and_ignores_order() -> None:
    rule = build_rule("median")
    updates = [_update("a", [1, 9]), _update("b", [5, 2]), _update("c", [100, 3])]
    forward = rule.aggregate(GLOBAL, updates, rule.init_state(GLOBAL), CONTEXT).params
    backward = rule.aggregate(GLOBAL, updates[::-1], {}, CONTEXT).params
    for key in GLOBAL:
        np.testing.assert_array_equal(forward[key], backward[key])
