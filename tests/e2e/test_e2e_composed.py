"""Composed jobs end to end (``nvflare simulator``): SCAFFOLD clients under FedYogi, FedProx clients under FedNova.

Small settings (3 rounds, 3 000 training samples, ``-t 3``). Checks that the global model changes every round and is
what the rule makes of the clients' saved results, that every result is accepted, that the metrics are sane, and
that the composition does what it says: the SCAFFOLD control is kept beside FedYogi's moments, and FedProx clients
report FedNova's proximal normaliser ||a||_1 = [1 - (1 - eta mu)^tau] / (eta mu).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from aggregators.registry import build_rule
from aggregators.types import ClientUpdate, RoundContext
from controllers.checkpoint import load_updates
from jobs.build import JobSpec, export_job

NUM_ROUNDS = 3
SITES = ("site-1", "site-2", "site-3")
LR, MU = 0.05, 0.01
SPECS = {
    "scaffold_fedyogi": JobSpec(
        name="e2e_scaffold_fedyogi", client="scaffold", server="fedyogi", server_args={"server_lr": 0.03}
    ),
    "fedprox_fednova": JobSpec(
        name="e2e_fedprox_fednova",
        client="fedprox",
        client_args={"mu": MU},
        server="fednova",
        pattern="uniform_random",
        max_local_epochs=3,
    ),
}
SMALL = {"num_rounds": NUM_ROUNDS, "max_train_samples": 3000, "max_test_samples": 1000, "save_client_updates": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fashion_mnist, simulate) -> dict[str, Path]:
    workspaces = {}
    for name, spec in SPECS.items():
        small = dataclasses.replace(spec, **SMALL)
        root = tmp_path_factory.mktemp(name)
        completed = simulate(export_job(small, root / "jobs"), root / "ws", num_clients=len(SITES), threads=3)
        state = root / "ws" / "server" / "simulate_job" / "app_server" / "server_state.pt"
        assert state.is_file(), completed.stdout[-4000:] + completed.stderr[-4000:]
        workspaces[name] = root / "ws"
    return workspaces


def _captures(workspace: Path):
    folder = workspace / "server" / "simulate_job" / "client_updates"
    return [load_updates(folder / f"round_{r:05d}.npz") for r in range(NUM_ROUNDS)]


@pytest.mark.parametrize("name", list(SPECS))
def test_every_round_accepts_all_sites_moves_the_model_and_improves_it(runs, round_metrics, name):
    records = round_metrics(runs[name])
    assert len(records) == NUM_ROUNDS + 1 and records[0]["stage"] == "initial"
    digests = [r["global_sha256"] for r in records]
    assert len(set(digests)) == len(digests), "the global model must change every round"
    for record in records[1:]:
        assert record["rejected"] == {} and sorted(record["aggregated"]) == list(SITES)
        assert all(math.isfinite(loss) for loss in record["site_train_loss"].values())
    assert all(0.0 <= r["test_accuracy"] <= 1.0 and math.isfinite(r["test_loss"]) for r in records)
    # Three short rounds: the model must have learnt something, not much (an adaptive server step starts small).
    assert records[-1]["test_loss"] < records[0]["test_loss"]
    assert records[-1]["test_accuracy"] > records[0]["test_accuracy"]


def test_scaffold_control_is_kept_beside_fedyogis_moments(runs):
    path = runs["scaffold_fedyogi"] / "server" / "simulate_job" / "app_server" / "server_state.pt"
    payload = torch.load(path, weights_only=True)
    assert payload["rule"] == "fedyogi+scaffold_control" and payload["round"] == NUM_ROUNDS - 1
    moments, control = payload["state"]["rule"], payload["state"]["companions"]["scaffold_control"]["control"]
    assert payload["state"]["rule"]["step"] == NUM_ROUNDS
    assert set(moments["m"]) == set(moments["v"]) == set(control)  # trainable parameters only
    assert max(float(v.abs().max()) for v in control.values()) > 0
    assert all(v.dtype == torch.float32 for v in (*moments["m"].values(), *control.values()))


def test_fedprox_clients_report_the_proximal_normaliser_and_fednova_made_the_global_model(runs, round_metrics):
    records = round_metrics(runs["fedprox_fednova"])[1:]
    captures = _captures(runs["fedprox_fednova"])
    epochs_seen = []
    for round_num in range(1, NUM_ROUNDS):
        site_meta = records[round_num]["site_meta"]
        updates = []
        for site in SITES:
            meta = site_meta[site]
            tau = meta[meta_keys.FEDNOVA_TAU]
            assert tau == meta[meta_keys.NUM_STEPS]
            expected = (1 - (1 - LR * MU) ** tau) / (LR * MU)
            assert meta[meta_keys.FEDNOVA_A_NORM] == pytest.approx(expected, rel=1e-9)
            steps_per_epoch = math.ceil(captures[round_num].site_samples[site] / 64)  # batch size 64, no drop_last
            assert tau % steps_per_epoch == 0 and 2 <= tau // steps_per_epoch <= 3
            epochs_seen.append(tau // steps_per_epoch)
            params = captures[round_num].site_params[site]
            updates.append(ClientUpdate(site, params, captures[round_num].site_samples[site], meta))
        previous = captures[round_num - 1].global_params
        context = RoundContext(round_num=round_num, num_rounds=NUM_ROUNDS, population=SITES)
        result = build_rule("fednova").aggregate(previous, updates, {"momentum": {}}, context)
        for key, value in captures[round_num].global_params.items():
            np.testing.assert_allclose(value, result.params[key], atol=1e-6, rtol=0, err_msg=key)
    assert len(set(epochs_seen)) == 2  # uniform_random local epochs in [2, 3]: the sites did different work
