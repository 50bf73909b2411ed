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
    import controllers.in_process as in_process

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
    import controllers.in_process as in_process

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
