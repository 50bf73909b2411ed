"""FedMoS server rule: server momentum in closed form and against the authors' (u, eta, E) form, the census round,
uniform and adaptive (stratified urn) selection with their aggregation weights, the controller's selection hook,
partial results, checkpoints and bad settings."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from aggregators.contracts.sampling import sample_sites, select_round_sites
from aggregators.fedmos import FedMoS, data_shares, select_adaptive, select_uniform, stratified_urns
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext
from controllers.checkpoint import load_rule_state, save_rule_state

SITES = ("a", "b", "c", "d")
COUNTS = {"a": 40, "b": 30, "c": 20, "d": 10}
CTX = RoundContext(round_num=0, num_rounds=10, population=SITES)


def update(site: str, w: float, n: int = 1, **extra: np.ndarray) -> ClientUpdate:
    return ClientUpdate(site=site, params={"w": np.array([w], dtype=np.float32), **extra}, num_samples=n)


def step(rule: FedMoS, x: float, updates: list[ClientUpdate], state: dict) -> tuple[float, dict]:
    result = rule.aggregate({"w": np.array([x], dtype=np.float32)}, updates, state, CTX)
    return float(result.params["w"][0]), result.state


# --------------------------------------------------------------------------------------------------------------------
# server momentum


def test_momentum_closed_form_over_three_rounds():
    rule = FedMoS(beta=0.8)
    state = rule.init_state({})
    # Round 0 (census: sample weights 1/4, 3/4): xt = 0.25 * 1 + 0.75 * 3 = 2.5 -> x = 2.5, m = 0.
    x, state = step(rule, 0.0, [update("a", 1.0, 1), update("b", 3.0, 3)], state)
    assert x == pytest.approx(2.5, abs=1e-6)
    assert state["num_samples"] == {"a": 1, "b": 3}
    # Round 1, selection weights 1/2, 1/2: xt = 1.5, m = 0.8 * 0 + 1.5 -> x = 4.0.
    x, state = step(rule, x, [update("a", x + 1), update("b", x + 2)], {**state, "selection": {"a": 0.5, "b": 0.5}})
    assert x == pytest.approx(4.0, abs=1e-6)
    # Round 2: xt = 1, m = 0.8 * 1.5 + 1 = 2.2 -> x = 6.2.
    x, state = step(rule, x, [update("a", x + 1), update("b", x + 1)], {**state, "selection": {"a": 0.5, "b": 0.5}})
    assert x == pytest.approx(6.2, abs=1e-6)
    assert state["momentum"]["w"] == pytest.approx([2.2], abs=1e-6)
    assert state["momentum"]["w"].dtype == np.float32


def authors_server(deltas: list[float], beta: float, eta: float, epochs: int) -> list[float]:
    """The authors' main_fed.py loop: round 0 x += xt; later u = beta u - xt/(eta E), x = x - eta E u."""
    x, u, path = 0.0, 0.0, []
    for t, xt in enumerate(deltas):
        if t == 0:
            x = x + xt
        else:
            u = beta * u - xt / (eta * epochs)
            x = x - eta * epochs * u
        path.append(x)
    return path


@pytest.mark.parametrize(("eta", "epochs"), [(0.01, 5), (0.05, 1), (0.3, 20)])
def test_matches_the_authors_form_for_any_constant_eta_and_epochs(eta, epochs):
    deltas = [0.5, -0.2, 0.3, 0.1, -0.4]
    rule = FedMoS(beta=0.5)
    state, x, path = rule.init_state({}), 0.0, []
    for delta in deltas:
        x, state = step(rule, x, [update("a", x + delta)], state)
        path.append(x)
    np.testing.assert_allclose(path, authors_server(deltas, 0.5, eta, epochs), atol=1e-6)


def test_beta_zero_is_weighted_averaging_and_integer_buffers_take_the_weighted_mean():
    rule = FedMoS(beta=0.0)
    state = {
        **rule.init_state({}),
        "momentum": {"w": np.array([5.0], dtype=np.float32)},
        "selection": {"a": 0.25, "b": 0.75},
    }
    steps = {"steps": np.array(0, dtype=np.int64)}
    updates = [
        update("a", 1.0, steps=np.array(4, dtype=np.int64)),
        update("b", 3.0, steps=np.array(8, dtype=np.int64)),
    ]
    result = rule.aggregate({"w": np.array([0.0], dtype=np.float32), **steps}, updates, state, CTX)
    assert result.params["w"] == pytest.approx([2.5], abs=1e-6)
    assert result.params["steps"] == 7 and result.params["steps"].dtype == np.int64


# --------------------------------------------------------------------------------------------------------------------
# selection


def test_census_round_until_every_site_has_reported_then_selection_by_data_share():
    rule = FedMoS(selection="uniform")
    state = rule.init_state({})
    sites, state = rule.select_sites(SITES, 2, state, seed=0, round_num=0)
    assert sites == list(SITES) and state["selection"] == {}
    _, state = step(rule, 0.0, [update(s, 1.0, COUNTS[s]) for s in SITES], state)
    assert state["num_samples"] == COUNTS
    sites, state = rule.select_sites(SITES, 2, state, seed=0, round_num=1)
    assert len(sites) == 2 and set(state["selection"]) == set(sites)
    # A site that joins later triggers another census round.
    sites, state = rule.select_sites((*SITES, "e"), 2, state, seed=0, round_num=2)
    assert sites == [*SITES, "e"] and state["selection"] == {}


def test_known_counts_skip_the_census():
    rule = FedMoS(site_num_samples=COUNTS)
    sites, state = rule.select_sites(SITES, 2, rule.init_state({}), seed=3, round_num=0)
    assert len(sites) == 2 and sum(state["selection"].values()) == pytest.approx(1.0)


