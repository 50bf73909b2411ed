"""The membership-inference benchmark (benchmarks/privacy.py): the attack statistics against brute force and hand
cases, the overrides, and (slow) one tiny run end to end."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from benchmarks.privacy import (
    attack_metrics,
    largest_site_epsilon,
    lira_offline_scores,
    logit_confidence,
    main,
    parse_overrides,
    record_keys,
    roc_auc,
    tpr_at_fpr,
)


def test_auc_is_the_share_of_member_non_member_pairs_ranked_right_ties_half():
    rng = np.random.default_rng(0)
    members, non_members = rng.integers(0, 5, 40).astype(float), rng.integers(0, 5, 30).astype(float)
    pairs = [(m > n) + 0.5 * (m == n) for m, n in itertools.product(members, non_members)]
    assert roc_auc(members, non_members) == pytest.approx(np.mean(pairs), abs=1e-12)
    assert roc_auc(np.array([2.0, 3.0]), np.array([0.0, 1.0])) == 1.0
    assert roc_auc(np.array([1.0]), np.array([1.0])) == 0.5


def test_tpr_at_fpr_uses_a_threshold_at_most_that_share_of_non_members_pass():
    non_members = np.arange(100, dtype=float)  # 0 .. 99
    members = np.array([98.5, 99.5, 97.5, 50.0])
    assert tpr_at_fpr(members, non_members, 0.01) == 0.5  # one non-member (99) may pass: threshold 98
    assert tpr_at_fpr(members, non_members, 0.02) == 0.75  # threshold 97
    assert tpr_at_fpr(members, non_members, 0.001) == 0.25  # none may pass: above 99
    values = attack_metrics(np.r_[members, non_members], np.r_[np.ones(4, bool), np.zeros(100, bool)])
    assert set(values) == {"auc", "tpr@0.01", "tpr@0.001"}


def test_loss_and_logit_confidence_from_the_logits():
    logits = np.array([[2.0, 0.0, -1.0], [0.0, 40.0, 0.0]])
    labels = np.array([0, 1])
    loss, phi = logit_confidence(logits, labels)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(loss, -np.log(p[[0, 1], labels]), rtol=1e-12)
    assert phi[0] == pytest.approx(np.log(p[0, 0] / (1 - p[0, 0])), rel=1e-12)
    assert phi[1] == pytest.approx(40 - np.log(2), rel=1e-12)  # p_y rounds to 1 in float64; phi does not


def test_lira_offline_standardises_against_the_out_shadows_with_a_pooled_variance():
    shadow_phi = np.array([[0.0, 10.0, 5.0], [2.0, 12.0, 5.0], [100.0, 11.0, 5.0]])
    shadow_in = np.array([[False, False, True], [False, False, True], [True, False, True]])
    scores, usable = lira_offline_scores(np.array([3.0, 13.0, 0.0]), shadow_phi, shadow_in)
    # Record 0: out shadows 0 and 2 -> mean 1; record 1: all three -> mean 11; record 2: none (left out).
    # Pooled variance: residuals (-1, 1) and (-1, 1, 0), 5 values, 2 means: 4 / 3.
    sigma = np.sqrt(4 / 3)
    assert usable.tolist() == [True, True, False]
    np.testing.assert_allclose(scores[:2], [(3 - 1) / sigma, (13 - 11) / sigma], rtol=1e-12)


def test_record_keys_ignore_the_loaders_dtype_and_overrides_read_json():
    assert record_keys(np.array([[1, 2]], np.int8), [3]) == record_keys(np.array([[1, 2]], np.int64), [3])
    assert record_keys(np.array([[1, 2]]), [3]) != record_keys(np.array([[1, 2]]), [4])
    assert parse_overrides(["server=dp_fedavg", 'server_args={"seed": 1}', "lr=0.1"]) == {
        "server": "dp_fedavg",
        "server_args": {"seed": 1},
        "lr": 0.1,
    }
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        parse_overrides(["oops"])


def test_the_largest_sample_level_epsilon_over_sites_and_rounds():
    rounds = [
        {"privacy": {"site-1": {"epsilon": 0.5}, "site-2": {"epsilon": 0.7}}},
        {"privacy": {"site-1": {"epsilon": 0.9}}},
        {"rule_diagnostics": {}},
    ]
    assert largest_site_epsilon(rounds) == 0.9
    assert largest_site_epsilon([{"stage": "round"}]) is None


@pytest.mark.slow
def test_a_tiny_run_writes_the_page_and_carries_a_server_dp_setting(tmp_path):
    out = tmp_path / "privacy.md"
    argv = ["--tasks", "1kg", "--seeds", "0", "--shadows", "1", "--rounds", "1", "--work", str(tmp_path / "w")]
    dp = ["--set", "server=dp_fedavg", "--set", 'server_args={"noise_multiplier": 1.0, "clip_norm": 1.0, "seed": 0}']
    assert main([*argv, *dp, "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())[0]
    row = result["seeds"][0]
    assert result["overrides"]["server"] == "dp_fedavg" and row["epsilon"] > 0
    assert row["members"] > 0 and row["non_members"] > 0 and 0 <= row["lira"]["auc"] <= 1
    assert "## 1kg" in out.read_text() and "LiRA offline" in out.read_text()
