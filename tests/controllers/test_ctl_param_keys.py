"""The round's trainable set (``train.param_keys``): the engine decides it from the set most sites report and
rejects by name every site that differs or reports none while others do (docs/reliability.md); SCAFFOLD's
round-1 control diffs are then checked against that set, so a bad site is named instead of failing the round."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.deltas import agreed_param_keys, trainable_keys
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate
from controllers.engine import Host, InProcessTransport, RoundEngine

SITES = ("site-1", "site-2", "site-3")
GLOBAL = {
    "w": np.array([[1.0, -2.0], [0.5, 4.0]], np.float32),
    "b": np.array([0.25, -1.0], np.float32),
    "steps": np.array(7, np.int64),  # an integer buffer: never trainable
}
TRAINABLE = ["w", "b"]
ABSENT = object()  # the site does not send train.param_keys at all


class Records(Host):
    def __init__(self) -> None:
        self.records: list[dict] = []

    def record(self, record: dict) -> None:
        self.records.append(record)


def site(shift: float, keys=TRAINABLE, diff_keys=None):
    """A site moving every float entry by ``shift``, reporting ``keys`` and (for SCAFFOLD) a diff over
    ``diff_keys`` (default: ``keys``, or the trainable set when it reports none)."""

    def train(round_num: int, params: dict, meta: dict) -> tuple[dict, dict]:
        out = {k: v + np.float32(shift) if v.dtype.kind == "f" else v for k, v in params.items()}
        sent = {meta_keys.NUM_SAMPLES: 10}
        if keys is not ABSENT:
            sent[meta_keys.PARAM_KEYS] = list(keys)
        covered = diff_keys or (TRAINABLE if keys is ABSENT else keys)
        sent[meta_keys.SCAFFOLD_CTRL_DIFF] = {k: np.full(np.shape(GLOBAL[k]), shift, np.float32) for k in covered}
        return out, sent

    return train


def one_round(rule_name: str, sites: dict) -> tuple[dict, object]:
    rule = build_rule(rule_name)
    engine = RoundEngine(rule, num_rounds=2)
    host = Records()
    outcome = engine.run_round(
        0, tuple(sites), GLOBAL, rule.init_state(GLOBAL), InProcessTransport(sites), host, run_id="r"
    )
    return host.records[0], outcome


@pytest.mark.parametrize("rule_name", ["fedavg", "fedadam", "median", "scaffold"])
def test_a_site_reporting_another_trainable_set_is_rejected_by_name_and_the_others_aggregate(rule_name):
    record, _ = one_round(rule_name, {"site-1": site(1.0), "site-2": site(2.0), "site-3": site(4.0, keys=["w"])})
    assert record["status"] == "aggregated", record.get("failure")
    assert record["aggregated"] == ["site-1", "site-2"]
    assert record["rejected"] == {
        "site-3": ["'train.param_keys' differs from the set 2 of 3 sites report (missing ['b'], unexpected [])"]
    }


def test_a_site_without_param_keys_is_rejected_when_the_others_report_them():
    record, _ = one_round("fedadam", {"site-1": site(1.0), "site-2": site(2.0), "site-3": site(4.0, keys=ABSENT)})
    assert record["status"] == "aggregated" and record["aggregated"] == ["site-1", "site-2"]
    assert record["rejected"] == {
        "site-3": ["'train.param_keys' is missing while 2 site(s) report the trainable parameters"]
    }


def test_a_tie_trusts_no_set_and_names_every_site():
    record, outcome = one_round("fedavg", {"site-1": site(1.0), "site-2": site(2.0, keys=["w"])})
    assert record["status"] == "failed" and not outcome.aggregated
    assert set(record["rejected"]) == {"site-1", "site-2"}
    assert all("none reported by more sites than another" in p[0] for p in record["rejected"].values())


def test_unknown_or_integer_keys_are_still_rejected_on_their_own_and_do_not_vote():
    sites = {
        "site-1": site(1.0),
        "site-2": site(2.0, keys=["w", "nope"], diff_keys=TRAINABLE),
        "site-3": site(4.0, keys=["w", "steps"], diff_keys=TRAINABLE),
    }
    record, _ = one_round("fedadam", sites)
    assert record["status"] == "aggregated" and record["aggregated"] == ["site-1"]
    assert record["rejected"]["site-2"] == ["'train.param_keys' names entries that are not in the model: ['nope']"]
    assert "names integer buffers ['steps']" in record["rejected"]["site-3"][0]


def test_no_site_reporting_leaves_the_models_own_trainable_entries():
    sites = {s: site(1.0, keys=ABSENT) for s in SITES}
    record, _ = one_round("fedadam", sites)
    assert record["status"] == "aggregated" and record["rejected"] == {}


def test_scaffold_round_one_rejects_by_name_a_diff_over_another_set_than_the_rounds():
    # site-3 claims the round's set but its control diff covers only 'w': named by the control check.
    sites = {"site-1": site(1.0), "site-2": site(2.0), "site-3": site(4.0, diff_keys=["w"])}
    record, outcome = one_round("scaffold", sites)
    assert record["status"] == "aggregated" and record["aggregated"] == ["site-1", "site-2"]
    [problem] = record["rejected"]["site-3"]
    assert problem.startswith("'scaffold.ctrl.diff': does not match this model's trainable parameters (missing ['b']")
    assert set(outcome.state["control"]) == {"w", "b"}


def test_scaffold_round_one_names_a_site_whose_claimed_set_and_diff_both_differ():
    # Consistent with itself (claims ['w'], diff over ['w']) but not with the round: it used to fail the round with
    # "the sites' control diffs cover different parameters", naming nobody.
    sites = {"site-1": site(1.0), "site-2": site(2.0), "site-3": site(4.0, keys=["w"])}
    record, outcome = one_round("scaffold", sites)
    assert record["status"] == "aggregated" and set(record["rejected"]) == {"site-3"}
    np.testing.assert_allclose(outcome.state["control"]["b"], np.full(2, (1.0 + 2.0) / 3), rtol=1e-6)


# -- the agreement itself (aggregators/deltas.py) -----------------------------------------------------------------


def test_agreement_takes_the_most_reported_set_and_says_why_each_other_is_refused():
    chosen, problems = agreed_param_keys({"a": ["w", "b"], "b": ["b", "w"], "c": ["w"], "d": None})
    assert chosen == frozenset({"w", "b"})
    assert set(problems) == {"c", "d"}
    assert agreed_param_keys({"a": None, "b": None}) == (None, {})


def test_trainable_keys_names_the_disagreeing_sites_when_called_without_the_engine():
    updates = [
        ClientUpdate("site-1", GLOBAL, 1, {meta_keys.PARAM_KEYS: TRAINABLE}),
        ClientUpdate("site-2", GLOBAL, 1, {meta_keys.PARAM_KEYS: TRAINABLE}),
        ClientUpdate("site-3", GLOBAL, 1, {meta_keys.PARAM_KEYS: ["w"]}),
    ]
    with pytest.raises(AggregationError, match=r"disagree on their trainable parameters: site-3: "):
        trainable_keys(GLOBAL, updates)
    assert trainable_keys(GLOBAL, updates[:2]) == TRAINABLE
