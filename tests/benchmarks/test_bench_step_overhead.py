"""Smoke test of the step-overhead benchmark: quick mode, in process; checks the table's shape, never timings."""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

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


def test_the_genotype_model_in_bf16_mixed_times_only_the_chosen_algorithms_against_plain_lightning(tmp_path):
    import json

    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--models", "cnn_transformer_large", "--snps", "32", "--precision", "bf16-mixed"]
    argv += ["--algorithms", "scaffold", "--steps", "2", "--rounds", "1", "--warmup", "0", "--batch-size", "4"]
    assert step_overhead.main([*argv, "--threads", "1", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["settings"]["precision"] == "bf16-mixed" and record["settings"]["algorithms"] == ["scaffold"]
    rows = {row["algorithm"]: row for row in record["rows"]}
    assert list(rows) == ["fedavg", "scaffold", step_overhead.REFERENCE_ROW]  # no ditto, feddyn, ... rows
    assert rows["scaffold"]["nvflare_ratio"] > 0  # NVFlare's built-in SCAFFOLD ran beside ours
    assert rows[step_overhead.REFERENCE_ROW]["lightning_ratio"] == 1.0
    assert rows["fedavg"]["ours_ratio"] == 1.0 and rows["fedavg"]["lightning_ratio"] > 0
    assert {row["model"] for row in rows.values()} == {"cnn_transformer 32 SNPs"}


def test_the_snp_count_resizes_only_genotype_models_and_bad_options_are_refused(capsys):
    large = step_overhead.MODEL_SPECS["cnn_transformer_large"]
    assert large.arch_args["n_snps"] == large.input_shape[0] == 10_000 and large.arch_args["d_model"] == 256
    resized = step_overhead.with_snps(large, 500)
    assert resized.arch_args["n_snps"] == 500 and resized.input_shape == (500,) and resized.arch_args["layers"] == 4
    assert step_overhead.with_snps(step_overhead.MODEL_SPECS["lenet5"], 500) == step_overhead.MODEL_SPECS["lenet5"]
    for bad, says in (
        (["--models", "cnn_transformer_large", "--momentum", "0.9"], "--momentum"),
        (["--snps", "0"], "--snps must be >= 1"),
        (["--precision", "16-mixed"], "invalid choice"),
        (["--algorithms", "nosuch"], "invalid choice"),
    ):
        with pytest.raises(SystemExit):
            step_overhead.parse_args(["--device", "cpu", *bad])
        assert says in capsys.readouterr().err


def test_compare_paths_times_each_path_and_the_fused_row_really_folds(tmp_path, monkeypatch):
    """The FedProx row takes the callback's fused plain-SGD step (one lerp per step), its gradient-form row never."""
    import json

    import torch

    lerps = []
    real = torch._foreach_lerp_
    monkeypatch.setattr(torch, "_foreach_lerp_", lambda *args, **kw: lerps.append(1) or real(*args, **kw))
    out = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--algorithms", "fedprox", "scaffold", "--compare-paths", "--no-reference"]
    argv += ["--steps", "2", "--rounds", "1", "--warmup", "1", "--batch-size", "4", "--threads", "1"]
    assert step_overhead.main([*argv, "--models", "lenet5", "--json", str(out)]) == 0
    rows = {row["algorithm"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fedavg", "scaffold", "scaffold [gradient form]", "fedprox", "fedprox [gradient form]"]
    assert all(row["ours_ratio"] > 0 for row in rows.values())
    assert len(lerps) == 3  # fedprox's 2 kept + 1 warm-up steps; none from its gradient form or SCAFFOLD
