"""Cross-site evaluation's arithmetic (aggregators/contracts/cross_site.py), in closed form: the sample-weighted means
over the other sites and the paired difference with its standard error, from counts only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from aggregators.contracts import cross_site
from aggregators.contracts.cross_site import owner_counts, split_key, summarize


def counts(n: int, kept: int, local: int, kept_only: int, local_only: int) -> dict[str, int]:
    return dict(zip(cross_site.COUNTS, (n, kept, local, kept_only, local_only), strict=True))


def per_sample(n: int, kept: int, local: int, kept_only: int, local_only: int) -> tuple[np.ndarray, np.ndarray]:
    """Correctness vectors with these counts (both right: kept - kept_only samples)."""
    both = kept - kept_only
    assert local - local_only == both
    k = np.r_[np.ones(both), np.ones(kept_only), np.zeros(local_only), np.zeros(n - both - kept_only - local_only)]
    loc = np.r_[np.ones(both), np.zeros(kept_only), np.ones(local_only), np.zeros(n - both - kept_only - local_only)]
    return k, loc


def test_the_means_are_over_every_sample_of_the_other_sites_and_the_own_site_is_left_out():
    pairs = {
        "site-1": {
            "site-1": counts(1000, 1000, 0, 1000, 0),  # the owner's own split: never part of its cross-site view
            "site-2": counts(10, 8, 5, 4, 1),
            "site-3": counts(30, 12, 15, 3, 6),
        }
    }
    view = summarize(pairs)["site-1"]
    assert view["kept_cross_site_accuracy"] == pytest.approx(20 / 40)  # (8 + 12) / (10 + 30), not (0.8 + 0.4) / 2
    assert view["local_cross_site_accuracy"] == pytest.approx(20 / 40)
    assert view["kept_minus_local_cross_site_accuracy"] == pytest.approx(((4 - 1) + (3 - 6)) / 40)
    assert view["cross_site_samples"] == 40 and view["cross_site_sites"] == 2


def test_the_standard_error_is_that_of_the_pooled_per_sample_differences():
    a, b = counts(10, 8, 5, 4, 1), counts(30, 12, 15, 3, 6)
    view = summarize({"x": {"y": a, "z": b}})["x"]
    (kept_a, local_a), (kept_b, local_b) = per_sample(10, 8, 5, 4, 1), per_sample(30, 12, 15, 3, 6)
    kept, local = np.r_[kept_a, kept_b], np.r_[local_a, local_b]
    d = kept - local
    assert view["kept_minus_local_cross_site_accuracy"] == pytest.approx(d.mean())
    assert view["kept_minus_local_cross_site_accuracy_se"] == pytest.approx(d.std(ddof=1) / math.sqrt(len(d)))
    assert view["kept_cross_site_accuracy"] == pytest.approx(kept.mean())


def test_identical_models_give_a_zero_difference_with_zero_error_and_one_sample_no_error():
    view = summarize({"x": {"y": counts(20, 7, 7, 0, 0)}})["x"]
    assert view["kept_minus_local_cross_site_accuracy"] == 0.0
    assert view["kept_minus_local_cross_site_accuracy_se"] == 0.0
    one = summarize({"x": {"y": counts(1, 1, 0, 1, 0)}})["x"]
    assert one["kept_minus_local_cross_site_accuracy"] == 1.0
    assert math.isnan(one["kept_minus_local_cross_site_accuracy_se"])


def test_an_owner_no_other_site_scored_is_left_out():
    assert summarize({"x": {"x": counts(5, 5, 5, 0, 0)}, "y": {}}) == {}
    assert summarize({"x": {"y": counts(0, 0, 0, 0, 0)}}) == {}


def test_a_validators_answer_is_read_per_owner_complete_counts_only():
    answer = {
        "site-1/num_samples": 12,
        "site-1/kept_correct": 9.0,
        "site-1/local_correct": 7,
        "site-1/kept_only": 3,
        "site-1/local_only": 1,
        "site-2/num_samples": 12,  # incomplete: left out
        "num_samples": 4,  # no owner
        "site-3/kept_correct": True,  # not a number
    }
    assert owner_counts(answer) == {"site-1": counts(12, 9, 7, 3, 1)}


def test_model_keys_round_trip_and_bad_ones_are_refused():
    key = cross_site.model_key(cross_site.KEPT_OWN, "net.0.weight", owner="site-2")
    assert key == "site-2/kept.own/net.0.weight"
    assert split_key(key, with_owner=True) == ("site-2", "kept.own", "net.0.weight")
    assert split_key("local/net.0.weight") == (None, "local", "net.0.weight")
    for bad in ("global/net.0.weight", "kept", "site-2/kept/"):
        with pytest.raises(ValueError, match="not a model key"):
            split_key(bad, with_owner=True)
    with pytest.raises(ValueError, match="unknown model part"):
        cross_site.model_key("global", "w")
    assert set(cross_site.submitted_data_patterns(["w"])) == {"kept/w", "kept.own/w", "kept.federated/w", "local/w"}
