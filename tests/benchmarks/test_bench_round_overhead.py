"""Smoke tests of the latency benchmarks (``benchmarks/round_overhead.py``, ``benchmarks/startup.py``): quick modes
run for real (the simulator, the client script in a fresh process) and the tables have the right shape. They assert
nothing about timings."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("benchmarks") is None:  # plain `pytest` (not `python -m pytest`) with importlib mode
    sys.path.insert(0, str(ROOT))

from benchmarks import round_overhead, startup  # noqa: E402


def _rows(report: str) -> list[list[str]]:
    lines = [line for line in report.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_overhead_is_wall_minus_slowest_fit_and_waiting_needs_the_wait_field():
    record = {
        "stage": "round",
        "elapsed_s": 2.0,
        "train_wait_s": 1.8,
        "site_meta": {"site-1": {"train.fit_seconds": 0.5}, "site-2": {"train.fit_seconds": 1.25}},
    }
    timed = round_overhead.parse_round(record)
    assert (timed.overhead, timed.waiting, timed.server) == (0.75, 1.8 - 1.25, 2.0 - 1.8)
    untimed = round_overhead.parse_round({**record, "train_wait_s": None})
    assert untimed.waiting is None and untimed.server is None
    assert round_overhead.parse_round({"stage": "initial"}) is None
    same, other = [[timed, timed]], [[timed, round_overhead.parse_round({**record, "global_sha256": "x"})]]
    assert "identical" in round_overhead.digest_line({"a": same, "b": same})
    assert "DIFFER" in round_overhead.digest_line({"a": same, "b": other})


def test_quick_round_overhead_run_reports_both_variants(tmp_path, capsys):
    out = tmp_path / "overhead.md"
    assert round_overhead.main(["--quick", "--out", str(out)]) == 0
    report = out.read_text(encoding="utf-8")
    assert report in capsys.readouterr().out
    rows = _rows(report)
    assert [row[0] for row in rows] == list(round_overhead.DEFAULT_VARIANTS)
    for row in rows:
        assert row[1] == "1"  # --quick: 2 rounds, round 0 left out
        assert all(math.isfinite(float(value)) for value in row[2:7]), row
    assert rows[0][-1] == "1.00"
    assert "Global models: identical in every run." in report  # the knobs never change what is trained


def test_quick_startup_run_reports_the_client_path(tmp_path, capsys):
    out = tmp_path / "startup.md"
    assert startup.main(["--quick", "--out", str(out)]) == 0
    [row] = _rows(out.read_text(encoding="utf-8"))
    assert row[0] == "working tree" and row[1] == "1"
    assert float(row[3]) > 0 and float(row[4]) > 0 and row[5] == "1.00"


def test_importtime_is_summed_by_top_level_package():
    text = "\n".join(
        [
            "import time: self [us] | cumulative | imported package",
            "import time:      1000 |       1000 |     torch._C",
            "import time:      2000 |       3000 |   torch",
            "import time:       500 |        500 | numpy",
        ]
    )
    assert startup.importtime_by_package(text) == [("torch", 0.003), ("numpy", 0.0005)]
