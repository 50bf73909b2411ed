"""The fedavg_dp job through ``nvflare simulator -n 2 -t 1``: every client round is a new process, and each site's
epsilon keeps counting across them (the ledger in the site's state store), as the accountant computes it from the
cumulative steps; nothing DP does not protect reaches the server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

pytest.importorskip("opacus")

from aggregators.contracts import meta_keys
from jobs.build import export_job
from jobs.presets import PRESETS
from lightning_modules.privacy.accountant import Segment, epsilon

pytestmark = pytest.mark.slow
# 2 sites x 2 rounds: every client round a process that calibrates sigma; round 2 shows the count carried over
NUM_ROUNDS = 2
SITES = ("site-1", "site-2")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, fashion_mnist, simulate) -> Path:
    spec = dataclasses.replace(
        PRESETS["fedavg_dp"],
        name="e2e_fedavg_dp",
        num_sites=len(SITES),
        num_rounds=NUM_ROUNDS,
        max_train_samples=600,
        max_test_samples=200,
    )
    root = tmp_path_factory.mktemp("privacy")
    completed = simulate(export_job(spec, root / "jobs"), root / "ws", num_clients=len(SITES), threads=1)
    state = root / "ws" / "server" / "simulate_job" / "app_server" / "server_state.pt"
    assert state.is_file(), completed.stdout[-4000:] + completed.stderr[-4000:]
    return root / "ws"


def test_epsilon_keeps_counting_across_the_per_round_processes(workspace, round_metrics):
    records = [r for r in round_metrics(workspace) if r["stage"] == "round"]
    assert len(records) == NUM_ROUNDS
    first = records[0]["privacy"]
    for round_num, record in enumerate(records, start=1):
        assert record["status"] == "aggregated" and sorted(record["privacy"]) == list(SITES)
        for site, privacy in record["privacy"].items():
            per_round = first[site]["steps"]
            assert privacy["steps"] == round_num * per_round  # not restarted by the new process
            segment = Segment(privacy["sample_rate"], privacy["noise_multiplier"], privacy["steps"])
            assert privacy["epsilon"] == pytest.approx(epsilon([segment], 1e-5), rel=1e-12)
            assert privacy["epsilon"] <= 8.0
            assert meta_keys.TRAIN_LOSS not in record["site_meta"][site]
    # sigma was calibrated for the planned rounds: the last round spends (nearly) the whole budget
    assert all(p["epsilon"] > 7.9 for p in records[-1]["privacy"].values())


def test_every_site_keeps_its_ledger_in_its_workspace(workspace):
    for site in SITES:
        ledgers = list((workspace / site).rglob("privacy.state"))
        assert len(ledgers) == 1, ledgers


def test_the_report_shows_epsilon_per_site_per_round(workspace, capsys):
    from controllers.report import main

    main([str(workspace)])
    out = capsys.readouterr().out
    assert "epsilon per site (delta 1e-05):" in out
    assert out.split("epsilon per site")[1].splitlines()[1].split() == ["round", *SITES]
