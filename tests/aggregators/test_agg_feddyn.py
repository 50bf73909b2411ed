"""FedDyn server rule: closed forms of docs/algorithms.md, FedDyn, the running-sum identity h_sum = sum of every
client's H_k
under partial participation, population (m) scaling, buffers, checkpointing, and bad client meta."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.feddyn import FedDyn
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext
from controllers.checkpoint import load_rule_state, save_rule_state

KEYS = meta_keys.FEDDYN_PARAM_KEYS
ALPHA_K = meta_keys.FEDDYN_ALPHA_K


def _update(site: str, w: float, n: int = 1, bn: float = 0.0, count: int = 5, alpha_k: float = 1.0) -> ClientUpdate:
    return ClientUpdate(
        site=site,
        params={
            "w": np.array([w], dtype=np.float32),
            "bn.running_mean": np.array([bn], dtype=np.float32),
            "count": np.array(count, dtype=np.int64),
        },
        num_samples=n,
        meta={KEYS: ["w"], ALPHA_K: alpha_k},
    )


def _global(w: float) -> dict[str, np.ndarray]:
    return {
        "w": np.array([w], dtype=np.float32),
        "bn.running_mean": np.array([0.0], dtype=np.float32),
        "count": np.array(5, dtype=np.int64),
    }


def _context(population: int, round_num: int = 0) -> RoundContext:
    return RoundContext(
        round_num=round_num, num_rounds=10, population=tuple(f"site-{i + 1}" for i in range(population))
    )


def _round(rule: FedDyn, theta: float, values: dict[str, float], state, population: int):
    updates = [_update(site, w) for site, w in values.items()]
    result = rule.aggregate(_global(theta), updates, state, _context(population))
    return float(result.params["w"][0]), result.state


# --------------------------------------------------------------------------------------------------------------------
# closed forms


def test_exact_minimisation_example_by_hand():
    # docs/algorithms.md, FedDyn, alpha = 1, m = |P| = 2, exact local solutions (derived in test_lm_feddyn.py):
    # round 1 from 0: theta_k = (0, 3) -> h_sum = 3, theta = 1.5 + 3/2 = 3;
    # round 2 from 3: theta_k = (1.5, 3) -> h_sum = 3 + (-1.5 + 0) = 1.5, theta = 2.25 + 1.5/2 = 3.
    rule = FedDyn(alpha=1.0)
    theta, state = _round(rule, 0.0, {"site-1": 0.0, "site-2": 3.0}, rule.init_state(_global(0.0)), 2)
    assert theta == pytest.approx(3.0, abs=1e-6)
    np.testing.assert_allclose(state["h_sum"]["w"], [3.0], atol=1e-6)
    theta, state = _round(rule, theta, {"site-1": 1.5, "site-2": 3.0}, state, 2)
    assert theta == pytest.approx(3.0, abs=1e-6)
    np.testing.assert_allclose(state["h_sum"]["w"], [1.5], atol=1e-6)


def paper_reference(alpha: float, m: int, rounds: int, steps: int = 3, lr: float = 0.1):
    """Independent numpy reference in the paper's h-form, clients L_k = h_k/2 (t - a_k)^2, h = (1, 3), a = (0, 4)."""
    curvature, target = np.array([1.0, 3.0]), np.array([0.0, 4.0])
    theta, h, g = 0.0, 0.0, np.zeros(2)
    out = []
    for _ in range(rounds):
        x = np.full(2, theta)
        for _ in range(steps):
            x = x - lr * (curvature * (x - target) - g + alpha * (x - theta))
        g = g - alpha * (x - theta)
        h = h - alpha / m * np.sum(x - theta)
        theta = float(np.mean(x) - h / alpha)
        out.append((x.copy(), theta))
    return out


def test_sgd_rounds_match_the_paper_form_reference():
    # The clients' models come from the reference itself; the rule must produce the same server models.
    rule = FedDyn(alpha=1.0)
    state, theta = rule.init_state(_global(0.0)), 0.0
    for local, ref_theta in paper_reference(alpha=1.0, m=2, rounds=4):
        theta, state = _round(rule, theta, {"site-1": local[0], "site-2": local[1]}, state, 2)
        assert theta == pytest.approx(ref_theta, abs=1e-5)
    # Round 1 by hand: clients (0, 2.352) -> theta = 1.176 + 2.352 / 2 = 2.352.
    assert paper_reference(1.0, 2, 1)[0][1] == pytest.approx(2.352, abs=1e-9)


