"""The framework-free round engine: selection, validation, aggregation, failure handling and records.

Sites are plain functions behind `InProcessTransport`; rules are the bundle's own, or tiny fakes that
misbehave on purpose (raise, return NaN, return the wrong keys). No NVFlare, no Lightning.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.contracts.sampling import sample_sites
from aggregators.registry import build_rule
from aggregators.types import AggregationResult, AggregationRule
from controllers.engine import (
    Host,
    InProcessTransport,
    RoundEngine,
    SiteResult,
    non_finite_state_keys,
    validate_result,
)

SITES = ("site-1", "site-2", "site-3")
GLOBAL = {"w": np.array([[1.0, -2.0], [0.5, 4.0]], np.float32), "b": np.array([0.25, -1.0], np.float32)}
SHIFTS = {"site-1": 1.0, "site-2": 2.0, "site-3": 4.0}
SAMPLES = {"site-1": 10, "site-2": 30, "site-3": 60}


def honest_site(site: str):
    def train(round_num: int, params: dict, meta: dict) -> tuple[dict, dict]:
        out = {k: v + np.float32(SHIFTS[site]) for k, v in params.items()}
        return out, {meta_keys.NUM_SAMPLES: SAMPLES[site], meta_keys.PARAM_KEYS: ["w", "b"]}

    return train


class MemoryHost(Host):
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.persisted: list[tuple[int, dict, Any, bool]] = []
        self.messages: list[tuple[int, str]] = []

    def persist(self, round_num, params, state, digest, updates, aggregated) -> None:
        self.persisted.append((round_num, {k: v.copy() for k, v in params.items()}, state, aggregated))

    def record(self, record: dict) -> None:
        self.records.append(record)

    def log(self, level: int, message: str) -> None:
        self.messages.append((level, message))

    def errors(self) -> list[str]:
        return [m for level, m in self.messages if level >= logging.ERROR]


def transport(**overrides) -> InProcessTransport:
    return InProcessTransport({site: overrides.get(site, honest_site(site)) for site in SITES})


def run_one_round(rule, sites=None, **engine_args):
    engine = RoundEngine(rule, num_rounds=3, **engine_args)
    host = MemoryHost()
    state = rule.init_state(GLOBAL)
    outcome = engine.run_round(0, SITES, GLOBAL, state, sites or transport(), host, run_id="run")
    return outcome, host, state


class FakeRule(AggregationRule):
    """A rule whose aggregate is given by ``fn``; hooks replaced per test."""

    def __init__(self, fn, name: str = "fake") -> None:
        self.fn = fn
        self.name = name

    def init_state(self, global_params):
        return {"n": 0}

    def aggregate(self, global_params, updates, state, context):
        return self.fn(global_params, updates, state)


def test_fedavg_round_is_the_sample_weighted_mean_and_is_recorded():
    outcome, host, _ = run_one_round(build_rule("fedavg"))
    expected_shift = sum(SAMPLES[s] * SHIFTS[s] for s in SITES) / sum(SAMPLES.values())  # (10 + 60 + 240) / 100
    for key, value in GLOBAL.items():
        np.testing.assert_allclose(outcome.params[key], value + expected_shift, atol=1e-6)
    [record] = host.records
    assert record["status"] == "aggregated" and record["rule"] == "fedavg"
    assert record["sites"] == list(SITES) and record["aggregated"] == list(SITES) and record["rejected"] == {}
    assert record["site_num_samples"] == SAMPLES
    [(round_num, persisted, _, aggregated)] = host.persisted
    assert round_num == 0 and aggregated
    np.testing.assert_array_equal(persisted["w"], outcome.params["w"])


def test_broadcast_meta_carries_the_round_bookkeeping_and_the_rules_meta():
    seen: list[dict] = []

    def spy(round_num, params, meta):
        seen.append(meta)
        return honest_site("site-1")(round_num, params, meta)

    engine = RoundEngine(build_rule("scaffold"), num_rounds=4, rule_label="scaffold-label")
    state = engine.rule.init_state(GLOBAL)
    engine.run_round(2, ("site-1",), GLOBAL, state, InProcessTransport({"site-1": spy}), MemoryHost(), run_id="r7")
    [meta] = seen
    assert meta[meta_keys.ROUND] == 2 and meta[meta_keys.NUM_ROUNDS] == 4
    assert meta[meta_keys.AGGREGATION_RULE] == "scaffold-label" and meta[meta_keys.RUN_ID] == "r7"
    assert meta_keys.SCAFFOLD_CTRL_GLOBAL in meta


def test_sampling_is_the_seeded_choice_of_the_controller():
    engine = RoundEngine(build_rule("fedavg"), num_rounds=5, clients_per_round=2, seed=7)
    host = MemoryHost()
    engine.run(SITES, GLOBAL, {}, transport(), host, run_id="r")
    assert [r["sites"] for r in host.records[1:]] == [sample_sites(SITES, 2, 7, r) for r in range(5)]


@pytest.mark.parametrize("value", [0, -1, True, 1.5, None])
def test_min_accepted_below_one_or_not_an_integer_is_refused(value):
    with pytest.raises(ValueError, match="min_accepted must be an integer >= 1"):
        RoundEngine(build_rule("fedavg"), num_rounds=1, min_accepted=value)


def test_controller_refuses_min_accepted_zero_at_construction():
    from controllers.fedalg_controller import FedAlgController

    with pytest.raises(ValueError, match=r"^min_accepted must be an integer >= 1, got 0$"):
        FedAlgController(settings={"min_accepted": 0})


def _assert_failed_round_kept_the_model(outcome, host, state, reason: str) -> None:
    assert outcome.params is GLOBAL and outcome.state is state and not outcome.aggregated
    [record] = host.records
    assert record["status"] == "failed" and record["aggregated"] == []
    assert reason in record["failure"], record["failure"]
    assert any(reason in message for message in host.errors())
    [(_, persisted, _, aggregated)] = host.persisted
    assert not aggregated
    for key, value in GLOBAL.items():
        np.testing.assert_array_equal(persisted[key], value)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_aggregate_is_never_persisted_nor_broadcast(bad):
    rule = FakeRule(lambda g, u, s: AggregationResult({k: np.full_like(v, bad) for k, v in g.items()}, s), "nanrule")
    outcome, host, state = run_one_round(rule)
    _assert_failed_round_kept_the_model(outcome, host, state, "rule 'nanrule' produced an unusable model")
    assert "NaN or Inf" in host.records[0]["failure"]


@pytest.mark.parametrize(
    ("bad_state", "where"),
    [
        ({"scaffold": {"control": {"w": np.array([1.0, np.nan], np.float32)}}}, "['scaffold.control.w']"),
        ({"m": [np.zeros(2), np.array([np.inf])], "step": 3}, "['m[1]']"),
        ({"smoothed_angle": {"site-1": float("nan")}}, "['smoothed_angle.site-1']"),
    ],
)
def test_a_non_finite_rule_state_is_never_persisted_nor_broadcast(bad_state, where):
    # A finite model with a poisoned state (SCAFFOLD's control, FedOpt's moments) would reach every site next round.
    rule = FakeRule(lambda g, u, s: AggregationResult(dict(g), bad_state), "badstate")
    outcome, host, state = run_one_round(rule)
    _assert_failed_round_kept_the_model(outcome, host, state, f"its state has NaN or Inf in {where}")


def test_integer_and_finite_state_entries_pass_the_state_check():
    state = {"count": 3, "ids": ["site-1"], "m": {"w": np.ones(2, np.float32)}, "t": 2.5, "flags": np.array([True])}
    assert non_finite_state_keys(state) == []


def test_an_aggregate_with_other_keys_or_shapes_is_refused():
    rule = FakeRule(lambda g, u, s: AggregationResult({"w": np.zeros((3, 3), np.float32)}, s), "shapes")
    outcome, host, state = run_one_round(rule)
    _assert_failed_round_kept_the_model(outcome, host, state, "rule 'shapes' produced an unusable model")
    assert "missing parameter keys ['b']" in host.records[0]["failure"]
    assert "has shape (3, 3), expected (2, 2)" in host.records[0]["failure"]


@pytest.mark.parametrize("error", [ZeroDivisionError("boom"), KeyError("x"), RuntimeError("bad"), MemoryError()])
def test_no_exception_from_aggregate_ends_the_job(error):
    def explode(g, u, s):
        raise error

    outcome, host, state = run_one_round(FakeRule(explode, "exploding"))
    _assert_failed_round_kept_the_model(outcome, host, state, "rule 'exploding' failed in aggregate")
    assert type(error).__name__ in host.records[0]["failure"]


def test_no_exception_from_broadcast_meta_or_select_sites_ends_the_job():
    rule = FakeRule(lambda g, u, s: AggregationResult(dict(g), s), "hooks")
    rule.broadcast_meta = lambda state: 1 / 0
    outcome, host, state = run_one_round(rule)
    _assert_failed_round_kept_the_model(outcome, host, state, "rule 'hooks' failed in broadcast_meta")

    rule = FakeRule(lambda g, u, s: AggregationResult(dict(g), s), "selector")
    rule.select_sites = lambda population, count, state, seed, round_num: (["site-9"], state)
    outcome, host, state = run_one_round(rule)
    _assert_failed_round_kept_the_model(outcome, host, state, "rule 'selector' selected ['site-9']")


def test_a_crashing_update_check_rejects_the_site_not_the_job():
    rule = FakeRule(lambda g, u, s: AggregationResult({k: np.mean([x.params[k] for x in u], 0) for k in g}, s), "m")

    def check(update, global_params, state):
        if update.site == "site-2":
            raise ValueError("cannot read")
        return []

    rule.update_problems = check
    _, host, _ = run_one_round(rule)
    record = host.records[0]
    assert record["status"] == "aggregated" and record["aggregated"] == ["site-1", "site-3"]
    assert record["rejected"] == {"site-2": ["rule 'm' raised while checking the update: ValueError: cannot read"]}


def test_sites_reporting_unusable_param_keys_are_rejected_by_name():
    def reports(keys):
        def train(round_num, params, meta):
            out, sent = honest_site("site-2")(round_num, params, meta)
            return out, {**sent, meta_keys.PARAM_KEYS: keys}

        return train

    _, host, _ = run_one_round(build_rule("fedavg"), transport(**{"site-2": reports(["w", "nope"])}))
    record = host.records[0]
    assert record["aggregated"] == ["site-1", "site-3"]
    assert record["rejected"]["site-2"] == ["'train.param_keys' names entries that are not in the model: ['nope']"]
    assert any("rejected result from site-2" in m for m in host.errors())

    _, host, _ = run_one_round(build_rule("fedavg"), transport(**{"site-3": reports("w")}))
    assert host.records[0]["rejected"] == {"site-3": ["'train.param_keys' must be a list of parameter names, got str"]}


def test_too_few_valid_results_fail_the_round_and_keep_the_model():
    def nan_site(round_num, params, meta):
        return {k: np.full_like(v, np.nan) for k, v in params.items()}, {meta_keys.NUM_SAMPLES: 5}

    sites = transport(**{"site-1": nan_site, "site-2": nan_site})
    outcome, host, state = run_one_round(build_rule("fedavg"), sites, min_accepted=2)
    _assert_failed_round_kept_the_model(outcome, host, state, "only 1 valid result(s), 2 needed")
    assert set(host.records[0]["rejected"]) == {"site-1", "site-2"}


def test_a_second_result_from_one_site_is_rejected():
    class Twice:
        def train(self, round_num, targets, params, meta):
            out, sent = honest_site("site-1")(round_num, params, meta)
            return [SiteResult("site-1", out, sent), SiteResult("site-1", out, sent)]

    engine = RoundEngine(build_rule("fedavg"), num_rounds=1)
    host = MemoryHost()
    outcome = engine.run_round(0, ("site-1",), GLOBAL, {}, Twice(), host, run_id="r")
    assert outcome.aggregated and host.records[0]["aggregated"] == ["site-1"]
    assert host.records[0]["rejected"] == {"site-1": ["a second result from this site in the same round"]}


@pytest.mark.parametrize("late_first", [True, False])
def test_a_late_result_of_an_earlier_round_is_rejected_and_never_displaces_the_current_one(late_first):
    """site-1's round-1 result arrives in round 2 next to its round-2 result: only the current one is aggregated,
    whichever arrives first (a late result computed from another global model must not be averaged in)."""

    class WithLateResult:
        def train(self, round_num, targets, params, meta):
            shifted = {k: v + np.float32(1.0) for k, v in params.items()}
            late = {k: v + np.float32(100.0) for k, v in params.items()}
            base = {meta_keys.NUM_SAMPLES: 10, meta_keys.PARAM_KEYS: ["w", "b"]}
            current = SiteResult("site-1", shifted, {**base, meta_keys.TRAINED_ROUND: round_num})
            stale = SiteResult("site-1", late, {**base, meta_keys.TRAINED_ROUND: round_num - 1})
            return [stale, current] if late_first else [current, stale]

    engine = RoundEngine(build_rule("fedavg"), num_rounds=3)
    host = MemoryHost()
    outcome = engine.run_round(1, ("site-1",), GLOBAL, {}, WithLateResult(), host, run_id="r")
    assert outcome.aggregated and host.records[0]["aggregated"] == ["site-1"]
    assert host.records[0]["rejected"] == {
        "site-1": ["a result trained in round 0 arrived in round 1 (late or replayed)"]
    }
    for key, value in GLOBAL.items():
        np.testing.assert_array_equal(outcome.params[key], value + np.float32(1.0))


def test_a_result_that_does_not_say_its_round_is_not_refused_for_it():
    outcome, host, _ = run_one_round(build_rule("fedavg"))
    assert outcome.aggregated and host.records[0]["rejected"] == {}


def test_validate_result_names_every_problem():
    result = SiteResult(
        "site-4",
        {"w": np.zeros((2, 2), np.float32), "extra": np.zeros(1)},
        {meta_keys.NUM_SAMPLES: -3, "scaffold_c_diff": {}},
    )
    rejection = validate_result(result, GLOBAL, required_meta=[meta_keys.SCAFFOLD_CTRL_DIFF])
    assert rejection.site == "site-4"
    text = str(rejection)
    for expected in (
        "missing parameter keys ['b']",
        "unexpected parameter keys ['extra']",
        "required meta key 'scaffold.ctrl.diff' is missing",
        "sample count must be non-negative, got -3",
        "NVFlare's reserved keys ['scaffold_c_diff']",
    ):
        assert expected in text


def test_in_process_transport_isolates_sites_and_refuses_unknown_ones():
    def vandal(round_num, params, meta):
        params["w"][...] = 99.0  # writes into what it received
        meta["server.round"] = -1
        return honest_site("site-1")(round_num, params, meta)

    received: list[tuple[dict, dict]] = []

    def witness(round_num, params, meta):
        received.append((params, meta))
        return honest_site("site-2")(round_num, params, meta)

    sent = {k: v.copy() for k, v in GLOBAL.items()}
    results = InProcessTransport({"site-1": vandal, "site-2": witness}).train(
        0, ["site-2", "site-1"], sent, {"server.round": 0}
    )
    assert [r.site for r in results] == ["site-1", "site-2"]
    np.testing.assert_array_equal(sent["w"], GLOBAL["w"])
    np.testing.assert_array_equal(received[0][0]["w"], GLOBAL["w"])
    assert received[0][1] == {"server.round": 0}
    with pytest.raises(KeyError, match="site-9"):
        InProcessTransport({}).train(0, ["site-9"], sent, {})


def test_run_records_initial_then_every_round_and_stops_when_asked():
    engine = RoundEngine(build_rule("fedavg"), num_rounds=4)
    host = MemoryHost()
    calls = iter([False, False, True])
    params, _ = engine.run(SITES, GLOBAL, {}, transport(), host, run_id="r", should_stop=lambda: next(calls))
    assert [r["stage"] for r in host.records] == ["initial", "round", "round"]
    assert host.records[-1]["global_sha256"] != host.records[0]["global_sha256"]
    assert any("abort requested; stopping before round 3" in m for _, m in host.messages)
    assert params is not GLOBAL
