"""A site that drops out mid-round: the controller finishes the round with the others and SCAFFOLD's global control
keeps the population scaling c <- c + (1/N) * sum_{i in S} delta_c_i with N = every site of the job, not |S|.

The controller's round runs for real; only NVFlare's transport (``send_model_and_wait``) and storage are replaced:
the fake returns the results of the sites that stayed, as NVFlare does once ``min_responses`` arrived or the
``train_timeout`` passed.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from aggregators.contracts import meta_keys
from controllers.fedalg_controller import FedAlgController

SITES = ("site-1", "site-2", "site-3")
GLOBAL = {"w": np.array([[1.0, -2.0], [0.5, 4.0]], np.float32), "b": np.array([0.25, -1.0], np.float32)}


def _result(site: str, received: dict, shift: float, ctrl_shift: float) -> FLModel:
    params = {k: v + shift for k, v in received.items()}
    diff = {k: np.full(v.shape, ctrl_shift, np.float32) for k, v in GLOBAL.items()}
    meta = {"client_name": site, meta_keys.NUM_SAMPLES: 10, meta_keys.SCAFFOLD_CTRL_DIFF: diff}
    return FLModel(params_type=ParamsType.FULL, params=params, meta=meta)


@pytest.fixture
def controller(tmp_path, monkeypatch):
    settings = {"num_rounds": 2, "server": "scaffold", "min_responses": 2, "train_timeout": 30}
    ctl = FedAlgController(settings=settings, evaluator_id="")
    ctl._run_id = "test-run"
    ctl._reachable = ctl._population = SITES  # what run() sets from the job's sites
    calls: dict = {"sent": [], "saved": [], "errors": []}
    monkeypatch.setattr(ctl, "get_run_dir", lambda: str(tmp_path))
    monkeypatch.setattr(ctl, "get_app_dir", lambda: str(tmp_path))
    monkeypatch.setattr(ctl, "save_model", lambda model: calls["saved"].append(model))
    monkeypatch.setattr(ctl, "info", lambda msg: None)
    monkeypatch.setattr(ctl, "error", lambda msg: calls["errors"].append(msg))
    return ctl, calls


def _drop_site_2(ctl, calls, monkeypatch, rounds):
    """Fake transport: site-2 never answers; the others send ``rounds[r]`` (shift, control shift) per site."""

    def send_model_and_wait(targets, data, min_responses, timeout):
        calls["sent"].append({"targets": list(targets), "min_responses": min_responses, "timeout": timeout})
        shifts = rounds[data.current_round]
        return [_result(site, data.params, *shifts[site]) for site in targets if site != "site-2"]

    monkeypatch.setattr(ctl, "send_model_and_wait", send_model_and_wait)


def test_round_finishes_with_the_remaining_sites_and_control_keeps_population_scaling(controller, monkeypatch):
    ctl, calls = controller
    rounds = {0: {"site-1": (0.5, 0.3), "site-3": (-0.1, 0.9)}, 1: {"site-1": (0.2, -0.6), "site-3": (0.4, 0.0)}}
    _drop_site_2(ctl, calls, monkeypatch, rounds)
    rule = ctl._rule
    state = rule.init_state(GLOBAL)

    params, state = ctl._run_round(0, SITES, GLOBAL, state, evaluator=None)
    params2, state2 = ctl._run_round(1, SITES, params, state, evaluator=None)

    # The job's settings reach NVFlare's wait, for every round, and all three sites were asked.
    assert calls["sent"] == [{"targets": list(SITES), "min_responses": 2, "timeout": 30}] * 2
    assert not calls["errors"] and len(calls["saved"]) == 2
    # Model: uniform mean of the two results (server lr 1).
    for key, value in GLOBAL.items():
        np.testing.assert_allclose(params[key], value + (0.5 - 0.1) / 2, atol=1e-6)
        np.testing.assert_allclose(params2[key], params[key] + (0.2 + 0.4) / 2, atol=1e-6)
    # Control: divided by N = 3 (all sites), not by the 2 that answered: 1.2/3 = 0.4, then 0.4 - 0.6/3 = 0.2.
    for key in GLOBAL:
        np.testing.assert_allclose(state["control"][key], 0.4, atol=1e-6)
        np.testing.assert_allclose(state2["control"][key], 0.2, atol=1e-6)
        assert state2["control"][key].dtype == np.float32


def test_metrics_record_who_was_asked_and_who_was_aggregated(controller, monkeypatch, tmp_path):
    ctl, calls = controller
    _drop_site_2(ctl, calls, monkeypatch, {0: {"site-1": (0.5, 0.3), "site-3": (-0.1, 0.9)}})

    ctl._run_round(0, SITES, GLOBAL, ctl._rule.init_state(GLOBAL), evaluator=None)

    record = json.loads((tmp_path / "metrics" / "round_metrics.jsonl").read_text().splitlines()[-1])
    assert record["sites"] == list(SITES)
    assert record["aggregated"] == ["site-1", "site-3"]
    assert set(record["site_num_samples"]) == {"site-1", "site-3"}


def test_too_few_results_leave_the_global_model_and_control_unchanged(controller, monkeypatch, tmp_path):
    ctl, calls = controller
    # Every site needed (waiting for all three, as 3 accepted results need): with site-2 gone the round must not
    # aggregate.
    ctl.round_settings = dataclasses.replace(ctl.round_settings, min_responses=None, min_accepted=3)
    _drop_site_2(ctl, calls, monkeypatch, {0: {"site-1": (0.5, 0.3), "site-3": (-0.1, 0.9)}})
    state = ctl._rule.init_state(GLOBAL)

    params, new_state = ctl._run_round(0, SITES, GLOBAL, state, evaluator=None)

    assert params is GLOBAL and new_state is state
    # The round is still persisted (resume continues after it), with the unchanged model.
    [saved] = calls["saved"]
    assert all(np.array_equal(saved.params[k], GLOBAL[k]) for k in GLOBAL)
    assert any("only 2 valid result(s), 3 needed" in message for message in calls["errors"])
    record = json.loads((tmp_path / "metrics" / "round_metrics.jsonl").read_text().splitlines()[-1])
    assert record["status"] == "failed" and record["aggregated"] == [] and record["rule"] == "scaffold"
    assert "only 2 valid result(s), 3 needed" in record["failure"]
