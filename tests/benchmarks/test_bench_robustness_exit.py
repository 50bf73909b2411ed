"""The robustness grid on the comparison harness, without training (the in-process federation is replaced by a
stand-in): it exits 1 naming the cell when a federation crashed, recorded fewer rounds than planned or no round that
aggregated (its entry would otherwise be missing or wrong in a table printed with exit status 0), a rerun recomputes
no finished cell (more seeds run only the new cells), and cells of other settings are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import robustness

# quick: 2 rounds; one worker: the cells run in this process, where the stand-in is patched in
ARGV = ["--quick", "--rules", "fedavg,median", "--attacks", "sign_flip", "--fractions", "0", "--workers", "1"]


def fake_run(rounds_by_rule: dict[str, int | list[str] | Exception], calls: list[tuple[str, int]] | None = None):
    """``run_in_process`` stand-in: per rule, an exception to raise, the number of round records to return (all
    aggregated) or their statuses (a failed one says "every result rejected"); the test accuracy is
    0.5 + seed / 10. Every call's (rule, seed) is appended to ``calls``."""

    def run_in_process(spec, state_root, observers=()):
        if calls is not None:
            calls.append((spec.server, spec.seed))
        outcome = rounds_by_rule[spec.server]
        if isinstance(outcome, Exception):
            raise outcome
        statuses = ["aggregated"] * outcome if isinstance(outcome, int) else outcome
        return SimpleNamespace(rounds=[round_record(r, status, spec.seed) for r, status in enumerate(statuses)])

    return run_in_process


def round_record(round_num: int, status: str, seed: int) -> dict:
    record = {"stage": "round", "round": round_num, "status": status, "test_accuracy": 0.5 + seed / 10}
    return {**record, "failure": "every result rejected"} if status == "failed" else record


@pytest.mark.parametrize(
    ("median", "reason"),
    [
        (RuntimeError("site process died"), "RuntimeError: site process died"),
        (1, "IncompleteFederation: 1 round record(s) of 2 planned"),
        (
            ["failed", "failed"],
            "IncompleteFederation: no round updated the global model (last failure: every result rejected)",
        ),
    ],
)
def test_a_crashed_or_short_federation_makes_the_run_exit_1_naming_it(monkeypatch, tmp_path, capsys, median, reason):
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": median}))
    assert robustness.main([*ARGV, "--out-dir", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert f"cell median__none__m0__s0 failed: {reason}" in err
    named = "error: federation did not complete: median__none__m0__s0 (median under none at 0% malicious, seed 0)"
    assert named in err and "fedavg__" not in err
    assert "| none | 0% | 50.0 | – |" in out  # the others still report; the missing cell says so
    assert sorted(p.name for p in (tmp_path / "cells").iterdir()) == ["fedavg__none__m0__s0.json"]


def test_a_federation_under_attack_with_some_failed_rounds_still_completes(monkeypatch, tmp_path, capsys):
    """Only a federation in which no round aggregated fails its cell; a round that rejected every result is a
    warning naming it."""
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": ["failed", "aggregated"]}))
    assert robustness.main([*ARGV, "--out-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "round 0: every result rejected" in err and "did not complete" not in err


def test_every_federation_complete_exits_0(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": 2}))
    assert robustness.main([*ARGV, "--out-dir", str(tmp_path)]) == 0
    assert "did not complete" not in capsys.readouterr().err


def test_a_rerun_recomputes_nothing_and_more_seeds_run_only_the_new_cells(monkeypatch, tmp_path, capsys):
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": 2}, calls))
    argv = [*ARGV, "--out-dir", str(tmp_path)]
    assert robustness.main(argv) == 0
    assert sorted(calls) == [("fedavg", 0), ("median", 0)]
    written = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir()}
    capsys.readouterr()
    assert robustness.main(argv) == 0
    out = capsys.readouterr().out
    assert len(calls) == 2 and "2 cells, 2 already done, 0 to run" in out
    assert "| none | 0% | 50.0 | 50.0 |" in out  # the table comes from the cells on disk
    assert robustness.main([*argv, "--seeds", "0,1"]) == 0
    assert sorted(calls[2:]) == [("fedavg", 1), ("median", 1)]  # seed 0 reused: the seed is not in protocol.json
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "cells").iterdir() if p.name in written} == written
    out = capsys.readouterr().out
    assert "mean ± std over 2 seeds (0, 1)" in out and "| none | 0% | 55.0 ± 7.1 | 55.0 ± 7.1 |" in out


def test_cells_of_other_settings_are_refused(monkeypatch, tmp_path):
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": 2}, calls))
    assert robustness.main([*ARGV, "--out-dir", str(tmp_path)]) == 0
    with pytest.raises(SystemExit, match=r"another protocol.*use another --out-dir"):
        robustness.main([*ARGV, "--out-dir", str(tmp_path), "--alpha", "0.5"])
    assert len(calls) == 2  # the first run's cells only


def test_quick_without_out_dir_leaves_nothing_behind(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default folder is relative: it would appear here
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": 2}))
    assert robustness.main(ARGV) == 0
    assert list(tmp_path.iterdir()) == []


def test_capture_exits_1_when_a_federation_crashed(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"median": ValueError("bad shard")}))
    argv = ["--quick", "--rules", "median", "--fractions", "0.4", "--capture-dir", str(tmp_path)]
    assert robustness.main(argv) == 1
    assert "ValueError: bad shard" in capsys.readouterr().err
