"""Our median as the aggregator of NVFlare's own FedAvg controller, in `nvflare simulator`: the job is NVFlare's
(its FedAvg workflow and persistor), the sites run our client script, and the final global model is the coordinate
-wise median of what the sites sent in the last round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from controllers.checkpoint import load_updates
from jobs.assembly import APP_PACKAGES, CLIENT_SCRIPT, JOBS_DIR, inside_directory
from jobs.spec import JobSpec, client_script_args

ROUNDS = 2


def export_nvflare_fedavg_job(root, audit_dir):
    from nvflare.app_common.workflows.fedavg import FedAvg
    from nvflare.app_opt.pt.job_config.model import PTModel
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import ScriptRunner

    from controllers.nvflare_aggregator import RuleAggregator

    spec = JobSpec(name="nvflare_median", dataset="digits", arch="mlp", batch_size=32, lr=0.1, num_rounds=ROUNDS)
    job = FedJob(name=spec.name, min_clients=3)
    job.set_app_packages(list(APP_PACKAGES))
    model = {"path": "lightning_modules.classifier.FLClassifier", "args": {"arch": "mlp", "num_classes": 10}}
    job.to_server(PTModel(model))
    median = RuleAggregator("median", save_updates_dir=str(audit_dir))
    job.to_server(FedAvg(num_clients=3, num_rounds=ROUNDS, aggregator=median))
    with inside_directory(JOBS_DIR):  # NVFlare records the client script's path as given
        job.to_clients(ScriptRunner(script=CLIENT_SCRIPT, script_args=client_script_args(spec)))
        job.export_job(str(root))
    return root / spec.name


@pytest.mark.slow
def test_nvflares_fedavg_controller_runs_our_median(tmp_path, simulate):
    from nvflare.app_common.workflows.fedavg import FedAvg  # noqa: F401  (fails early if NVFlare moved it)

    job = export_nvflare_fedavg_job(tmp_path / "jobs", tmp_path / "audit")
    workspace = tmp_path / "ws"
    completed = simulate(job, workspace, num_clients=3, threads=3)
    output = completed.stdout + completed.stderr
    assert "Traceback" not in output, output[-4000:]
    rounds = sorted((tmp_path / "audit").glob("round_*.npz"))
    assert len(rounds) == ROUNDS, output[-4000:]
    last = load_updates(rounds[-1])
    assert sorted(last.site_params) == ["site-1", "site-2", "site-3"]
    for key, value in last.global_params.items():
        if key.endswith("num_batches_tracked"):
            continue
        stacked = np.stack([last.site_params[site][key] for site in sorted(last.site_params)])
        np.testing.assert_allclose(value, np.median(stacked, axis=0), atol=1e-6, rtol=0)
    saved = torch.load(workspace / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False)
    final = saved.get("model", saved)
    for key, value in last.global_params.items():  # NVFlare's persistor saved our median as the global model
        np.testing.assert_array_equal(np.asarray(final[key]), value)
