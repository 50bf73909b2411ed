"""MOON end to end through ``nvflare simulator``: the user's command with the default single thread (a new process
for every client-round) and with ``-t 2`` (one process per site), 2 sites and 2 rounds on a small subset.

The site's previous local model must come back from its state file in round 2 under ``-t 1`` (the process that
trained it is gone), the projection head must be part of the federated and evaluated model, and both thread modes
must give bit-identical global models.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from controllers import report
from controllers.checkpoint import load_updates
from jobs.build import JobSpec, export_job

NUM_ROUNDS = 2
#: Two sites: the state a site keeps across processes is per site, so a third adds run time and no check.
SITES = ("site-1", "site-2")
THREAD_MODES = {"default-single-thread": None, "threads-2": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fashion_mnist, simulate) -> dict[str, Path]:
    spec = JobSpec(
        name="e2e_moon",
        client="moon",
        client_args={"mu": 5.0, "history_size": 2},
        num_rounds=NUM_ROUNDS,
        num_sites=len(SITES),
        max_train_samples=600,
        max_test_samples=500,
        save_client_updates=True,
    )
    workspaces = {}
    for mode, threads in THREAD_MODES.items():
        root = tmp_path_factory.mktemp(mode)
        completed = simulate(export_job(spec, root / "jobs"), root / "ws", num_clients=len(SITES), threads=threads)
        final = root / "ws" / "server" / "simulate_job" / "client_updates" / f"round_{NUM_ROUNDS - 1:05d}.npz"
        assert final.is_file(), completed.stdout[-4000:] + completed.stderr[-4000:]
        workspaces[mode] = root / "ws"
    return workspaces


def _history(workspace: Path, site: str) -> list[dict[str, np.ndarray]]:
    stored = report.site_state_store(workspace, site).latest("moon")
    assert stored is not None, f"{site}: no MOON history file"
    return [{k: v.numpy() for k, v in model.items()} for model in stored.state["models"]]


@pytest.mark.parametrize("mode", list(THREAD_MODES))
def test_round_two_reads_each_sites_previous_model_from_disk(runs, round_metrics, mode):
    records = round_metrics(runs[mode])[1:]
    assert len(records) == NUM_ROUNDS
    for round_num, record in enumerate(records):
        assert sorted(record["aggregated"]) == list(SITES) and record["rejected"] == {}
        for site in SITES:
            site_meta = record["site_meta"][site]
            assert site_meta[meta_keys.MOON_NUM_NEGATIVES] == 1
            # round 1: first participation (the received model stands in); round 2: the model trained in round 1
            assert site_meta[meta_keys.MOON_HISTORY_MODELS] == round_num


@pytest.mark.parametrize("mode", list(THREAD_MODES))
def test_history_holds_the_models_each_site_sent_in_fifo_order(runs, mode):
    updates = runs[mode] / "server" / "simulate_job" / "client_updates"
    sent = [load_updates(updates / f"round_{r:05d}.npz") for r in range(NUM_ROUNDS)]
    for site in SITES:
        history = _history(runs[mode], site)
        assert len(history) == 2  # history_size 2, oldest first
        for stored, capture in zip(history, sent, strict=True):
            # The history holds the network's state_dict; the sent model is FLClassifier's (keys under "net.").
            assert {f"net.{key}" for key in stored} == set(capture.site_params[site])
            for key, value in stored.items():
                np.testing.assert_array_equal(value, capture.site_params[site][f"net.{key}"], err_msg=f"{site} {key}")


def test_projection_head_is_federated_and_evaluated(runs, round_metrics):
    capture = load_updates(runs["threads-2"] / "server" / "simulate_job" / "client_updates" / "round_00001.npz")
    assert capture.global_params["net.projection.2.weight"].shape == (256, 84)
    assert capture.global_params["net.classifier.weight"].shape == (10, 256)
    # Nothing but the model travels: the frozen global / previous models are never in the sent state_dict.
    for params in capture.site_params.values():
        assert set(params) == set(capture.global_params)
    accuracies = [r["test_accuracy"] for r in round_metrics(runs["threads-2"])]
    assert len(accuracies) == NUM_ROUNDS + 1 and all(0.0 <= a <= 1.0 for a in accuracies)


def test_process_per_round_and_process_per_site_agree_bit_for_bit(runs, round_metrics):
    digests = {mode: [r["global_sha256"] for r in round_metrics(ws)] for mode, ws in runs.items()}
    assert digests["threads-2"] == digests["default-single-thread"]
    assert len(set(digests["threads-2"])) == NUM_ROUNDS + 1  # the model changed every round
