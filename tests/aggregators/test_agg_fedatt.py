"""FedAtt: layer-wise softmax attention over Frobenius distances, step epsilon, noise on trainable floats only."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.fedatt import softmax
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext

CONTEXT = RoundContext(round_num=0, num_rounds=3, population=("site-1", "site-2"))


def _update(site, params, n=1, meta=None):
    return ClientUpdate(site=site, params=params, num_samples=n, meta=meta or {})


def test_scalar_layer_closed_form_from_algorithms_md():
    # w_t = 0, clients at 1 and 3, epsilon 1.2, beta 0: s = (1, 3), alpha = (e, e^3)/(e + e^3),
    # w = 1.2 * (0.119203 + 3 * 0.880797) = 3.313913
    x0 = {"w": np.array([0.0], np.float32)}
    updates = [
        _update("site-1", {"w": np.array([1.0], np.float32)}),
        _update("site-2", {"w": np.array([3.0], np.float32)}),
    ]
    rule = build_rule("fedatt", epsilon=1.2, noise=0.0)
    result = rule.aggregate(x0, updates, rule.init_state(x0), CONTEXT)
    alpha = np.exp([1.0, 3.0]) / np.exp([1.0, 3.0]).sum()
    np.testing.assert_allclose(result.params["w"], [1.2 * (alpha[0] * 1 + alpha[1] * 3)], atol=1e-6)
    assert result.params["w"][0] == pytest.approx(3.3139128, abs=1e-6)


def test_attention_is_per_layer_frobenius_and_sample_counts_are_ignored():
    x0 = {"a": np.zeros((2, 2), np.float32), "b": np.zeros(3, np.float32)}
    first = {"a": np.full((2, 2), 0.5, np.float32), "b": np.array([0.0, 0.0, 0.1], np.float32)}  # ||a|| = 1
    second = {"a": np.zeros((2, 2), np.float32), "b": np.array([0.0, 0.4, 0.3], np.float32)}  # ||b|| = 0.5
    rule = build_rule("fedatt", epsilon=1.0, noise=0.0)
    result = rule.aggregate(x0, [_update("site-1", first, 100), _update("site-2", second, 1)], {}, CONTEXT)
    alpha_a = softmax(np.array([1.0, 0.0]))
    alpha_b = softmax(np.array([0.1, 0.5]))
    np.testing.assert_allclose(result.params["a"], alpha_a[0] * first["a"], atol=1e-6)
    np.testing.assert_allclose(result.params["b"], alpha_b[0] * first["b"] + alpha_b[1] * second["b"], atol=1e-6)


def test_noise_is_added_to_trainable_floats_only_and_is_reproducible():
    x0 = {
        "w": np.zeros(1000, np.float32),
        "bn.running_var": np.ones(4, np.float32),
        "bn.num_batches_tracked": np.array(5, np.int64),
    }
    client = {"w": np.zeros(1000, np.float32), "bn.running_var": np.full(4, 3.0, np.float32)}
    client["bn.num_batches_tracked"] = np.array(9, np.int64)
    updates = [_update("site-1", client, meta={meta_keys.PARAM_KEYS: ["w"]})]
    rule = build_rule("fedatt", epsilon=1.0, noise=0.01, seed=7)
    first = rule.aggregate(x0, updates, {}, CONTEXT)
    again = rule.aggregate(x0, updates, {}, CONTEXT)
    later = rule.aggregate(x0, updates, {}, RoundContext(round_num=1, num_rounds=3, population=CONTEXT.population))
    assert np.std(first.params["w"]) == pytest.approx(0.01, rel=0.1)
    np.testing.assert_array_equal(first.params["w"], again.params["w"])
    assert not np.array_equal(first.params["w"], later.params["w"])
    np.testing.assert_array_equal(first.params["bn.running_var"], np.full(4, 3.0, np.float32))  # averaged, no noise
    assert first.params["bn.num_batches_tracked"] == 9 and first.params["bn.num_batches_tracked"].dtype == np.int64


def test_large_distances_do_not_overflow_and_order_does_not_matter():
    x0 = {"w": np.zeros(4, np.float32)}
    updates = [_update(f"site-{i}", {"w": np.full(4, 500.0 * i, np.float32)}) for i in (1, 2, 3)]
    snapshot = copy.deepcopy(updates)
    rule = build_rule("fedatt", epsilon=1.0, noise=0.0)
    forward = rule.aggregate(x0, updates, {}, CONTEXT)
    backward = rule.aggregate(x0, updates[::-1], {}, CONTEXT)
    np.testing.assert_allclose(forward.params["w"], np.full(4, 1500.0), rtol=1e-6)  # saturates on the farthest
    np.testing.assert_array_equal(forward.params["w"], backward.params["w"])
    for u, saved in zip(updates, snapshot, strict=True):
        np.testing.assert_array_equal(u.params["w"], saved.params["w"])


@pytest.mark.parametrize("hp", [{"epsilon": 0.0}, {"epsilon": -1.0}, {"noise": -0.1}, {"seed": -1}, {"noise": True}])
def test_bad_hyperparameters(hp):
    with pytest.raises(AggregationError, match="fedatt"):
        build_rule("fedatt", **hp)
