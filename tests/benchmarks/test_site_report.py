"""benchmarks.site_report: what a cell keeps of a job's test-split scores, and the per-site page built from cells."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks import site_report as sr
from benchmarks import site_stats as st


def test_cell_scores_reads_every_candidate_and_the_kept_one_from_the_sites_meta():
    meta = {
        "site-1": {
            "eval.global_test_accuracy": 0.5,
            "eval.personal_test_accuracy": 0.6,
            "eval.local_test_accuracy": 0.55,
            "eval.kept_test_accuracy": 0.6,
            "eval.kept_candidate": 1.0,  # the index the sites send (lightning_modules.keep_best.CANDIDATES)
            "eval.val_accuracy": 0.9,  # a validation score is never a test score
        },
        "site-2": {"eval.global_test_accuracy": 0.7},
    }
    got = sr.cell_scores(meta)
    assert got["site_test"] == {
        "global": {"site-1": 0.5, "site-2": 0.7},
        "personal": {"site-1": 0.6},
        "local": {"site-1": 0.55},
        "kept": {"site-1": 0.6},
    }
    assert got["kept_candidate"] == {"site-1": "personal"}
    assert [sr.candidate_name(v) for v in (0.0, 2, "local", 3.0, 4.0, 1.5)] == [
        "global",
        "local",
        "local",
        "mixture",
        "unknown(4)",
        "unknown(1.5)",
    ]


def test_the_last_round_with_test_scores_is_the_one_read():
    records = [
        {"stage": "round", "site_meta": {"site-1": {"eval.kept_test_accuracy": 0.1}}},
        {"stage": "round", "site_meta": {"site-1": {"eval.kept_test_accuracy": 0.2}}},
        {"stage": "round", "site_meta": {"site-1": {"train.loss": 1.0}}},  # a round whose sites scored nothing
    ]
    assert sr.test_metrics_record(records) == {"site-1": {"eval.kept_test_accuracy": 0.2}}
    assert sr.test_metrics_record([{"stage": "initial"}]) == {}


def test_bytes_per_site_round_is_the_mean_over_rounds_of_all_traffic_per_site():
    traffic = [
        {"sites": 2, "model_down": 100, "meta_down": 10, "model_up": 200, "meta_up": 0},
        {"sites": 1, "model_down": 50, "meta_down": 0, "model_up": 50, "meta_up": 20},
    ]
    assert sr.bytes_per_site_round(traffic) == pytest.approx((310 / 2 + 120) / 2)


KEPT = {0: {"site-1": 0.90, "site-2": 0.50}, 1: {"site-1": 0.88, "site-2": 0.75}, 2: {"site-1": 0.91, "site-2": 0.70}}
LOCAL = {0: {"site-1": 0.85, "site-2": 0.72}, 1: {"site-1": 0.86, "site-2": 0.71}, 2: {"site-1": 0.87, "site-2": 0.70}}


def _cells(method, kept, local, partition="dir0.3"):
    cells = []
    for seed in kept:
        site_test = {"kept": kept[seed], "local": local[seed], "global": local[seed], "personal": kept[seed]}
        cells.append(
            {
                "cell": {"algorithm": method, "partition": partition, "seed": seed, "partition_seed": 0},
                "site_test": site_test,
                "kept_candidate": {site: "personal" for site in kept[seed]},
                "site_sizes": {"site-1": {"train": 600, "val": 200, "test": 200}, "site-2": {"train": 30}},
                "traffic": [{"sites": 2, "model_down": 2048, "meta_down": 0, "model_up": 2048, "meta_up": 0}],
                "wall_s": 10.0,
            }
        )
    return cells


def test_the_page_names_the_missing_pair_the_interval_and_every_methods_sites():
    same = {seed: dict(sites) for seed, sites in LOCAL.items()}
    cells = _cells("fedavgm", KEPT, LOCAL) + _cells("fedavg", same, LOCAL)
    lines = sr.report_lines(cells, "Fashion-MNIST")
    text = "\n".join(lines)
    assert "### Fashion-MNIST, dir0.3, partition seed 0" in text
    # fedavgm (the default): site-2 seed 0 is 22 points below its local-only model
    assert "Target for fedavgm (the pre-registered default): **missed**" in text
    assert "site-2 seed 0 (-22.0)" in text
    row = next(line for line in lines if line.startswith("| fedavgm ★ |"))
    interval = st.setting_interval(st.paired_differences(KEPT, LOCAL))
    assert f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]" in row
    assert "-22.0 (site-2, seed 0)" in row and "| 1 of 6 | missed | 2 | 10 |" in row  # (2048 + 2048) B / 2 sites
    # kept == local everywhere: no pair below, mean equal: met
    assert "Target for fedavg: **met**" in text
    assert (
        text.count("Per site, ") == 2 and "| site-1 | 600 / 200 / 200 |" in text and "| site-2 | 30 / – / – |" in text
    )


def test_a_site_row_has_the_t_interval_over_seeds_of_kept_minus_local():
    lines = sr.site_rows({seed: c for seed, c in enumerate(_cells("fedrep", KEPT, LOCAL))})
    d = np.array([KEPT[s]["site-1"] - LOCAL[s]["site-1"] for s in range(3)])
    half = 4.302652729749464 * d.std(ddof=1) / math.sqrt(3)
    expected = f"{100 * d.mean():+.1f} [{100 * (d.mean() - half):+.1f}, {100 * (d.mean() + half):+.1f}]"
    assert expected in lines[0] and lines[0].endswith(
        "| within | personal, personal, personal |"
    )  # [-0.1, +7.5] holds 0


def test_cells_without_test_scores_give_no_section():
    assert sr.report_lines([{"cell": {"algorithm": "fedavg", "partition": "C2", "seed": 0}}], "x") == []


def test_the_central_run_is_read_only_against_the_federated_global_models():
    cells = _cells("fedavg", KEPT, LOCAL) + _cells("central", KEPT, LOCAL)
    for cell, pooled in zip(cells, (0.4, 0.5, 0.6, 0.7, 0.8, 0.9), strict=True):
        cell["site_pooled_test"] = {"global": {"site-1": pooled, "site-2": pooled}}
    text = "\n".join(sr.report_lines(cells, "x"))
    # fedavg's global model: (40 + 50 + 60) / 3 = 50.0 on the pooled test set; central: (70 + 80 + 90) / 3 = 80.0
    assert "Global model on the pooled test set (all labels, mean over seeds): fedavg 50.0;" in text
    assert "trained centrally on data of the same size and distribution as the sites' union" in text
    assert "epochs and rounds: 80.0." in text
    assert "| central |" not in text and "Target for central" not in text  # no site could keep it


def test_the_global_model_chosen_on_validation_is_shown_beside_the_last_ones():
    cells = _cells("fedavg", KEPT, LOCAL) + _cells("central", KEPT, LOCAL)
    for cell, pooled in zip(cells, (0.4, 0.5, 0.6, 0.7, 0.8, 0.9), strict=True):
        cell["site_pooled_test"] = {"global": dict.fromkeys(("site-1", "site-2"), pooled)}
        cell["site_pooled_test"]["best_global"] = dict.fromkeys(("site-1", "site-2"), pooled + 0.05)
    text = "\n".join(sr.report_lines(cells, "x"))
    assert "fedavg 50.0 at the end, 55.0 chosen on validation;" in text
    assert "epochs and rounds: 80.0 at the end, 85.0 chosen on validation." in text


def test_the_delivered_global_models_scores_are_the_sites_scores_in_the_round_it_was_sent():
    def round_record(r: int, pooled: float, **extra) -> dict:
        meta = {"eval.global_pooled_test_accuracy": pooled, "eval.global_test_accuracy": pooled / 2}
        return {"stage": "round", "round": r, "site_meta": {"site-1": meta, "site-2": dict(meta)}, **extra}

    note = {"sent_in_round": 2, "metric": "val_loss", "mean_over_sites": 0.3}
    records = [{"stage": "initial"}, round_record(0, 0.4), round_record(1, 0.9, best_global=note), round_record(2, 0.6)]
    assert sr.best_global_scores(records) == {"site-1": 0.9, "site-2": 0.9}  # round 2 (1-based) scored it
    assert sr.best_global_scores(records, "test") == {"site-1": 0.45, "site-2": 0.45}
    assert sr.best_global_scores(records[:2]) == {}  # nothing chosen


def test_a_site_that_kept_its_own_model_everywhere_reads_no_gain_not_a_zero_width_interval():
    cells = _cells("fedavgm", LOCAL, LOCAL)
    for cell in cells:
        cell["kept_own"] = {"site-1": True, "site-2": False}
    rows = sr.site_rows(dict(enumerate(cells)))
    assert "| no gain: kept its own model |" in rows[0] and rows[0].count("| own |") == 1
    assert "no gain" not in rows[1] and "+0.0 (no spread over seeds)" in rows[1]  # measured


def test_the_pooled_site_table_gives_what_the_global_model_would_trade_per_site():
    cells = _cells("fedavgm", KEPT, LOCAL)
    pooled_global = {0: 0.80, 1: 0.82, 2: 0.84}
    for seed, cell in enumerate(cells):
        cell["site_pooled_test"] = {
            "local": {"site-1": 0.40, "site-2": 0.50},
            "kept": {"site-1": 0.60, "site-2": 0.50},
            "global": {"site-1": pooled_global[seed], "site-2": pooled_global[seed]},
        }
        cell["site_test"]["global"] = {"site-1": LOCAL[seed]["site-1"] - 0.02, "site-2": LOCAL[seed]["site-2"]}
        cell["kept_own"] = {"site-1": False, "site-2": True}
    lines = sr.pooled_site_table("fedavgm", dict(enumerate(cells)))
    site1 = next(line for line in lines if line.startswith("| site-1 |"))
    site2 = next(line for line in lines if line.startswith("| site-2 |"))
    # site-1: local 40.0, kept 60.0, global (80 + 82 + 84) / 3 = 82.0 pooled; kept +20.0 exactly at every seed;
    # global - local pooled 40, 42, 44: mean +42.0, half-width t(0.975, 2) * 2 / sqrt(3) = 4.97; own cost -2.0
    assert site1.startswith("| site-1 | 40.0 | 60.0 | 82.0 | +20.0 (no spread over seeds) | +42.0 [+37.0, +47.0] |")
    assert site1.endswith("| -2.0 (no spread over seeds) |")
    assert "| no gain: kept its own model |" in site2
    assert sr.pooled_site_table("fedavgm", dict(enumerate(_cells("fedavgm", KEPT, LOCAL)))) == []  # no pooled view


def test_the_gain_targets_are_read_on_the_interval_over_seeds_and_the_pooled_mean():
    # Own view: site means over seeds +4, +4, +4 points: mean +4 >= +3, interval [+4, +4] above 0: met. Pooled:
    # +10 at every pair: below +15: missed. Sites of 30 and 600 training samples: one holds >= 600, said so.
    local = {seed: {"site-1": 0.5, "site-2": 0.6} for seed in range(3)}
    kept = {seed: {"site-1": 0.54, "site-2": 0.64} for seed in range(3)}
    cells = _cells("fedavgm", kept, local)
    for cell in cells:
        cell["site_pooled_test"] = {"kept": {"site-1": 0.4, "site-2": 0.4}, "local": {"site-1": 0.3, "site-2": 0.3}}
    by_seed = {cell["cell"]["seed"]: cell for cell in cells}
    text = sr.gain_target_sentence("fedavgm", by_seed)
    assert text == (
        "Gain targets for fedavgm (sites of 30–600 training samples; some site holds ≥ 600): own view +4.0 "
        "(no spread over seeds) (met: ≥ +3 with the interval above 0); pooled view +10.0 (no spread over seeds) "
        "(missed: ≥ +15 on the mean)."
    )
    # A mean of +4 whose interval holds 0 misses: seeds +12, +0, +0 (site means).
    kept[0] = {"site-1": 0.62, "site-2": 0.72}
    kept[1], kept[2] = dict(local[1]), dict(local[2])
    by_seed = {cell["cell"]["seed"]: cell for cell in _cells("fedavgm", kept, local)}
    assert "own view +4.0 [-13.2, +21.2] (missed" in sr.gain_target_sentence("fedavgm", by_seed)
    assert sr.gain_target_sentence("fedavgm", {0: {"site_test": {}}}) is None


def test_seeds_that_all_give_the_same_value_read_no_spread_not_a_zero_width_interval():
    assert sr.interval_text(st.t_interval([0.0, 0.0, 0.0])) == "+0.0 (no spread over seeds)"
    assert sr.interval_text(st.t_interval([0.01, 0.03])).startswith("+2.0 [")
