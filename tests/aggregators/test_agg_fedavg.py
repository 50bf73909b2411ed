"""FedAvg (docs/algorithms.md, FedAvg, docs/design.md decisions 6 and 7): closed-form expectations derived by hand.

Two clients A and B with sample counts 1 and 3 give p = (0.25, 0.75) throughout unless a test says otherwise.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest

from aggregators.fedavg import FedAvg, fedavg_params
from aggregators.types import AggregationError, AggregationResult, AggregationRule, ClientUpdate, RoundContext

CONTEXT = RoundContext(round_num=0, num_rounds=1, population=("site-a", "site-b"))


def _global() -> dict[str, np.ndarray]:
    return {
        "w": np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32),
        "b": np.array([0.5, -0.5], dtype=np.float32),
        "scale": np.array(1.0, dtype=np.float32),  # 0-d parameter
        "f64": np.array([0.0], dtype=np.float64),
        "bn.num_batches_tracked": np.array(5, dtype=np.int64),
    }


def _client_a() -> dict[str, np.ndarray]:
    return {
        "w": np.array([[0.0, 4.0], [8.0, -4.0]], dtype=np.float32),
        "b": np.array([1.0, 2.0], dtype=np.float32),
        "scale": np.array(2.0, dtype=np.float32),
        "f64": np.array([0.1], dtype=np.float64),
        "bn.num_batches_tracked": np.array(10, dtype=np.int64),
    }


def _client_b() -> dict[str, np.ndarray]:
    return {
        "w": np.array([[4.0, 0.0], [-8.0, 8.0]], dtype=np.float32),
        "b": np.array([3.0, -2.0], dtype=np.float32),
        "scale": np.array(6.0, dtype=np.float32),
        "f64": np.array([0.3], dtype=np.float64),
        "bn.num_batches_tracked": np.array(20, dtype=np.int64),
    }


def _updates(n_a: int = 1, n_b: int = 3) -> list[ClientUpdate]:
    return [ClientUpdate("site-a", _client_a(), n_a), ClientUpdate("site-b", _client_b(), n_b)]


# By hand, 0.25 * A + 0.75 * B:
#   w:     [[0 + 3, 1 + 0], [2 - 6, -1 + 6]] = [[3, 1], [-4, 5]]
#   b:     [0.25 + 2.25, 0.5 - 1.5]          = [2.5, -1.0]
#   scale: 0.5 + 4.5                          = 5.0
#   f64:   0.025 + 0.225                      = 0.25
#   num_batches_tracked: 2.5 + 15 = 17.5 -> rint (half to even) -> 18
EXPECTED_AVG = {
    "w": np.array([[3.0, 1.0], [-4.0, 5.0]]),
    "b": np.array([2.5, -1.0]),
    "scale": np.array(5.0),
    "f64": np.array([0.25]),
    "bn.num_batches_tracked": np.array(18),
}


def _assert_params_close(actual: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(actual[key], value, atol=1e-6, rtol=0, err_msg=key)
        assert np.shape(actual[key]) == np.shape(value), key


def _assert_bits_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        assert a[key].tobytes() == b[key].tobytes(), key


def test_sample_weighted_average_matches_hand_computation():
    # Prepare
    global_params, updates = _global(), _updates(1, 3)

    # Execute
    result = fedavg_params(global_params, updates)

    # Assert
    _assert_params_close(result, EXPECTED_AVG)


def test_weights_are_sample_counts_not_uniform():
    # Prepare: same clients, counts 3 and 1 instead of 1 and 3 -> p = (0.75, 0.25).
    # By hand: b = [0.75 + 0.75, 1.5 - 0.5] = [1.5, 1.0]; a uniform mean would give [2.0, 0.0].
    updates = _updates(3, 1)

    # Execute
    result = fedavg_params(_global(), updates)

    # Assert
    np.testing.assert_allclose(result["b"], [1.5, 1.0], atol=1e-6, rtol=0)


def test_dtypes_and_shapes_are_those_of_the_global_model():
    # Execute
    result = fedavg_params(_global(), _updates())

    # Assert
    for key, value in _global().items():
        assert np.asarray(result[key]).dtype == value.dtype, key
        assert np.shape(result[key]) == value.shape, key


def test_every_output_value_is_an_ndarray():
    # Execute
    result = fedavg_params(_global(), _updates())

    # Assert
    not_arrays = {key: type(value).__name__ for key, value in result.items() if not isinstance(value, np.ndarray)}
    assert not_arrays == {}


def test_float32_client_params_in_float64_are_cast_back_to_float32():
    # Prepare: a client that sends float64 for a float32 global parameter.
    global_params = {"w": np.zeros(3, dtype=np.float32)}
    updates = [
        ClientUpdate("a", {"w": np.array([1.0, 2.0, 3.0], dtype=np.float64)}, 1),
        ClientUpdate("b", {"w": np.array([3.0, 2.0, 1.0], dtype=np.float32)}, 1),
    ]

    # Execute
    result = fedavg_params(global_params, updates)

    # Assert
    assert result["w"].dtype == np.float32
    np.testing.assert_array_equal(result["w"], np.array([2.0, 2.0, 2.0], dtype=np.float32))


@pytest.mark.parametrize(
    ("like", "value_a", "value_b"),
    [
        (np.array(0.0, dtype=np.float32), np.array(2.0, dtype=np.float32), np.array(6.0, dtype=np.float32)),
        (np.float64(0.0), np.float64(2.0), np.float64(6.0)),  # numpy scalars (np.generic), not arrays
    ],
    ids=["0d-array", "numpy-scalar"],
)
def test_scalar_parameters(like, value_a, value_b):
    # Prepare: 0.25 * 2 + 0.75 * 6 = 5
    updates = [ClientUpdate("a", {"s": value_a}, 1), ClientUpdate("b", {"s": value_b}, 3)]

    # Execute
    result = fedavg_params({"s": like}, updates)

    # Assert
    assert np.shape(result["s"]) == ()
    assert np.asarray(result["s"]).dtype == np.asarray(like).dtype
    np.testing.assert_allclose(result["s"], 5.0, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    ("count_a", "count_b", "n_a", "n_b", "expected"),
    [
        (10, 20, 1, 3, 18),  # 17.5 -> 18 (truncation would give 17)
        (16, 17, 1, 1, 16),  # 16.5 -> 16: half to even (round-half-up would give 17)
        (2, 3, 1, 1, 2),  # 2.5 -> 2: half to even
        (3, 4, 1, 1, 4),  # 3.5 -> 4: half to even
        (1, 2, 1, 3, 2),  # 1.75 -> 2 (truncation would give 1)
        (0, 7, 2, 1, 2),  # 7/3 = 2.33 -> 2
        (100, 100, 5, 7, 100),  # equal counters stay exact
    ],
)
def test_integer_buffer_is_averaged_in_float_and_rounded_half_to_even(count_a, count_b, n_a, n_b, expected):
    # Prepare
    global_params = {"bn.num_batches_tracked": np.array(0, dtype=np.int64)}
    updates = [
        ClientUpdate("a", {"bn.num_batches_tracked": np.array(count_a, dtype=np.int64)}, n_a),
        ClientUpdate("b", {"bn.num_batches_tracked": np.array(count_b, dtype=np.int64)}, n_b),
    ]

    # Execute
    result = fedavg_params(global_params, updates)["bn.num_batches_tracked"]

    # Assert
    assert result.dtype == np.int64
    assert result.shape == ()
    assert int(result) == expected


def test_int32_buffer_keeps_its_dtype():
    # Prepare: 0.5 * [1, 4] + 0.5 * [2, 7] = [1.5, 5.5] -> rint -> [2, 6]
    global_params = {"counts": np.zeros(2, dtype=np.int32)}
    updates = [
        ClientUpdate("a", {"counts": np.array([1, 4], dtype=np.int32)}, 2),
        ClientUpdate("b", {"counts": np.array([2, 7], dtype=np.int32)}, 2),
    ]

    # Execute
    result = fedavg_params(global_params, updates)["counts"]

    # Assert
    assert result.dtype == np.int32
    np.testing.assert_array_equal(result, [2, 6])


def test_two_clients_in_either_order_give_identical_bits():
    # Prepare: with two clients, 0 + w_a*a + w_b*b is a single IEEE addition, which commutes exactly.
    global_params = _global()
    forward = _updates()

    # Execute
    result_forward = fedavg_params(global_params, forward)
    result_reversed = fedavg_params(global_params, forward[::-1])

    # Assert
    _assert_bits_equal(result_forward, result_reversed)


def test_key_order_of_client_dicts_does_not_matter():
    # Prepare: same clients, but their dicts list the keys in reverse order of the global model.
    reversed_a = dict(reversed(list(_client_a().items())))
    reversed_b = dict(reversed(list(_client_b().items())))
    updates = [ClientUpdate("site-a", reversed_a, 1), ClientUpdate("site-b", reversed_b, 3)]

    # Execute
    result = fedavg_params(_global(), updates)

    # Assert
    _assert_params_close(result, EXPECTED_AVG)
    assert list(result) == list(_global())


def _random_updates(num_clients: int, size: int, dtype) -> tuple[dict[str, np.ndarray], list[ClientUpdate]]:
    rng = np.random.default_rng(1234)
    global_params = {"w": np.zeros(size, dtype=dtype)}
    counts = [3, 7, 11, 5, 13][:num_clients]
    updates = [ClientUpdate(f"site-{i}", {"w": rng.normal(size=size).astype(dtype)}, n) for i, n in enumerate(counts)]
    return global_params, updates


def test_client_order_changes_the_result_by_rounding_only():
    # Prepare
    global_params, updates = _random_updates(4, 1000, np.float64)
    weights = np.array([u.num_samples for u in updates], dtype=np.float64)
    weights /= weights.sum()
    expected = sum(w * u.params["w"] for w, u in zip(weights, updates, strict=True))

    # Execute / Assert
    for permutation in itertools.permutations(updates):
        result = fedavg_params(global_params, list(permutation))
        np.testing.assert_allclose(result["w"], expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_client_order_invariance_is_bitwise_for_three_or_more_clients(dtype):
    # Prepare
    global_params, updates = _random_updates(4, 10_000, dtype)

    # Execute
    results = [fedavg_params(global_params, list(p)) for p in itertools.permutations(updates)]

    # Assert
    for result in results[1:]:
        _assert_bits_equal(results[0], result)


def test_inputs_are_not_mutated():
    # Prepare
    global_params, updates = _global(), _updates()
    global_before = copy.deepcopy(global_params)
    updates_before = copy.deepcopy(updates)

    # Execute
    result = fedavg_params(global_params, updates, server_lr=0.5)

    # Assert
    _assert_bits_equal(global_params, global_before)
    for update, before in zip(updates, updates_before, strict=True):
        assert update.site == before.site
        assert update.num_samples == before.num_samples
        _assert_bits_equal(dict(update.params), dict(before.params))
    for key, value in result.items():
        assert not np.shares_memory(value, global_params[key]), key
        for update in updates:
            assert not np.shares_memory(value, update.params[key]), key


@pytest.mark.parametrize("counts", [(1, 1, 1), (1, 2, 4), (5, 0, 3)])
def test_identical_clients_give_back_their_params(counts):
    # Prepare
    same = _client_a()
    updates = [ClientUpdate(f"site-{i}", copy.deepcopy(same), n) for i, n in enumerate(counts)]

    # Execute
    result = fedavg_params(_global(), updates)

    # Assert: float32 and int64 come back exactly; float64 within rounding of the weights.
    for key, value in same.items():
        if value.dtype == np.float64:
            np.testing.assert_allclose(result[key], value, atol=1e-12, rtol=0)
        else:
            np.testing.assert_array_equal(result[key], value)


def test_single_client_gives_back_its_params():
    # Execute
    result = fedavg_params(_global(), [ClientUpdate("site-a", _client_a(), 42)])

    # Assert
    _assert_params_close(result, _client_a())


def test_client_with_zero_samples_gets_zero_weight():
    # Prepare: the zero-sample client's values are huge, so any weight on them would show.
    heavy = {key: np.full_like(value, 10_000) for key, value in _client_a().items()}
    updates = [ClientUpdate("site-a", heavy, 0), ClientUpdate("site-b", _client_b(), 7)]

    # Execute
    result = fedavg_params(_global(), updates)

    # Assert
    _assert_params_close(result, _client_b())


@pytest.mark.parametrize(
    ("server_lr", "expected_w"),
    [
        # x + eta * (avg - x), avg - x = [[3-1, 1-2], [-4-3, 5-4]] = [[2, -1], [-7, 1]]
        (0.5, [[2.0, 1.5], [-0.5, 4.5]]),
        (2.0, [[5.0, 0.0], [-11.0, 6.0]]),
        (1.0, [[3.0, 1.0], [-4.0, 5.0]]),
    ],
)
def test_server_lr_moves_float_params_and_leaves_integer_buffers_at_the_average(server_lr, expected_w):
    # Execute
    result = fedavg_params(_global(), _updates(), server_lr=server_lr)

    # Assert
    np.testing.assert_allclose(result["w"], expected_w, atol=1e-6, rtol=0)
    # scale: 1 + eta * (5 - 1)
    np.testing.assert_allclose(result["scale"], 1.0 + server_lr * 4.0, atol=1e-6, rtol=0)
    # Integer buffer: the (rounded) average 18, never 5 + eta * (17.5 - 5).
    assert result["bn.num_batches_tracked"].dtype == np.int64
    assert int(result["bn.num_batches_tracked"]) == 18
    assert result["w"].dtype == np.float32


@pytest.mark.parametrize("server_lr", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_invalid_server_lr_is_rejected(server_lr):
    with pytest.raises(AggregationError, match="server_lr"):
        FedAvg(server_lr=server_lr)


def test_empty_update_list_is_an_aggregation_error():
    with pytest.raises(AggregationError):
        fedavg_params(_global(), [])


@pytest.mark.parametrize("counts", [(0, 0), (0,), (-1, 1), (3, -1)])
def test_zero_total_weight_or_negative_count_is_an_aggregation_error(counts):
    # Prepare
    updates = [ClientUpdate(f"site-{i}", _client_a(), n) for i, n in enumerate(counts)]

    # Execute / Assert
    with pytest.raises(AggregationError, match="sample counts"):
        fedavg_params(_global(), updates)


def test_shape_mismatch_is_an_aggregation_error_not_a_silent_broadcast():
    # Prepare
    global_params = {"w": np.zeros(3, dtype=np.float32)}
    updates = [
        ClientUpdate("a", {"w": np.ones(3, dtype=np.float32)}, 1),
        ClientUpdate("b", {"w": np.array([5.0], dtype=np.float32)}, 1),
    ]

    # Execute / Assert
    with pytest.raises(AggregationError):
        fedavg_params(global_params, updates)


# --- the rule object -------------------------------------------------------------------------------------------


def test_rule_satisfies_the_protocol_and_is_stateless():
    # Prepare
    rule = FedAvg()

    # Assert
    assert isinstance(rule, AggregationRule)
    assert rule.name == "fedavg"
    assert rule.required_meta == ()
    assert rule.server_lr == 1.0
    assert rule.init_state(_global()) == {}
    assert rule.broadcast_meta({}) == {}


def test_rule_aggregate_matches_hand_values_and_returns_state_unchanged():
    # Prepare
    rule = FedAvg()
    state = {"anything": 3, "nested": {"k": "v"}}
    state_before = copy.deepcopy(state)

    # Execute
    result = rule.aggregate(_global(), _updates(), state, CONTEXT)

    # Assert
    assert isinstance(result, AggregationResult)
    _assert_params_close(result.params, EXPECTED_AVG)
    assert result.state == state_before
    assert result.state is not state
    assert state == state_before
    assert result.meta == {}


def test_rule_uses_its_server_lr():
    # Execute
    result = FedAvg(server_lr=0.5).aggregate(_global(), _updates(), {}, CONTEXT)

    # Assert
    np.testing.assert_allclose(result.params["w"], [[2.0, 1.5], [-0.5, 4.5]], atol=1e-6, rtol=0)
    assert int(result.params["bn.num_batches_tracked"]) == 18
