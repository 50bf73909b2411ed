"""The comparison harness: a tiny grid end to end, resuming, the byte counts and the tie rule."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from benchmarks import compare


def test_meta_bytes_counts_arrays_only():
    meta = {"a": np.zeros(3, np.float32), "b": {"c": np.zeros((2, 2), np.float64)}, "d": 1.5, "e": "x"}
    assert compare.meta_bytes(meta) == 3 * 4 + 4 * 8


def test_every_algorithm_of_the_headline_grid_is_a_valid_job():
    grid = compare.GRIDS["headline"]()
    assert {"fedavg", "scaffold", "fedprox", "feddyn", "fedmos", "moon", "fednova", "fedavgm"} <= set(grid.algorithms)
    for algorithm in grid.algorithms:
        for partition in grid.partitions:
            spec = compare.cell_spec(compare.Cell(algorithm, partition, 0.5, 0), grid.protocol)
            assert spec.num_sites == 10 and spec.clients_per_round == 0.5


def _summary(name: str, mean: float, std: float) -> compare.Summary:
    nan = float("nan")
    return compare.Summary(name, 3, np.zeros((3, 2)), (mean, std), (mean, std), None, 0, nan, nan, nan, nan, 0, 0, 0)


def test_a_gap_below_the_seed_spread_is_a_tie():
    notes = compare.ranking_notes([_summary("a", 0.80, 0.01), _summary("b", 0.79, 0.02), _summary("c", 0.70, 0.01)])
    assert notes == {"a": "best", "b": "tie", "c": ""}


@pytest.mark.slow
def test_smoke_grid_writes_a_report_and_resumes(tmp_path, capsys):
    assert compare.main(["--grid", "smoke", "--out", str(tmp_path), "--workers", "1"]) == 0
    cells = sorted((tmp_path / "cells").glob("*.json"))
    assert len(cells) == 4
    result = json.loads(cells[0].read_text())
    rounds = [r for r in result["records"] if r["stage"] == "round"]
    assert len(rounds) == 2 and len(result["traffic"]) == 2
    report = (tmp_path / "report.md").read_text()
    assert "| scaffold | 2 |" in report and "| fedavg | 2 |" in report
    assert (tmp_path / "compare_dir0.1_p1.png").stat().st_size > 0
    # SCAFFOLD sends its control both ways, as many bytes as the model (all parameters are trainable here); the
    # global control goes out from round 2 on (round 1 broadcasts none: it is zero).
    first, second = json.loads((tmp_path / "cells" / "scaffold__dir0.1__p1__s0.json").read_text())["traffic"]
    assert first["meta_down"] == 0 and first["meta_up"] == first["model_up"]
    assert second["meta_down"] == second["model_down"]
    capsys.readouterr()
    assert compare.main(["--grid", "smoke", "--out", str(tmp_path), "--workers", "1"]) == 0
    assert "4 cells, 4 already done, 0 to run" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="another protocol"):
        compare.main(["--grid", "smoke", "--out", str(tmp_path), "--rounds", "3"])


def test_niid_bench_grid_is_the_published_protocol():
    grid = compare.GRIDS["niid_bench"]()
    assert set(grid.partitions) == set(compare.PUBLISHED_NIID_BENCH) and grid.seeds == (42,)
    for algorithm in grid.algorithms:
        spec = compare.cell_spec(compare.Cell(algorithm, "C1", 1.0, 42), grid.protocol)
        assert (spec.arch, spec.lr, spec.momentum, spec.weight_decay) == ("simple_cnn", 0.01, 0.9, 1e-5)
        assert (spec.epochs, spec.batch_size, spec.num_rounds, spec.num_sites) == (10, 64, 50, 10)
        assert spec.scheme == "shards" and spec.classes_per_site == 1 and spec.clients_per_round is None
    fedprox = compare.cell_spec(compare.Cell("fedprox", "iid", 1.0, 42), grid.protocol)
    fednova = compare.cell_spec(compare.Cell("fednova_equal_epochs", "iid", 1.0, 42), grid.protocol)
    assert fedprox.client_args == {"mu": 0.01} and fednova.server == "fednova" and fednova.pattern == "constant"
    # "#C=k" is dealt as NIID-Bench deals it (unequal sites), not with the balanced shards of the headline grid.
    c2 = compare.cell_spec(compare.Cell("scaffold", "C2nb", 1.0, 42), grid.protocol)
    assert (c2.scheme, c2.classes_per_site) == ("label_quantity", 2)
    assert set(grid.partitions) == {"iid", "dir0.5", "C3nb", "C2nb", "C1"}


def test_published_comparison_takes_the_best_round_and_the_difference():
    records = [{"test_accuracy": 0.1}, {"test_accuracy": 0.5}, {"test_accuracy": 0.9}, {"test_accuracy": 0.7}]
    groups = {("C2nb", 1.0): {"scaffold": [{"records": records}], "fedavg": [{"records": records[:2]}]}}
    table = "\n".join(compare.published_comparison(groups))
    assert "| C2nb | 81.0 / 50.0 (-31.0) | 10.0 / 90.0 (+80.0) |" in table  # the initial model never counts
    assert "89.0 / not run" in table


def test_cells_of_an_older_protocol_with_a_field_it_no_longer_has_are_refused_cleanly(tmp_path):
    saved = tmp_path / "protocol.json"
    saved.write_text(json.dumps({**dataclasses.asdict(compare.Protocol()), "seed": 0}))
    with pytest.raises(SystemExit, match="another protocol"):
        compare.same_protocol(saved, compare.Protocol())


def test_late_gain_is_the_last_window_minus_the_one_before_in_points_and_flat_within_the_seed_spread():
    # Two seeds, initial model then 4 rounds; window 2: seed 0 (0.5 + 0.6)/2 - (0.1 + 0.2)/2 = 0.4,
    # seed 1 (0.7 + 0.7)/2 - (0.6 + 0.6)/2 = 0.1; mean 0.25 -> 25 points.
    curves = np.array([[0.0, 0.1, 0.2, 0.5, 0.6], [0.0, 0.6, 0.6, 0.7, 0.7]])
    assert compare.late_gain(curves, window=2) == pytest.approx(25.0, abs=1e-9)
    assert np.isnan(compare.late_gain(curves, window=3))  # shorter than two windows
    summary = compare.Summary("fedavg", 2, curves, (0.65, 0.3), (0.65, 0.1), None, 0, *[0.0] * 6, 0, late_gain=25.0)
    assert compare.flattened(summary)  # 25 points <= 100 * 0.3
    assert not compare.flattened(dataclasses.replace(summary, final=(0.65, 0.05)))
    assert not compare.flattened(dataclasses.replace(summary, late_gain=float("nan")))


def test_late_mean_is_each_seeds_mean_over_the_last_window_then_mean_and_std_over_seeds():
    # Window 2: seed 0 (0.5 + 0.6)/2 = 0.55, seed 1 (0.7 + 0.7)/2 = 0.7; mean 0.625, sample std 0.15/sqrt(2).
    curves = np.array([[0.0, 0.1, 0.2, 0.5, 0.6], [0.0, 0.6, 0.6, 0.7, 0.7]])
    mean, std = compare.late_mean(curves, window=2)
    assert mean == pytest.approx(0.625, abs=1e-12) and std == pytest.approx(0.15 / np.sqrt(2), abs=1e-12)
    assert compare.late_mean(curves, window=4) == pytest.approx((0.5, np.std([0.35, 0.65], ddof=1)), abs=1e-12)
    assert all(np.isnan(compare.late_mean(curves, window=5)))  # shorter than the window


def test_table_remarks_and_loss_spreads_read_cleanly():
    """Failed rounds without a rank note have no stray separator; blown-up and non-finite spreads stay readable."""
    best = dataclasses.replace(_summary("fedavg", 0.8, 0.01), loss_spread=0.25)
    collapsed = dataclasses.replace(_summary("scaffold", 0.1, 0.01), failed_rounds=41, loss_spread=float("nan"))
    diverged = dataclasses.replace(_summary("feddyn", 0.7, 0.01), failed_rounds=2, loss_spread=2.15e24)
    rows = compare.group_table([best, collapsed, diverged], target=0.7)[2:]
    cells = [[cell.strip() for cell in row.split("|")[1:-1]] for row in rows]
    assert [(c[0], c[7], c[-1]) for c in cells] == [
        ("fedavg", "0.250", "best"),
        ("feddyn", "2.1e+24", "2 failed rounds"),
        ("scaffold", "non-finite", "41 failed rounds"),
    ]
    tied = dataclasses.replace(_summary("fedyogi", 0.795, 0.02), failed_rounds=1)
    assert compare.group_table([best, tied], target=0.7)[-1].endswith("| tie; 1 failed round |")


def test_overview_has_a_column_per_group_marks_best_and_ties_and_orders_by_mean_final():
    dir_full = [_summary("fedavg", 0.60, 0.02), _summary("fedyogi", 0.80, 0.03), _summary("moon", 0.79, 0.01)]
    c2_half = [_summary("fedavg", 0.50, 0.01), _summary("fedyogi", 0.40, 0.01)]
    lines = compare.overview_table({("dir0.1", 1.0): dir_full, ("C2", 0.5): c2_half})
    assert lines[0] == "| algorithm | dir0.1, 100% of sites per round | C2, 50% of sites per round |"
    # Means over the groups each ran in: fedyogi (0.8 + 0.4)/2 = 0.6 ... moon 0.79 (one group), fedavg 0.55.
    assert lines[2:5] == [
        "| moon | 79.0 ± 1.0 (tie) | – |",
        "| fedyogi | **80.0 ± 3.0** | 40.0 ± 1.0 |",
        "| fedavg | 60.0 ± 2.0 | **50.0 ± 1.0** |",
    ]


def test_overview_neither_ranks_nor_gives_a_spread_to_single_seed_values():
    one_seed = [dataclasses.replace(_summary(name, acc, 0.0), seeds=1) for name, acc in (("a", 0.8), ("b", 0.7))]
    assert compare.overview_table({("iid", 1.0): one_seed})[2:4] == ["| a | 80.0 |", "| b | 70.0 |"]


def test_a_federation_that_records_fewer_rounds_than_planned_fails_its_cell_and_the_command_exits_1(
    tmp_path, monkeypatch, capsys
):
    import benchmarks.in_process as in_process

    def stops_after_one_round(spec, state_root, *, run_id, wrap_transport, **_):
        wrap_transport(None)
        records = [{"stage": "initial", "num_rounds": 2}, {"stage": "round", "round": 0, "status": "aggregated"}]
        return in_process.InProcessRun(params={}, state={}, records=records)

    monkeypatch.setattr(in_process, "run_in_process", stops_after_one_round)
    assert compare.main(["--grid", "smoke", "--out", str(tmp_path), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "cell fedavg__dir0.1__p1__s0 failed: IncompleteFederation: 1 round record(s) of 2 planned" in err
    assert "error: 4 cell(s) failed" in err
    assert not list((tmp_path / "cells").glob("*.json"))  # a failed cell is never written, so a rerun retries it


def test_a_federation_in_which_no_round_aggregated_fails_its_cell_and_the_command_exits_1(
    tmp_path, monkeypatch, capsys
):
    """The round engine records failed rounds too: all its rounds, none aggregated, is the initial model's flat
    curve, never a table entry."""
    import benchmarks.in_process as in_process

    failed = {"stage": "round", "status": "failed", "failure": "rule 'fedavg': no valid result"}

    def never_aggregates(spec, state_root, *, run_id, wrap_transport, **_):
        wrap_transport(None)
        records = [{"stage": "initial", "num_rounds": 2}, *({**failed, "round": r} for r in range(2))]
        return in_process.InProcessRun(params={}, state={}, records=records)

    monkeypatch.setattr(in_process, "run_in_process", never_aggregates)
    assert compare.main(["--grid", "smoke", "--out", str(tmp_path), "--workers", "1"]) == 1
    err = capsys.readouterr().err
    reason = "IncompleteFederation: no round updated the global model (last failure: rule 'fedavg': no valid result)"
    assert f"cell fedavg__dir0.1__p1__s0 failed: {reason}" in err
    assert "error: 4 cell(s) failed" in err
    assert not list((tmp_path / "cells").glob("*.json"))


def test_some_failed_rounds_are_not_an_incomplete_federation():
    """A federation under attack may fail a round; only one in which no round aggregated is refused."""
    rounds = [
        {"stage": "round", "round": 0, "status": "failed", "failure": "every result rejected"},
        {"stage": "round", "round": 1, "status": "aggregated"},
    ]
    compare.require_rounds(rounds, 2)
    with pytest.raises(compare.IncompleteFederation, match=r"^no round updated the global model \(last failure: every"):
        compare.require_rounds(rounds[:1], 1)


# --------------------------------------------------------------------------------------------------------------------
# Personalization grid (benchmarks/personalization.py): does each site gain from joining?
# --------------------------------------------------------------------------------------------------------------------
def test_every_cell_of_the_personalization_grid_is_a_valid_job():
    grid = compare.GRIDS["personalization"]()
    assert set(grid.algorithms) == {"fedavg", "finetune", "fedper", "fedbn", "fedrep", "ditto", "local"}
    assert len(grid.seeds) == 3 and set(grid.partitions) == {"dir0.1", "C2"}
    specs = {a: compare.cell_spec(compare.Cell(a, "C2", 1.0, 0), grid.protocol) for a in grid.algorithms}
    assert all(spec.site_val_fraction == grid.protocol.site_val_fraction > 0 for spec in specs.values())
    assert specs["fedbn"].arch == "bn_cnn" and "bn" in specs["fedbn"].local_keys  # FedBN's own model
    assert (
        specs["fedper"].arch == "lenet5" and specs["fedper"].local_keys == "net.classifier.bias,net.classifier.weight"
    )
    assert specs["finetune"].finetune_epochs == 1 and specs["ditto"].client == "ditto"
    assert specs["local"] == dataclasses.replace(specs["fedavg"], name=specs["local"].name)  # FedAvg's sites alone
    with pytest.raises(SystemExit, match="unknown personalization method 'scaffold'"):
        compare.cell_spec(compare.Cell("scaffold", "C2", 1.0, 0), grid.protocol)


def test_a_site_gains_ties_or_loses_by_its_paired_difference_against_its_seed_spread():
    from benchmarks import personalization as p

    personal = {0: {"a": 0.9, "b": 0.5, "c": 0.1}, 1: {"a": 0.8, "b": 0.6, "c": 0.2}, 2: {"a": 0.7, "b": 0.7, "c": 0.0}}
    local = {s: {"a": 0.6, "b": 0.6, "c": 0.6} for s in (0, 1, 2)}
    differences = p.site_differences(personal, local)
    assert differences["a"] == pytest.approx((0.2, 0.1), abs=1e-9)  # 0.3, 0.2, 0.1
    assert differences["b"] == pytest.approx((0.0, 0.1), abs=1e-9)  # -0.1, 0, 0.1
    assert differences["c"] == pytest.approx((-0.5, 0.1), abs=1e-9)  # -0.5, -0.4, -0.6
    assert p.gain_tie_lose(differences) == (1, 1, 1)
    assert [p.verdict(*d) for d in ((0.1, 0.1), (0.1 + 1e-9, 0.1), (-0.1 - 1e-9, 0.1), (0.0, 0.0))] == [
        "tie",
        "gain",
        "lose",
        "tie",
    ]
    # Seeds only one side ran are left out; a site one seed lacks is left out.
    assert set(p.site_differences({**personal, 3: {"a": 1.0}}, {**local, 4: {"a": 0.0}})) == {"a", "b", "c"}


def test_mean_and_worst_site_are_per_seed_first_then_mean_and_sd_over_seeds():
    from benchmarks import personalization as p

    (mean, mean_sd), (worst, worst_sd) = p.site_mean_and_worst({0: {"a": 0.9, "b": 0.5}, 1: {"a": 0.7, "b": 0.3}})
    assert (mean, worst) == pytest.approx((0.6, 0.4), abs=1e-12)
    assert mean_sd == pytest.approx(0.02**0.5, abs=1e-12) and worst_sd == pytest.approx(0.02**0.5, abs=1e-12)
    assert p.site_mean_and_worst({0: {"a": 0.5}})[0] == (0.5, 0.0)  # one seed: no spread


def _scores(global_: dict[str, float] | None, personal: dict[str, float]) -> dict[str, dict[str, float]]:
    return {"global": global_ or {}, "personal": personal}


def _setting() -> dict[str, dict[int, dict[str, dict[str, float]]]]:
    """Two sites, two seeds: FedAvg's global model serves site b badly, fine-tuning fixes it; local-only between."""
    glob = {0: {"a": 0.9, "b": 0.3}, 1: {"a": 0.9, "b": 0.1}}
    return {
        "local": {0: _scores(None, {"a": 0.8, "b": 0.8}), 1: _scores(None, {"a": 0.8, "b": 0.6})},
        "fedavg": {seed: _scores(glob[seed], glob[seed]) for seed in (0, 1)},
        "finetune": {0: _scores(glob[0], {"a": 0.95, "b": 0.85}), 1: _scores(glob[1], {"a": 0.95, "b": 0.75})},
    }


