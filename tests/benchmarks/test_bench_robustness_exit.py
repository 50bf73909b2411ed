"""The robustness harness exits 1 with the reason when a federation crashed or recorded fewer rounds than
planned (its cell would otherwise be missing or wrong in a table printed with exit status 0). No training: the
in-process federation is replaced by a stand-in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import robustness

ARGV = ["--quick", "--rules", "fedavg,median", "--attacks", "sign_flip", "--fractions", "0"]  # quick: 2 rounds


def fake_run(rounds_by_rule: dict[str, int | Exception]):
    """``run_in_process`` stand-in: per rule, an exception to raise or the number of round records to return."""

    def run_in_process(spec, state_root, observers=()):
        outcome = rounds_by_rule[spec.server]
        if isinstance(outcome, Exception):
            raise outcome
        records = [{"round": r, "status": "aggregated", "test_accuracy": 0.5} for r in range(outcome)]
        return SimpleNamespace(rounds=records)

    return run_in_process


@pytest.mark.parametrize(
    ("median", "reason"),
    [
        (RuntimeError("site process died"), "median under none at 0% malicious: RuntimeError: site process died"),
        (1, "median under none at 0% malicious: IncompleteFederation: 1 round record(s) of 2 planned"),
    ],
)
def test_a_crashed_or_short_federation_makes_the_run_exit_1_naming_it(monkeypatch, capsys, median, reason):
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": median}))
    assert robustness.main(ARGV) == 1
    out, err = capsys.readouterr()
    assert f"error: federation did not complete: {reason}" in err
    assert "| none | 0% | 50.0 | – |" in out  # the others still report; the missing cell says so


def test_every_federation_complete_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"fedavg": 2, "median": 2}))
    assert robustness.main(ARGV) == 0
    assert "did not complete" not in capsys.readouterr().err


def test_capture_exits_1_when_a_federation_crashed(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(robustness, "run_in_process", fake_run({"median": ValueError("bad shard")}))
    argv = ["--quick", "--rules", "median", "--fractions", "0.4", "--capture-dir", str(tmp_path)]
    assert robustness.main(argv) == 1
    assert "ValueError: bad shard" in capsys.readouterr().err
