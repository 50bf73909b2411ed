"""``controllers.checkpoint``: the rule-state checkpoint (atomic, versioned) and the per-round JSON-lines log."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from controllers import checkpoint
from controllers.checkpoint import (
    STATE_FORMAT_VERSION,
    append_metrics,
    atomic_torch_save,
    load_rule_state,
    save_rule_state,
)


def _state() -> dict:
    base = np.arange(6, dtype=np.float64).reshape(2, 3)
    return {
        "m": {"fc.weight": np.array([[0.5, -1.5]], dtype=np.float32), "fc.bias": np.zeros(2, dtype=np.float32)},
        "v": {"fc.weight": np.array([[1e-8, 2.0]], dtype=np.float32)},
        "count": np.array([3, 4], dtype=np.int64),
        "flags": np.array([True, False]),
        "reversed": base[::-1],  # negative strides
        "transposed": base.T,  # Fortran-ordered view
        "per_site": {"site-1": {"angle": np.array(0.25)}, "site-2": {"angle": np.array(1.0)}},
        "history": [np.array([1.0]), np.array([2.0, 3.0])],
        "step": 7,
        "lr": 0.01,
        "name": "adam",
        "none": None,
    }


def _assert_same_tree(actual, expected, where="state"):
    if isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), where
        assert actual.dtype == expected.dtype, where
        np.testing.assert_array_equal(actual, expected, err_msg=where)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), where
        for key in expected:
            _assert_same_tree(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same_tree(a, e, f"{where}[{i}]")
    else:
        assert actual == expected and type(actual) is type(expected), where


def test_rule_state_round_trip(tmp_path):
    # Prepare
    path = tmp_path / "app" / "server_state.pt"
    state = _state()

    # Execute
    save_rule_state(path, "fedyogi", 4, state)
    round_num, loaded = load_rule_state(path, "fedyogi")

    # Assert
    assert round_num == 4
    _assert_same_tree(loaded, _state())


def test_saved_state_is_a_plain_tensor_payload(tmp_path):
    # Prepare
    path = tmp_path / "server_state.pt"

    # Execute
    save_rule_state(path, "fedavg", 0, {"x": np.ones(2, dtype=np.float32)})
    payload = torch.load(path, weights_only=True)

    # Assert
    assert payload["format_version"] == STATE_FORMAT_VERSION
    assert payload["rule"] == "fedavg"
    assert payload["round"] == 0
    assert isinstance(payload["state"]["x"], torch.Tensor)


def test_saving_copies_the_arrays(tmp_path):
    # Prepare
    path = tmp_path / "server_state.pt"
    array = np.zeros(3, dtype=np.float32)

    # Execute
    save_rule_state(path, "fedavg", 0, {"x": array})
    array[:] = 9.0
    _, loaded = load_rule_state(path, "fedavg")

    # Assert
    np.testing.assert_array_equal(loaded["x"], np.zeros(3, dtype=np.float32))


def test_empty_state_round_trip(tmp_path):
    # Execute
    save_rule_state(tmp_path / "s.pt", "fedavg", 2, {})

    # Assert
    assert load_rule_state(tmp_path / "s.pt", "fedavg") == (2, {})


def test_state_of_another_rule_is_refused(tmp_path):
    # Prepare
    path = tmp_path / "server_state.pt"
    save_rule_state(path, "fedadam", 1, {"m": np.zeros(1)})

    # Execute / Assert
    with pytest.raises(ValueError, match=r"'fedadam'.*'fedyogi'"):
        load_rule_state(path, "fedyogi")


@pytest.mark.parametrize("version", [STATE_FORMAT_VERSION + 1, 0, None, "1"])
def test_state_of_another_format_version_is_refused(tmp_path, version):
    # Prepare
    path = tmp_path / "server_state.pt"
    torch.save({"format_version": version, "rule": "fedavg", "round": 0, "state": {}}, path)

    # Execute / Assert
    with pytest.raises(ValueError, match="unsupported server state format"):
        load_rule_state(path, "fedavg")


def test_state_without_format_version_is_refused(tmp_path):
    # Prepare
    path = tmp_path / "server_state.pt"
    torch.save({"rule": "fedavg", "round": 0, "state": {}}, path)

    # Execute / Assert
    with pytest.raises(ValueError, match="unsupported server state format"):
        load_rule_state(path, "fedavg")


def test_atomic_save_leaves_only_the_target_file(tmp_path):
    # Prepare
    path = tmp_path / "deep" / "er" / "model.pt"

    # Execute
    atomic_torch_save({"v": torch.tensor([1.0])}, path)
    atomic_torch_save({"v": torch.tensor([2.0])}, path)  # overwrite

    # Assert
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]
    assert torch.equal(torch.load(path, weights_only=True)["v"], torch.tensor([2.0]))


@pytest.mark.parametrize("exc_type", [RuntimeError, OSError, KeyboardInterrupt])
def test_failed_save_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch, exc_type):
    # Prepare
    path = tmp_path / "server_state.pt"
    atomic_torch_save({"v": torch.tensor([1.0])}, path)
    old_bytes = path.read_bytes()

    def half_written_then_fail(obj, handle, *args, **kwargs):
        handle.write(b"partial garbage")
        raise exc_type("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", half_written_then_fail)

    # Execute
    with pytest.raises(exc_type):
        atomic_torch_save({"v": torch.tensor([2.0])}, path)

    # Assert
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server_state.pt"]
    assert path.read_bytes() == old_bytes


def test_failed_first_save_leaves_nothing(tmp_path, monkeypatch):
    # Prepare
    def fail(obj, handle, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(checkpoint.torch, "save", fail)

    # Execute
    with pytest.raises(RuntimeError):
        save_rule_state(tmp_path / "server_state.pt", "fedavg", 0, {})

    # Assert
    assert list(tmp_path.iterdir()) == []


def _strict_json(line: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON constant {token}")

    return json.loads(line, parse_constant=refuse)


def test_append_metrics_writes_valid_json_lines(tmp_path):
    # Prepare
    path = tmp_path / "metrics" / "round_metrics.jsonl"
    first = {
        "round": np.int64(3),
        "accuracy": np.float32(0.5),
        "loss": float("nan"),
        "grad": float("inf"),
        "worst": np.float64(-np.inf),
        "nan64": np.float64("nan"),
        "sites": ["site-1", "site-2"],
        "per_site": {"site-1": np.float16(0.25), "site-2": (np.int32(7), float("nan"))},
        "elapsed_s": 1.25,
        "none": None,
        "flag": True,
        1: "int key",
    }
    second = {"stage": "initial", "round": None}

    # Execute
    append_metrics(path, first)
    append_metrics(path, second)

    # Assert
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    parsed = _strict_json(lines[0])
    assert parsed == {
        "round": 3,
        "accuracy": 0.5,
        "loss": None,
        "grad": None,
        "worst": None,
        "nan64": None,
        "sites": ["site-1", "site-2"],
        "per_site": {"site-1": 0.25, "site-2": [7, None]},
        "elapsed_s": 1.25,
        "none": None,
        "flag": True,
        "1": "int key",
    }
    assert type(parsed["round"]) is int
    assert _strict_json(lines[1]) == second


def test_append_metrics_keeps_float_values(tmp_path):
    # Prepare
    path = tmp_path / "m.jsonl"

    # Execute
    append_metrics(path, {"a": np.float32(0.1), "b": 1e-300, "c": -0.0})

    # Assert
    parsed = _strict_json(path.read_text())
    assert parsed["a"] == float(np.float32(0.1))
    assert parsed["b"] == 1e-300
    assert parsed["c"] == 0.0 and math.copysign(1.0, parsed["c"]) == -1.0


@pytest.mark.parametrize(
    ("value", "expected"),
    [(np.bool_(True), True), (np.array(0.5), 0.5), (np.array([1.0, np.nan]), [1.0, None])],
    ids=["np.bool_", "0d-array", "1d-array"],
)
def test_append_metrics_converts_other_numpy_values(tmp_path, value, expected):
    # Prepare
    path = tmp_path / "m.jsonl"

    # Execute
    append_metrics(path, {"x": value})

    # Assert
    assert _strict_json(path.read_text()) == {"x": expected}


def test_save_updates_round_trips_through_load_updates(tmp_path):
    from aggregators.types import ClientUpdate
    from controllers.checkpoint import load_updates, save_updates

    updates = [
        ClientUpdate("site-1", {"w": np.array([1.0, 2.0], np.float32), "n": np.array(3, np.int64)}, 10),
        ClientUpdate("site-2", {"w": np.array([3.0, 4.0], np.float32), "n": np.array(5, np.int64)}, 30),
    ]
    path = tmp_path / "round_00000.npz"
    save_updates(path, updates, {"w": np.array([2.5, 3.5], np.float32), "n": np.array(4, np.int64)})
    capture = load_updates(path)
    assert capture.site_samples == {"site-1": 10, "site-2": 30}
    assert set(capture.site_params) == {"site-1", "site-2"} and set(capture.site_params["site-1"]) == {"w", "n"}
    np.testing.assert_array_equal(capture.site_params["site-2"]["w"], [3.0, 4.0])
    np.testing.assert_array_equal(capture.global_params["w"], np.array([2.5, 3.5], np.float32))
    assert capture.global_params["n"].dtype == np.int64
