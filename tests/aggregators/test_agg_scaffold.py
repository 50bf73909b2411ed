"""SCAFFOLD server rule: closed-form rounds, the N-scaling under partial participation, and bad controls."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.registry import build_rule
from aggregators.scaffold import Scaffold, control_problems
from aggregators.types import AggregationError, ClientUpdate, RoundContext

DIFF = meta_keys.SCAFFOLD_CTRL_DIFF


def _update(site: str, y: float, dc: float, n: int = 1) -> ClientUpdate:
    return ClientUpdate(
        site=site,
        params={"w": np.array([y], dtype=np.float32), "count": np.array(5, dtype=np.int64)},
        num_samples=n,
        meta={DIFF: {"w": np.array([dc], dtype=np.float32)}},
    )


def _context(population: int) -> RoundContext:
    return RoundContext(round_num=0, num_rounds=1, population=tuple(f"site-{i + 1}" for i in range(population)))


GLOBAL = {"w": np.array([0.0], dtype=np.float32), "count": np.array(5, dtype=np.int64)}


def test_first_round_matches_the_hand_computed_quadratic_example():
    # Clients f_i = h_i/2 (y - a_i)^2 with h = (1, 3), a = (0, 4), x = 0, eta = 0.1, K = 3 (see the client test):
    # y_1 = 0, y_2 = 2.628; delta_c_1 = 0, delta_c_2 = -8.76.
    rule = Scaffold()
    updates = [_update("site-1", 0.0, 0.0), _update("site-2", 2.628, -8.76)]
    result = rule.aggregate(GLOBAL, updates, rule.init_state(GLOBAL), _context(2))
    np.testing.assert_allclose(result.params["w"], [1.314], atol=1e-6)
    np.testing.assert_allclose(result.state["control"]["w"], [-4.38], atol=1e-6)
    assert result.state["control"]["w"].dtype == np.float32
    assert result.params["count"].dtype == np.int64 and result.params["count"] == 5
    assert rule.broadcast_meta(result.state)[meta_keys.SCAFFOLD_CTRL_GLOBAL]["w"][0] == pytest.approx(-4.38)


def test_partial_participation_scales_the_control_by_the_population_not_the_participants():
    # 2 of 4 sites participate: c = 0 + (1/4) * (2 + 4) = 1.5, not NVFlare's participant mean 3.0.
    rule = Scaffold()
    updates = [_update("site-1", 1.0, 2.0), _update("site-3", 3.0, 4.0)]
    result = rule.aggregate(GLOBAL, updates, {"control": {}}, _context(4))
    np.testing.assert_allclose(result.state["control"]["w"], [1.5], atol=1e-7)
    np.testing.assert_allclose(result.params["w"], [2.0], atol=1e-7)  # uniform model mean over participants


def test_control_stays_the_mean_of_all_client_controls_over_rounds():
    # Invariant from the paper: with all controls starting at 0, c = (1/N) sum_i c_i after every round.
    rng = np.random.default_rng(0)
    population, rule = 5, Scaffold()
    local = {f"site-{i + 1}": np.zeros(3) for i in range(population)}
    state = {"control": {}}
    for _ in range(6):
        chosen = sorted(rng.choice(list(local), size=2, replace=False))
        updates = []
        for site in chosen:
            new_local = rng.normal(size=3)
            diff = (new_local - local[site]).astype(np.float32)
            local[site] = local[site] + diff.astype(np.float64)
            updates.append(ClientUpdate(site, {"w": np.zeros(3, np.float32)}, 1, {DIFF: {"w": diff}}))
        state = rule.aggregate({"w": np.zeros(3, np.float32)}, updates, state, _context(population)).state
        np.testing.assert_allclose(state["control"]["w"], np.mean(list(local.values()), axis=0), atol=1e-5)


def test_sample_weighting_and_server_lr():
    rule = Scaffold(weighting="samples", server_lr=0.5)
    updates = [_update("site-1", 1.0, 0.0, n=1), _update("site-2", 4.0, 0.0, n=3)]
    result = rule.aggregate(GLOBAL, updates, {"control": {}}, _context(2))
    np.testing.assert_allclose(result.params["w"], [0.5 * (0.25 * 1.0 + 0.75 * 4.0)], atol=1e-6)


def test_inputs_are_not_mutated_and_order_does_not_matter():
    rule = Scaffold()
    state = {"control": {"w": np.array([1.0], np.float32)}}
    a, b = _update("site-1", 1.0, 0.5), _update("site-2", 2.0, -0.25)
    first = rule.aggregate(GLOBAL, [a, b], state, _context(3))
    second = rule.aggregate(GLOBAL, [b, a], state, _context(3))
    assert state["control"]["w"][0] == 1.0 and a.meta[DIFF]["w"][0] == np.float32(0.5)
    np.testing.assert_array_equal(first.state["control"]["w"], second.state["control"]["w"])
    np.testing.assert_array_equal(first.params["w"], second.params["w"])


@pytest.mark.parametrize(
    ("diff", "control", "message"),
    [
        (None, {}, "must be a non-empty dict"),
        ({}, {}, "must be a non-empty dict"),
        ({"nope": np.zeros(1, np.float32)}, {}, "unexpected ['nope']"),
        ({"w": np.zeros(2, np.float32)}, {}, "has shape"),
        ({"w": np.array([np.nan], np.float32)}, {}, "NaN or Inf"),
        ({"w": [0.0]}, {}, "float numpy array"),
        ({"count": np.zeros((), np.float32)}, {}, "integer buffer"),
        ({"w": np.zeros(1, np.float32)}, {"v": np.zeros(1, np.float32)}, "missing ['v'], unexpected ['w']"),
    ],
)
def test_bad_controls_are_named(diff, control, message):
    params = {**GLOBAL, "v": np.zeros(1, np.float32)}
    problems = control_problems(diff, params, control)
    assert any(message in p for p in problems), problems


def test_good_control_passes_and_rule_hooks_it_in():
    rule = Scaffold()
    assert rule.update_problems(_update("site-1", 0.0, 1.0), GLOBAL, {"control": {}}) == []
    assert rule.required_meta == (DIFF,)


def test_population_smaller_than_participants_and_bad_settings_raise():
    with pytest.raises(AggregationError, match="population"):
        Scaffold(population_size=1).aggregate(
            GLOBAL, [_update("site-1", 0, 0), _update("site-2", 0, 0)], {"control": {}}, _context(2)
        )
    with pytest.raises(AggregationError, match="weighting"):
        build_rule("scaffold", weighting="median")
    with pytest.raises(AggregationError, match="server_lr"):
        build_rule("scaffold", server_lr=0)


def test_in_round_one_a_diff_with_other_keys_than_the_trainable_parameters_is_refused():
    """Before any global control exists the diff is checked against the site's trainable parameters."""
    params = {**GLOBAL, "v": np.zeros(1, np.float32)}
    problems = control_problems({"w": np.zeros(1, np.float32)}, params, {}, param_keys=["w", "v"])
    assert problems and "missing ['v']" in problems[0]
    assert control_problems({"w": np.zeros(1, np.float32)}, params, {}, param_keys=["w"]) == []


