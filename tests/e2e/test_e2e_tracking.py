"""``--tracking mlflow`` and ``--tracking wandb`` end to end through ``nvflare simulator`` (2 sites, 2 rounds of the
digits MLP): every site's per-round training loss and accuracy reach the server's receiver and land in a local MLflow
store (NVFlare's default SQLite file in the server's run folder, no tracking server) or in W&B offline run files,
with the values the server's round records hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.build import JobSpec, export_job

SITES = ("site-1", "site-2")
ROUNDS = 2
WANDB_BLOCK = 32768  # W&B's transaction log is LevelDB's log format: 32 KiB blocks of framed records


def _run(
    tmp_path: Path, simulate, round_metrics, outputs: tuple[Path, ...] = (), **tracking
) -> tuple[Path, dict[str, list[float]]]:
    """Export and simulate the tiny job; return the server's run folder and each site's train loss per round.
    ``outputs``: the folders the run writes outside its workspace (a retried start-up sets the failed try's aside)."""
    spec = JobSpec(
        name="tracked",
        dataset="digits",
        arch="mlp",
        num_sites=len(SITES),
        num_rounds=ROUNDS,
        client="fedavg",
        server="fedavg",
        **tracking,
    )
    job_dir = export_job(spec, tmp_path / "jobs")
    workspace = tmp_path / "ws"
    completed = simulate(job_dir, workspace, num_clients=len(SITES), threads=len(SITES), outputs=outputs)
    records = [r for r in round_metrics(workspace) if r["stage"] == "round"]
    assert [r["round"] for r in records] == list(range(ROUNDS)), completed.stdout[-3000:]
    losses = {site: [r["site_train_loss"][site] for r in records] for site in SITES}
    return workspace / "server" / "simulate_job", losses


@pytest.mark.slow
def test_mlflow_tracking_writes_every_sites_curves_into_the_local_store(tmp_path, simulate, round_metrics):
    mlflow_client = pytest.importorskip("mlflow.tracking").MlflowClient

    run_dir, losses = _run(tmp_path, simulate, round_metrics, tracking="mlflow", tracking_project="e2e")

    store = run_dir / "mlflow.db"
    assert store.is_file(), f"no MLflow store at {store}"
    client = mlflow_client(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("e2e")
    # NVFlare names a site's run "<site>-<job id>-<job name>-<run name>".
    runs = {run.info.run_name.rsplit("-", 3)[0]: run for run in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == list(SITES)
    for site, run in runs.items():
        assert run.data.tags["client"] == "fedavg" and run.data.tags["job"] == "tracked"
        loss = client.get_metric_history(run.info.run_id, "train_loss")
        assert [m.step for m in sorted(loss, key=lambda m: m.step)] == list(range(ROUNDS)), site
        assert [m.value for m in sorted(loss, key=lambda m: m.step)] == pytest.approx(losses[site], rel=1e-6)
        accuracy = client.get_metric_history(run.info.run_id, "train_accuracy")
        assert sorted(m.step for m in accuracy) == list(range(ROUNDS)), site
        assert all(0 <= m.value <= 1 for m in accuracy)


@pytest.mark.slow
def test_wandb_offline_tracking_writes_a_run_per_site_with_its_curves(tmp_path, simulate, round_metrics, monkeypatch):
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2

    wandb_dir = tmp_path / "wandb_dir"
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))  # the simulator's server inherits it
    monkeypatch.setenv("WANDB_MODE", "offline")

    # A failed start-up's runs are set aside with its workspace: one run per site counts the completed try's only.
    _, losses = _run(tmp_path, simulate, round_metrics, (wandb_dir,), tracking="wandb", tracking_project="e2e")

    run_files = sorted((wandb_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(run_files) == len(SITES), run_files
    seen = {}
    for path in run_files:
        records = [wandb_internal_pb2.Record.FromString(raw) for raw in _wandb_records(path.read_bytes())]
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert run.project == "e2e"
        history = [
            {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        seen[run.display_name.rsplit("-", 2)[0]] = history  # NVFlare's "<site>-<job id>-<job name>"
    assert sorted(seen) == list(SITES)
    for site, history in seen.items():
        assert [h["_step"] for h in history] == list(range(ROUNDS)), site
        assert [h["train_loss"] for h in history] == pytest.approx(losses[site], rel=1e-6)
        assert all(0 <= h["train_accuracy"] <= 1 for h in history)


def _wandb_records(data: bytes) -> list[bytes]:
    """The serialized records of a W&B offline run file: a 7-byte file header, then LevelDB log records (CRC, length,
    type: 1 whole, 2 first, 3 middle, 4 last part) that never straddle a 32 KiB block; a block's last < 7 bytes are
    padding. The wandb package no longer ships a reader of its own."""
    assert data[:4] == b":W&B", "not a W&B run file"
    records, parts, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    return records
