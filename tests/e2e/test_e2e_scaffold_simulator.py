"""SCAFFOLD end to end through ``nvflare simulator`` with partial participation (2 of 3 sites per round).

The per-site control c_i lives in a state file in each site's workspace, so the default single-thread simulator
(a new process for every client-round) must give exactly the same controls and global models as ``-t 3``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from controllers import report
from controllers.checkpoint import load_updates

NUM_ROUNDS = 3
SITES = ("site-1", "site-2", "site-3")
THREAD_MODES = {"threads-3": 3, "default-single-thread": None}


@pytest.fixture(scope="module")
def runs(fashion_mnist, shared_specs, simulated) -> dict[str, Path]:
    spec = shared_specs["scaffold-partial"]
    assert (spec.num_rounds, spec.clients_per_round, spec.save_client_updates) == (NUM_ROUNDS, 2, True)
    workspaces = {}
    for mode, threads in THREAD_MODES.items():
        workspace, completed = simulated(spec, threads)
        assert (workspace / "server" / "simulate_job" / "app_server" / "server_state.pt").is_file(), (
            completed.stdout[-4000:] + completed.stderr[-4000:]
        )
        workspaces[mode] = workspace
    return workspaces


def _server_control(workspace: Path) -> dict[str, np.ndarray]:
    payload = torch.load(workspace / "server" / "simulate_job" / "app_server" / "server_state.pt", weights_only=True)
    assert payload["rule"] == "scaffold" and payload["round"] == NUM_ROUNDS - 1
    return {key: value.numpy() for key, value in payload["state"]["control"].items()}


def _site_controls(workspace: Path, site: str) -> dict[str, np.ndarray] | None:
    stored = report.site_state_store(workspace, site).latest("scaffold")
    if stored is None:
        return None
    return {key: value.numpy() for key, value in stored.state.items() if not key.startswith("__")}


@pytest.mark.parametrize("mode", list(THREAD_MODES))
def test_rounds_sample_two_sites_and_accept_every_control(runs, round_metrics, mode):
    records = round_metrics(runs[mode])[1:]
    assert len(records) == NUM_ROUNDS
    for record in records:
        assert len(record["sites"]) == 2 and record["aggregated"] == record["sites"]
        assert record["rejected"] == {}


@pytest.mark.parametrize("mode", list(THREAD_MODES))
def test_global_control_is_the_population_mean_of_site_controls(runs, mode):
    control = _server_control(runs[mode])
    site_controls = [_site_controls(runs[mode], site) for site in SITES]
    assert any(c is not None for c in site_controls)
    for key, value in control.items():
        # A site that never participated holds c_i = 0 (no state file yet).
        mean = np.mean([c[key] if c is not None else np.zeros_like(value) for c in site_controls], axis=0)
        np.testing.assert_allclose(value, mean, atol=1e-6, rtol=0, err_msg=key)
    assert max(float(np.abs(v).max()) for v in control.values()) > 0


@pytest.mark.parametrize("mode", list(THREAD_MODES))
def test_global_model_is_the_uniform_mean_of_participants(runs, mode):
    path = runs[mode] / "server" / "simulate_job" / "client_updates" / f"round_{NUM_ROUNDS - 1:05d}.npz"
    capture = load_updates(path)
    assert len(capture.site_params) == 2
    for key, value in capture.global_params.items():
        expected = np.mean([params[key].astype(np.float64) for params in capture.site_params.values()], axis=0)
        np.testing.assert_allclose(value, expected, atol=1e-6, rtol=0)


def test_process_per_round_and_process_per_site_agree_bit_for_bit(runs, round_metrics):
    digests = {mode: [r["global_sha256"] for r in round_metrics(ws)] for mode, ws in runs.items()}
    assert digests["threads-3"] == digests["default-single-thread"]
    controls = {mode: _server_control(ws) for mode, ws in runs.items()}
    for key, value in controls["threads-3"].items():
        np.testing.assert_array_equal(value, controls["default-single-thread"][key])
    for site in SITES:
        a, b = (_site_controls(runs[mode], site) for mode in THREAD_MODES)
        assert (a is None) == (b is None)
        for key in a or {}:
            np.testing.assert_array_equal(a[key], b[key])


def test_nvflare_reserved_keys_never_reach_the_wire(runs):
    config = runs["threads-3"].parent / "jobs" / "e2e_scaffold" / "app" / "config" / "config_fed_server.json"
    text = config.read_text()
    assert all(key not in text for key in meta_keys.NVFLARE_RESERVED)
