"""A user's own model and data (examples/custom_model) through `nvflare simulator`, as the docs tell a user to run
it: SCAFFOLD with AdamW, the sites evaluating every received global model on their own validation split, and one
process per site giving the same global models bit for bit as a new process per client round (-t 1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.in_process import quiet_lightning, run_in_process
from controllers import report
from jobs.spec import JobSpec
from tests.e2e.simulator_run import run_simulator_command

REPO = Path(__file__).resolve().parents[2]
OWN_MODEL = ["--ship", "examples/custom_model", "--model", "custom_model.model:DigitsClassifier"]
ROUNDS = 3
#: The thread-count and state checks run two sites: what a site keeps across processes is per site, so a third site
#: adds a process per round and no check.
TWO_SITES = {"site-1", "site-2"}


def simulate(job: Path, workspace: Path, threads: int) -> list[dict]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = ["nvflare", "simulator", str(job), "-w", str(workspace), "-n", str(len(TWO_SITES)), "-t", str(threads)]
    completed = run_simulator_command(command, workspace, env=env, timeout=900)
    records = report.load_records(workspace)
    assert [r["stage"] for r in records] == ["initial"] + ["round"] * ROUNDS, completed.stdout[-3000:]
    return records


@pytest.mark.slow
def test_example_model_trains_with_site_evaluation_and_is_thread_count_independent(tmp_path, monkeypatch, capsys):
    build = [sys.executable, "-m", "jobs.build", "--client", "scaffold", "--server", "scaffold"]
    build += ["--name", "custom_scaffold", "--output-dir", str(tmp_path), "--num-rounds", str(ROUNDS)]
    build += ["--model", "custom_model.model:DigitsClassifier", "--data", "custom_model.data:DigitsSites"]
    build += ["--ship", "examples/custom_model", "--final-site-eval", "--num-sites", str(len(TWO_SITES))]
    subprocess.run(build, check=True, cwd=REPO, capture_output=True)
    by_process = simulate(tmp_path / "custom_scaffold", tmp_path / "per_site", threads=len(TWO_SITES))
    by_round = simulate(tmp_path / "custom_scaffold", tmp_path / "t1", threads=1)
    assert [r["global_sha256"] for r in by_process] == [r["global_sha256"] for r in by_round]
    assert len({r["global_sha256"] for r in by_process}) == ROUNDS + 1  # every round moved the model
    accuracy = [r["site_eval"]["val_accuracy"] for r in by_process[1:]]
    assert all(set(a["per_site"]) == TWO_SITES for a in accuracy)
    assert accuracy[-1]["mean"] > accuracy[0]["mean"] + 0.2  # the round-1 score is the untrained model's
    meta = by_process[-1]["site_meta"]["site-1"]
    assert meta["client.algorithm"] == "scaffold" and "fednova.tau" not in meta  # AdamW: no FedNova report
    assert report.main([str(tmp_path / "per_site"), "--plot", str(tmp_path / "p.png")]) == 0
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
        num_sites=len(TWO_SITES),
        model="custom_model.model:DigitsClassifier",
        data="custom_model.data:DigitsSites",
    )
    with quiet_lightning():
        run = run_in_process(spec, tmp_path / "in_process_state")
    assert [r["global_sha256"] for r in run.records] == [r["global_sha256"] for r in by_process]
    # --final-site-eval: every site scored the final global model; the same numbers as the in-process runner's.
    for workspace in ("per_site", "t1"):
        final = json.loads((tmp_path / workspace / report.FINAL_SCORES).read_text())
        assert final["round"] == ROUNDS and set(final["sites"]) == TWO_SITES
        for site, scores in run.final_site_scores.items():
            assert set(scores) == set(final["sites"][site]) and "val_accuracy" in scores
            for metric, value in scores.items():
                assert final["sites"][site][metric] == pytest.approx(value, abs=1e-6), (workspace, site, metric)
    assert "the final global model at every site" in capsys.readouterr().out


def build_and_simulate(tmp_path: Path, name: str, options: list[str], sites: int = 3, threads: int = 3) -> list[dict]:
    """Build job ``name`` with the builder's command-line ``options`` (2 rounds), run it in the simulator (workspace
    ``tmp_path/ws``) and return its round records, checked to have aggregated both rounds."""
    build = [sys.executable, "-m", "jobs.build", "--name", name, "--output-dir", str(tmp_path), "--num-rounds", "2"]
    subprocess.run([*build, *options], check=True, cwd=REPO, capture_output=True)
    return simulate_two_rounds(tmp_path / name, tmp_path / "ws", sites, threads)


def simulate_two_rounds(job: Path, workspace: Path, sites: int, threads: int) -> list[dict]:
    """Run the 2-round ``job`` in the simulator and return its round records, checked to have aggregated both."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    command = ["nvflare", "simulator", str(job), "-w", str(workspace), "-n", str(sites), "-t", str(threads)]
    completed = run_simulator_command(command, workspace, env=env, timeout=900)
    rounds = [r for r in report.load_records(workspace) if r["stage"] == "round"]
    assert [r["status"] for r in rounds] == ["aggregated", "aggregated"], completed.stdout[-3000:]
    return rounds


OTHERS = {
    "fedprox": ("fedavg", {}, {"mu": 0.01}),
    "feddyn": ("feddyn", {}, {}),
    "moon": ("fedavg", {"projection_dim": 16}, {"mu": 1.0}),  # MOON's protocol: net.embed + algorithm_loss
    "fedmos": ("fedmos", {"optimizer": "sgd", "lr": 0.1}, {}),  # FedMoS's protocol: task_loss; plain SGD
}
#: Client algorithms whose site state (FedDyn's H_k, MOON's previous local model) must outlive a client-round.
STATEFUL = ("feddyn", "moon")