SD2 = 0.05 * 2**0.5  # sample sd of two values 0.1 apart


def test_summary_numbers_counts_and_target_of_a_synthetic_setting():
    from benchmarks import personalization as p

    setting = _setting()
    local = {seed: s["personal"] for seed, s in setting["local"].items()}
    finetune = p.summarise_method("finetune", setting["finetune"], local)
    assert finetune.final == pytest.approx((0.875, SD2 / 2), abs=1e-9)  # site means 0.9, 0.85
    assert finetune.worst == pytest.approx((0.8, SD2), abs=1e-9)  # 0.85, 0.75
    assert finetune.global_mean == pytest.approx((0.55, SD2), abs=1e-9)  # 0.6, 0.5
    assert finetune.global_worst == pytest.approx((0.2, 2 * SD2), abs=1e-9)  # 0.3, 0.1
    assert finetune.counts == (2, 0, 0)  # a: +0.15, +0.15; b: +0.05, +0.15 -> 0.1 > sd 0.0707
    fedavg = p.summarise_method("fedavg", setting["fedavg"], local)
    assert fedavg.counts == (1, 0, 1)  # a: +0.1 twice (sd 0: a gain); b: -0.5 twice
    baseline = p.summarise_method("local", setting["local"], local)
    assert baseline.final == pytest.approx((0.75, SD2), abs=1e-9) and baseline.counts is None
    assert baseline.global_mean is None
    met, text = p.target_check([finetune, fedavg, baseline])
    assert met and text.startswith("best: finetune, 87.5 ± 3.5 vs local-only 75.0 ± 7.1 (at least")
    assert text.endswith("0 site(s) below local-only beyond their seed spread")
    met, text = p.target_check([fedavg, baseline])  # 55.0 is below 75.0 - 7.1, and site b loses
    assert not met and "below it beyond the seed spread" in text and "; 1 site(s) below" in text


