"""A real deployment on loopback: ``nvflare provision``, server and three sites as separate processes, the committed
``jobs/scaffold`` submitted through the admin API, results checked, everything shut down. On the same deployment: a
job needing four sites is refused with NVFlare's reason, and a job without ``custom/`` runs from the installed
package under the class allow-list.

Sandboxed: HOME, kits, workspaces and the server's job store live under ``tmp_path``; the port is picked free at test
time; a finalizer kills every process of the deployment (also on failure) and the test fails if any is left.
The sites' training data comes from each site's own ``local/fedalg_site_data.json`` (300 samples per site), never
from the job; the bundle is used as installed in this ``.venv`` (the job carries only the client script).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs.build import JobSpec, export_job
from jobs.provision import loopback

REPO = Path(__file__).resolve().parents[2]
NUM_SITES = 3
JOB_TIMEOUT_S = 420.0
DATA = {"dataset": "fashion_mnist", "scheme": "dirichlet", "num_sites": NUM_SITES, "max_train_samples": 900}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, fashion_mnist):
    root = tmp_path_factory.mktemp("loopback")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))
        (root / "home").mkdir()
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", NUM_SITES, env)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        # Give up on unschedulable jobs after two tries one second apart (defaults: 10 tries, ~40 min).
        loopback.keep_server_storage_inside(
            deployment.server, {"max_schedule_count": 2, "min_schedule_interval": 1.0, "max_schedule_interval": 2.0}
        )
        for site, site_dir in deployment.sites.items():
            loopback.configure_site_data(site_dir, site, DATA)
        started = time.monotonic()
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                yield deployment, session
        finally:
            loopback.stop(deployment)
            left = loopback.leftover_processes(deployment)
            print(f"loopback deployment: {time.monotonic() - started:.1f} s from start to shutdown")
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def _initial_model() -> dict[str, np.ndarray]:
    from lightning_modules.classifier import FLClassifier

    config = json.loads((REPO / "jobs/scaffold/app/config/config_fed_server.json").read_text())
    persistor = next(c for c in config["components"] if c["id"] == "persistor")
    model = FLClassifier(**persistor["args"]["model"]["args"])
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_scaffold_job_runs_on_provisioned_sites(deployment):
    deployment, session = deployment
    started = time.monotonic()

    job_id, meta = loopback.run_job(session, deployment, REPO / "jobs" / "scaffold", JOB_TIMEOUT_S)
    result = loopback.download_result(session, job_id)
    print(f"jobs/scaffold on the loopback deployment: {time.monotonic() - started:.1f} s")

    assert meta["status"] == "FINISHED:COMPLETED", meta
    assert meta.get("byoc") is True  # the client script travels in app/custom/: NVFlare treats the job as BYOC
    records = [json.loads(line) for line in (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in records if r["stage"] == "round"]
    assert len(rounds) == 10
    assert all(r["aggregated"] == sorted(deployment.sites) and not r["rejected"] for r in rounds)
    digests = [records[0]["global_sha256"]] + [r["global_sha256"] for r in rounds]
    assert len(set(digests)) == len(digests), "the global model must change every round"
    # The saved global model is not the initial one.
    saved = torch.load(result / "app_server" / "FL_global_model.pt", weights_only=False)["model"]
    initial = _initial_model()
    assert set(saved) == set(initial)
    assert any(not np.allclose(saved[k].numpy(), initial[k]) for k in initial)
    # Each site trained on its own configured data and persisted its SCAFFOLD control in its own workspace.
    for site, site_dir in deployment.sites.items():
        assert (site_dir / "client_state" / job_id / site / "scaffold.state").is_file()
        log = (site_dir / job_id / "log.txt").read_text()
        assert f"training data from {site_dir / 'data' / 'train.npz'}" in log
        assert rounds[0]["site_num_samples"][site] == len(np.load(site_dir / "data" / "train.npz")["y"])
    # Per-site training curves streamed to the server as TensorBoard event files.
    for site in deployment.sites:
        assert list((result / "tb_events" / site).glob("events.out.tfevents.*")), site


def test_job_needing_more_sites_than_connected_is_refused(deployment, tmp_path):
    deployment, session = deployment
    job = tmp_path / "needs_four"
    shutil.copytree(REPO / "jobs" / "scaffold", job)
    meta_file = job / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "min_clients": NUM_SITES + 1}))

    job_id = loopback.submit(session, deployment, job)
    final = session.wait_for_job(job_id, timeout=60, poll_interval=1.0)

    assert final["status"] == "FINISHED:CAN_NOT_SCHEDULE", final
    history = " ".join(final.get("schedule_history", []))
    assert f"connected sites ({NUM_SITES}) < min_sites ({NUM_SITES + 1})" in history


def test_job_without_custom_code_runs_from_the_installed_package_under_the_allow_list(deployment, tmp_path):
    deployment, session = deployment
    spec = JobSpec(name="fedavg_installed", num_rounds=2, max_test_samples=500)
    job = loopback.installed_script_job(export_job(spec, tmp_path / "exported"), tmp_path / "fedavg_installed")
    assert not list(job.rglob("custom")) and not list(job.rglob("*.py"))

    job_id, meta = loopback.run_job(session, deployment, job, JOB_TIMEOUT_S)

    assert meta["status"] == "FINISHED:COMPLETED", meta
    assert not meta.get("byoc"), "a job without custom/ must not be BYOC: the allow-list applies"
    result = loopback.download_result(session, job_id)
    records = [json.loads(line) for line in (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()]
    assert [r["aggregated"] for r in records if r["stage"] == "round"] == [sorted(deployment.sites)] * 2
