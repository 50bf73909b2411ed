"""Smoke test of the step-overhead benchmark: quick mode, in process; checks the table's shape, never timings."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if importlib.util.find_spec("benchmarks") is None:  # plain `pytest` (not `python -m pytest`) with importlib mode
    sys.path.insert(0, str(ROOT))

from benchmarks import step_overhead  # noqa: E402
from lightning_modules.algorithms import CLIENT_ALGORITHMS  # noqa: E402

RATIO = re.compile(r"^(\S+) \[(\S+)–(\S+)\]$")


def table_rows(report: str) -> list[list[str]]:
    lines = [line for line in report.splitlines() if line.startswith("| ")]
    header, rows = lines[0], lines[1:]
    assert "ours ÷ plain" in header
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in rows]


def ratios(cell: str) -> list[float]:
    match = RATIO.match(cell)
    assert match, f"not a ratio cell: {cell!r}"
    return [float(group) for group in match.groups()]


def test_quick_mode_prints_one_row_per_algorithm_with_finite_ratios(tmp_path, capsys):
    out = tmp_path / "results.md"
    assert step_overhead.main(["--quick", "--out", str(out)]) == 0
    report = out.read_text(encoding="utf-8")
    assert report in capsys.readouterr().out

    rows = table_rows(report)
    algorithms = [row[2] for row in rows]
    for name in CLIENT_ALGORITHMS:
        assert algorithms.count(name) == 1, f"{name}: {algorithms}"
    for name in step_overhead.NVFLARE_BUILTINS:
        assert algorithms.count(name) == 1, f"{name}: {algorithms}"

    by_name = {row[2]: row for row in rows}
    assert ratios(by_name["fedavg"][5])[0] == 1.0
    for name in CLIENT_ALGORITHMS:
        if "skipped" in by_name[name][10]:
            continue
        assert all(math.isfinite(r) and r > 0 for r in ratios(by_name[name][5])), by_name[name]
    for name in step_overhead.NVFLARE_BUILTINS:
        assert all(math.isfinite(r) and r > 0 for r in ratios(by_name[name][7])), by_name[name]
    assert "torch" in report and "threads" in report
