"""Smoke runs of the robustness harness (tiny settings) and of the capture -> pretrain -> rerun workflow."""

from __future__ import annotations

import pytest

from aggregators import build_rule
from aggregators.attention import load_attention_checkpoint
from aggregators.pretrain_attention import main as pretrain_main
from benchmarks.robustness import main, markdown_table, scenarios

pytestmark = pytest.mark.usefixtures("fashion_mnist")


def test_quick_grid_writes_table_and_plot(tmp_path, capsys) -> None:
    out, plot = tmp_path / "r.md", tmp_path / "r.png"
    argv = ["--quick", "--rules", "fedavg,attack_adaptive,median", "--attacks", "sign_flip", "--fractions", "0,0.4"]
    assert main([*argv, "--out", str(out), "--plot", str(plot)]) == 0
    report = out.read_text()
    assert "| attack | malicious | FedAvg | attack-adaptive | median |" in report
    assert "| none | 0% |" in report and "| sign_flip | 40% |" in report
    assert plot.stat().st_size > 0


def test_capture_pretrain_and_rerun_with_the_new_checkpoint(tmp_path) -> None:
    capture = tmp_path / "capture"
    argv = ["--quick", "--rules", "median", "--fractions", "0.4", "--capture-dir", str(capture)]
    assert main(argv) == 0
    assert len(list(capture.rglob("round_*.pt"))) == 4 * 2  # 4 attacks x 2 quick rounds
    checkpoint = tmp_path / "att.pt"
    assert pretrain_main(["--dataset-dir", str(capture), "--save-path", str(checkpoint), "--epochs", "2"]) == 0
    _, header = load_attention_checkpoint(checkpoint)
    assert header["input_width"] == 96 and header["info"]["best_epoch"] in (1, 2)
    rerun = ["--quick", "--rules", "attack_adaptive", "--fractions", "0", "--attention-model-path", str(checkpoint)]
    assert main(rerun) == 0
    assert build_rule("attack_adaptive", attention_model_path=str(checkpoint)).pca_components == 10


def test_scenarios_share_one_clean_run_and_table_layout() -> None:
    assert scenarios([0.0, 0.2], ["a", "b"]) == [("none", 0.0), ("a", 0.2), ("b", 0.2)]
    table = markdown_table({("median", "none", 0.0): [0.5, 0.75]}, ["median"])
    assert table.splitlines()[-1] == "| none | 0% | 75.0 |"
