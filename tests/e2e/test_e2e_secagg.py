"""``--secure-aggregation secagg`` end to end in ``nvflare simulator`` (digits, the MLP, 3 sites, 2 rounds, one
process per site: a site keeps its round's keys and shares in its job process): the same job with ``plain`` (NVFlare's
plaintext accumulating aggregator) is the reference.

Checked: every round aggregates every site after the key and unmask stages; what each site sent the server for
training is the masked update (six bytes a coordinate: 1.5x the plain job's float32 result, less the shared
overhead); the final global model equals the plain job's within the rounds' quantisation error (one step,
2^-20, per round, carried through one more round of training) and moved from the initial model. The other admitted
settings run too: FedOpt's step at the sites (FedAdam; every site held the same state both rounds) and DP-SGD at the
sites (every site's epsilon recorded), with nothing for the egress gate to strip. A site that sends its masked
update and then fails the unmask stage (tests/e2e/secagg_dropout.py) is still summed: the round's model is the
plain job's within one quantisation step.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregators.secagg import quantisation_step
from jobs.build import JobSpec

pytestmark = pytest.mark.slow
pytest.importorskip("flwr")

NUM_SITES, ROUNDS = 3, 2
SETTINGS = {"dataset": "digits", "arch": "mlp", "num_sites": NUM_SITES, "num_rounds": ROUNDS}
#: The plain and secagg jobs see the same data, seeds and initial model; they differ by the quantisation of each
#: round's mean update (below one step a coordinate) and what one further round of training makes of it.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def runs(simulated) -> dict[str, Path]:
    out = {}
    for mode in ("plain", "secagg"):
        workspace, completed = simulated(JobSpec(name=f"e2e_{mode}", secure_aggregation=mode, **SETTINGS), NUM_SITES)
        assert completed.returncode == 0, completed.stdout[-3000:]
        out[mode] = workspace
    return out


def _rounds(workspace: Path) -> list[dict]:
    path = workspace / "server" / "simulate_job" / "metrics" / "round_metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["stage"] == "round"]


def _model(workspace: Path) -> dict[str, np.ndarray]:
    saved = torch.load(
        workspace / "server" / "simulate_job" / "app_server" / "FL_global_model.pt",
        map_location="cpu",
        weights_only=False,
    )
    weights = saved.get("model", saved)
    return {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}


def test_every_round_aggregates_every_site(runs):
    for mode, workspace in runs.items():
        records = _rounds(workspace)
        assert [r["round"] for r in records] == list(range(ROUNDS)), mode
        for record in records:
            assert record["status"] == "aggregated" and record["aggregated"] == [f"site-{i}" for i in (1, 2, 3)]
    log = (runs["secagg"] / "server" / "log.txt").read_text()
    for round_num in range(ROUNDS):
        assert f"secagg round {round_num}: unmasked the sum of ['site-1', 'site-2', 'site-3'], dropped []" in log


def test_the_sites_send_masked_updates_of_six_bytes_a_coordinate(runs):
    plain, masked = _rounds(runs["plain"])[-1], _rounds(runs["secagg"])[-1]
    coordinates = sum(v.size for v in _model(runs["plain"]).values())
    for site, sent in masked["result_bytes"].items():
        assert sent >= 6 * coordinates
        assert sent <= 1.5 * plain["result_bytes"][site]
    assert masked["global_bytes"] == plain["global_bytes"]


def test_the_final_model_equals_plain_fedavgs_within_the_quantisation_error(runs):
    plain, secagg = _model(runs["plain"]), _model(runs["secagg"])
    assert set(plain) == set(secagg)
    worst = max(float(np.max(np.abs(plain[k] - secagg[k]))) for k in plain)
    assert worst < TOLERANCE
    assert quantisation_step() < TOLERANCE / 10
    from jobs.spec import job_model

    initial = job_model(JobSpec(name="init", secure_aggregation="plain", **SETTINGS)).state_dict()
    moved = max(float(np.max(np.abs(secagg[k] - initial[k].numpy()))) for k in secagg)
    assert moved > 100 * TOLERANCE


#: The other admitted settings: FedOpt's step at the sites (on the unmasked mean) and DP-SGD at the sites.
ADMITTED = {"fedadam": {"server": "fedadam"}, "dp_sgd": {"dp_target_epsilon": 8.0, "dp_max_grad_norm": 1.0}}


@pytest.mark.parametrize("name", sorted(ADMITTED))
def test_fedopts_site_step_and_dp_sgd_run_under_secagg(simulated, name):
    spec = JobSpec(name=f"e2e_secagg_{name}", secure_aggregation="secagg", **SETTINGS, **ADMITTED[name])
    workspace, completed = simulated(spec, NUM_SITES)
    assert completed.returncode == 0, completed.stdout[-3000:]
    records = _rounds(workspace)
    assert [r["round"] for r in records] == list(range(ROUNDS))
    assert all(r["aggregated"] == ["site-1", "site-2", "site-3"] and r["secagg"]["setup_s"] > 0 for r in records)
    log = (workspace / "server" / "log.txt").read_text()
    if name == "fedadam":  # every site stepped from the same unmasked mean, both rounds
        assert log.count("FedOpt at the sites, round") == ROUNDS
    else:
        assert all(set(r["privacy"]) == {"site-1", "site-2", "site-3"} for r in records)
    for site in ("site-1", "site-2", "site-3"):  # the egress gate had nothing to strip or refuse
        assert "EgressGate" not in (workspace / site / "log.txt").read_text()


def test_a_site_dropping_after_its_masked_update_is_still_summed(tmp_path, simulate):
    """site-2 sends its masked update, then never answers the unmask stage: the other two holders (the threshold,
    2 of 3) rebuild its self-mask, and the round's model is the plain job's (same data, same seeds)."""
    from jobs.build import export_job
    from tests.e2e import secagg_dropout

    spec = JobSpec(name="e2e_secagg_dropout", secure_aggregation="secagg", **{**SETTINGS, "num_rounds": 1})
    job = export_job(spec, tmp_path / "jobs")
    secagg_dropout.install(job, "site-2")
    completed = simulate(job, tmp_path / "ws", NUM_SITES, NUM_SITES)
    assert completed.returncode == 0, completed.stdout[-3000:]
    (record,) = _rounds(tmp_path / "ws")
    assert record["aggregated"] == ["site-1", "site-2", "site-3"]
    log = (tmp_path / "ws" / "server" / "log.txt").read_text()
    assert "secagg round 0: unmasked the sum of ['site-1', 'site-2', 'site-3'], dropped []" in log
    assert "site-2 dropped out before the unmask stage" in (tmp_path / "ws" / "site-2" / "log.txt").read_text()
    plain_spec = JobSpec(name="e2e_plain_1", secure_aggregation="plain", **{**SETTINGS, "num_rounds": 1})
    plain_job = export_job(plain_spec, tmp_path / "jobs")
    assert simulate(plain_job, tmp_path / "ws_plain", NUM_SITES, NUM_SITES).returncode == 0
    plain, secagg = _model(tmp_path / "ws_plain"), _model(tmp_path / "ws")
    assert max(float(np.max(np.abs(plain[k] - secagg[k]))) for k in plain) < quantisation_step() + 1e-6
