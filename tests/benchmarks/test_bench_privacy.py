"""The membership-inference benchmark (benchmarks/privacy.py): the attack statistics against brute force and hand
cases, the overrides, and (slow) one tiny run end to end."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from benchmarks.privacy import (
    GRID_BEGIN,
    GRID_END,
    NotCached,
    attack_metrics,
    cached,
    cell_overrides,
    epsilon_axis,
    grid_rows,
    grid_section,
    largest_site_epsilon,
    lira_offline_scores,
    logit_confidence,
    main,
    paired_verdict,
    parse_epsilons,
    parse_more_rounds,
    parse_overrides,
    parse_personal,
    personal_leak_note,
    personal_row,
    record_keys,
    replace_section,
    roc_auc,
    site_attack_metrics,
    site_weighted_accuracy,
    tpr_at_fpr,
    undertraining_note,
    write_page,
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
    assert parse_overrides(["server=dp_fedavg", 'server_args={"clip_norm": 1}', "lr=0.1"]) == {
        "server": "dp_fedavg",
        "server_args": {"clip_norm": 1},
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


def test_site_accuracy_weights_the_per_class_test_accuracy_by_the_sites_label_shares():
    test_y = np.array([0, 0, 1, 1, 1, 2])
    correct = np.array([True, False, True, True, False, True])  # per class: 1/2, 2/3, 1
    site_y = np.array([0, 1, 1, 1])  # shares 1/4, 3/4, 0
    assert site_weighted_accuracy(correct, test_y, site_y, 3) == pytest.approx(0.25 * 0.5 + 0.75 * 2 / 3, abs=1e-12)
    # A class the test set lacks counts 0; a site holding every class equally gets the class-balanced accuracy.
    assert site_weighted_accuracy(correct, test_y, np.array([3]), 4) == 0.0
    balanced = site_weighted_accuracy(correct, test_y, np.array([0, 1, 2]), 3)
    assert balanced == pytest.approx((0.5 + 2 / 3 + 1) / 3, abs=1e-12)


def test_grid_cells_combine_the_base_the_method_and_the_budget():
    assert cell_overrides("fedavg", None, {"lr": 0.1}) == {"lr": 0.1}
    assert cell_overrides("scaffold", 3.0, {}) == {
        "client": "scaffold",
        "dp_max_grad_norm": 1.0,
        "dp_delta": 1e-5,
        "dp_target_epsilon": 3.0,
    }
    assert cell_overrides("fedadam", 1.0, {})["server"] == "fedadam"
    with pytest.raises(SystemExit, match="unknown method 'fedsgd'"):
        cell_overrides("fedsgd", 1.0, {})
    assert parse_epsilons(["1", "8", "inf"]) == [1.0, 8.0, None]
    for bad in ("0", "-1", "x", "nan"):
        with pytest.raises(SystemExit, match="--epsilons"):
            parse_epsilons([bad])
    assert epsilon_axis([1.0, 8.0, None]) == [1.0, 8.0, 20.0]


def test_more_rounds_name_a_task_and_method_and_their_extra_round_counts():
    assert parse_more_rounds(["fmnist:fedavg=10", "fmnist:fedavg=10,20", "1kg:scaffold=5"]) == {
        ("fmnist", "fedavg"): [10, 20],
        ("1kg", "scaffold"): [5],
    }
    assert parse_more_rounds([]) == {}
    for bad in ("fmnist=10", "fmnist:fedsgd=10", "mnist:fedavg=10", "fmnist:fedavg=0", "fmnist:fedavg=x"):
        with pytest.raises(SystemExit, match="--more-rounds"):
            parse_more_rounds([bad])


def test_site_attacks_score_each_site_on_its_own_members_and_non_members_then_average():
    members = [np.array([True, True, False, False, False]), np.array([False, False, True, False, False])]
    non_members = [np.array([False, False, True, True, False]), np.array([False, False, False, True, True])]
    # Site 0 scores records 0, 1 (members) against 2, 3: AUC 1. Site 1: record 2 against 3, 4: one win, one tie.
    scores = np.array([[5.0, 4.0, 1.0, 2.0, 9.0], [0.0, 0.0, 3.0, 1.0, 3.0]])
    values = site_attack_metrics(scores, members, non_members)
    assert values["auc"] == pytest.approx((1.0 + 0.75) / 2, abs=1e-12)
    # A 1-D score (the global model) is the same row for every site.
    shared = site_attack_metrics(scores[0], members, non_members)
    assert shared["auc"] == pytest.approx((1.0 + 0.0) / 2, abs=1e-12)  # site 1: record 2 (1.0) under 2.0 and 9.0


def test_personal_cells_settings_and_their_row_pair_personal_with_global():
    assert parse_personal(["1kg:fedper", "fmnist:finetune=10"]) == [("1kg", "fedper", None), ("fmnist", "finetune", 10)]
    for bad in ("fmnist:fedavg", "1kg:fedavg", "1kg", "1kg:fedrep=0", "1kg:fedrep=x", "1kg:fedrep="):
        with pytest.raises(SystemExit, match="--personal"):
            parse_personal([bad])
    assert cell_overrides("fedper", 8.0, {}, {"local_keys": "net.head.*"})["local_keys"] == "net.head.*"
    attack = {"auc": 0.6, "tpr@0.01": 0.03}
    mine = {"accuracy": 0.9, "global_accuracy": 0.5, "loss": attack, "global_loss": attack}
    seeds = [
        {"site_epsilon": None, "personal": {**mine, "lira": {"auc": 0.7, "tpr@0.01": 0.05}, "global_lira": attack}},
        {"site_epsilon": None, "personal": {**mine, "lira": {"auc": 0.5, "tpr@0.01": 0.01}, "global_lira": attack}},
    ]
    cell = {"task": "1kg", "method": "ditto", "rounds": 3, "target_epsilon": None, "seeds": seeds}
    cell = {**cell, "shadows": 2, "federation_minutes": 1.0}
    assert personal_row(cell) == (
        "| 1kg | ditto | 3 | ∞ | - | 90.0 ± 0.0 | 50.0 ± 0.0 | 60.0 ± 0.0 | 60.0 ± 0.0 | 60.0 ± 14.1 | 60.0 ± 0.0 | "
        "3.0 ± 2.8 | 3.0 ± 0.0 |"
    )
    section = "\n".join(grid_section([{**cell, "personal": True}, _no_dp_cell("1kg", 3, [0.8])], "cmd", None))
    assert "### Attacks on a site's personal model" in section and section.count("| 1kg | ditto |") == 1
    # LiRA d = +0.1, -0.1: mean 0 -> tie; loss d = 0, 0 -> tie.
    assert personal_leak_note([cell])[:2] == [
        "- loss threshold, personal AUC against global AUC beyond the seed spread (paired by seed): none; every other "
        "cell a tie.",
        "- LiRA offline, personal AUC against global AUC beyond the seed spread (paired by seed): none; every other "
        "cell a tie.",
    ]


def test_personal_leakage_is_more_or_less_only_beyond_the_paired_seed_spread():
    # d = 0.03, 0.01, 0.04: mean 0.0267 > std 0.0153 -> more; the mirror -> less.
    assert paired_verdict([0.53, 0.52, 0.54], [0.50, 0.51, 0.50]) == "more"
    assert paired_verdict([0.50, 0.51, 0.50], [0.53, 0.52, 0.54]) == "less"
    # d = 0.03, -0.02, 0.01: mean 0.0067 < std 0.0252 -> tie, though the means differ.
    assert paired_verdict([0.53, 0.50, 0.52], [0.50, 0.52, 0.51]) == "tie"
    # Pairing matters: unpaired, the spreads (0.12) swamp it; paired, d = 0.02 every seed.
    assert paired_verdict([0.42, 0.52, 0.66], [0.40, 0.50, 0.64]) == "more"
    assert paired_verdict([0.6], [0.5]) == "more"  # one seed: no spread


def _no_dp_cell(task, rounds, accuracies):
    seeds = [_row(i, a, None, 0.5, None, None) for i, a in enumerate(accuracies)]
    cell = {"task": task, "method": "fedavg", "rounds": rounds, "target_epsilon": None, "seeds": seeds}
    return {**cell, "shadows": 0, "federation_minutes": 1.0}


def test_a_task_is_undertrained_when_its_no_dp_accuracy_is_below_more_rounds_beyond_the_seed_spread():
    # fmnist: 0.25 +- 0.01 at 3 rounds against 0.60 +- 0.10 at 10: 35 points, beyond 10. 1kg: 0.80 at 3 rounds
    # against the no-DP section's 0.90 +- 0.14 (sample std of 0.8, 1.0): 10 points, within 14.1.
    cells = [_no_dp_cell("fmnist", 3, [0.24, 0.25, 0.26]), _no_dp_cell("fmnist", 10, [0.5, 0.6, 0.7])]
    cells.append(_no_dp_cell("1kg", 3, [0.8, 0.8]))
    reference = [
        {"task": "1kg", "rounds": 10, "overrides": {}, "seeds": [{"test_accuracy": 0.8}, {"test_accuracy": 1.0}]},
        {"task": "fmnist", "rounds": 10, "overrides": {}, "seeds": [{"test_accuracy": 0.1}]},  # the grid's count wins
    ]
    lines, undertrained = undertraining_note(cells, reference)
    assert undertrained == ["fmnist"]
    assert lines[0] == (
        "- fmnist: FedAvg without DP reaches 25.0 ± 1.0 % at 3 rounds (grid), 60.0 ± 10.0 % at 10 rounds (grid); "
        "**its 3-round rows are undertrained**: 35.0 points below the same federations at 10 rounds, beyond the "
        "seed spread."
    )
    assert lines[1] == (
        "- 1kg: FedAvg without DP reaches 80.0 ± 0.0 % at 3 rounds (grid), 90.0 ± 14.1 % at 10 rounds (the section "
        "above); the gap from 3 to 10 rounds (10.0 points) is within the seed spread."
    )
    assert lines[-1].endswith("So read fmnist's trade-off from its 10-round rows.")
    cells.append({**_no_dp_cell("fmnist", 3, [0.3]), "method": "scaffold"})
    assert undertraining_note(cells, reference)[0][-1].endswith(
        "So read fmnist's trade-off from its 10-round rows; its scaffold rows stop short of that and do not rank "
        "those methods."
    )
    assert undertraining_note(cells[2:], []) == ([], [])  # one round count: nothing to compare


def _row(seed, acc, sites, loss_auc, lira_auc, eps):
    lira = None if lira_auc is None else {"auc": lira_auc, "tpr@0.01": 0.02}
    return {
        "seed": seed,
        "test_accuracy": acc,
        "site_accuracy": sites,
        "loss": {"auc": loss_auc, "tpr@0.01": 0.01},
        "lira": lira,
        "site_epsilon": eps,
    }


def test_a_grid_row_is_mean_and_std_over_seeds_with_missing_attacks_as_dashes():
    cell = {
        "task": "1kg",
        "method": "fedavg",
        "rounds": 3,
        "target_epsilon": 8.0,
        "seeds": [_row(0, 0.8, [0.7, 0.9], 0.5, 0.6, 7.5), _row(1, 0.6, [0.5, 0.3], 0.7, 0.8, 7.9)],
    }
    # Sample std (ddof 1) of two values a, b is |a - b| / sqrt(2).
    assert grid_rows(cell) == (
        "| 1kg | fedavg | 3 | 8 | 7.90 | 70.0 ± 14.1 | 60.0 ± 28.3 | 50.0 ± 28.3 | 60.0 ± 14.1 | 1.0 ± 0.0 | "
        "70.0 ± 14.1 | 2.0 ± 0.0 |"
    )
    cell = {**cell, "target_epsilon": None, "seeds": [_row(0, 0.8, None, 0.5, None, None)]}
    assert grid_rows(cell).startswith("| 1kg | fedavg | 3 | ∞ | - | 80.0 ± 0.0 | - | - | 50.0 ± 0.0 |")
    assert grid_rows(cell).endswith("| - | - |")


def test_the_grid_section_is_appended_once_replaced_after_and_kept_by_the_no_dp_page(tmp_path):
    page = "# Page\n\nno-DP tables\n"
    once = replace_section(page, [GRID_BEGIN, "grid v1", GRID_END])
    assert once == f"# Page\n\nno-DP tables\n\n{GRID_BEGIN}\ngrid v1\n{GRID_END}\n"
    twice = replace_section(once, [GRID_BEGIN, "grid v2", GRID_END])
    assert twice == once.replace("grid v1", "grid v2")
    out = tmp_path / "privacy.md"
    out.write_text(twice)
    write_page([], out, "python -m benchmarks.privacy")
    text = out.read_text()
    assert text.startswith("# Membership inference") and text.count(GRID_BEGIN) == 1 and "grid v2" in text


def test_a_cached_only_run_reads_the_cache_and_names_the_cells_it_would_have_to_run(tmp_path):
    with pytest.raises(NotCached):
        cached(tmp_path / "seed0.npz", None)
    assert cached(tmp_path / "seed0.npz", lambda: {"test_accuracy": 0.5})["test_accuracy"] == 0.5
    assert cached(tmp_path / "seed0.npz", None)["test_accuracy"] == 0.5  # now from the file
    cell = {"task": "1kg", "method": "fedavg", "target_epsilon": 1.0, "rounds": 3, "shadows": 2}
    cell = {**cell, "federation_minutes": 1.0, "seeds": [_row(0, 0.8, [0.8], 0.5, 0.5, 1.0)]}
    lines = grid_section(
        [cell], "python -m benchmarks.privacy --grid --cached-only --out p.md", None, ["1kg scaffold ε=8"]
    )
    assert "Not yet run (time): 1kg scaffold ε=8. `python -m benchmarks.privacy --grid --out p.md` runs them" in (
        "\n".join(lines)
    )


@pytest.mark.slow
def test_a_tiny_run_writes_the_page_and_carries_a_server_dp_setting(tmp_path):
    out = tmp_path / "privacy.md"
    argv = ["--tasks", "1kg", "--seeds", "0", "--shadows", "1", "--rounds", "1", "--work", str(tmp_path / "w")]
    dp = ["--set", "server=dp_fedavg", "--set", 'server_args={"noise_multiplier": 1.0, "clip_norm": 1.0}']
    assert main([*argv, *dp, "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())[0]
    row = result["seeds"][0]
    assert result["overrides"]["server"] == "dp_fedavg" and row["epsilon"] > 0
    assert row["members"] > 0 and row["non_members"] > 0 and 0 <= row["lira"]["auc"] <= 1
    assert "## 1kg" in out.read_text() and "LiRA offline" in out.read_text()


@pytest.mark.slow
def test_a_tiny_grid_writes_its_section_plot_and_json_and_reaches_the_budget(tmp_path):
    out = tmp_path / "privacy.md"
    argv = ["--grid", "--tasks", "1kg", "--methods", "fedavg", "--epsilons", "8", "inf", "--seeds", "0"]
    argv += ["--personal", "1kg:ditto"]  # no DP cell: Ditto is refused under DP-SGD
    assert main([*argv, "--shadows", "1", "--rounds", "1", "--work", str(tmp_path / "w"), "--out", str(out)]) == 0
    private, plain, ditto = json.loads((tmp_path / "privacy_dp.json").read_text())
    mine = ditto["seeds"][0]["personal"]
    assert ditto["personal"] and ditto["target_epsilon"] is None and 0 <= mine["accuracy"] <= 1
    assert 0 <= mine["loss"]["auc"] <= 1 and 0 <= mine["lira"]["auc"] <= 1 and 0 <= mine["global_lira"]["auc"] <= 1
    assert "### Attacks on a site's personal model" in out.read_text()
    assert private["target_epsilon"] == 8.0 and 0 < private["seeds"][0]["site_epsilon"] <= 8.0 + 1e-6
    assert plain["target_epsilon"] is None and plain["seeds"][0]["site_epsilon"] is None
    assert len(private["seeds"][0]["site_accuracy"]) == 3 and private["seeds"][0]["lira"] is not None
    assert GRID_BEGIN in out.read_text() and (tmp_path / "privacy_dp.png").stat().st_size > 0


def test_built_in_site_records_are_what_each_site_trains_and_validates_on(tmp_path):
    from benchmarks.in_process import site_rounds
    from benchmarks.privacy import site_splits
    from jobs.spec import spec_from_values

    spec = spec_from_values(
        "split", {"dataset": "digits", "arch": "mlp", "num_sites": 3, "site_val_fraction": 0.4, "seed": 4}
    )
    sites = list(site_rounds(spec, tmp_path).values())
    for site, ((train_x, train_y), (val_x, val_y)) in zip(sites, site_splits(spec), strict=True):
        np.testing.assert_array_equal(train_y, site.dataset.tensors[1].numpy())
        held_x, held_y = (t.numpy() for t in site.validation.tensors)
        np.testing.assert_array_equal(val_y, held_y)
        np.testing.assert_allclose(val_x.reshape(held_x.shape), held_x, atol=1e-6)
        assert abs(len(val_y) - 0.4 * (len(val_y) + len(train_y))) <= 1
        # Disjoint: a site's members are never its own non-members.
        assert not set(record_keys(train_x, train_y)) & set(record_keys(val_x, val_y))
