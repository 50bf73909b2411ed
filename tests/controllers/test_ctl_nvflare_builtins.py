"""NVFlare 2.9's built-in Lightning SCAFFOLD/FedProx handlers must never switch on for this bundle's jobs.

They activate when the received meta holds ``scaffold_c_global`` or ``fedprox_mu``; a correction would then be
applied twice (ours and theirs). Our keys are namespaced, and a result that shows a built-in handler ran is refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_opt.lightning.algorithm import _AlgorithmHandlerManager

from aggregators.contracts import meta_keys
from aggregators.registry import RULES, build_rule
from controllers.adapters import Rejection, to_client_update

PARAMS = {"net.w": np.zeros(2, np.float32)}


# Rules that cannot be built without settings get the least they need.
REQUIRED_ARGS = {"attack_adaptive": {"allow_random_attention": True}}


def _broadcast_meta(rule_name: str) -> dict:
    rule = build_rule(rule_name, **REQUIRED_ARGS.get(rule_name, {}))
    state = rule.init_state(PARAMS)
    if rule_name == "scaffold":
        state = {"control": {"net.w": np.ones(2, np.float32)}}
    return {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r", **rule.broadcast_meta(state)}


@pytest.mark.parametrize("rule_name", sorted(RULES))
def test_no_builtin_handler_activates_on_our_broadcast(rule_name):
    manager = _AlgorithmHandlerManager()
    manager.start_round(
        trainer=None, pl_module=None, input_model=FLModel(params=PARAMS, meta=_broadcast_meta(rule_name))
    )
    assert manager._handlers == {}
    assert not set(_broadcast_meta(rule_name)) & set(meta_keys.NVFLARE_RESERVED)


def test_the_check_above_can_fail_a_reserved_key_does_activate_a_handler():
    manager = _AlgorithmHandlerManager()
    with pytest.raises(RuntimeError):  # the handler starts, then refuses the fake trainer
        manager.start_round(trainer=None, pl_module=None, input_model=FLModel(params=PARAMS, meta={"fedprox_mu": 0.1}))
    assert manager._handlers != {}


@pytest.mark.parametrize("reserved", meta_keys.NVFLARE_RESERVED)
def test_a_result_from_a_client_whose_builtin_handler_ran_is_rejected(reserved):
    result = FLModel(
        params={"net.w": np.ones(2, np.float32)},
        meta={"client_name": "site-2", meta_keys.NUM_SAMPLES: 10, reserved: 1},
    )
    outcome = to_client_update(result, PARAMS)
    assert isinstance(outcome, Rejection) and outcome.site == "site-2"
    assert any(reserved in problem for problem in outcome.problems)