def test_in_round_one_without_reported_keys_the_diff_covers_the_models_trainable_entries_only():
    """No site reports ``train.param_keys``: the expected set is the one every rule uses (float entries, BatchNorm
    statistics excluded), so a diff over the parameters alone passes and one that controls statistics does not."""
    params = {
        "w": np.zeros(2, np.float32),
        "bn.running_mean": np.zeros(2, np.float32),
        "bn.running_var": np.ones(2, np.float32),
        "bn.num_batches_tracked": np.array(3, np.int64),
    }
    assert control_problems({"w": np.zeros(2, np.float32)}, params, {}) == []
    problems = control_problems({k: np.zeros(2, np.float32) for k in ("w", "bn.running_mean")}, params, {})
    assert problems and "unexpected ['bn.running_mean']" in problems[0]


def test_diffs_over_different_keys_name_the_sites_when_the_engine_did_not_check_them():
    """Called without the round engine's checks (which reject such a site first), the rule still names who sent
    what instead of failing anonymously."""
    global_params = {**GLOBAL, "v": np.zeros(1, np.float32)}
    first = _update("site-1", 1.0, 1.0)
    first = ClientUpdate(
        first.site,
        {**first.params, "v": np.zeros(1, np.float32)},
        1,
        {DIFF: {"w": np.ones(1, np.float32), "v": np.ones(1, np.float32)}},
    )
    second = ClientUpdate("site-2", first.params, 1, {DIFF: {"w": np.ones(1, np.float32)}})
    with pytest.raises(
        AggregationError, match=r"the control diffs of \['site-2'\] cover other parameters than that of site-1"
    ):
        Scaffold().aggregate(global_params, [second, first], {"control": {}}, _context(2))