@pytest.mark.slow
@pytest.mark.parametrize("client", sorted(OTHERS))
def test_example_model_runs_under_every_other_client_algorithm(tmp_path, client):
    server, model_args, client_args = OTHERS[client]
    options = ["--client", client, "--server", server, *OWN_MODEL, "--data", "custom_model.data:DigitsSites"]
    options += ["--model-args", json.dumps(model_args, separators=(",", ":"))]
    options += ["--client-args", json.dumps(client_args, separators=(",", ":"))]
    sites = len(TWO_SITES) if client in STATEFUL else 3
    rounds = build_and_simulate(tmp_path, client, [*options, "--num-sites", str(sites)], sites=sites, threads=sites)
    assert all(r["rejected"] == {} for r in rounds)
    assert {m["client.algorithm"] for m in rounds[-1]["site_meta"].values()} == {client}
    assert "val_accuracy" in rounds[-1]["site_eval"]
    if client in STATEFUL:  # state that outlives a round must survive a new process per client-round (-t 1)
        by_round = simulate_two_rounds(tmp_path / client, tmp_path / "t1", sites=sites, threads=1)
        assert [r["global_sha256"] for r in by_round] == [r["global_sha256"] for r in rounds]


@pytest.mark.slow
def test_the_genomics_job_runs_with_the_users_command_shape(tmp_path):
    """The consortium's own model and data (examples/genomics) as the committed snp_scaffold job, shortened."""
    options = ["--client", "scaffold", "--server", "scaffold", "--ship", "examples/genomics"]
    options += ["--model", "genomics.model:SnpClassifier", "--data", "genomics.data:SnpSites"]
    options += ["--model-args", '{"arch":"mlp","n_snps":127,"num_classes":5,"lr":0.001}']
    options += ["--data-args", '{"source":"1kg","split":"population","batch_size":128}']
    rounds = build_and_simulate(tmp_path, "snp", options, threads=1)
    assert set(rounds[-1]["site_eval"]["val_accuracy"]["per_site"]) == {"site-1", "site-2", "site-3"}
    assert rounds[-1]["rule_diagnostics"]["scaffold.ctrl.global_norm"] > 0


@pytest.mark.slow
def test_a_users_own_training_script_runs_under_the_bundles_server(tmp_path):
    """examples/custom_model/train_script.py: a plain Lightning loop plus job_algorithm() and flare.patch."""
    options = ["--client", "scaffold", "--server", "scaffold", *OWN_MODEL]
    rounds = build_and_simulate(tmp_path, "script", [*options, "--script", "examples/custom_model/train_script.py"])
    assert {m["client.algorithm"] for m in rounds[-1]["site_meta"].values()} == {"scaffold"}
    assert rounds[-1]["site_eval"]["val_accuracy"]["mean"] > rounds[0]["site_eval"]["val_accuracy"]["mean"]
    assert rounds[-1]["rule_diagnostics"]["scaffold.ctrl.global_norm"] > 0


@pytest.mark.slow
def test_sites_training_with_two_ddp_processes_each_run_under_the_simulator(tmp_path):
    """--devices 2: NVFlare starts each site's client under torchrun (two CPU processes, Lightning DDP); rank 0
    talks to NVFlare and the other rank follows. Rounds aggregate, the sites evaluate, the final model is scored at
    every site, and each site's SCAFFOLD state is written once. (That DDP equals one process is
    tests/lightning_modules/test_lm_ddp.py.)"""
    options = ["--client", "scaffold", "--server", "scaffold", *OWN_MODEL, "--data", "custom_model.data:DigitsSites"]
    options += ["--num-sites", "2", "--devices", "2", "--final-site-eval"]
    rounds = build_and_simulate(tmp_path, "ddp", options, sites=2, threads=2)
    assert rounds[-1]["rejected"] == {}
    assert set(rounds[-1]["site_eval"]["val_accuracy"]["per_site"]) == {"site-1", "site-2"}
    final = json.loads((tmp_path / "ws" / report.FINAL_SCORES).read_text())
    assert set(final["sites"]) == {"site-1", "site-2"}
    for site in ("site-1", "site-2"):
        # The committed c_i and the last round's pending one (confirmed by a next round that never comes).
        files = sorted(p.name for p in (tmp_path / "ws" / site).rglob("scaffold.*"))
        assert files == ["scaffold.pending", "scaffold.state"], files


@pytest.mark.slow
def test_under_dp_sgd_the_final_site_scores_stay_at_the_sites(tmp_path):
    """--final-site-eval with DP-SGD: every site scores the final model in its own log and sends the server only
    the names of what it withheld; nothing of a site's validation data reaches the server's records."""
    options = ["--client", "fedavg", "--server", "fedavg", *OWN_MODEL, "--data", "custom_model.data:DigitsSites"]
    options += ["--final-site-eval", "--dp-noise-multiplier", "1.0", "--dp-max-grad-norm", "1.0"]
    rounds = build_and_simulate(tmp_path, "own_dp", options)
    assert "site_eval" not in rounds[-1] or not rounds[-1]["site_eval"]  # eval.* withheld every round
    final = json.loads((tmp_path / "ws" / report.FINAL_SCORES).read_text())
    assert final["sites"] == {site: {} for site in ("site-1", "site-2", "site-3")}
    assert {site: "val_accuracy" in names for site, names in final["withheld"].items()} == {
        "site-1": True,
        "site-2": True,
        "site-3": True,
    }
