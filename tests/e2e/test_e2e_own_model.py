"""A user's own model and data (examples/custom_model) through `nvflare simulator`, as the docs tell a user to run
it: SCAFFOLD with AdamW, the sites evaluating every received global model on their own validation split, and one
process per site (-t 3) giving the same global models bit for bit as a new process per client round (-t 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controllers import report

REPO = Path(__file__).resolve().parents[2]
ROUNDS = 3


def simulate(job: Path, workspace: Path, threads: int) -> list[dict]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = ["nvflare", "simulator", str(job), "-w", str(workspace), "-n", "3", "-t", str(threads)]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    records = report.load_records(workspace)
    assert [r["stage"] for r in records] == ["initial"] + ["round"] * ROUNDS, completed.stdout[-3000:]
    return records


@pytest.mark.slow
def test_example_model_trains_with_site_evaluation_and_is_thread_count_independent(tmp_path):
    build = [sys.executable, "-m", "jobs.build", "--client", "scaffold", "--server", "scaffold"]
    build += ["--name", "custom_scaffold", "--output-dir", str(tmp_path), "--num-rounds", str(ROUNDS)]
    build += ["--model", "custom_model.model:DigitsClassifier", "--data", "custom_model.data:DigitsSites"]
    build += ["--ship", "examples/custom_model"]
    subprocess.run(build, check=True, cwd=REPO, capture_output=True)
    by_process = simulate(tmp_path / "custom_scaffold", tmp_path / "t3", threads=3)
    by_round = simulate(tmp_path / "custom_scaffold", tmp_path / "t1", threads=1)
    assert [r["global_sha256"] for r in by_process] == [r["global_sha256"] for r in by_round]
    assert len({r["global_sha256"] for r in by_process}) == ROUNDS + 1  # every round moved the model
    accuracy = [r["site_eval"]["val_accuracy"] for r in by_process[1:]]
    assert all(set(a["per_site"]) == {"site-1", "site-2", "site-3"} for a in accuracy)
    assert accuracy[-1]["mean"] > accuracy[0]["mean"] + 0.2  # the round-1 score is the untrained model's
    meta = by_process[-1]["site_meta"]["site-1"]
    assert meta["client.algorithm"] == "scaffold" and "fednova.tau" not in meta  # AdamW: no FedNova report
    assert report.main([str(tmp_path / "t3"), "--plot", str(tmp_path / "p.png")]) == 0
    assert json.dumps(by_process[-1]["site_eval"])  # JSON-able as written


OTHERS = {
    "fedprox": ("fedavg", {}, {"mu": 0.01}),
    "feddyn": ("feddyn", {}, {}),
    "moon": ("fedavg", {"projection_dim": 16}, {"mu": 1.0}),  # MOON's protocol: net.embed + algorithm_loss
    "fedmos": ("fedmos", {"optimizer": "sgd", "lr": 0.1}, {}),  # FedMoS's protocol: task_loss; plain SGD
}


@pytest.mark.slow
@pytest.mark.parametrize("client", sorted(OTHERS))
def test_example_model_runs_under_every_other_client_algorithm(tmp_path, client):
    server, model_args, client_args = OTHERS[client]
    build = [sys.executable, "-m", "jobs.build", "--client", client, "--server", server, "--name", client]
    build += ["--output-dir", str(tmp_path), "--num-rounds", "2", "--ship", "examples/custom_model"]
    build += ["--model", "custom_model.model:DigitsClassifier", "--data", "custom_model.data:DigitsSites"]
    build += ["--model-args", json.dumps(model_args, separators=(",", ":"))]
    build += ["--client-args", json.dumps(client_args, separators=(",", ":"))]
    subprocess.run(build, check=True, cwd=REPO, capture_output=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = ["nvflare", "simulator", str(tmp_path / client), "-w", str(tmp_path / "ws"), "-n", "3", "-t", "3"]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    records = report.load_records(tmp_path / "ws")
    rounds = [r for r in records if r["stage"] == "round"]
    assert [r["status"] for r in rounds] == ["aggregated", "aggregated"], completed.stdout[-3000:]
    assert all(r["rejected"] == {} for r in rounds)
    assert {m["client.algorithm"] for m in rounds[-1]["site_meta"].values()} == {client}
    assert "val_accuracy" in rounds[-1]["site_eval"]
