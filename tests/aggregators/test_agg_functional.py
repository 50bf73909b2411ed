"""The shared kernels of the rules: the blocked weighted sum and the streamed delta statistics, against plain numpy."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators import deltas, functional
from aggregators.types import AggregationError


def _arrays(shape, count=5, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(count)]


@pytest.mark.parametrize("block", [1, 7, 1 << 15])
@pytest.mark.parametrize("shape", [(), (13,), (4, 9)])
def test_blocked_sum_is_bit_identical_to_the_unblocked_float64_loop(monkeypatch, block, shape):
    monkeypatch.setattr(functional, "BLOCK", block)
    arrays, weights = _arrays(shape), [0.1, 0.2, 0.3, 0.15, 0.25]
    expected = np.zeros(shape)
    for w, a in zip(weights, arrays, strict=True):  # independent reference: 0 + w_1 a_1 + w_2 a_2 + ...
        expected = expected + np.asarray(a, dtype=np.float64) * w
    got = functional.weighted_sum(arrays, weights, arrays[0], dtype=np.float64)
    assert got.dtype == np.float64 and got.shape == np.shape(arrays[0])
    assert got.tobytes() == expected.tobytes()
    mean = functional.weighted_mean(arrays, np.array(weights), arrays[0])
    assert mean.dtype == np.float32 and mean.tobytes() == expected.astype(np.float32).tobytes()


def test_differences_are_formed_before_weighting(monkeypatch):
    monkeypatch.setattr(functional, "BLOCK", 3)
    x = np.array([1e8, 1.0, -2.5, 7.0], dtype=np.float32)
    moved = x.copy()
    moved[1] += 0.5
    got = functional.weighted_sum([x, moved, x], [1 / 3, 1 / 3, 1 / 3], x, minus=x)
    np.testing.assert_array_equal(got[[0, 2, 3]], 0.0)  # unmoved coordinates are exactly 0 even at 1e8
    assert got[1] == pytest.approx(0.5 / 3, abs=1e-6)


@pytest.mark.parametrize("block", [3, 1 << 15])
def test_a_weighted_step_is_x_plus_the_weighted_deltas_and_gives_an_unmoved_x_back_bit_for_bit(monkeypatch, block):
    monkeypatch.setattr(functional, "BLOCK", block)
    x = _arrays((50,), count=1, seed=3)[0] * np.float32(100)
    weights = [0.13, 0.41, 0.29, 0.35]  # sum 1.18: the rearranged (1 - sum w) x + sum w y moved x
    unmoved = functional.weighted_step(x, [x.copy() for _ in weights], weights)
    assert unmoved.dtype == np.float32 and unmoved.tobytes() == x.tobytes()
    ys = [x + d for d in _arrays((50,), count=4, seed=4)]
    expected = x.astype(np.float64) + sum(w * (y.astype(np.float64) - x) for w, y in zip(weights, ys, strict=True))
    got = functional.weighted_step(x, ys, weights)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_max_ulp(got, expected.astype(np.float32), maxulp=2)  # float32 round-off


def test_integer_buffers_are_averaged_in_float_and_rounded_back():
    counters = [np.array(10, dtype=np.int64), np.array(13, dtype=np.int64)]
    got = functional.weighted_mean(counters, np.array([0.5, 0.5]), counters[0])
    assert got.dtype == np.int64 and int(got) == 12  # rint(11.5) = 12 (round half to even)


def test_wrong_shapes_and_weight_counts_are_refused():
    arrays = _arrays((4,), count=2)
    with pytest.raises(AggregationError, match="shape"):
        functional.weighted_sum([arrays[0], np.zeros(5, np.float32)], [0.5, 0.5], arrays[0])
    with pytest.raises(AggregationError, match="weights"):
        functional.weighted_sum(arrays, [1.0], arrays[0])


@pytest.mark.parametrize("chunk", [2, 1 << 14])
def test_delta_statistics_match_numpy(monkeypatch, chunk):
    monkeypatch.setattr(deltas, "CHUNK", chunk)
    x = _arrays((3, 5), count=1, seed=1)[0]
    ys = _arrays((3, 5), count=4, seed=2)
    w = np.array([0.1, 0.2, 0.3, 0.4])
    d = np.stack([(y.astype(np.float64) - x).reshape(-1) for y in ys])  # independent: float64 deltas
    mean = w @ d
    dots, norms, mean_norm = deltas.delta_alignment(x, ys, w)
    np.testing.assert_allclose(dots, d @ mean, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(norms, (d**2).sum(axis=1), rtol=1e-6, atol=1e-9)
    assert mean_norm == pytest.approx(float(mean @ mean), rel=1e-6)
    np.testing.assert_allclose(deltas.delta_sq_norms(x, ys), (d**2).sum(axis=1), rtol=1e-6, atol=1e-9)