def test_the_personalization_report_has_a_table_per_setting_and_the_best_methods_sites(tmp_path):
    from benchmarks import personalization as p

    (tmp_path / "cells").mkdir()
    (tmp_path / "protocol.json").write_text(json.dumps({"dataset": "digits", "site_val_fraction": 0.2}))
    for method, by_seed in _setting().items():
        for seed, scores in by_seed.items():
            cell = {"cell": {"algorithm": method, "partition": "dir0.1", "participation": 1.0, "seed": seed}}
            cell |= {
                "site_personal": scores["personal"],
                **({"site_global": scores["global"]} if scores["global"] else {}),
            }
            (tmp_path / "cells" / f"{method}_{seed}.json").write_text(json.dumps(cell))
    (tmp_path / "cells" / "other.json").write_text(json.dumps({"cell": {}}))  # another grid's cell: skipped
    report = p.write_folder_report(tmp_path, "cmd", {"fedavg": {}, "fedper": {"local_keys": "x"}}, "digits").read_text()
    assert "### digits, dir0.1" in report and "seeds [0, 1]" in report
    assert "| finetune | 2 | 55.0 ± 7.1 | 20.0 ± 14.1 | **87.5 ± 3.5** | 80.0 ± 7.1 | 2 / 0 / 0 |" in report
    assert "| fedavg | 2 | 55.0 ± 7.1 | 20.0 ± 14.1 | 55.0 ± 7.1 | 20.0 ± 14.1 | 1 / 0 / 1 |" in report
    assert "| local | 2 | – | – | 75.0 ± 7.1 | 70.0 ± 14.1 | – |" in report
    assert "Target met: best: finetune" in report
    assert (
        "| site-a |" not in report and "| b | 20.0 ± 14.1 | 80.0 ± 7.1 | 70.0 ± 14.1 | +10.0 ± 7.1 | gain |" in report
    )
    page = tmp_path / "page.md"
    assert p.main(["--out", str(page), str(tmp_path)]) == 0
    assert page.read_text().startswith(
        "# Does each site gain from joining?\n\n## Does each site gain from joining? digits"
    )


