"""The round engine with partial sharing (``local_keys``): the rule, the validation and the key agreement see the
shared entries only; the global model's local entries keep their initial values under every rule; a site that
sends one is rejected by name; every record says the server-side evaluation used the initial values for them.
"""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.registry import build_rule
from controllers.engine import LOCAL_EVAL_FIELD, Host, InProcessTransport, RoundEngine
from controllers.nvflare_aggregator import RuleAggregator

SITES = ("site-1", "site-2", "site-3")
GLOBAL = {
    "body.w": np.array([[1.0, -2.0], [0.5, 4.0]], np.float32),
    "bn.running_mean": np.array([0.0, 0.0], np.float32),
    "bn.num_batches_tracked": np.array(0, np.int64),
    "head.w": np.array([0.25, -1.0], np.float32),
}
LOCAL = ("bn.num_batches_tracked", "bn.running_mean", "head.w")
SHARED_PARAMS = ["body.w"]
SHIFTS = {"site-1": 1.0, "site-2": 2.0, "site-3": 4.0}
SAMPLES = {"site-1": 10, "site-2": 30, "site-3": 60}


class Recorder(Host):
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.evaluated: list[dict] = []

    def evaluate(self, params):
        self.evaluated.append({k: v.copy() for k, v in params.items()})
        return {"test_accuracy": 0.5}

    def record(self, record: dict) -> None:
        self.records.append(record)


def site(name: str, leak: bool = False):
    def train(round_num: int, params: dict, meta: dict):
        sent = {"body.w": params["body.w"] + np.float32(SHIFTS[name])}
        if leak:
            sent["head.w"] = params["head.w"] + 1
        return sent, {meta_keys.NUM_SAMPLES: SAMPLES[name], meta_keys.PARAM_KEYS: SHARED_PARAMS}

    return train


def run(rule_name: str = "fedavg", rounds: int = 2, leak: str | None = None, **rule_args):
    engine = RoundEngine(build_rule(rule_name, **rule_args), num_rounds=rounds, local_keys=LOCAL)
    host = Recorder()
    sites = InProcessTransport({name: site(name, leak=name == leak) for name in SITES})
    params = {k: v.copy() for k, v in GLOBAL.items()}
    final, state = engine.run(SITES, params, engine.init_state(params), sites, host, run_id="r")
    return final, state, host


def test_fedavg_of_the_shared_entries_in_closed_form_and_local_entries_untouched():
    final, _, host = run(rounds=1)
    mean_shift = sum(SHIFTS[s] * SAMPLES[s] for s in SITES) / sum(SAMPLES.values())  # 2.9
    np.testing.assert_allclose(final["body.w"], GLOBAL["body.w"] + mean_shift, atol=1e-6)
    for key in LOCAL:
        np.testing.assert_array_equal(final[key], GLOBAL[key])
    assert list(final) == list(GLOBAL)  # the global model keeps its key order
    assert host.records[-1]["status"] == "aggregated"


@pytest.mark.parametrize(
    ("rule", "args"), [("median", {}), ("fedadam", {"server_lr": 0.1}), ("fedatt", {}), ("krum", {"num_byzantine": 0})]
)
def test_every_rule_leaves_the_local_entries_at_their_initial_values(rule, args):
    final, _, _ = run(rule, rounds=2, **args)
    for key in LOCAL:
        np.testing.assert_array_equal(final[key], GLOBAL[key])
    assert not np.array_equal(final["body.w"], GLOBAL["body.w"])


def nested_keys(value) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {k for v in value.values() for k in nested_keys(v)}
    return set()


def test_rule_state_covers_the_shared_entries_only():
    _, state, _ = run("fedadam", rounds=1, server_lr=0.1)
    assert "body.w" in nested_keys(state) and not nested_keys(state) & set(LOCAL)


def test_a_site_that_sends_a_local_entry_is_rejected_by_name():
    final, _, host = run(rounds=1, leak="site-2")
    rejected = host.records[-1]["rejected"]
    assert list(rejected) == ["site-2"]
    assert rejected["site-2"] == ["sent local entries ['head.w'], which never leave a site (local_keys)"]
    mean_shift = (SHIFTS["site-1"] * 10 + SHIFTS["site-3"] * 60) / 70
    np.testing.assert_allclose(final["body.w"], GLOBAL["body.w"] + mean_shift, atol=1e-6)


def test_server_evaluation_uses_the_initial_local_values_and_every_record_says_so():
    _, _, host = run(rounds=2)
    assert [r[LOCAL_EVAL_FIELD] for r in host.records] == ["initial"] * 3
    for evaluated in host.evaluated:
        for key in LOCAL:
            np.testing.assert_array_equal(evaluated[key], GLOBAL[key])


def test_records_without_local_keys_are_unchanged():
    engine = RoundEngine(build_rule("fedavg"), num_rounds=1)
    host = Recorder()
    engine.run(SITES, {"body.w": GLOBAL["body.w"].copy()}, {}, InProcessTransport({}), host, run_id="r")
    assert all(LOCAL_EVAL_FIELD not in r for r in host.records)


def test_nvflare_fedavg_aggregator_refuses_local_keys():
    with pytest.raises(ValueError, match="local_keys"):
        RuleAggregator("fedavg", local_keys=["head.w"])
