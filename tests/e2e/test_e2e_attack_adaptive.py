"""The ``attack_adaptive`` preset end to end through ``nvflare simulator`` with the shipped LeNet-5 checkpoint.

Small settings (3 sites, 2 rounds, 600 training samples, ``-t 3``): the preset's server side — the rule, the
relative checkpoint path resolved inside the installed package, the width check — is exactly the committed one;
only the data size, the rounds and the site count are reduced (the attention input width does not depend on the
number of sites). site-3 flips the sign of its update, so the run also exercises the client-side attack and the
``attack.applied`` meta, and the capture writes one file per round.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from aggregators.capture import read_capture
from jobs.build import PRESETS, export_job

NUM_ROUNDS = 2


def test_preset_runs_with_the_shipped_checkpoint(tmp_path, fashion_mnist, simulate, round_metrics) -> None:
    preset = PRESETS["attack_adaptive"]
    capture_dir = tmp_path / "capture"
    spec = dataclasses.replace(
        preset,
        name="e2e_attack_adaptive",
        num_sites=3,
        num_rounds=NUM_ROUNDS,
        max_train_samples=600,
        max_test_samples=500,
        attack="sign_flip",
        malicious_sites="site-3",
        server_args={**preset.server_args, "dataset_capture_dir": str(capture_dir)},
    )
    workspace = tmp_path / "ws"
    completed = simulate(export_job(spec, tmp_path / "jobs"), workspace, num_clients=3, threads=3)
    records = [r for r in round_metrics(workspace) if r["stage"] == "round"]
    assert len(records) == NUM_ROUNDS, completed.stdout[-3000:] + completed.stderr[-3000:]
    for record in records:
        assert record["aggregated"] == ["site-1", "site-2", "site-3"] and record["rejected"] == {}
        assert record["site_meta"]["site-3"]["attack.applied"] is True
        assert record["site_meta"]["site-1"]["attack.applied"] is False
    assert records[0]["global_sha256"] != records[1]["global_sha256"]
    state = torch.load(workspace / "server" / "simulate_job" / "app_server" / "server_state.pt", weights_only=True)[
        "state"
    ]
    weights = {site: float(w) for site, w in state["weights"].items()}
    assert abs(sum(weights.values()) - 1.0) < 1e-6
    metadata, rounds = read_capture(capture_dir)
    assert metadata["input_width"] == 96 and len(rounds) == NUM_ROUNDS
    np.testing.assert_array_equal(rounds[-1].malicious, [False, False, True])
