"""FedBN and FedRep end to end through ``nvflare simulator``: the ``jobs/fedbn`` and ``jobs/fedrep`` presets,
shortened (2 sites, 2 rounds, 600 samples).

Under the default ``-t 1`` every client round is a new process, so the entries each site keeps (FedBN's BatchNorm
entries, FedRep's classifier head) must survive in its state store; ``-t 2`` keeps one process per site. Both must
give the same global models bit for bit, every round must aggregate every site, and no result the server received
may carry a local entry: the global model keeps the initial values of those entries.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.in_process import initial_params
from controllers.checkpoint import load_updates
from jobs.build import PRESETS, export_job

pytestmark = pytest.mark.slow
NUM_ROUNDS = 2
#: Two sites: what a site keeps is per site, so a third adds run time and no check.
SITES = ("site-1", "site-2")


@pytest.fixture(scope="module", params=["fedbn", "fedrep"])
def runs(request, tmp_path_factory, fashion_mnist, simulate):
    spec = dataclasses.replace(
        PRESETS[request.param],
        name=f"e2e_{request.param}",
        num_rounds=NUM_ROUNDS,
        num_sites=len(SITES),
        max_train_samples=600,
        max_test_samples=200,
        save_client_updates=True,
    )
    workspaces = {}
    for threads in (1, len(SITES)):
        root = tmp_path_factory.mktemp(f"{request.param}-t{threads}")
        job_dir = export_job(spec, root / "jobs")
        workspaces[threads] = root / "ws"
        completed = simulate(job_dir, workspaces[threads], num_clients=len(SITES), threads=threads)
        assert completed.returncode == 0, completed.stderr[-2000:]
    return spec, workspaces


def test_one_process_per_round_equals_one_process_per_site_bit_for_bit(runs, round_metrics):
    _, workspaces = runs
    digests = {t: [r["global_sha256"] for r in round_metrics(ws)] for t, ws in workspaces.items()}
    assert len(digests[1]) == NUM_ROUNDS + 1 and digests[1] == digests[len(SITES)]
    for record in round_metrics(workspaces[1])[1:]:
        assert record["status"] == "aggregated" and record["aggregated"] == list(SITES) and not record["rejected"]
        assert record["global_eval_local_entries"] == "initial"


def test_the_server_never_receives_a_local_entry(runs):
    spec, workspaces = runs
    local = set(spec.local_keys.split(","))
    if spec.client == "fedrep":
        assert local == {"net.classifier.weight", "net.classifier.bias"}  # the head lenet5 declares
    else:
        assert local and all(".bn" in key for key in local)
    initial = initial_params(spec)
    for workspace in workspaces.values():
        for round_num in range(NUM_ROUNDS):
            capture = load_updates(
                workspace / "server" / "simulate_job" / "client_updates" / f"round_{round_num:05d}.npz"
            )
            assert set(capture.site_params) == set(SITES)
            for params in capture.site_params.values():
                assert not local & set(params)
            for key in local:  # the global model keeps the initial values (FedBN: mean 0, variance 1, no batches)
                np.testing.assert_array_equal(capture.global_params[key], initial[key])
