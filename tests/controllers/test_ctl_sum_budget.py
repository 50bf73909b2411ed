"""The sum workflow's end of budget (controllers/secure_aggregation.py): the round recorder names a DP site whose
result says its next round would exceed its budget, and only a budget-aware workflow's recorder ends the job there,
never after the last planned round; the builder gives a DP-SGD sum job that workflow and no other job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aggregators.contracts import meta_keys
from controllers.budget import spent_budget
from controllers.secure_aggregation import RoundRecorder
from jobs.build import JobSpec, export_job


def budget(spent: float, target: float, after: float) -> dict[str, float]:
    keys = (meta_keys.PRIVACY_EPSILON, meta_keys.PRIVACY_TARGET_EPSILON, meta_keys.PRIVACY_NEXT_EPSILON)
    return dict(zip(keys, (spent, target, after), strict=True))


SPENT, AFFORDABLE = budget(6.8, 7.5, 8.1), budget(6.2, 7.5, 7.3)


def recorder(end_on_spent_budget: bool) -> RoundRecorder:
    rounds = RoundRecorder(num_rounds=4, secure_aggregation="plain", end_on_spent_budget=end_on_spent_budget)
    for site, meta in (("site-1", SPENT), ("site-2", AFFORDABLE)):
        why = spent_budget(meta)
        if why:
            rounds.out_of_budget.setdefault(site, why)
    return rounds


def test_a_spent_site_ends_a_budget_aware_job_after_the_round_but_never_past_its_last() -> None:
    rounds = recorder(True)
    assert set(rounds.out_of_budget) == {"site-1"}
    assert rounds.ends_after(1) and rounds.ends_after(2) and not rounds.ends_after(3)
    note = rounds.budget_note(1, 2)
    assert note["rule"] == "privacy_budget" and note["round"] == 1
    assert note["message"].startswith("ending the job before round 3: 1 site(s) have spent their privacy budget")
    assert "site-1: epsilon 6.8 of dp_target_epsilon 7.5 spent (its next round would reach 8.1)" in note["message"]


def test_without_the_budget_aware_workflow_the_recorder_ends_nothing() -> None:
    assert not recorder(False).ends_after(1)
    assert not RoundRecorder(4, "plain", end_on_spent_budget=True).ends_after(1)  # nobody spent


@pytest.mark.parametrize(("dp", "workflow"), [(True, "BudgetScatterAndGather"), (False, "ScatterAndGather")])
def test_only_a_dp_sum_job_gets_the_budget_aware_workflow(tmp_path: Path, dp: bool, workflow: str) -> None:
    private = {"dp_noise_multiplier": 1.0, "dp_target_epsilon": 7.5, "dp_max_grad_norm": 1.0} if dp else {}
    spec = JobSpec(name="sum", dataset="digits", arch="mlp", num_sites=2, secure_aggregation="plain", **private)
    config = json.loads((export_job(spec, tmp_path) / "app" / "config" / "config_fed_server.json").read_text())
    (controller,) = config["workflows"]
    assert controller["path"].rsplit(".", 1)[1] == workflow
    assert controller["args"]["min_clients"] == 2
    (rounds,) = [c for c in config["components"] if c["id"] == "rounds"]
    assert rounds["args"].get("end_on_spent_budget", False) is dp


def test_a_dp_secagg_job_ends_on_a_spent_budget_like_the_sum_workflow(tmp_path: Path) -> None:
    """SecAgg+'s workflow is a BudgetScatterAndGather, and a DP secagg job's recorder ends the job on a spent budget
    (tests/e2e/test_e2e_budget_sum_workflow.py runs it)."""
    pytest.importorskip("flwr")
    from controllers.secagg import SecAggScatterAndGather
    from controllers.secure_aggregation import BudgetScatterAndGather

    private = {"dp_noise_multiplier": 1.0, "dp_target_epsilon": 7.5, "dp_max_grad_norm": 1.0}
    spec = JobSpec(name="sum", dataset="digits", arch="mlp", num_sites=3, secure_aggregation="secagg", **private)
    config = json.loads((export_job(spec, tmp_path) / "app" / "config" / "config_fed_server.json").read_text())
    (controller,) = config["workflows"]
    assert controller["path"] == "controllers.secagg.SecAggScatterAndGather"
    assert issubclass(SecAggScatterAndGather, BudgetScatterAndGather)
    (rounds,) = [c for c in config["components"] if c["id"] == "rounds"]
    assert rounds["args"]["end_on_spent_budget"] is True
