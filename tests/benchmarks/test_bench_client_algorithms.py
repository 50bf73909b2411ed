"""Smoke test of the FedMoS/MOON benchmark: quick mode, in process; checks the table's shape, never timings."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("benchmarks") is None:  # plain `pytest` (not `python -m pytest`) with importlib mode
    sys.path.insert(0, str(ROOT))

from benchmarks import client_algorithms  # noqa: E402


def test_quick_mode_reports_every_variant_with_finite_ratios_and_memory(tmp_path, capsys):
    out = tmp_path / "results.md"
    assert client_algorithms.main(["--quick", "--out", str(out)]) == 0
    report = out.read_text(encoding="utf-8")
    assert report in capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in report.splitlines() if line.startswith("| ")]
    by_name = {(row[0], row[1]): row for row in rows[1:]}
    names = [name for _, name in by_name]
    assert names.count("fedavg") == 2
    assert {"fedmos", "fedmos authors", "moon h=1", "moon h=2", "moon h=4"} <= set(names)
    for (_, name), row in by_name.items():
        ratio = float(row[3].split()[0])
        assert math.isfinite(ratio) and ratio > 0, row
        if name == "fedavg":  # the baseline of each model; the others' ratios are timings (any finite value)
            assert ratio == 1.0
    # FedMoS keeps x, d and the previous iterate: exactly three fp32 copies of LeNet-5's trainable parameters.
    assert by_name[("LeNet-5", "fedmos")][5] == "3.0"
    # MOON keeps 1 + h frozen networks; its history file grows with h.
    head = "LeNet-5 + projection head 256"
    assert [by_name[(head, f"moon h={h}")][5] for h in (1, 2, 4)] == ["2.0", "3.0", "5.0"]
    files = [float(by_name[(head, f"moon h={h}")][6]) for h in (1, 2, 4)]
    assert 0 < files[0] < files[1] < files[2]
    assert "MOON cost per history model" in report
    # Fine-tuning: the copy's parameters and their gradients (plain SGD keeps no state): twice LeNet-5's weights.
    assert "(2.0x the model; freed before the round's training)" in report
    assert "Peak RSS" not in report  # --quick measures no child processes


def test_the_rss_child_runs_the_fine_tuning_rounds_and_reports_its_rounds_peak(capsys):
    args = ["--finetune-child", "1", "--finetune-samples", "60", "--finetune-rounds", "1"]
    assert client_algorithms.main(args) == 0
    name, before, peak = capsys.readouterr().out.splitlines()[-1].split()
    assert name == client_algorithms.RSS_LINE
    assert 100e6 < int(before) <= int(peak)  # this process has torch loaded; the peak is reset to the RSS before
