"""Ditto end to end through ``nvflare simulator``: the committed ``jobs/ditto`` settings on a small Fashion-MNIST
subset and 2 sites, with one process per client-round (``-t 1``: v_i must come back from the state store every
round) and one process per site (``-t 2``): identical results bit for bit, and the personal model's scores in the
round records."""

from __future__ import annotations

import pytest
import torch

from jobs.build import export_job
from jobs.presets import PRESET_SETTINGS
from jobs.spec import JobSpec

NUM_ROUNDS = 2
#: Two sites: v_i is per site, so a third adds run time and no check.
SITES = ["site-1", "site-2"]

pytestmark = pytest.mark.slow


def _simulate(tmp_path_factory, simulate, threads: int):
    root = tmp_path_factory.mktemp(f"ditto-t{threads}")
    settings = {
        **PRESET_SETTINGS["ditto"],
        "num_rounds": NUM_ROUNDS,
        "num_sites": len(SITES),
        "max_train_samples": 1500,
    }
    job_dir = export_job(JobSpec(name="e2e_ditto", max_test_samples=500, **settings), root / "jobs")
    workspace = root / "ws"
    completed = simulate(job_dir, workspace, num_clients=len(SITES), threads=threads)
    return workspace, completed


def test_ditto_is_bit_identical_with_a_process_per_round_and_per_site(
    tmp_path_factory, fashion_mnist, simulate, round_metrics
):
    runs = {threads: _simulate(tmp_path_factory, simulate, threads) for threads in (1, len(SITES))}
    records = {}
    for threads, (workspace, completed) in runs.items():
        records[threads] = round_metrics(workspace)
        rounds = [r for r in records[threads] if r["stage"] == "round"]
        assert len(rounds) == NUM_ROUNDS, completed.stdout[-3000:]
        for record in rounds:
            assert record["rejected"] == {}
            personal = record["site_eval"]["personal_val_accuracy"]
            assert sorted(personal["per_site"]) == SITES
    for one, three in zip(records[1], records[len(SITES)], strict=True):
        assert one.get("site_eval") == three.get("site_eval")
        assert one.get("test_accuracy") == three.get("test_accuracy")
    models = [
        torch.load(ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False)["model"]
        for ws, _ in runs.values()
    ]
    for key, value in models[0].items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(models[1][key])), key
