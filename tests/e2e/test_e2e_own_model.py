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
from controllers.in_process import quiet_lightning, run_in_process
from jobs.spec import JobSpec

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
def test_example_model_trains_with_site_evaluation_and_is_thread_count_independent(tmp_path, monkeypatch, capsys):
    build = [sys.executable, "-m", "jobs.build", "--client", "scaffold", "--server", "scaffold"]
    build += ["--name", "custom_scaffold", "--output-dir", str(tmp_path), "--num-rounds", str(ROUNDS)]
    build += ["--model", "custom_model.model:DigitsClassifier", "--data", "custom_model.data:DigitsSites"]
    build += ["--ship", "examples/custom_model", "--final-site-eval"]
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
    # SCAFFOLD's diagnostics: the server's ||c|| and every site's ||delta c_i||, each round.
    assert all(r["rule_diagnostics"]["scaffold.ctrl.global_norm"] > 0 for r in by_process[1:])
    assert all(m["scaffold.ctrl.diff_norm"] > 0 for m in by_process[-1]["site_meta"].values())
    # The in-process runner (benchmarks) gives the simulator's global models bit for bit for a user model too.
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    spec = JobSpec(
        name="custom_scaffold",
        client="scaffold",
        server="scaffold",
        num_rounds=ROUNDS,
        model="custom_model.model:DigitsClassifier",
        data="custom_model.data:DigitsSites",
    )
    with quiet_lightning():
        run = run_in_process(spec, tmp_path / "in_process_state")
    assert [r["global_sha256"] for r in run.records] == [r["global_sha256"] for r in by_process]
    # --final-site-eval: every site scored the final global model; the same numbers as the in-process runner's.
    for workspace in ("t3", "t1"):
        final = json.loads((tmp_path / workspace / report.FINAL_SCORES).read_text())
        assert final["round"] == ROUNDS and set(final["sites"]) == {"site-1", "site-2", "site-3"}
        for site, scores in run.final_site_scores.items():
            assert set(scores) == set(final["sites"][site]) and "val_accuracy" in scores
            for metric, value in scores.items():
                assert final["sites"][site][metric] == pytest.approx(value, abs=1e-6), (workspace, site, metric)
    assert "the final global model at every site" in capsys.readouterr().out


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


@pytest.mark.slow
def test_the_genomics_job_runs_with_the_users_command_shape(tmp_path):
    """The consortium's own model and data (examples/genomics) as the committed snp_scaffold job, shortened."""
    build = [sys.executable, "-m", "jobs.build", "--client", "scaffold", "--server", "scaffold", "--name", "snp"]
    build += ["--output-dir", str(tmp_path), "--num-rounds", "2", "--ship", "examples/genomics"]
    build += ["--model", "genomics.model:SnpClassifier", "--data", "genomics.data:SnpSites"]
    build += ["--model-args", '{"arch":"mlp","n_snps":127,"num_classes":5,"lr":0.001}']
    build += ["--data-args", '{"source":"1kg","split":"population","batch_size":128}']
    subprocess.run(build, check=True, cwd=REPO, capture_output=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = ["nvflare", "simulator", str(tmp_path / "snp"), "-w", str(tmp_path / "ws"), "-n", "3"]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    rounds = [r for r in report.load_records(tmp_path / "ws") if r["stage"] == "round"]
    assert [r["status"] for r in rounds] == ["aggregated", "aggregated"], completed.stdout[-3000:]
    assert set(rounds[-1]["site_eval"]["val_accuracy"]["per_site"]) == {"site-1", "site-2", "site-3"}
    assert rounds[-1]["rule_diagnostics"]["scaffold.ctrl.global_norm"] > 0


@pytest.mark.slow
def test_a_users_own_training_script_runs_under_the_bundles_server(tmp_path):
    """examples/custom_model/train_script.py: a plain Lightning loop plus job_algorithm() and flare.patch."""
    build = [sys.executable, "-m", "jobs.build", "--client", "scaffold", "--server", "scaffold", "--name", "script"]
    build += ["--output-dir", str(tmp_path), "--num-rounds", "2", "--ship", "examples/custom_model"]
    build += ["--model", "custom_model.model:DigitsClassifier", "--script", "examples/custom_model/train_script.py"]
    subprocess.run(build, check=True, cwd=REPO, capture_output=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = ["nvflare", "simulator", str(tmp_path / "script"), "-w", str(tmp_path / "ws"), "-n", "3", "-t", "3"]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    rounds = [r for r in report.load_records(tmp_path / "ws") if r["stage"] == "round"]
    assert [r["status"] for r in rounds] == ["aggregated", "aggregated"], completed.stdout[-3000:]
    assert {m["client.algorithm"] for m in rounds[-1]["site_meta"].values()} == {"scaffold"}
    assert rounds[-1]["site_eval"]["val_accuracy"]["mean"] > rounds[0]["site_eval"]["val_accuracy"]["mean"]
    assert rounds[-1]["rule_diagnostics"]["scaffold.ctrl.global_norm"] > 0
