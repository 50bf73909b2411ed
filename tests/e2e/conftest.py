"""Helpers for end-to-end runs of the real ``nvflare simulator`` command on exported jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

NVFLARE = Path(sys.executable).with_name("nvflare")


@pytest.fixture(scope="session")
def simulate():
    """The ``run_simulator`` function, as a fixture (test modules cannot import conftest under importlib mode)."""
    return run_simulator


@pytest.fixture(scope="session")
def round_metrics():
    """The ``read_metrics`` function, as a fixture."""
    return read_metrics


def run_simulator(job_dir: Path, workspace: Path, num_clients: int, threads: int | None) -> subprocess.CompletedProcess:
    """Run the user's command line; the simulator exits 0 even on some aborts, so callers check the outputs."""
    command = [str(NVFLARE), "simulator", str(job_dir), "-w", str(workspace), "-n", str(num_clients)]
    if threads is not None:
        command += ["-t", str(threads)]
    return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=workspace.parent)


def read_metrics(workspace: Path) -> list[dict]:
    path = workspace / "server" / "simulate_job" / "metrics" / "round_metrics.jsonl"
    assert path.is_file(), f"no metrics written at {path}"
    return [json.loads(line) for line in path.read_text().splitlines()]