def test_population_not_participants_divides_the_sum():
    # m = 4, |P| = 2: from 0 the clients reach 1 and 3 -> mean 2, h_sum 4, theta = 2 + 4/4 = 3 (|P| would give 4).
    rule = FedDyn()
    theta, _ = _round(rule, 0.0, {"site-1": 1.0, "site-3": 3.0}, {"h_sum": {}}, population=4)
    assert theta == pytest.approx(3.0, abs=1e-6)
    explicit = FedDyn(population_size=4)
    theta, _ = _round(explicit, 0.0, {"site-1": 1.0, "site-3": 3.0}, {"h_sum": {}}, population=9)
    assert theta == pytest.approx(3.0, abs=1e-6)


def test_non_participants_keep_contributing_their_h():
    # m = 4. Round 1 from 0: sites 1, 2 reach 2, 4 -> mean 3, h_sum 6, theta = 3 + 6/4 = 4.5.
    # Round 2 from 4.5: sites 3, 4 reach 5.5, 3.5 -> mean 4.5, displacements +1 and -1, h_sum 6, theta = 4.5 + 1.5 = 6.
    # Forgetting the stale H of sites 1 and 2 would give 4.5 + 0/4 = 4.5.
    rule = FedDyn()
    theta, state = _round(rule, 0.0, {"site-1": 2.0, "site-2": 4.0}, {"h_sum": {}}, 4)
    assert theta == pytest.approx(4.5, abs=1e-6)
    theta, state = _round(rule, theta, {"site-3": 5.5, "site-4": 3.5}, state, 4)
    assert theta == pytest.approx(6.0, abs=1e-6)


def test_running_sum_equals_explicit_per_client_bookkeeping_under_partial_participation():
    # Explicit bookkeeping (what the authors' code stores): every client's H_k, stale for non-participants;
    # theta = mean_P theta_k + mean_{all m} H_k. The rule keeps only h_sum and must agree every round.
    rng = np.random.default_rng(0)
    population, rule = 6, FedDyn()
    sites = [f"site-{i + 1}" for i in range(population)]
    h = {site: np.zeros(3) for site in sites}
    global_params = {"w": rng.normal(size=3).astype(np.float32), "count": np.array(0, np.int64)}
    state = rule.init_state(global_params)
    for round_num in range(8):
        chosen = sorted(rng.choice(sites, size=int(rng.integers(1, 4)), replace=False))
        prev = global_params["w"].astype(np.float64)
        updates = []
        for site in chosen:
            theta_k = (prev + rng.normal(scale=0.5, size=3)).astype(np.float32)
            h[site] = h[site] + (theta_k.astype(np.float64) - prev)
            meta = {KEYS: ["w"], ALPHA_K: 0.01}
            updates.append(ClientUpdate(site, {"w": theta_k, "count": np.array(round_num, np.int64)}, 1, meta))
        expected = np.mean([u.params["w"] for u in updates], axis=0) + np.mean(list(h.values()), axis=0)
        result = rule.aggregate(global_params, updates, state, _context(population, round_num))
        global_params, state = result.params, result.state
        np.testing.assert_allclose(global_params["w"], expected, atol=1e-5)
        np.testing.assert_allclose(state["h_sum"]["w"], np.sum(list(h.values()), axis=0), atol=1e-5)


def test_model_mean_is_uniform_not_sample_weighted():
    # n = (1, 3), from 0 to (1, 4): uniform mean 2.5 + h_sum 5 / 2 = 5 (sample weights would give 3.25 + 2.5).
    rule = FedDyn()
    updates = [_update("site-1", 1.0, n=1), _update("site-2", 4.0, n=3)]
    result = rule.aggregate(_global(0.0), updates, {"h_sum": {}}, _context(2))
    np.testing.assert_allclose(result.params["w"], [5.0], atol=1e-6)


def test_buffers_are_averaged_and_never_corrected():
    rule = FedDyn()
    updates = [_update("site-1", 1.0, bn=2.0, count=4), _update("site-2", 3.0, bn=5.0, count=7)]
    result = rule.aggregate(_global(0.0), updates, {"h_sum": {}}, _context(3))
    np.testing.assert_allclose(result.params["bn.running_mean"], [3.5], atol=1e-7)  # plain mean, no h
    assert result.params["count"].dtype == np.int64 and int(result.params["count"]) == 6  # rint(5.5) = 6
    assert set(result.state["h_sum"]) == {"w"} and result.state["h_sum"]["w"].dtype == np.float32
    assert {k: v.dtype for k, v in result.params.items()} == {k: v.dtype for k, v in _global(0.0).items()}


