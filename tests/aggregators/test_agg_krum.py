"""Krum / Multi-Krum (Blanchard et al. 2017): scores and selections derived by hand on 1-D points."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.krum import krum_params, krum_scores, krum_select
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext

POINTS = np.array([[0.0], [0.1], [0.3], [10.0]])
GLOBAL = {"w": np.array([0.0], np.float32), "t": np.array(0, np.int64)}


def _updates(values, counts=None) -> list[ClientUpdate]:
    counts = counts or [1] * len(values)
    return [
        ClientUpdate(site=f"s{i}", params={"w": np.array([v], np.float32), "t": np.array(c, np.int64)}, num_samples=c)
        for i, (v, c) in enumerate(zip(values, counts, strict=True))
    ]


def test_scores_sum_the_nearest_n_minus_f_minus_2() -> None:
    # f=0 -> 2 nearest others. 0: .01+.09; 0.1: .01+.04; 0.3: .04+.09; 10: 9.7^2 + 9.9^2
    np.testing.assert_allclose(krum_scores(POINTS, 0), [0.10, 0.05, 0.13, 94.09 + 98.01], atol=1e-9)
    # f=1 -> 1 nearest other
    np.testing.assert_allclose(krum_scores(POINTS, 1), [0.01, 0.01, 0.04, 94.09], atol=1e-9)


def test_krum_picks_the_lowest_score_and_multi_krum_averages() -> None:
    assert krum_select(POINTS, 0, 1) == [1]
    assert krum_select(POINTS, 1, 1) == [0]  # tie 0.01/0.01 broken by order
    params, selected = krum_params(GLOBAL, _updates([0.0, 0.1, 0.3, 10.0]), 0, 2)
    assert selected == ["s0", "s1"]
    np.testing.assert_allclose(params["w"], [0.05], atol=1e-7)


def test_buffers_come_from_the_selected_clients_only() -> None:
    params, selected = krum_params(GLOBAL, _updates([0.0, 0.1, 0.3, 10.0], counts=[1, 2, 1, 50]), 0, 2)
    assert selected == ["s0", "s1"]
    assert params["t"] == 2  # (1*1 + 2*2) / 3 = 1.67 -> 2; with the outlier's 50 samples it would be 43


def test_too_few_clients_for_f_is_an_error() -> None:
    with pytest.raises(AggregationError, match="n - f - 2"):
        krum_scores(POINTS, 2)
    with pytest.raises(AggregationError, match="num_byzantine"):
        build_rule("krum", num_byzantine=-1)


def test_rule_reports_the_selection_in_its_state() -> None:
    rule = build_rule("krum", num_byzantine=1, num_selected=1)
    context = RoundContext(round_num=0, num_rounds=1, population=())
    result = rule.aggregate(GLOBAL, _updates([10.0, 0.1, 0.3, 0.0]), {}, context)
    assert result.state["selected"] == ["s1"]  # scores: 10: 94.09, 0.1: .01, 0.3: .04, 0: .01 -> tie, s1 first
    np.testing.assert_allclose(result.params["w"], [0.1], atol=1e-7)
