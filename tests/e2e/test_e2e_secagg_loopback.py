"""``--secure-aggregation secagg`` on the provisioned loopback deployment (no HEBuilder: SecAgg+ needs no provisioned
key), at 3 and at 5 sites: the same 2-round FedAvg job (digits, the MLP) with ``plain`` and ``secagg`` on one started
deployment each.

Checked: both jobs complete with every site aggregated every round; the SecAgg+ round records carry its key set-up
and unmask stages; the final model equals the plain job's within the quantisation error carried through training
(the plain job is the reference); a curious server's recorder (tests/e2e/egress_recorder.py, first among its result
filters) finds nothing beyond what the egress gates declare, on the training task and on every stage's answer, and
no training result it received holds the sites' weights (the data kind is the masked update's).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregators.contracts.egress import TRANSPORT_HEADERS
from aggregators.secagg import KEYS_TASK, MASKED_KIND, SHARES_TASK, UNMASK_TASK
from jobs.build import JobSpec, export_job
from jobs.provision import loopback
from tests.e2e import egress_recorder

pytestmark = pytest.mark.slow
pytest.importorskip("flwr")

ROUNDS = 2
#: As in tests/e2e/test_e2e_secagg.py: one quantisation step (2^-20) per round, carried through one more round.
TOLERANCE = 1e-4
TASKS = {"plain": ["train"], "secagg": ["train", KEYS_TASK, SHARES_TASK, UNMASK_TASK]}


@pytest.fixture(scope="module", params=[3, 5], ids=["3-sites", "5-sites"])
def runs(request, tmp_path_factory):
    """``(deployment, {mode: (job folder, final meta, downloaded result, recorded results)})`` for one site count."""
    num_sites = request.param
    root = tmp_path_factory.mktemp(f"secagg_loopback_{num_sites}")
    settings = {"dataset": "digits", "arch": "mlp", "num_sites": num_sites, "num_rounds": ROUNDS}
    jobs = {
        m: export_job(JobSpec(name=f"e2e_{m}_{num_sites}", secure_aggregation=m, **settings), root / "jobs")
        for m in TASKS
    }
    for mode, job in jobs.items():
        egress_recorder.install(job, TASKS[mode], root / f"record_{mode}.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))
        (root / "home").mkdir()
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", num_sites, env, he=False)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        loopback.keep_server_storage_inside(deployment.server)
        data = {"dataset": "digits", "scheme": "dirichlet", "num_sites": num_sites}
        for site, site_dir in deployment.sites.items():
            loopback.configure_site_data(site_dir, site, data)
        started, results = time.monotonic(), {}
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                for mode, job in jobs.items():
                    job_id, meta = loopback.run_job(session, deployment, job, timeout=420.0)
                    result = loopback.download_result(session, job_id)
                    results[mode] = (job, meta, result, egress_recorder.read(root / f"record_{mode}.jsonl"))
            yield deployment, results
        finally:
            loopback.stop(deployment)
            left = loopback.leftover_processes(deployment)
            print(f"secagg loopback, {num_sites} sites: {time.monotonic() - started:.1f} s from start to shutdown")
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def _rounds(result: Path) -> list[dict]:
    lines = (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == "round"]


def _model(result: Path) -> dict[str, np.ndarray]:
    saved = torch.load(result / "app_server" / "FL_global_model.pt", map_location="cpu", weights_only=False)
    return {k: np.asarray(v, dtype=np.float64) for k, v in saved.get("model", saved).items()}


def test_both_jobs_complete_with_every_site_every_round(runs):
    deployment, results = runs
    for mode, (_, meta, result, _) in results.items():
        assert loopback.job_problems(meta, result) == [], mode
        rounds = _rounds(result)
        assert [r["round"] for r in rounds] == list(range(ROUNDS)), mode
        assert all(r["aggregated"] == sorted(deployment.sites) and not r["rejected"] for r in rounds), mode
    for record in _rounds(results["secagg"][2]):
        cost = record["secagg"]
        assert cost["setup_s"] > 0 and cost["unmask_s"] > 0 and cost["up_bytes"] > 0 and cost["down_bytes"] > 0


def test_the_final_model_is_plain_fedavgs_within_the_quantisation_error(runs):
    _, results = runs
    plain, secagg = _model(results["plain"][2]), _model(results["secagg"][2])
    assert set(plain) == set(secagg)
    assert max(float(np.max(np.abs(plain[k] - secagg[k]))) for k in plain) < TOLERANCE


def test_the_curious_server_gets_masked_updates_and_nothing_undeclared(runs):
    deployment, results = runs
    for mode, (job, _, _, records) in results.items():
        assert egress_recorder.beyond_declared(records, job, TRANSPORT_HEADERS) == [], mode
    recorded = results["secagg"][3]
    train = [r for r in recorded if r.get("task") == "train"]
    assert len(train) == ROUNDS * len(deployment.sites)
    assert {r["data_kind"] for r in train} == {MASKED_KIND}
    for task in (KEYS_TASK, SHARES_TASK, UNMASK_TASK):
        assert len([r for r in recorded if r.get("task") == task]) == ROUNDS * len(deployment.sites), task