def test_state_checkpoints_as_arrays_and_a_resumed_run_continues_identically(tmp_path):
    rule = FedDyn()
    rounds = [{"site-1": 1.0, "site-2": 2.0}, {"site-2": 0.5}, {"site-1": -1.0, "site-3": 2.5}]
    theta, state = 0.0, rule.init_state(_global(0.0))
    uninterrupted = []
    for values in rounds:
        theta, state = _round(rule, theta, values, state, 3)
        uninterrupted.append(theta)
    # By hand (m = 3): 1.5 + 3/3 = 2.5; 0.5 + (3 - 2)/3 = 5/6; 0.75 + (1 - 11/6 + 10/6)/3 = 0.75 + 5/18.
    assert uninterrupted == pytest.approx([2.5, 5 / 6, 0.75 + 5 / 18], abs=1e-6)
    theta, state = _round(rule, 0.0, rounds[0], rule.init_state(_global(0.0)), 3)
    save_rule_state(tmp_path / "server_state.pt", "feddyn", 0, state)
    round_num, restored = load_rule_state(tmp_path / "server_state.pt", "feddyn")
    assert round_num == 0 and isinstance(restored["h_sum"]["w"], np.ndarray)
    np.testing.assert_array_equal(restored["h_sum"]["w"], state["h_sum"]["w"])
    for values, expected in zip(rounds[1:], uninterrupted[1:], strict=True):
        theta, restored = _round(rule, theta, values, restored, 3)
        assert theta == expected


def test_inputs_are_not_mutated_and_order_does_not_matter():
    rule = FedDyn()
    state = {"h_sum": {"w": np.array([1.0], np.float32)}}
    a, b = _update("site-1", 1.0), _update("site-2", 2.0)
    first = rule.aggregate(_global(0.5), [a, b], state, _context(3))
    second = rule.aggregate(_global(0.5), [b, a], state, _context(3))
    assert state["h_sum"]["w"][0] == 1.0 and a.params["w"][0] == np.float32(1.0)
    np.testing.assert_array_equal(first.state["h_sum"]["w"], second.state["h_sum"]["w"])
    np.testing.assert_array_equal(first.params["w"], second.params["w"])
    np.testing.assert_allclose(first.params["w"], [1.5 + 3.0 / 3], atol=1e-6)  # h_sum = 1 + 0.5 + 1.5


# --------------------------------------------------------------------------------------------------------------------
# protocol, bad input


def test_broadcast_and_required_meta():
    rule = build_rule("feddyn", alpha=0.05)
    assert rule.broadcast_meta(rule.init_state(_global(0.0))) == {meta_keys.FEDDYN_ALPHA: 0.05}
    assert FedDyn().broadcast_meta({"h_sum": {}}) == {"feddyn.alpha": 0.01}
    assert rule.required_meta == (ALPHA_K, KEYS) and rule.broadcast_keys == (meta_keys.FEDDYN_ALPHA,)
    assert rule.update_problems(_update("site-1", 0.0), _global(0.0), {"h_sum": {}}) == []


@pytest.mark.parametrize(
    ("meta", "h_sum", "message"),
    [
        ({KEYS: None}, {}, f"'{KEYS}' must be a non-empty list"),
        ({KEYS: []}, {}, f"'{KEYS}' must be a non-empty list"),
        ({KEYS: "w"}, {}, f"'{KEYS}' must be a non-empty list"),
        ({KEYS: [1]}, {}, f"'{KEYS}' must be a non-empty list"),
        ({KEYS: ["w", "w"]}, {}, "more than once"),
        ({KEYS: ["w", "nope"]}, {}, "not in the model: ['nope']"),
        ({KEYS: ["w", "count"]}, {}, "integer buffers ['count']"),
        ({KEYS: ["w", "bn.running_mean"]}, {"w": np.zeros(1, np.float32)}, "differs from earlier rounds"),
        ({ALPHA_K: None}, {}, f"'{ALPHA_K}': must be a finite number"),
        ({ALPHA_K: "0.1"}, {}, f"'{ALPHA_K}': must be a finite number"),
        ({ALPHA_K: True}, {}, f"'{ALPHA_K}': must be a finite number"),
        ({ALPHA_K: math.nan}, {}, f"'{ALPHA_K}': must be a finite number"),
        ({ALPHA_K: -0.1}, {}, f"'{ALPHA_K}': must be > 0.0"),
    ],
)
def test_bad_client_meta_is_named(meta, h_sum, message):
    base = _update("site-1", 0.0)
    update = ClientUpdate(base.site, base.params, base.num_samples, {**base.meta, **meta})
    problems = FedDyn().update_problems(update, _global(0.0), {"h_sum": h_sum})
    assert any(message in p for p in problems), problems


