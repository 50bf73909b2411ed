"""benchmarks.site_stats: paired differences, t-intervals, the worst pair and the per-site target, against closed
forms computed here with numpy and textbook t quantiles."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import site_stats as st

#: Student t quantiles t_{0.975, df} from the tables (independent of scipy)
T975 = {1: 12.706204736174707, 2: 4.302652729749464, 4: 2.7764451051977987}


@pytest.mark.parametrize("df", sorted(T975))
def test_t_quantile_is_the_tabled_value(df):
    assert st.t_quantile(0.975, df) == pytest.approx(T975[df], abs=1e-6)


def test_t_interval_is_mean_plus_minus_t_sd_over_root_n():
    values = np.array([0.01, 0.03, -0.02])
    got = st.t_interval(values.tolist())
    half = T975[2] * values.std(ddof=1) / math.sqrt(3)
    assert got.n == 3 and got.mean == pytest.approx(values.mean(), abs=1e-12)
    assert got.half == pytest.approx(half, abs=1e-6)
    assert (got.low, got.high) == pytest.approx((values.mean() - half, values.mean() + half), abs=1e-6)


def test_one_run_has_no_interval_and_claims_neither_gain_nor_loss():
    got = st.t_interval([0.2])
    assert got.half == math.inf and st.verdict(got) == "within"
    with pytest.raises(ValueError, match="no values"):
        st.t_interval([])


def test_verdict_needs_the_whole_interval_on_one_side_of_zero():
    assert st.verdict(st.Interval(0.02, 0.01, 3)) == "gain"
    assert st.verdict(st.Interval(-0.02, 0.01, 3)) == "loss"
    assert st.verdict(st.Interval(0.02, 0.03, 3)) == "within"
    assert st.verdict(st.t_interval([-0.030, -0.032, -0.028])) == "loss"
    # a wide interval claims nothing, but the target still sees the -46-point pair (test_target_...)
    assert st.verdict(st.t_interval([-0.464, 0.05, 0.10])) == "within"


KEPT = {0: {"site-1": 0.90, "site-2": 0.70}, 1: {"site-1": 0.88, "site-2": 0.75}, 2: {"site-1": 0.91, "site-2": 0.60}}
LOCAL = {0: {"site-1": 0.85, "site-2": 0.72}, 1: {"site-1": 0.86, "site-2": 0.71}, 2: {"site-1": 0.87, "site-2": 0.70}}


def test_paired_differences_site_intervals_and_setting_interval():
    d = st.paired_differences(KEPT, LOCAL)
    assert d["site-1"] == pytest.approx({0: 0.05, 1: 0.02, 2: 0.04}, abs=1e-12)
    assert d["site-2"] == pytest.approx({0: -0.02, 1: 0.04, 2: -0.10}, abs=1e-12)
    site2 = np.array([-0.02, 0.04, -0.10])
    got = st.site_intervals(d)["site-2"]
    assert (got.mean, got.half) == pytest.approx((site2.mean(), T975[2] * site2.std(ddof=1) / math.sqrt(3)), abs=1e-6)
    # the setting's replicates are the per-run means over sites, not the 6 pairs
    means = np.array([(0.05 - 0.02) / 2, (0.02 + 0.04) / 2, (0.04 - 0.10) / 2])
    assert list(st.run_means(d).values()) == pytest.approx(means.tolist(), abs=1e-12)
    setting = st.setting_interval(d)
    assert setting.n == 3 and setting.half == pytest.approx(T975[2] * means.std(ddof=1) / math.sqrt(3), abs=1e-6)


def test_only_pairs_both_sides_have_are_compared_and_the_setting_uses_runs_every_site_has():
    kept = {0: {"a": 0.5, "b": 0.6}, 1: {"a": 0.7}, 3: {"a": 0.1, "b": 0.1}}
    local = {0: {"a": 0.4, "b": 0.6}, 1: {"a": 0.6, "b": 0.2}}
    d = st.paired_differences(kept, local)
    assert set(d) == {"a", "b"} and d["a"] == pytest.approx({0: 0.1, 1: 0.1}) and d["b"] == pytest.approx({0: 0.0})
    assert st.run_means(d) == pytest.approx({0: 0.05})


def test_worst_pair_names_site_run_and_difference():
    assert st.worst_pair(st.paired_differences(KEPT, LOCAL)) == ("site-2", 2, pytest.approx(-0.10, abs=1e-12))


def test_target_misses_a_pair_beyond_two_points_but_not_one_at_two():
    at_limit = {0: {"a": 0.80, "b": 0.90}}
    base = {0: {"a": 0.82, "b": 0.80}}
    check = st.target_check(at_limit, base)
    assert check.met and check.misses == () and check.pairs == 2
    beyond = {0: {"a": 0.7999, "b": 0.90}}
    check = st.target_check(beyond, base)
    assert not check.met and [(s, r) for s, r, _ in check.misses] == [("a", 0)]
    assert check.misses[0][2] == pytest.approx(-0.0201, abs=1e-9)
    # One test sample of 50 (48 vs 49 right): exactly 2 points, though 0.96 - 0.98 is a few ulps below -0.02.
    assert 0.96 - 0.98 < -0.02 and st.target_check({0: {"a": 48 / 50}}, {0: {"a": 49 / 50}}).misses == ()


def test_target_needs_the_mean_kept_at_least_the_mean_local_even_with_no_large_loss():
    kept = {0: {"a": 0.80, "b": 0.79}, 1: {"a": 0.80, "b": 0.79}}
    local = {0: {"a": 0.81, "b": 0.80}, 1: {"a": 0.80, "b": 0.80}}
    check = st.target_check(kept, local)
    assert check.misses == () and not check.met
    assert (check.mean_kept, check.mean_local) == pytest.approx(
        (np.mean([0.8, 0.79] * 2), np.mean([0.81, 0.8, 0.8, 0.8]))
    )


def test_target_check_with_nothing_to_pair_is_refused():
    with pytest.raises(ValueError, match="share no"):
        st.target_check({0: {"a": 0.5}}, {1: {"a": 0.5}})
