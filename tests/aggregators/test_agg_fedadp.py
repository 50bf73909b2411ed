"""FedAdp: angles over flattened trainable deltas, per-site smoothing, Gompertz weights times data sizes."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.fedadp import gompertz
from aggregators.fedavg import fedavg_params
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext

CONTEXT = RoundContext(round_num=0, num_rounds=3, population=("site-1", "site-2", "site-3"))
X0 = {"a": np.zeros(1, np.float32), "b": np.zeros(1, np.float32)}


def _update(site, a, b, n=1, extra=None, meta=None):
    params = {"a": np.array([a], np.float32), "b": np.array([b], np.float32), **(extra or {})}
    return ClientUpdate(site=site, params=params, num_samples=n, meta=meta or {})


def _expected_weights(samples, thetas, alpha=5.0):
    f = alpha * (1 - np.exp(-np.exp(-alpha * (np.asarray(thetas) - 1))))
    w = np.asarray(samples) * np.exp(f)
    return w / w.sum()


def test_gompertz_values_from_algorithms_md():
    np.testing.assert_allclose(gompertz(np.array([1.0, np.pi / 2, np.pi]), 5.0), [3.1606, 0.2799, 0.0001], atol=1e-4)
    assert float(gompertz(np.array(0.0), 5.0)) == pytest.approx(5.0, abs=0.05)


def test_two_clients_closed_form_with_angles_across_layers():
    # Deltas (1, 0) and (1, 1) over the two layers, D = (1, 1): mean (1, 0.5);
    # cos_1 = 1/sqrt(1.25), cos_2 = 1.5/(sqrt(1.25) sqrt(2)).
    updates = [_update("site-1", 1.0, 0.0), _update("site-2", 1.0, 1.0)]
    rule = build_rule("fedadp")
    result = rule.aggregate(X0, updates, rule.init_state(X0), CONTEXT)
    thetas = [np.arccos(1 / np.sqrt(1.25)), np.arccos(1.5 / (np.sqrt(1.25) * np.sqrt(2)))]
    psi = _expected_weights([1, 1], thetas)
    np.testing.assert_allclose(result.params["a"], [1.0], atol=1e-6)
    np.testing.assert_allclose(result.params["b"], [psi[1]], atol=1e-6)
    np.testing.assert_allclose([result.state["angles"][s] for s in ("site-1", "site-2")], thetas, atol=1e-9)
    assert result.state["counts"] == {"site-1": 1, "site-2": 1}


def test_equal_angles_give_fedavg_with_data_sizes():
    # Deltas (1, 0) and (0, 1) with equal D: both at 45 degrees from the mean, so psi is the FedAvg weight.
    extra1 = {"n": np.array(4, np.int64)}
    extra2 = {"n": np.array(8, np.int64)}
    x0 = {**X0, "n": np.array(0, np.int64)}
    updates = [_update("site-1", 1.0, 0.0, 5, extra1), _update("site-2", 0.0, 1.0, 5, extra2)]
    rule = build_rule("fedadp")
    result = rule.aggregate(x0, updates, rule.init_state(x0), CONTEXT)
    expected = fedavg_params(x0, updates)
    for key in x0:
        np.testing.assert_allclose(result.params[key], expected[key], atol=1e-7)
    assert result.params["n"].dtype == np.int64


def test_smoothing_uses_each_sites_own_participation_count():
    rule = build_rule("fedadp")
    state = {"angles": {"site-1": 0.2, "site-2": 0.9}, "counts": {"site-1": 3, "site-2": 1}}
    # This round: site-1 again (4th time) and site-3 (first time); site-2 sits out and keeps its state.
    updates = [_update("site-1", 1.0, 0.0), _update("site-3", 1.0, 1.0)]
    result = rule.aggregate(X0, updates, state, CONTEXT)
    theta1 = np.arccos(1 / np.sqrt(1.25))
    theta3 = np.arccos(1.5 / (np.sqrt(1.25) * np.sqrt(2)))
    assert result.state["angles"]["site-1"] == pytest.approx(3 / 4 * 0.2 + theta1 / 4, abs=1e-12)
    assert result.state["angles"]["site-3"] == pytest.approx(theta3, abs=1e-12)  # not 1/round-index weighted
    assert result.state["angles"]["site-2"] == 0.9 and result.state["counts"] == {"site-1": 4, "site-2": 1, "site-3": 1}
    psi = _expected_weights([1, 1], [3 / 4 * 0.2 + theta1 / 4, theta3])
    np.testing.assert_allclose(result.params["b"], [psi[1]], atol=1e-6)
    assert state["counts"]["site-1"] == 3  # the input state is not mutated


def test_buffers_stay_out_of_the_angle():
    meta = {meta_keys.PARAM_KEYS: ["a", "b"]}
    x0 = {**X0, "bn.running_mean": np.zeros(1, np.float32)}
    huge = {"bn.running_mean": np.array([1000.0], np.float32)}
    tiny = {"bn.running_mean": np.array([0.0], np.float32)}
    updates = [_update("site-1", 1.0, 0.0, extra=huge, meta=meta), _update("site-2", 1.0, 1.0, extra=tiny, meta=meta)]
    rule = build_rule("fedadp")
    with_buffer = rule.aggregate(x0, updates, rule.init_state(x0), CONTEXT)
    plain = rule.aggregate(X0, [_update("site-1", 1.0, 0.0), _update("site-2", 1.0, 1.0)], rule.init_state(X0), CONTEXT)
    assert with_buffer.state["angles"] == plain.state["angles"]
    np.testing.assert_allclose(with_buffer.params["bn.running_mean"], [500.0])


def test_zero_delta_gets_angle_zero_order_invariance_and_no_mutation():
    updates = [_update("site-1", 0.0, 0.0), _update("site-2", 0.5, -0.5, 2), _update("site-3", 0.1, 0.3, 3)]
    snapshot = copy.deepcopy(updates)
    rule = build_rule("fedadp")
    forward = rule.aggregate(X0, updates, rule.init_state(X0), CONTEXT)
    backward = rule.aggregate(X0, updates[::-1], rule.init_state(X0), CONTEXT)
    assert forward.state["angles"]["site-1"] == 0.0
    for key in X0:
        np.testing.assert_array_equal(forward.params[key], backward.params[key])
    for u, saved in zip(updates, snapshot, strict=True):
        np.testing.assert_array_equal(u.params["a"], saved.params["a"])


def test_bad_alpha():
    with pytest.raises(AggregationError, match="alpha"):
        build_rule("fedadp", alpha=0)


def test_weights_multiply_data_sizes_with_the_gompertz_factor():
    # D = (1, 3): mean delta = (1, 0.75); angles and psi by independent numpy.
    updates = [_update("site-1", 1.0, 0.0, 1), _update("site-2", 1.0, 1.0, 3)]
    rule = build_rule("fedadp")
    result = rule.aggregate(X0, updates, rule.init_state(X0), CONTEXT)
    mean = np.array([1.0, 0.75])
    thetas = [np.arccos(d @ mean / (np.linalg.norm(d) * np.linalg.norm(mean))) for d in (np.array([1, 0]), np.ones(2))]
    psi = _expected_weights([1, 3], thetas)
    np.testing.assert_allclose(result.params["b"], [psi[1]], atol=1e-6)
    assert psi[1] != pytest.approx(_expected_weights([1, 1], thetas)[1], abs=1e-3)