def _with_keys(update: ClientUpdate, keys: Sequence[str]) -> ClientUpdate:
    return ClientUpdate(update.site, update.params, update.num_samples, {**update.meta, KEYS: list(keys)})


def test_inconsistent_rounds_raise():
    rule = FedDyn()
    mixed = [_update("site-1", 0.0), _with_keys(_update("site-2", 0.0), ["w", "bn.running_mean"])]
    with pytest.raises(AggregationError, match="different trainable parameters"):
        rule.aggregate(_global(0.0), mixed, {"h_sum": {}}, _context(2))
    with pytest.raises(AggregationError, match="running sum"):
        rule.aggregate(_global(0.0), [_update("site-1", 0.0)], {"h_sum": {"v": np.zeros(1, np.float32)}}, _context(2))
    lacking = ClientUpdate("site-1", {"count": np.array(5, np.int64)}, 1, {KEYS: ["w"], ALPHA_K: 1.0})
    with pytest.raises(AggregationError, match=r"\['site-1'\] lack parameters"):
        rule.aggregate(_global(0.0), [lacking], {"h_sum": {}}, _context(2))
    with pytest.raises(AggregationError, match="no client update"):
        rule.aggregate(_global(0.0), [], {"h_sum": {}}, _context(2))
    with pytest.raises(AggregationError, match="population of only 1"):
        FedDyn(population_size=1).aggregate(
            _global(0.0), [_update("site-1", 0), _update("site-2", 0)], {"h_sum": {}}, _context(2)
        )


@pytest.mark.parametrize(("total", "refused"), [(99, True), (100, False), (101, False), (1000, False)])
def test_a_population_total_smaller_than_the_sites_own_count_is_refused_by_site_and_setting(total, refused):
    """site-2 holds n_k = 100 samples; with alpha_weighting='samples' its alpha_k comes from the client's formula
    with its total_samples. A total below its own count is refused with the site, the setting and what is allowed;
    a total equal to it (the boundary, alpha_k = alpha / m up to rounding) or above it is aggregated."""
    from lightning_modules.algorithms.feddyn import client_alpha

    rule, m = FedDyn(alpha=0.03), 3
    fine = _update("site-1", 1.0, n=50, alpha_k=client_alpha(0.03, 50, m, 1000))
    tested = _update("site-2", 2.0, n=100, alpha_k=client_alpha(0.03, 100, m, total))
    uniform = _update("site-3", 3.0, n=100, alpha_k=0.03)
    run = lambda: rule.aggregate(_global(0.0), [fine, tested, uniform], {"h_sum": {}}, _context(m))  # noqa: E731
    if not refused:
        assert run().params["w"][0] == pytest.approx(2.0 + 6.0 / 3, abs=1e-6)  # mean 2 + h_sum / m = 6 / 3
        return
    with pytest.raises(AggregationError) as raised:
        run()
    message = str(raised.value)
    assert "site 'site-2'" in message and "site-1" not in message and "site-3" not in message
    assert "'total_samples'" in message and "works out at 99," in message and "own 100 training samples" in message
    assert "at least every site's own count" in message and "server's m = 3" in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0}, "feddyn: hyperparameter 'alpha' must be a finite number > 0 "),
        ({"alpha": -1.0}, "feddyn: hyperparameter 'alpha' must be a finite number > 0 "),
        ({"alpha": math.nan}, "feddyn: hyperparameter 'alpha' must be a finite number > 0 "),
        ({"alpha": math.inf}, "feddyn: hyperparameter 'alpha' must be a finite number > 0 "),
        ({"alpha": "0.01"}, "feddyn: hyperparameter 'alpha' must be a finite number"),
        ({"alpha": True}, "feddyn: hyperparameter 'alpha' must be a finite number"),
        ({"population_size": 0}, "feddyn: hyperparameter 'population_size' must be an integer >= 1"),
        ({"population_size": 2.5}, "feddyn: hyperparameter 'population_size' must be an integer >= 1"),
        ({"population_size": True}, "feddyn: hyperparameter 'population_size' must be an integer >= 1"),
        ({"mu": 1.0}, "bad hyperparameters for rule 'feddyn'"),
    ],
)
def test_bad_settings_raise(kwargs, message):
    with pytest.raises(AggregationError, match=message):
        build_rule("feddyn", **kwargs)
