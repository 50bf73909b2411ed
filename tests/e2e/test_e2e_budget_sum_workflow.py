"""Privacy budgets end cleanly under NVFlare's sum workflow (``--secure-aggregation plain``; ``he`` runs the same
server components): two DP-SGD sites with sigma 1 and a budget of epsilon 7.5 on 4 planned rounds. After round 2
site-1's next round would reach about 8.1 (its ledger: 5.20, 6.84 after rounds 1 and 2), site-2's only about 7.4
(4.87, 6.25). The server must end the job after round 2 as finished, with a record naming site-1 and why, and send
no third round: site-2 must not train a round whose result could never be used (before, the third round was sent,
site-1 refused it, the job died in a fatal abort, and site-2 had trained and spent it)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("opacus")

from aggregators.contracts.run_records import stop_note, stopped_early
from jobs.build import JobSpec, export_job
from lightning_modules.privacy.ledger import LEDGER_NAME, ledger_from_state
from lightning_modules.state_store import ClientStateStore

SECAGG_SITES = ("site-1", "site-2", "site-3")


def ledger_steps(workspace: Path, site: str) -> int:
    store = ClientStateStore(workspace / site / "client_state", site, per_run=True)
    store.use_run("simulate_job")
    return ledger_from_state(store.load(LEDGER_NAME).state).steps


def run_to_a_spent_budget(tmp_path, simulate, round_metrics, mechanism: str, sites: int, samples: int):
    """A DP-SGD job under the sum workflow ``mechanism`` (sigma 1, epsilon 7.5, 4 planned rounds) in the simulator,
    checked for what both workflows must do: rounds 0 and 1 aggregated, then a finished stop by the privacy budget
    that names epsilon 7.5 for every spent site, and no fatal abort. Returns the workspace, the output, the round
    records and the stop note."""
    spec = JobSpec(
        name=f"budget_{mechanism}",
        dataset="digits",
        arch="mlp",
        num_sites=sites,
        num_rounds=4,
        max_train_samples=samples,
        secure_aggregation=mechanism,
        dp_noise_multiplier=1.0,
        dp_target_epsilon=7.5,
        dp_max_grad_norm=1.0,
    )
    job = export_job(spec, tmp_path / "jobs")
    workspace = tmp_path / "ws"
    completed = simulate(job, workspace, num_clients=sites, threads=sites)
    output = completed.stdout + completed.stderr
    records = round_metrics(workspace)
    rounds = [r for r in records if r.get("stage") == "round"]
    assert [r["round"] for r in rounds] == [0, 1], output[-3000:]
    assert all(r["status"] == "aggregated" for r in rounds)
    note = stop_note(records)
    assert note is not None and note["rule"] == "privacy_budget", output[-3000:]
    assert all("dp_target_epsilon 7.5" in why for why in note["out_of_budget"].values())
    assert not stopped_early(records)
    assert "Exception in ScatterAndGather control_flow" not in output and "PrivacyBudgetExhausted" not in output
    return workspace, output, rounds, note


def test_a_spent_budget_ends_the_sum_workflow_as_finished_before_an_unused_round(tmp_path, simulate, round_metrics):
    workspace, _, _, note = run_to_a_spent_budget(tmp_path, simulate, round_metrics, "plain", sites=2, samples=400)
    assert set(note["out_of_budget"]) == {"site-1"}
    # site-2 could have afforded a third round, but none was sent: its ledger holds two rounds of steps
    steps = {site: ledger_steps(workspace, site) for site in ("site-1", "site-2")}
    assert steps == {"site-1": 6, "site-2": 8}


def test_a_spent_budget_ends_the_secagg_workflow_as_finished_before_an_unused_round(tmp_path, simulate, round_metrics):
    """The same under ``--secure-aggregation secagg`` (SecAgg+ needs 3 sites, so three): after round 2 some site's
    next round would exceed epsilon 7.5. Before SecAggScatterAndGather was a BudgetScatterAndGather, the third round
    was sent and the spent site refused it in training: no stop record, a site's failure instead."""
    pytest.importorskip("flwr")
    workspace, _, rounds, note = run_to_a_spent_budget(
        tmp_path, simulate, round_metrics, "secagg", sites=3, samples=600
    )
    assert all(r["aggregated"] == list(SECAGG_SITES) for r in rounds)
    spent = set(note["out_of_budget"])
    assert spent and spent < set(SECAGG_SITES)  # some site could have afforded a third round
    log = (workspace / "server" / "log.txt").read_text()
    assert "secagg round 2" not in log  # no key stage for a round nobody could use
    # every site's ledger holds exactly the steps of its last aggregated result (round 2's), none of a third round
    steps = {site: ledger_steps(workspace, site) for site in SECAGG_SITES}
    assert steps == {site: rounds[-1]["privacy"][site]["steps"] for site in SECAGG_SITES}
    assert all(steps[site] > rounds[0]["privacy"][site]["steps"] > 0 for site in SECAGG_SITES)
