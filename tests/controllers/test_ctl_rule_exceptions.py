"""No exception from a rule ends the job: whatever a rule raises or returns in select_sites, broadcast_meta,
update_problems or aggregate, the round is recorded as failed (or the site rejected) with the rule's name and the
exception, and the previous global model is kept (docs/reliability.md)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.contracts.sampling import sample_sites, select_round_sites
from aggregators.types import AggregationResult, AggregationRule
from controllers import engine as engine_module
from controllers.engine import Host, InProcessTransport, RoundEngine

SITES = ("site-1", "site-2", "site-3")
GLOBAL = {"w": np.array([1.0, -2.0], np.float32)}


def ufunc_type_error() -> None:
    np.add(np.array(["text"]), np.array([1.0]))  # numpy.core._exceptions.UFuncTypeError


class Recorder(Host):
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.errors: list[str] = []

    def record(self, record: dict) -> None:
        self.records.append(record)

    def log(self, level: int, message: str) -> None:
        if level >= logging.ERROR:
            self.errors.append(message)


class Mean(AggregationRule):
    """A plain mean whose hooks a test replaces."""

    name = "brittle"

    def aggregate(self, global_params, updates, state, context):
        return AggregationResult({k: np.mean([u.params[k] for u in updates], axis=0) for k in global_params}, {})


def honest(round_num: int, params: dict, meta: dict) -> tuple[dict, dict]:
    return {k: v + 1 for k, v in params.items()}, {meta_keys.NUM_SAMPLES: 4}


def run_rounds(rule: AggregationRule, rounds: int = 2, **engine_args) -> Recorder:
    """The whole federation: it must reach its last round whatever the rule does."""
    host = Recorder()
    engine = RoundEngine(rule, num_rounds=rounds, **engine_args)
    engine.run(SITES, GLOBAL, {}, InProcessTransport(dict.fromkeys(SITES, honest)), host, run_id="r")
    assert [r["round"] for r in host.records[1:]] == list(range(rounds))
    return host


def assert_every_round_failed_naming(host: Recorder, *fragments: str) -> None:
    for record in host.records[1:]:
        assert record["status"] == "failed" and record["global_sha256"] == host.records[0]["global_sha256"]
        for fragment in fragments:
            assert fragment in record["failure"], record["failure"]
    assert any(all(f in m for f in fragments) for m in host.errors)


@pytest.mark.parametrize(
    ("hook", "error", "expected"),
    [
        ("aggregate", ufunc_type_error, "UFuncTypeError"),
        ("aggregate", lambda: 1 / 0, "ZeroDivisionError"),
        ("select_sites", ufunc_type_error, "UFuncTypeError"),
        ("broadcast_meta", lambda: 1 / 0, "ZeroDivisionError"),
    ],
)
def test_an_exception_inside_a_rule_hook_fails_the_round_with_the_rules_name(hook, error, expected):
    rule = Mean()
    setattr(rule, hook, lambda *args, **kwargs: error())
    host = run_rounds(rule)
    assert_every_round_failed_naming(host, f"rule 'brittle' failed in {hook}", expected)


@pytest.mark.parametrize(
    ("hook", "returned", "expected"),
    [
        ("select_sites", 42, "rule 'brittle' failed in select_sites: TypeError"),
        ("select_sites", (["site-9"], {}), "rule 'brittle' selected ['site-9']"),
        ("broadcast_meta", ["not", "a", "mapping"], "rule 'brittle' failed in broadcast_meta"),
        ("broadcast_meta", {meta_keys.ROUND: 99}, "rule 'brittle' broadcasts the engine's round keys ['server.round']"),
        ("aggregate", AggregationResult(dict(GLOBAL), None), "its state is a NoneType, not a mapping"),
        ("aggregate", "a string", "the aggregate is a NoneType, not a mapping"),
    ],
)
def test_a_malformed_value_returned_by_a_rule_fails_the_round_not_the_job(hook, returned, expected):
    rule = Mean()
    setattr(rule, hook, lambda *args, **kwargs: returned)
    assert_every_round_failed_naming(run_rounds(rule), expected)


def test_an_update_check_raising_a_numpy_error_rejects_the_site_with_the_rules_name():
    rule = Mean()

    def check(update, global_params, state):
        if update.site == "site-2":
            ufunc_type_error()
        return []

    rule.update_problems = check
    host = run_rounds(rule, rounds=1)
    record = host.records[1]
    assert record["status"] == "aggregated" and record["aggregated"] == ["site-1", "site-3"]
    [problem] = record["rejected"]["site-2"]
    assert problem.startswith("rule 'brittle' raised while checking the update: UFuncTypeError")


def test_an_observer_or_transport_that_raises_fails_the_round_only():
    def observer(*args) -> None:
        raise RuntimeError("observer broke")

    host = run_rounds(Mean(), observers=[observer])
    assert_every_round_failed_naming(host, "round failed under rule 'brittle': RuntimeError: observer broke")

    class Broken:
        def train(self, *args):
            raise ConnectionError("link down")

    host, engine = Recorder(), RoundEngine(Mean(), num_rounds=2)
    engine.run(SITES, GLOBAL, {}, Broken(), host, run_id="r")
    assert [r["status"] for r in host.records[1:]] == ["failed", "failed"]
    assert "ConnectionError: link down" in host.records[1]["failure"]


@pytest.mark.parametrize("value", [1.5, 0, -1, float("nan"), "3", True])
def test_clients_per_round_that_can_never_resolve_is_refused_when_the_engine_is_built(value):
    with pytest.raises(ValueError, match=r"^clients_per_round must be none \(all sites\), an integer count >= 1 "):
        RoundEngine(Mean(), num_rounds=1, clients_per_round=value)


@pytest.mark.parametrize("seed", [-1, 1.5, None])
def test_a_seed_numpy_cannot_use_is_refused_when_the_engine_is_built(seed):
    with pytest.raises(ValueError, match="seed must be an integer >= 0"):
        RoundEngine(Mean(), num_rounds=1, seed=seed)


def test_the_engine_selects_sites_through_the_one_selection_in_sampling(monkeypatch):
    calls: list[tuple] = []

    def spy(rule, population, count, state, seed, round_num):
        calls.append((population, count, seed, round_num))
        return select_round_sites(rule, population, count, state, seed, round_num)

    monkeypatch.setattr(engine_module, "select_round_sites", spy)
    host = run_rounds(Mean(), rounds=2, clients_per_round=2, seed=3)
    assert calls == [(SITES, 2, 3, 0), (SITES, 2, 3, 1)]
    assert [r["sites"] for r in host.records[1:]] == [sample_sites(SITES, 2, 3, r) for r in range(2)]
