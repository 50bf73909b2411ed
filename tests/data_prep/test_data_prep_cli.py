"""The ``python -m data_prep`` command line: the counts table, the PNG plot, and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.cli import main

REPO_ROOT = Path(__file__).resolve().parents[2]


def _table_rows(output: str) -> dict[str, list[int]]:
    """Parse the printed table into {row name: numbers}."""
    rows = {}
    for line in output.splitlines():
        cells = line.split()
        if cells and (cells[0].startswith("site-") or cells[0] == "total"):
            rows[cells[0]] = [int(c) for c in cells[1:]]
    return rows


def test_cli_prints_counts_and_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "plots" / "parts.png"
    argv = ["--dataset", "digits", "--scheme", "shards", "--num-sites", "5", "--classes-per-site", "2"]
    assert main([*argv, "--seed", "1", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "digits  shards  k=2  sites=5  seed=1" in out
    rows = _table_rows(out)
    assert list(rows) == ["site-1", "site-2", "site-3", "site-4", "site-5", "total"]
    counts = np.array([rows[f"site-{i}"] for i in range(1, 6)])
    assert np.all((counts[:, :10] > 0).sum(axis=1) == 2), "each site must show exactly 2 labels"
    np.testing.assert_array_equal(counts[:, 10], counts[:, :10].sum(axis=1))
    np.testing.assert_array_equal(rows["total"], counts.sum(axis=0))
    assert rows["total"][-1] == 1438
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_notes_samples_left_out_by_shards(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dataset", "digits", "--scheme", "shards", "--num-sites", "4", "--classes-per-site", "2"]) == 0
    out = capsys.readouterr().out
    left_out = 1438 - _table_rows(out)["total"][-1]
    assert left_out > 0 and f"note: {left_out} of 1438 training samples" in out


def test_cli_subset_total(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dataset", "digits", "--scheme", "iid", "--num-sites", "2", "--max-train-samples", "100"]) == 0
    assert _table_rows(capsys.readouterr().out)["total"][-1] == 100


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--dataset", "cifar10"], "unknown dataset 'cifar10'"),
        (["--dataset", "digits", "--alpha", "-1"], "alpha must be > 0"),
        (["--dataset", "digits", "--scheme", "shards", "--classes-per-site", "11"], "classes_per_site=11"),
        (["--dataset", "digits", "--num-sites", "5000"], "5000 sites but only 1438 samples"),
        (["--dataset", "digits", "--num-sites", "three"], "invalid int value: 'three'"),
        (["--dataset", "digits", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse reports its own errors by exiting
        code = exc.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("data_prep: error: ") and expected in lines[0]


def test_python_m_data_prep_reports_without_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "data_prep", "--dataset", "digits", "--scheme", "nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "data_prep: error: unknown partition scheme 'nope'; choose one of: "
        "iid, dirichlet, shards, quantity, population, label_quantity, small_sites"
    ]