def test_uniform_weights_are_the_shares_renormalised_over_the_chosen():
    shares = data_shares(SITES, COUNTS)
    assert shares == [Fraction(4, 10), Fraction(3, 10), Fraction(2, 10), Fraction(1, 10)]
    for seed in range(20):
        chosen = select_uniform(SITES, shares, 2, np.random.default_rng(seed))
        total = sum(COUNTS[s] for s in chosen)
        assert len(chosen) == 2
        assert chosen == pytest.approx({s: COUNTS[s] / total for s in chosen}, abs=1e-12)


def test_uniform_draws_sites_in_proportion_to_their_data():
    rng = np.random.default_rng(0)
    shares = data_shares(SITES, COUNTS)
    hits = {s: 0 for s in SITES}
    for _ in range(4000):
        (site,) = select_uniform(SITES, shares, 1, rng)
        hits[site] += 1
    np.testing.assert_allclose([hits[s] / 4000 for s in SITES], [0.4, 0.3, 0.2, 0.1], atol=0.03)


def test_stratified_urns_closed_form():
    # masses m * p_i = 0.8, 0.6, 0.4, 0.2 laid largest first into two urns of mass 1.
    urns = stratified_urns(SITES, data_shares(SITES, COUNTS), 2)
    f = Fraction
    assert urns == [{"a": f(8, 10), "b": f(2, 10)}, {"b": f(4, 10), "c": f(4, 10), "d": f(2, 10)}]
    # Unbiased: each site's expected weight sum_k mass_ik / m is exactly its data share.
    for site, share in zip(SITES, data_shares(SITES, COUNTS), strict=True):
        assert sum(urn.get(site, 0) for urn in urns) / 2 == share


def test_a_big_site_can_fill_several_urns_and_is_weighted_by_its_draws():
    counts = {"big": 70, "small1": 20, "small2": 10}
    sites = sorted(counts)
    urns = stratified_urns(sites, data_shares(sites, counts), 3)
    assert urns[0] == {"big": 1} and urns[1] == {"big": 1}  # 3 * 0.7 = 2.1: two full urns and a bit of the third
    weights = select_adaptive(sites, data_shares(sites, counts), 3, np.random.default_rng(1))
    assert weights["big"] >= 2 / 3 and sum(weights.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(w * 3 == pytest.approx(round(w * 3)) for w in weights.values())


def test_adaptive_weights_are_unbiased():
    rng = np.random.default_rng(0)
    shares = data_shares(SITES, COUNTS)
    mean = {s: 0.0 for s in SITES}
    for _ in range(4000):
        for site, weight in select_adaptive(SITES, shares, 2, rng).items():
            mean[site] += weight / 4000
    np.testing.assert_allclose([mean[s] for s in SITES], [0.4, 0.3, 0.2, 0.1], atol=0.02)


def test_selection_is_seeded_and_reaches_aggregate_through_the_state():
    rule = FedMoS(selection="adaptive", site_num_samples=COUNTS)
    first = rule.select_sites(SITES, 2, rule.init_state({}), seed=7, round_num=4)
    again = rule.select_sites(SITES, 2, rule.init_state({}), seed=7, round_num=4)
    assert first == again
    sites, state = first
    updates = [update(s, 10.0 * (i + 1), COUNTS[s]) for i, s in enumerate(sites)]
    x, _ = step(rule, 0.0, updates, state)
    expected = sum(state["selection"][u.site] * float(u.params["w"][0]) for u in updates)
    assert x == pytest.approx(expected, abs=1e-5)


def test_missing_results_renormalise_and_unselected_results_are_refused():
    rule = FedMoS(beta=0.0)
    state = {**rule.init_state({}), "selection": {"a": 0.25, "b": 0.75}}
    x, _ = step(rule, 0.0, [update("b", 2.0)], state)
    assert x == pytest.approx(2.0, abs=1e-6)
    with pytest.raises(AggregationError, match="not selected"):
        step(rule, 0.0, [update("c", 2.0)], state)


def test_controller_hook_uses_the_rules_selection_and_falls_back_to_sampling():
    rule = build_rule("fedmos", site_num_samples=COUNTS)
    sites, state = select_round_sites(rule, SITES, 2, rule.init_state({}), seed=1, round_num=2)
    assert sites == sorted(state["selection"])
    plain = build_rule("fedavg")
    sites, same = select_round_sites(plain, SITES, 2, {"x": 1}, seed=1, round_num=2)
    assert sites == sample_sites(SITES, 2, 1, 2) and same == {"x": 1}


def test_state_survives_a_checkpoint(tmp_path):
    rule = FedMoS(site_num_samples=COUNTS)
    _, state = rule.select_sites(SITES, 2, rule.init_state({}), seed=0, round_num=0)
    _, state = step(rule, 0.0, [update(s, 1.0, COUNTS[s]) for s in state["selection"]], state)
    save_rule_state(tmp_path / "s.pt", "fedmos", 0, state)
    _, loaded = load_rule_state(tmp_path / "s.pt", "fedmos")
    assert loaded["num_samples"] == COUNTS
    np.testing.assert_array_equal(loaded["momentum"]["w"], state["momentum"]["w"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": 1.0}, "beta"),
        ({"beta": -0.1}, "beta"),
        ({"beta": "0.5"}, "beta"),
        ({"selection": "clustering"}, "selection"),
        ({"site_num_samples": {"a": 0}}, "site_num_samples"),
    ],
)
def test_bad_settings_are_rejected(kwargs, match):
    with pytest.raises(AggregationError, match=match):
        FedMoS(**kwargs)
