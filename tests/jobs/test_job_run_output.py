"""`jobs.run_output`: a local run's whole output goes to its log, the terminal shows only the per-round lines that
``make demo`` shows (the same pattern as scripts/demo.sh), from this process and from the processes it starts, and
the terminal is back as it was afterwards. ``job.py``'s own run: tests/jobs/test_recipe_job_entry.py."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import run_output
from jobs.run_output import PROGRESS_PATTERN, progress_lines, quiet_output

REPO = Path(__file__).resolve().parents[2]

#: Lines as the simulator prints them (NVFlare's format); the first five are the demo's, the rest are not.
SHOWN = [
    "2026-12-05 17:17:06,921 - INFO - global model: test_accuracy=0.0940, test_loss=2.3063",
    "2026-12-05 17:17:06,928 - INFO - round 1/5: training on ['site-1', 'site-2', 'site-3']",
    "2026-12-05 17:17:28,763 - INFO - finished 5 rounds. metrics: /tmp/ws/metrics/round_metrics.jsonl",
    "RuntimeError: site-2 failed",
    "Traceback (most recent call last):",
]
HIDDEN = [
    "2026-12-05 17:17:06,929 - INFO - Sending task train to ['site-1', 'site-2', 'site-3']",
    "2026-12-05 17:17:07,742 - INFO - ClientTaskWorker started to run",
    "2026-12-05 17:17:11,459 - INFO - start task run() with full path: /tmp/ws/site-2/custom/client.py",
    "round 1 of 5",
]


def test_the_pattern_is_the_one_make_demo_greps_for():
    script = (REPO / "scripts" / "demo.sh").read_text()
    match = re.search(r'grep --line-buffered -E "([^"]+)"', script)
    assert match, "scripts/demo.sh: no grep -E of the simulator's output"
    assert match.group(1) == PROGRESS_PATTERN


def test_only_the_demos_lines_are_shown():
    assert progress_lines("\n".join(HIDDEN[:2] + SHOWN[:3] + HIDDEN[2:] + SHOWN[3:])) == SHOWN


def test_a_run_and_its_child_processes_go_to_the_log_and_only_progress_reaches_the_terminal(tmp_path, capfd):
    log = tmp_path / "run.log"
    log.write_text("left from an earlier run\n")
    child = "import sys; print(sys.argv[1]); print(sys.argv[2], file=sys.stderr); print(sys.argv[3])"
    with quiet_output(log):
        print(HIDDEN[0])
        print(SHOWN[0], flush=True)
        subprocess.run([sys.executable, "-c", child, HIDDEN[1], SHOWN[3], SHOWN[1]], check=True)
        print(SHOWN[2], file=sys.stderr)
        sys.stdout.write(SHOWN[4])  # no newline at the end: shown all the same
    print("after")
    captured = capfd.readouterr()
    assert captured.out.splitlines() == [*SHOWN[:1], SHOWN[3], SHOWN[1], SHOWN[2], SHOWN[4], "after"]
    assert captured.err == ""
    written = log.read_text().splitlines()
    assert "left from an earlier run" not in written
    assert set(HIDDEN[:2]) <= set(written) and set(SHOWN) <= set(written)


def test_the_terminal_is_back_when_the_run_fails(tmp_path, capfd):
    with pytest.raises(RuntimeError, match="boom"), quiet_output(tmp_path / "run.log"):
        print(HIDDEN[2])
        raise RuntimeError("boom")
    print("after", file=sys.stderr)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == "after\n"
    assert HIDDEN[2] in (tmp_path / "run.log").read_text()


def test_a_slow_run_shows_its_lines_while_it_runs(tmp_path, capfd, monkeypatch):
    """The log is read while the run lasts, not only at its end (a 10-minute run shows its rounds as they come)."""
    monkeypatch.setattr(run_output, "POLL_S", 0.01)
    with quiet_output(tmp_path / "run.log"):
        print(SHOWN[1], flush=True)
        shown = ""
        for _ in range(500):  # up to 5 s; the test passes as soon as the line is there
            shown += capfd.readouterr().out
            if SHOWN[1] in shown:
                break
            time.sleep(0.01)
    assert SHOWN[1] in shown
