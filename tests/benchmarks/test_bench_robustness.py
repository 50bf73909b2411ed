"""Smoke runs of the robustness harness (tiny settings), the capture -> pretrain -> rerun workflow, and the table
built from cells over one seed and over several."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import asdict
from functools import partial

import pytest

from aggregators.attention import load_attention_checkpoint
from aggregators.pretrain_attention import main as pretrain_main
from aggregators.registry import build_rule
from benchmarks.robustness import (
    RobustnessCell,
    Settings,
    build_report,
    main,
    markdown_table,
    run_robustness_cell,
    scenarios,
    target_check,
)

QUICK = Settings(num_sites=5, rounds=2, max_train_samples=500, test_samples=200)


@pytest.mark.usefixtures("fashion_mnist")
def test_quick_grid_writes_cells_table_and_plot(tmp_path) -> None:
    out, plot, cells = tmp_path / "r.md", tmp_path / "r.png", tmp_path / "grid" / "cells"
    argv = ["--quick", "--rules", "fedavg,attack_adaptive,median", "--attacks", "sign_flip", "--fractions", "0,0.4"]
    argv += ["--out-dir", str(tmp_path / "grid"), "--workers", "1"]
    assert main([*argv, "--out", str(out), "--plot", str(plot)]) == 0
    report = out.read_text()
    assert "Final global test accuracy (%), one seed (0):" in report and "±" not in report
    assert "| attack | malicious | FedAvg | attack-adaptive | median |" in report
    assert "| none | 0% |" in report and "| sign_flip | 40% |" in report
    assert plot.stat().st_size > 0
    assert json.loads((tmp_path / "grid" / "protocol.json").read_text()) == asdict(QUICK)  # no seed: per cell
    assert len(list(cells.glob("*.json"))) == 6
    result = json.loads((cells / "median__sign_flip__m0.4__s0.json").read_text())
    assert result["cell"] == {"rule": "median", "attack": "sign_flip", "fraction": 0.4, "seed": 0}
    assert result["settings"] == asdict(QUICK) and len(result["accuracies"]) == 2
    row = next(line for line in report.splitlines() if line.startswith("| sign_flip | 40% |"))
    assert row.endswith(f"| {100 * result['accuracies'][-1]:.1f} |")  # the median column: that cell's last round


@pytest.mark.usefixtures("fashion_mnist")
def test_capture_pretrain_and_rerun_with_the_new_checkpoint(tmp_path) -> None:
    capture = tmp_path / "capture"
    argv = ["--quick", "--rules", "median", "--fractions", "0.4", "--capture-dir", str(capture), "--seed", "1"]
    assert main(argv) == 0
    assert len(list(capture.rglob("round_*.pt"))) == 4 * 2  # 4 attacks x 2 quick rounds
    checkpoint = tmp_path / "att.pt"
    assert pretrain_main(["--dataset-dir", str(capture), "--save-path", str(checkpoint), "--epochs", "2"]) == 0
    _, header = load_attention_checkpoint(checkpoint)
    assert header["input_width"] == 96 and header["info"]["best_epoch"] in (1, 2)
    rerun = ["--quick", "--rules", "attack_adaptive", "--fractions", "0", "--attention-model-path", str(checkpoint)]
    assert main([*rerun, "--workers", "1"]) == 0
    assert build_rule("attack_adaptive", attention_model_path=str(checkpoint)).pca_components == 10


@pytest.mark.slow
@pytest.mark.usefixtures("fashion_mnist")
def test_the_grid_runs_in_a_process_pool(tmp_path, capsys) -> None:
    argv = ["--quick", "--rules", "median", "--fractions", "0", "--seeds", "0,1", "--workers", "2"]
    assert main([*argv, "--out-dir", str(tmp_path)]) == 0
    cells = sorted((tmp_path / "cells").glob("*.json"))
    assert [p.name for p in cells] == ["median__none__m0__s0.json", "median__none__m0__s1.json"]
    assert {json.loads(p.read_text())["threads"] for p in cells} == {max(1, (os.cpu_count() or 1) // 2)}
    assert "mean ± std over 2 seeds (0, 1)" in capsys.readouterr().out


def test_the_cell_run_pickles_for_the_process_pool() -> None:
    run = pickle.loads(pickle.dumps(partial(run_robustness_cell, settings=QUICK)))
    assert run.func is run_robustness_cell and run.keywords == {"settings": QUICK}
    cell = RobustnessCell("trimmed_mean", "label_flip", 0.2, 3)
    assert pickle.loads(pickle.dumps(cell)) == cell and cell.key == "trimmed_mean__label_flip__m0.2__s3"


def test_scenarios_share_one_clean_run_and_table_layout() -> None:
    assert scenarios([0.0, 0.2], ["a", "b"]) == [("none", 0.0), ("a", 0.2), ("b", 0.2)]
    table = markdown_table({("median", "none", 0.0): {0: 0.75}}, ["median"])
    assert table.splitlines()[-1] == "| none | 0% | 75.0 |"


def cell_result(rule: str, attack: str, fraction: float, seed: int, final: float) -> dict:
    """A cell's result as run_robustness_cell writes it (only what the report reads is filled in)."""
    cell = {"rule": rule, "attack": attack, "fraction": fraction, "seed": seed}
    return {"cell": cell, "settings": asdict(QUICK), "accuracies": [0.1, final], "wall_s": 1.0}


def test_the_table_over_two_seeds_gives_mean_and_std_and_says_how_many() -> None:
    results = [
        cell_result("median", "none", 0.0, 0, 0.50),
        cell_result("median", "none", 0.0, 1, 0.60),
        cell_result("krum", "none", 0.0, 0, 0.40),
        cell_result("krum", "none", 0.0, 1, 0.40),
        cell_result("median", "scale", 0.2, 0, 0.30),  # seed 1 of this cell failed
    ]
    report, finals = build_report(results, ["median", "krum"], QUICK, "Wall time: -")
    assert finals[("median", "none", 0.0)] == {0: 0.50, 1: 0.60}
    assert "Final global test accuracy (%), mean ± std over 2 seeds (0, 1):" in report
    table = report.split("\n\n")[2].splitlines()
    assert table[2] == "| none | 0% | 55.0 ± 7.1 | 40.0 ± 0.0 |"  # sample std of 50 and 60: 7.07
    assert table[3] == "| scale | 20% | 30.0 ± 0.0 (1 of 2 seeds) | – |"


def test_the_report_of_one_seed_says_so() -> None:
    report, _ = build_report([cell_result("median", "none", 0.0, 4, 0.5)], ["median"], QUICK, "Wall time: -")
    assert "Final global test accuracy (%), one seed (4):" in report
    assert report.splitlines()[-1] == "| none | 0% | 50.0 |"


def test_the_targets_are_checked_on_the_means_over_seeds() -> None:
    finals = {
        ("attack_adaptive", "none", 0.0): {0: 0.50, 1: 0.60},  # clean: mean 55
        ("attack_adaptive", "sign_flip", 0.2): {0: 0.50, 1: 0.56},  # mean 53: 2 points down
        ("median", "sign_flip", 0.2): {0: 0.60, 1: 0.52},  # mean 56: 3 points better
    }
    (line,) = target_check(finals, ["attack_adaptive", "median"])
    assert line == (
        "- sign_flip 20%: 53.0 (clean 55.0, drop +2.0 pts ✓); best classical 56.0 (gap +3.0 pts ✗ target ≤ 2)"
    )
