"""Privacy budgets end cleanly (controllers/budget.py): a DP site that cannot afford another round gets none, the
job goes on with the others while a round has enough sites, and otherwise ends at that round, before anyone trains,
with one line naming the site and its epsilon. A site that lost its ledger after a *rejected* release stops too."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import RoundInfo
from aggregators.registry import build_rule
from controllers.budget import end_of_budget_message, required_sites, spent_budget
from controllers.engine import InProcessTransport, RoundEngine, SiteResult, released_steps
from tests.controllers.test_ctl_engine import GLOBAL, SAMPLES, SITES, MemoryHost

TARGET = 8.0


def budget_meta(spent: float, next_round: float) -> dict[str, float]:
    return {
        meta_keys.PRIVACY_EPSILON: spent,
        meta_keys.PRIVACY_TARGET_EPSILON: TARGET,
        meta_keys.PRIVACY_NEXT_EPSILON: next_round,
    }


def test_a_site_has_spent_its_budget_when_its_next_round_would_exceed_it():
    assert spent_budget(budget_meta(5.0, 7.9)) is None
    assert spent_budget(budget_meta(5.0, TARGET * (1 + 1e-12))) is None  # the site's own check allows this slack
    why = spent_budget(budget_meta(7.93, 8.61))
    assert why == "epsilon 7.93 of dp_target_epsilon 8 spent (its next round would reach 8.61)"
    assert spent_budget({meta_keys.PRIVACY_EPSILON: 7.9}) is None  # no budget: nothing to run out of
    assert spent_budget({**budget_meta(1.0, 9.0), meta_keys.PRIVACY_TARGET_EPSILON: True}) is None


def test_a_round_needs_min_responses_and_at_least_min_accepted_sites():
    assert required_sites(1, None) == 1
    assert required_sites(2, None) == 2
    assert required_sites(1, 3) == 3
    assert required_sites(2, 1) == 2


def dp_sites(exhausted_after: dict[str, int], trained: list[tuple[int, str]]):
    """Sites that log each round they train; a site of ``exhausted_after`` says after that round that its next one
    would exceed its budget."""

    def site(name: str):
        def train(round_num: int, params: dict, meta: dict) -> tuple[dict, dict]:
            trained.append((round_num, name))
            spent = 2.0 * (round_num + 1)
            over = round_num >= exhausted_after.get(name, 99)
            out = {k: v + np.float32(1.0) for k, v in params.items()}
            meta = {meta_keys.NUM_SAMPLES: SAMPLES[name], meta_keys.PARAM_KEYS: ["w", "b"]}
            return out, {**meta, **budget_meta(spent, 9.0 if over else spent + 2.0)}

        return train

    return InProcessTransport({name: site(name) for name in SITES})


def run(min_responses: int | None, exhausted_after: dict[str, int]) -> tuple[list[tuple[int, str]], MemoryHost]:
    trained: list[tuple[int, str]] = []
    engine = RoundEngine(build_rule("fedavg"), num_rounds=4, min_responses=min_responses)
    host = MemoryHost()
    state = engine.init_state(GLOBAL)
    engine.run(SITES, GLOBAL, state, dp_sites(exhausted_after, trained), host, run_id="run")
    return trained, host


def test_the_job_goes_on_without_a_site_out_of_budget_while_a_round_has_enough_sites():
    trained, host = run(None, {"site-2": 1})
    assert [r for r, site in trained if site == "site-2"] == [0, 1]  # rounds 0 and 1, then none
    assert [r for r, site in trained if site == "site-1"] == [0, 1, 2, 3]
    warnings = [m for level, m in host.messages if level == logging.WARNING and "no more rounds" in m]
    assert warnings == [f"site-2 takes no more rounds: {spent_budget(budget_meta(4.0, 9.0))}"]
    assert [r["sites"] for r in host.records if r["stage"] == "round"][2] == ["site-1", "site-3"]


def test_the_job_ends_before_a_round_that_too_few_sites_can_afford_and_names_them():
    trained, host = run(3, {"site-2": 1})
    assert max(r for r, _ in trained) == 1  # nobody trains in round 2: its result could not be used
    errors = host.errors()
    assert errors == [end_of_budget_message(2, {"site-2": spent_budget(budget_meta(4.0, 9.0))}, 2, 3)]
    assert "site-2: epsilon 4 of dp_target_epsilon 8" in errors[0] and "a round needs 3" in errors[0]
    assert len([r for r in host.records if r["stage"] == "round"]) == 2


def test_the_broadcast_names_every_site_whose_result_reached_the_server_even_rejected():
    engine = RoundEngine(build_rule("fedavg"), num_rounds=3)

    def bad(round_num, params, meta):  # a result the server rejects (NaN): it has still left the site
        return {k: v * np.nan for k, v in params.items()}, {meta_keys.NUM_SAMPLES: 5, meta_keys.PARAM_KEYS: ["w", "b"]}

    def good(round_num, params, meta):
        return dict(params), {meta_keys.NUM_SAMPLES: 5, meta_keys.PARAM_KEYS: ["w", "b"]}

    sites = InProcessTransport({"site-1": good, "site-2": bad, "site-3": good})
    outcome = engine.run_round(0, SITES, GLOBAL, engine.init_state(GLOBAL), sites, MemoryHost(), run_id="r")
    assert "site-2" in outcome.record["rejected"]
    meta = engine.broadcast_meta(1, outcome.state, "r")
    assert meta[meta_keys.LAST_RELEASED] == {"site-1": 0, "site-2": 0, "site-3": 0}
    assert "site-2" not in meta[meta_keys.LAST_AGGREGATED]
    assert RoundInfo.from_meta(meta).value.last_released == meta[meta_keys.LAST_RELEASED]
    assert (
        "rounds >= 0"
        in RoundInfo.from_meta({**meta, meta_keys.LAST_RELEASED: {"site-1": -1}}).problems[meta_keys.LAST_RELEASED]
    )


def test_a_dp_site_whose_rejected_result_left_it_stops_when_its_ledger_is_lost(tmp_path):
    pytest.importorskip("opacus")
    from lightning_modules.privacy.ledger import LedgerError, read_ledger
    from lightning_modules.state_store import ClientStateStore

    store = ClientStateStore(tmp_path, "site-2", per_run=True)
    meta = {meta_keys.RUN_ID: "r", meta_keys.LAST_AGGREGATED: {}, meta_keys.LAST_RELEASED: {"site-2": 0}}
    with pytest.raises(LedgerError, match=r"site-2: privacy ledger .* is missing although the server received"):
        read_ledger(store, "site-2", meta, 1e-5)
    fresh = read_ledger(store, "site-3", meta, 1e-5)  # a site that never released anything starts at zero
    assert fresh.steps == 0


def test_the_broadcast_carries_the_dp_steps_each_sites_last_result_reported():
    """The server's record of what each DP site released (its cumulative ``privacy.steps``), broadcast every round:
    a site checks its ledger against it (lightning_modules/privacy/ledger.py, ``stale_by``)."""
    engine = RoundEngine(build_rule("fedavg"), num_rounds=3)

    def dp_site(steps_per_round):
        def train(round_num, params, meta):
            steps = steps_per_round * (round_num + 1)  # cumulative, as a DP site's ledger counts
            meta = {meta_keys.NUM_SAMPLES: 5, meta_keys.PARAM_KEYS: ["w", "b"], meta_keys.PRIVACY_STEPS: steps}
            return dict(params), meta

        return train

    def plain(round_num, params, meta):
        return dict(params), {meta_keys.NUM_SAMPLES: 5, meta_keys.PARAM_KEYS: ["w", "b"]}

    sites = InProcessTransport({"site-1": dp_site(5), "site-2": dp_site(3), "site-3": plain})
    assert meta_keys.RELEASED_STEPS not in engine.broadcast_meta(0, engine.init_state(GLOBAL), "r")  # nothing yet
    state = engine.init_state(GLOBAL)
    for round_num in range(2):
        outcome = engine.run_round(round_num, SITES, GLOBAL, state, sites, MemoryHost(), run_id="r")
        state = outcome.state
    meta = engine.broadcast_meta(2, state, "r")
    assert meta[meta_keys.RELEASED_STEPS] == {"site-1": 10, "site-2": 6}
    assert RoundInfo.from_meta(meta).value.released_steps == {"site-1": 10, "site-2": 6}
    bad = RoundInfo.from_meta({**meta, meta_keys.RELEASED_STEPS: {"site-1": -1}}).problems
    assert "step counts >= 0" in bad[meta_keys.RELEASED_STEPS]
    # A result reporting fewer steps than before (a site on a stale ledger) never lowers the record.
    assert released_steps({"site-1": 10}, [SiteResult("site-1", {}, {meta_keys.PRIVACY_STEPS: 5})]) == {"site-1": 10}
