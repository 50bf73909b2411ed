"""``aggregators.validation``: every problem with a client result is reported by key (docs/design.md, decision 8)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggregators.validation import meta_problems, num_samples_problems, param_problems

GLOBAL = {
    "conv.weight": np.zeros((2, 3), dtype=np.float32),
    "conv.bias": np.zeros(2, dtype=np.float32),
    "bn.num_batches_tracked": np.array(0, dtype=np.int64),
}


def _good() -> dict[str, np.ndarray]:
    return {
        "conv.weight": np.ones((2, 3), dtype=np.float32),
        "conv.bias": np.ones(2, dtype=np.float32),
        "bn.num_batches_tracked": np.array(7, dtype=np.int64),
    }


def _with(key: str, value) -> dict:
    params = _good()
    params[key] = value
    return params


def test_good_params_have_no_problem():
    assert param_problems(GLOBAL, _good()) == []


def test_float64_for_a_float32_parameter_is_accepted():
    assert param_problems(GLOBAL, _with("conv.bias", np.ones(2, dtype=np.float64))) == []


def test_numpy_scalar_for_a_0d_parameter_is_accepted():
    assert param_problems(GLOBAL, _with("bn.num_batches_tracked", np.int64(3))) == []


def test_missing_key_is_named():
    # Prepare
    params = _good()
    del params["conv.bias"]

    # Execute
    problems = param_problems(GLOBAL, params)

    # Assert
    assert len(problems) == 1
    assert "missing" in problems[0] and "conv.bias" in problems[0]


def test_unexpected_key_is_named():
    # Execute
    problems = param_problems(GLOBAL, _with("head.extra", np.zeros(1, dtype=np.float32)))

    # Assert
    assert len(problems) == 1
    assert "unexpected" in problems[0] and "head.extra" in problems[0]


def test_many_missing_keys_are_truncated_to_five_names():
    # Prepare
    global_params = {f"k{i:02d}": np.zeros(1) for i in range(8)}

    # Execute
    problems = param_problems(global_params, {})

    # Assert
    assert problems == ["missing parameter keys ['k00', 'k01', 'k02', 'k03', 'k04'] ..."]


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("conv.weight", np.ones((3, 2), dtype=np.float32), "shape (3, 2), expected (2, 3)"),
        ("conv.bias", np.ones((2, 1), dtype=np.float32), "shape (2, 1), expected (2,)"),
        ("bn.num_batches_tracked", np.array([7], dtype=np.int64), "shape (1,), expected ()"),
        ("conv.bias", np.array([1.0, np.nan], dtype=np.float32), "NaN or Inf"),
        ("conv.bias", np.array([np.inf, 1.0], dtype=np.float32), "NaN or Inf"),
        ("conv.weight", np.full((2, 3), -np.inf), "NaN or Inf"),
        ("conv.bias", torch.ones(2), "Tensor, expected a numpy array"),  # exchange format left as PyTorch
        ("conv.bias", [1.0, 1.0], "list, expected a numpy array"),
        ("bn.num_batches_tracked", 7, "int, expected a numpy array"),
        ("conv.bias", None, "NoneType, expected a numpy array"),
    ],
    ids=["shape-2d", "shape-extra-dim", "shape-0d", "nan", "inf", "neg-inf", "torch", "list", "python-int", "none"],
)
def test_bad_value_is_reported_naming_the_key(key, value, fragment):
    # Execute
    problems = param_problems(GLOBAL, _with(key, value))

    # Assert
    assert len(problems) == 1
    assert f"'{key}'" in problems[0]
    assert fragment in problems[0]


def test_integer_arrays_are_not_nan_checked_but_float_values_at_integer_keys_are():
    # Prepare: an int64 counter at its extreme value is a valid integer; a float NaN sent for an int key is not.
    big = np.array(np.iinfo(np.int64).max, dtype=np.int64)
    nan_for_int = np.array(np.nan, dtype=np.float64)

    # Execute / Assert
    assert param_problems(GLOBAL, _with("bn.num_batches_tracked", big)) == []
    problems = param_problems(GLOBAL, _with("bn.num_batches_tracked", nan_for_int))
    assert problems == ["parameter 'bn.num_batches_tracked' contains NaN or Inf"]


def test_every_problem_is_reported_not_only_the_first():
    # Prepare
    params = _good()
    params["conv.weight"] = np.full((2, 3), np.nan, dtype=np.float32)
    params["conv.bias"] = np.ones(5, dtype=np.float32)
    del params["bn.num_batches_tracked"]
    params["extra"] = np.zeros(1)

    # Execute
    problems = param_problems(GLOBAL, params)

    # Assert
    assert len(problems) == 4
    joined = "\n".join(problems)
    for key in ("conv.weight", "conv.bias", "bn.num_batches_tracked", "extra"):
        assert key in joined


@pytest.mark.parametrize(
    "value",
    [
        np.array(["a", "b"]),
        np.array([complex(np.nan, 0.0), 1.0 + 0.0j]),
        np.array([1.0 + 2.0j, 1.0 + 0.0j]),
    ],
    ids=["str", "complex-nan", "complex"],
)
def test_non_real_numeric_dtype_is_rejected(value):
    problems = param_problems(GLOBAL, _with("conv.bias", value))
    assert any("conv.bias" in p for p in problems)


def test_meta_problems_name_each_missing_key():
    # Prepare
    meta = {"train.num_samples": 3, "scaffold.ctrl.diff": None}

    # Execute
    problems = meta_problems(meta, ["train.num_samples", "scaffold.ctrl.diff", "feddyn.h", "fednova.a_norm"])

    # Assert
    assert problems == [
        "required meta key 'feddyn.h' is missing",
        "required meta key 'fednova.a_norm' is missing",
    ]


def test_meta_problems_with_nothing_required():
    assert meta_problems({}, []) == []
    assert meta_problems({"x.y": 1}, ()) == []


@pytest.mark.parametrize("count", [0, 1, 60_000, np.int64(5), np.int32(0), np.uint8(3)])
def test_valid_sample_counts(count):
    assert num_samples_problems(count) == []


@pytest.mark.parametrize(
    ("count", "fragment"),
    [
        (True, "integer"),
        (False, "integer"),
        (np.bool_(True), "integer"),
        (3.0, "integer"),
        (np.float64(3.0), "integer"),
        ("3", "integer"),
        (None, "integer"),
        (-1, "non-negative"),
        (np.int64(-5), "non-negative"),
    ],
)
def test_invalid_sample_counts(count, fragment):
    # Execute
    problems = num_samples_problems(count)

    # Assert
    assert len(problems) == 1
    assert fragment in problems[0]