@pytest.mark.slow
def test_personalization_smoke_grid_scores_every_site_and_writes_the_report(tmp_path):
    assert compare.main(["--grid", "personalization_smoke", "--out", str(tmp_path), "--workers", "1"]) == 0
    ditto = json.loads((tmp_path / "cells" / "ditto__dir0.1__p1__s0.json").read_text())
    local = json.loads((tmp_path / "cells" / "local__dir0.1__p1__s0.json").read_text())
    assert (
        set(ditto["site_global"])
        == set(ditto["site_personal"])
        == set(local["site_personal"])
        == {
            "site-1",
            "site-2",
            "site-3",
        }
    )
    fedavg = json.loads((tmp_path / "cells" / "fedavg__dir0.1__p1__s0.json").read_text())
    assert fedavg["site_personal"] == fedavg["site_global"]  # FedAvg's sites keep the global model
    assert "records" not in local  # no federation
    report = (tmp_path / "report.md").read_text()
    assert "### digits, dir0.1" in report and "| local | 2 |" in report and "Target " in report


def test_the_per_site_columns_show_only_the_seeds_the_difference_pairs():
    from benchmarks import personalization as p

    scores = {"m": {0: {"global": {}, "personal": {"a": 0.9}}}}
    rows = p.per_site_table("m", scores, {0: {"a": 0.8}, 1: {"a": 0.0}})  # local-only ran a seed m has not
    assert rows[-1] == "| a | – | 90.0 ± 0.0 | 80.0 ± 0.0 | +10.0 ± 0.0 | gain |"


def test_a_federation_its_stopping_rule_ended_is_complete_and_one_cut_short_is_not():
    rounds = [{"stage": "round", "round": r, "status": "aggregated"} for r in range(3)]
    with pytest.raises(compare.IncompleteFederation, match=r"^3 round record\(s\) of 10 planned"):
        compare.require_rounds(rounds, 10)
    rounds[-1]["stopped"] = {"rule": "validation plateau", "after_round": 2}
    compare.require_rounds(rounds, 10)
