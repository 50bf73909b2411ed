"""FedOpt server rules (FedAdam, FedYogi, FedAdagrad, FedAvgM): closed forms, equivalences and pitfalls."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.fedavg import fedavg_params
from aggregators.fedopt import TAU_FLOOR_WHY
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext
from controllers.adapters import split_results

CONTEXT = RoundContext(round_num=0, num_rounds=5, population=("site-1", "site-2"))
X0 = {"w": np.zeros(2, dtype=np.float32)}


def _update(site: str, w, n: int = 1, **extra) -> ClientUpdate:
    params = {"w": np.asarray(w, dtype=np.float32), **extra.pop("params", {})}
    return ClientUpdate(site=site, params=params, num_samples=n, meta=extra.pop("meta", {}))


def _reference(variant, deltas_per_round, lr, beta1, beta2, tau, v0=0.0, bias=False):
    """Independent loop of Reddi et al. Algorithm 2 (and FedAvgM) over given mean deltas."""
    x = np.zeros_like(deltas_per_round[0])
    m = np.zeros_like(x)
    v = np.full_like(x, v0)
    for t, d in enumerate(deltas_per_round, start=1):
        if variant == "avgm":
            m = beta1 * m + d
            x = x + lr * m
            continue
        m = beta1 * m + (1 - beta1) * d
        if variant == "adam":
            v = beta2 * v + (1 - beta2) * d**2
        elif variant == "adagrad":
            v = v + d**2
        else:
            v = v - (1 - beta2) * d**2 * np.sign(v - d**2)
        eta = lr * np.sqrt(1 - beta2**t) / (1 - beta1**t) if bias else lr
        x = x + eta * m / (np.sqrt(v) + tau)
    return x


def _run(rule, rounds):
    """Feed ``rounds`` (lists of client deltas, equal sample counts) through ``rule`` starting from X0."""
    x, state = X0, rule.init_state(X0)
    for deltas in rounds:
        updates = [_update(f"site-{i + 1}", x["w"] + d) for i, d in enumerate(deltas)]
        result = rule.aggregate(x, updates, state, CONTEXT)
        x, state = result.params, result.state
    return x, state


def test_first_round_matches_the_hand_computed_adam_example():
    # docs/server_rules.md, FedOpt: Delta_1 = (0.1, -0.2), Delta_2 = (0.1, 0.2) -> Delta_t = (0.1, 0); m = (0.01, 0),
    # v = (1e-4, 0): x = 0.01 * 0.01 / (0.01 + 0.001) = 0.00909090..., second coordinate unchanged.
    rule = build_rule("fedadam", server_lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3, v0=0.0)
    x, state = _run(rule, [[np.array([0.1, -0.2]), np.array([0.1, 0.2])]])
    np.testing.assert_allclose(x["w"], [0.01 * 0.01 / 0.011, 0.0], atol=1e-8)
    np.testing.assert_allclose(state["m"]["w"], [0.01, 0.0], atol=1e-9)
    np.testing.assert_allclose(state["v"]["w"], [1e-4, 0.0], atol=1e-11)
    assert state["m"]["w"].dtype == state["v"]["w"].dtype == np.float32 and state["step"] == 1


@pytest.mark.parametrize(
    ("variant", "bias"),
    [("adam", False), ("adam", True), ("yogi", False), ("yogi", True), ("adagrad", False), ("avgm", False)],
)
def test_three_rounds_match_an_independent_loop(variant, bias):
    rng = np.random.default_rng(1)
    rounds = [[rng.normal(0, 0.1, 2), rng.normal(0, 0.1, 2)] for _ in range(3)]
    hp = {"server_lr": 0.05, "beta1": 0.8, "beta2": 0.95, "tau": 1e-3, "v0": 1e-4}
    if variant == "avgm":
        hp = {"server_lr": 0.7, "beta1": 0.9}
    rule = build_rule(f"fed{variant}", bias_correction=bias, **hp) if bias else build_rule(f"fed{variant}", **hp)
    x, _ = _run(rule, rounds)
    means = [np.mean(r, axis=0) for r in rounds]
    expected = _reference(
        variant, means, hp["server_lr"], hp["beta1"], hp.get("beta2", 0), hp.get("tau", 0), hp.get("v0", 0), bias
    )
    np.testing.assert_allclose(x["w"], expected, atol=1e-6, rtol=0)


def test_yogi_first_step_equals_adams_with_v0_zero_and_then_differs():
    rounds = [[np.array([0.1, -0.3])], [np.array([0.005, 0.2])]]
    hp = {"server_lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "v0": 0.0}
    adam_1, _ = _run(build_rule("fedadam", **hp), rounds[:1])
    yogi_1, _ = _run(build_rule("fedyogi", **hp), rounds[:1])
    np.testing.assert_array_equal(adam_1["w"], yogi_1["w"])
    adam_2, adam_state = _run(build_rule("fedadam", **hp), rounds)
    yogi_2, yogi_state = _run(build_rule("fedyogi", **hp), rounds)
    # Round 2, first coordinate: v1 = 1e-4 > Delta^2 = 2.5e-5, so Yogi subtracts 0.01 * Delta^2 (Adam decays v).
    np.testing.assert_allclose(yogi_state["v"]["w"][0], 1e-4 - 0.01 * 2.5e-5, rtol=1e-5)
    np.testing.assert_allclose(adam_state["v"]["w"][0], 0.99 * 1e-4 + 0.01 * 2.5e-5, rtol=1e-5)
    assert not np.array_equal(adam_2["w"], yogi_2["w"])


def test_default_v0_is_tau_squared_as_in_algorithm_2():
    rule = build_rule("fedadam", server_lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3)
    x, state = _run(rule, [[np.array([0.1, 0.0])]])
    v = 0.99 * 1e-6 + 0.01 * 0.01
    np.testing.assert_allclose(state["v"]["w"], [v, 0.99 * 1e-6], rtol=1e-6)
    np.testing.assert_allclose(x["w"][0], 0.01 * 0.01 / (np.sqrt(v) + 1e-3), atol=1e-8)


def test_bias_correction_scales_the_first_step_by_sqrt_one_minus_beta2_over_one_minus_beta1():
    hp = {"server_lr": 0.01, "beta1": 0.9, "beta2": 0.999, "tau": 1e-3, "v0": 0.0}
    plain, _ = _run(build_rule("fedadam", **hp), [[np.array([0.1, 0.0])]])
    corrected, _ = _run(build_rule("fedadam", bias_correction=True, **hp), [[np.array([0.1, 0.0])]])
    m, v = 0.01, 0.001 * 0.01
    np.testing.assert_allclose(plain["w"][0], 0.01 * m / (np.sqrt(v) + 1e-3), atol=1e-8)
    np.testing.assert_allclose(corrected["w"][0], 0.01 * np.sqrt(0.001) / 0.1 * m / (np.sqrt(v) + 1e-3), atol=1e-8)


def test_fedavgm_with_lr_one_and_no_momentum_is_fedavg_bit_for_bit():
    x0 = {"w": np.array([0.3, -1.0], dtype=np.float32), "count": np.array(4, dtype=np.int64)}
    updates = [
        ClientUpdate("site-2", {"w": np.array([0.5, 0.25], np.float32), "count": np.array(9, np.int64)}, 3),
        ClientUpdate("site-1", {"w": np.array([-0.1, 2.0], np.float32), "count": np.array(6, np.int64)}, 1),
    ]
    rule = build_rule("fedavgm", server_lr=1.0, beta1=0.0)
    result = rule.aggregate(x0, updates, rule.init_state(x0), CONTEXT)
    expected = fedavg_params(x0, updates)
    np.testing.assert_allclose(result.params["w"], expected["w"], atol=1e-7, rtol=0)
    assert result.params["count"] == expected["count"] == 8 and result.params["count"].dtype == np.int64


def test_sample_weights_by_default_and_uniform_on_request():
    updates = [_update("site-1", [1.0, 0.0], n=3), _update("site-2", [0.0, 1.0], n=1)]
    samples = build_rule("fedavgm", server_lr=1.0, beta1=0.0)
    uniform = build_rule("fedavgm", server_lr=1.0, beta1=0.0, weighting="uniform")
    np.testing.assert_allclose(
        samples.aggregate(X0, updates, samples.init_state(X0), CONTEXT).params["w"], [0.75, 0.25]
    )
    np.testing.assert_allclose(uniform.aggregate(X0, updates, uniform.init_state(X0), CONTEXT).params["w"], [0.5, 0.5])


def test_buffers_are_averaged_and_never_pushed_through_the_moments():
    x0 = {
        "w": np.zeros(2, np.float32),
        "bn.running_mean": np.array([1.0, 1.0], np.float32),
        "bn.num_batches_tracked": np.array(10, np.int64),
    }
    meta = {meta_keys.PARAM_KEYS: ["w"]}

    def update(site, w, mean, count):
        params = {"w": np.array(w, np.float32), "bn.running_mean": np.array(mean, np.float32)}
        params["bn.num_batches_tracked"] = np.array(count, np.int64)
        return ClientUpdate(site, params, 1, meta)

    updates = [update("site-1", [0.1, 0.1], [3.0, 1.0], 13), update("site-2", [0.1, -0.1], [5.0, 1.0], 16)]
    rule = build_rule("fedyogi", server_lr=0.5, tau=1e-3)
    result = rule.aggregate(x0, updates, rule.init_state(x0), CONTEXT)
    np.testing.assert_allclose(result.params["bn.running_mean"], [4.0, 1.0])  # plain mean, not x + eta m/(...)
    assert result.params["bn.num_batches_tracked"] == 14 and result.params["bn.num_batches_tracked"].dtype == np.int64
    assert set(result.state["m"]) == set(result.state["v"]) == {"w"}
    assert list(result.params) == list(x0)


def test_result_does_not_depend_on_client_order_and_inputs_are_not_mutated():
    rng = np.random.default_rng(3)
    x0 = {"a": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    updates = [
        ClientUpdate(f"site-{i}", {k: (v + rng.normal(0, 0.1, v.shape)).astype(np.float32) for k, v in x0.items()}, i)
        for i in range(1, 5)
    ]
    rule = build_rule("fedadam")
    state = rule.init_state(x0)
    snapshot = copy.deepcopy((x0, updates, state))
    forward = rule.aggregate(x0, updates, state, CONTEXT)
    backward = rule.aggregate(x0, updates[::-1], state, CONTEXT)
    for key in x0:
        np.testing.assert_array_equal(forward.params[key], backward.params[key])
        np.testing.assert_array_equal(forward.state["v"][key], backward.state["v"][key])
        np.testing.assert_array_equal(x0[key], snapshot[0][key])
        for u, saved in zip(updates, snapshot[1], strict=True):
            np.testing.assert_array_equal(u.params[key], saved.params[key])
    assert state == snapshot[2]


class _Result:
    def __init__(self, site, params, n):
        self.params, self.meta = params, {"client_name": site, meta_keys.NUM_SAMPLES: n}


def test_a_nan_client_is_rejected_and_the_others_aggregate_without_it():
    x0 = {"w": np.array([0.0, 1.0], np.float32)}
    good = _Result("site-1", {"w": np.array([0.2, 1.2], np.float32)}, 2)
    nan = _Result("site-2", {"w": np.array([np.nan, 1.0], np.float32)}, 2)
    inf = _Result("site-3", {"w": np.array([0.0, np.inf], np.float32)}, 2)
    updates, rejected = split_results([nan, good, inf], x0)
    assert [r.site for r in rejected] == ["site-2", "site-3"] and [u.site for u in updates] == ["site-1"]
    rule = build_rule("fedyogi")
    result = rule.aggregate(x0, updates, rule.init_state(x0), CONTEXT)
    alone = rule.aggregate(x0, [ClientUpdate("site-1", good.params, 2)], rule.init_state(x0), CONTEXT)
    np.testing.assert_array_equal(result.params["w"], alone.params["w"])
    assert np.all(np.isfinite(result.params["w"])) and x0["w"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("name", "hp", "message"),
    [
        ("fedadam", {"server_lr": 0.0}, "server_lr"),
        ("fedadam", {"beta1": 1.5}, "beta1"),
        ("fedyogi", {"tau": -1.0}, "tau"),
        ("fedadagrad", {"bias_correction": True}, "fedadam and fedyogi only"),
        ("fedavgm", {"weighting": "steps"}, "weighting"),
        ("fedadam", {"v0": float("nan")}, "v0"),
        ("fedadam", {"v0": -1e-6}, r"'v0' must be a finite number >= 0 or none \(.*\), got -1e-06"),
        ("fedyogi", {"v0": float("inf")}, r"'v0' must be a finite number >= 0 or none \(.*\), got inf"),
        ("fedadam", {"lr": 0.1}, "bad hyperparameters"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(name, hp, message):
    with pytest.raises(AggregationError, match=message):
        build_rule(name, **hp)


def test_a_stored_moment_of_the_wrong_shape_is_an_error():
    rule = build_rule("fedadam")
    state = {"m": {"w": np.zeros(3, np.float32)}, "v": {}, "step": 1}
    with pytest.raises(AggregationError, match="shape"):
        rule.aggregate(X0, [_update("site-1", [0.1, 0.1])], state, CONTEXT)


@pytest.mark.parametrize(
    ("rule", "args", "message"),
    [
        ("fedadam", {"tau": 0.0}, r"'tau' must be a finite number >= 1e-12 \(.*\), got 0.0$"),
        ("fedyogi", {"tau": 0.0}, r"'tau' must be a finite number >= 1e-12 \(.*\), got 0.0$"),
        ("fedadagrad", {"tau": -1.0}, r"'tau' must be a finite number >= 1e-12 \(.*\), got -1.0$"),
        ("fedadam", {"beta1": 1.0}, r"'beta1' must be a finite number in \[0, 1\)"),
        ("fedavgm", {"beta1": 1.0}, r"'beta1' must be a finite number in \[0, 1\)"),
        ("fedadam", {"beta2": 1.0}, r"'beta2' must be a finite number in \[0, 1\)"),
    ],
)
def test_settings_that_make_nan_or_a_frozen_moment_are_refused(rule, args, message):
    with pytest.raises(AggregationError, match=message):
        build_rule(rule, **args)


@pytest.mark.parametrize("rule", ["fedadam", "fedyogi", "fedadagrad"])
@pytest.mark.parametrize("tau", [1e-40, 1e-46, 9.99e-13])
def test_a_tau_below_the_floor_is_refused_naming_the_setting_the_range_and_why(rule, tau):
    """1e-46 is 0 in float32 (0 / 0 = NaN on an unmoved coordinate); 1e-40 turns a move of 1e-24 into ~1e13."""
    expected = f"{rule}: hyperparameter 'tau' must be a finite number >= 1e-12 (m and v are float32: v of a coordinate"
    with pytest.raises(AggregationError) as refused:
        build_rule(rule, tau=tau)
    message = str(refused.value)
    assert message.startswith(expected) and message.endswith(f"), got {tau}") and "\n" not in message
    assert TAU_FLOOR_WHY in message


def test_fedavgm_ignores_tau_so_any_tau_of_at_least_0_is_accepted():
    assert build_rule("fedavgm", tau=0.0).tau == 0.0
    refusal = r"^fedavgm: hyperparameter 'tau' must be a finite number >= 0 \(.*\), got -1.0$"
    with pytest.raises(AggregationError, match=refusal):
        build_rule("fedavgm", tau=-1.0)


@pytest.mark.parametrize(
    ("v0", "expected"),
    [
        # v0 = 0: Delta^2 = 1e-48 underflows to 0 in float32, so v = 0 and the step is eta * m / tau, with
        # m = (1 - 0.9) * 1e-24: 0.01 * 1e-25 / 1e-12 = 1e-15.
        (0.0, 1e-15),
        # v0 = tau^2 = 1e-24: v = 0.99 * 1e-24 + 0, sqrt(v) = sqrt(0.99) * 1e-12, so the step is
        # 0.01 * 1e-25 / ((1 + sqrt(0.99)) * 1e-12).
        (None, 1e-27 / ((1 + 0.99**0.5) * 1e-12)),
    ],
)
def test_tau_at_the_floor_keeps_the_step_of_an_underflowing_coordinate_finite_and_tiny(v0, expected):
    rule = build_rule("fedadam", server_lr=0.01, beta1=0.9, beta2=0.99, tau=1e-12, v0=v0)
    x, _ = _run(rule, [[np.array([1e-24, 0.0])]])
    np.testing.assert_allclose(x["w"], [expected, 0.0], rtol=1e-6, atol=0)


def test_a_coordinate_no_client_moved_stays_exactly_where_it_was():
    """Delta = sum_i p_i (y_i - x): unmoved coordinates give exactly 0 even with a tiny tau and a large x."""
    x = {"w": np.array([1234.567, -0.1, 3.0], dtype=np.float32)}
    ys = [{"w": x["w"] + np.array([0.0, 0.5, 0.0], dtype=np.float32)} for _ in range(3)]
    updates = [ClientUpdate(f"site-{i}", y, n) for i, (y, n) in enumerate(zip(ys, (7, 11, 13), strict=True))]
    rule = build_rule("fedadam", tau=1e-9, server_lr=0.1)
    result = rule.aggregate(x, updates, rule.init_state(x), RoundContext(0, 1, ("site-0", "site-1", "site-2")))
    assert result.params["w"][0] == x["w"][0] and result.params["w"][2] == x["w"][2]
    assert result.params["w"][1] != x["w"][1]
