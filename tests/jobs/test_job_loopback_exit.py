"""``python -m jobs.provision.loopback`` exits non-zero unless the job did its rounds: NVFlare's status alone
says FINISHED:COMPLETED for a controller that stopped early, so the server's metrics are checked too (round
records against the planned rounds, and at least one aggregated round). No deployment: only the decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.provision.loopback import job_problems

DONE = {"status": "FINISHED:COMPLETED"}


def write_metrics(result: Path, planned: int, statuses: list[str]) -> Path:
    metrics = result / "metrics" / "round_metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    records = [{"stage": "initial", "round": None, "num_rounds": planned}]
    records += [{"stage": "round", "round": r, "status": s} for r, s in enumerate(statuses)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    return result


def test_a_completed_job_with_every_round_recorded_is_fine(tmp_path):
    assert job_problems(DONE, write_metrics(tmp_path, 3, ["aggregated", "failed", "aggregated"])) == []


@pytest.mark.parametrize(
    ("meta", "statuses", "expected"),
    [
        (DONE, ["aggregated", "aggregated"], "the job stopped after round 2 of 3"),
        (DONE, ["failed"] * 3, "no round updated the global model"),
        ({"status": "FINISHED:EXECUTION_EXCEPTION"}, ["aggregated"] * 3, "job status is FINISHED:EXECUTION_EXCEPTION"),
    ],
)
def test_a_short_useless_or_failed_job_is_named(tmp_path, meta, statuses, expected):
    problems = job_problems(meta, write_metrics(tmp_path, 3, statuses))
    assert any(expected in p for p in problems), problems


def test_no_metrics_file_is_a_problem(tmp_path):
    [problem] = job_problems(DONE, tmp_path)
    assert problem == f"no metrics file at {tmp_path / 'metrics' / 'round_metrics.jsonl'}"
