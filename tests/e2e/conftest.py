"""Helpers for end-to-end runs of the real ``nvflare simulator`` command on exported jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from jobs.build import JobSpec, export_job
from tests.e2e.simulator_run import run_simulator_command

NVFLARE = Path(sys.executable).with_name("nvflare")


@pytest.fixture(scope="session")
def simulate():
    """The ``run_simulator`` function, as a fixture (test modules cannot import conftest under importlib mode)."""
    return run_simulator


@pytest.fixture(scope="session")
def round_metrics():
    """The ``read_metrics`` function, as a fixture."""
    return read_metrics


@pytest.fixture(scope="session")
def shared_specs() -> dict[str, JobSpec]:
    """Jobs that several modules run in the simulator, each simulated once per session (``simulated``): the FedAvg
    and SCAFFOLD modules check their algorithm on them, the engine-equivalence module the in-process engine against
    the same runs. FedAvg: momentum, 2 local epochs. SCAFFOLD: 2 of 3 sites a round, so some site uses its persisted
    c_i again. Both record every client update (server-side files only; the models do not change)."""
    subset = {"num_rounds": 3, "max_train_samples": 3000, "max_test_samples": 2000, "save_client_updates": True}
    return {
        "fedavg": JobSpec(name="e2e_fedavg", epochs=2, momentum=0.9, lr=0.02, **subset),
        "scaffold-partial": JobSpec(
            name="e2e_scaffold", client="scaffold", server="scaffold", clients_per_round=2, **subset
        ),
    }


@pytest.fixture(scope="session")
def simulated(tmp_path_factory):
    """``simulated(spec, threads)``: the workspace and completed process of ``spec`` exported and run in the
    simulator under ``-t threads`` (None: the simulator's default, a process per client-round), once per session."""
    runs: dict[tuple[str, int | None], tuple[Path, subprocess.CompletedProcess]] = {}

    def run(spec: JobSpec, threads: int | None) -> tuple[Path, subprocess.CompletedProcess]:
        key = (repr(spec), threads)
        if key not in runs:
            root = tmp_path_factory.mktemp(f"{spec.name}_t{threads}")
            completed = run_simulator(export_job(spec, root / "jobs"), root / "ws", spec.num_sites, threads)
            runs[key] = (root / "ws", completed)
        return runs[key]

    return run


def run_simulator(
    job_dir: Path, workspace: Path, num_clients: int, threads: int | None, outputs: Sequence[Path] = ()
) -> subprocess.CompletedProcess:
    """Run the user's command line, once more if its start-up failed (tests/e2e/simulator_run.py), the retry with a
    fresh workspace and none of ``outputs`` (what the run writes outside it) left from the failed try; the simulator
    exits 0 even on some aborts, so callers check the outputs."""
    command = [str(NVFLARE), "simulator", str(job_dir), "-w", str(workspace), "-n", str(num_clients)]
    if threads is not None:
        command += ["-t", str(threads)]
    return run_simulator_command(command, workspace, timeout=900, outputs=outputs, cwd=workspace.parent)


def read_metrics(workspace: Path) -> list[dict]:
    path = workspace / "server" / "simulate_job" / "metrics" / "round_metrics.jsonl"
    assert path.is_file(), f"no metrics written at {path}"
    return [json.loads(line) for line in path.read_text().splitlines()]
