"""FedMoS end to end through ``nvflare simulator -t 3``: FedMoS clients, the FedMoS server with 2 of 3 sites selected
by data share, on a small subset.

Round 1 is the census round (every site, sample weights); afterwards two sites train per round and the global model
must be x + m with m <- beta * m + sum_i wt_i (y_i - x), wt_i the selection weights (data shares renormalised over
the selected sites), recomputed here from the captured client models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from controllers.checkpoint import load_updates
from jobs.build import JobSpec, export_job

NUM_ROUNDS = 3
BETA = 0.8
SITES = ("site-1", "site-2", "site-3")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, fashion_mnist, simulate) -> Path:
    spec = JobSpec(
        name="e2e_fedmos",
        client="fedmos",
        client_args={"a": 0.1, "mu": 0.001},
        server="fedmos",
        server_args={"beta": BETA, "selection": "uniform"},
        num_rounds=NUM_ROUNDS,
        clients_per_round=2,
        max_train_samples=1500,
        max_test_samples=500,
        save_client_updates=True,
    )
    root = tmp_path_factory.mktemp("fedmos")
    completed = simulate(export_job(spec, root / "jobs"), root / "ws", num_clients=len(SITES), threads=3)
    state = root / "ws" / "server" / "simulate_job" / "app_server" / "server_state.pt"
    assert state.is_file(), completed.stdout[-4000:] + completed.stderr[-4000:]
    return root / "ws"


def _capture(workspace: Path, round_num: int):
    return load_updates(workspace / "server" / "simulate_job" / "client_updates" / f"round_{round_num:05d}.npz")


def test_census_round_then_two_sites_selected_per_round(workspace, round_metrics):
    records = round_metrics(workspace)[1:]
    assert [len(r["sites"]) for r in records] == [3, 2, 2]
    for record in records:
        assert record["rejected"] == {} and sorted(record["aggregated"]) == record["sites"]
        for site in record["sites"]:
            assert record["site_meta"][site][meta_keys.FEDMOS_A] == 0.1


def test_global_model_is_the_server_momentum_step_with_selection_weights(workspace):
    captures = [_capture(workspace, r) for r in range(NUM_ROUNDS)]
    counts = captures[0].site_samples
    assert set(counts) == set(SITES)
    previous, momentum = None, {}
    for capture in captures:
        sites = sorted(capture.site_params)
        weights = np.array([counts[s] for s in sites], dtype=np.float64)
        weights /= weights.sum()
        for key, value in capture.global_params.items():
            mean = sum(w * capture.site_params[s][key].astype(np.float64) for w, s in zip(weights, sites, strict=True))
            if previous is None:  # census round: x <- sum p_i y_i, the momentum starts at 0
                expected, momentum[key] = mean, np.zeros_like(mean)
            else:
                step = BETA * momentum[key] + (mean - previous[key].astype(np.float64))
                expected = previous[key].astype(np.float64) + step
                momentum[key] = step.astype(np.float32).astype(np.float64)  # the server keeps m in float32
            np.testing.assert_allclose(value, expected, atol=2e-5, rtol=0, err_msg=key)
        previous = capture.global_params


def test_server_state_records_every_sites_sample_count(workspace):
    payload = torch.load(workspace / "server" / "simulate_job" / "app_server" / "server_state.pt", weights_only=True)
    assert payload["rule"] == "fedmos"
    assert payload["state"]["num_samples"] == _capture(workspace, 0).site_samples
    assert set(payload["state"]["momentum"]) == set(_capture(workspace, 0).global_params)
