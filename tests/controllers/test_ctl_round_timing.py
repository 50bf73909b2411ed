"""Round latency on the server side: the controller's ``task_check_period`` reaches NVFlare's task monitor, and every
round's metrics record says where its wall time went (``train_wait_s``, ``evaluate_s``, ``persist_s``).

NVFlare's transport and storage are replaced as in ``test_ctl_disconnect.py``; the round itself runs for real.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from nvflare.apis.impl.wf_comm_server import WFCommServer
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from aggregators.contracts import meta_keys
from controllers.fedalg_controller import ROUND_TIMING_KEYS, TASK_CHECK_PERIOD, FedAlgController, _ControllerHost

SITES = ("site-1", "site-2")
GLOBAL = {"w": np.array([1.0, -2.0], np.float32)}


def test_task_check_period_reaches_nvflare_task_monitor():
    # NVFlare 2.9 writes the period to an attribute WFCommServer never reads; its monitor polls every 0.2 s.
    assert WFCommServer()._task_check_period == 0.2
    for period in (TASK_CHECK_PERIOD, 0.3):
        communicator = WFCommServer()
        FedAlgController(task_check_period=period).set_communicator(communicator)
        assert communicator._task_check_period == period


class _Evaluator:
    def evaluate(self, params):
        return {"test_accuracy": 0.5}


@pytest.fixture
def controller(tmp_path, monkeypatch):
    ctl = FedAlgController(settings={"num_rounds": 1, "server": "fedavg"})
    ctl._run_id = "test-run"
    ctl._reachable = ctl._population = SITES  # what run() sets from the job's sites
    monkeypatch.setattr(ctl, "get_run_dir", lambda: str(tmp_path))
    monkeypatch.setattr(ctl, "get_app_dir", lambda: str(tmp_path))
    monkeypatch.setattr(ctl, "save_model", lambda model: None)
    monkeypatch.setattr(ctl, "info", lambda msg: None)

    def send_model_and_wait(targets, data, min_responses, timeout):
        meta = {meta_keys.NUM_SAMPLES: 10, meta_keys.FIT_SECONDS: 0.01}
        return [
            FLModel(params_type=ParamsType.FULL, params=dict(data.params), meta={"client_name": site, **meta})
            for site in targets
        ]

    monkeypatch.setattr(ctl, "send_model_and_wait", send_model_and_wait)
    return ctl


def test_round_record_has_the_server_timings(controller, tmp_path):
    controller._run_round(0, SITES, GLOBAL, controller._rule.init_state(GLOBAL), evaluator=_Evaluator())

    [record] = [json.loads(line) for line in (tmp_path / "metrics" / "round_metrics.jsonl").read_text().splitlines()]
    for key in ROUND_TIMING_KEYS:
        assert 0 <= record[key] <= record["elapsed_s"], key
    assert record["test_accuracy"] == 0.5
    assert controller._timings == {}  # nothing carries over into the next round's record


def test_initial_record_has_no_round_timings(controller, tmp_path):
    controller._round_engine().initial_record(GLOBAL, _ControllerHost(controller, _Evaluator()), "initial", "test-run")

    [record] = [json.loads(line) for line in (tmp_path / "metrics" / "round_metrics.jsonl").read_text().splitlines()]
    assert record["stage"] == "initial" and not set(ROUND_TIMING_KEYS) & set(record)
