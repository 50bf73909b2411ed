"""The wire contract: every message round-trips through meta, and bad meta is named by key, never raised."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import ControlVariate, FedDynReport, FedNovaReport, RoundInfo, TrainingStats

SHAPES = {"w": (2, 2), "b": (2,)}
CONTROL = {"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float32)}


@pytest.mark.parametrize(
    "message",
    [
        RoundInfo(3, 10, "scaffold", "run-1"),
        RoundInfo(0, 1, "fedavg", "", last_aggregated={"site-1": 0, "site-2": 4}),
        FedNovaReport(12, 11.5),
        FedDynReport(0.01, ("w", "b")),
        TrainingStats(120, 8, 0.25, ("w", "b")),
    ],
)
def test_messages_round_trip(message):
    parsed = type(message).from_meta(message.to_meta())
    assert parsed.ok and parsed.value == message


def test_a_control_round_trips_in_float32_and_keeps_its_keys():
    meta = ControlVariate(meta_keys.SCAFFOLD_CTRL_DIFF, CONTROL).to_meta()
    parsed = ControlVariate.from_meta(meta, meta_keys.SCAFFOLD_CTRL_DIFF, SHAPES, allow_empty=False)
    assert parsed.ok and set(parsed.value.arrays) == {"w", "b"}
    assert all(a.dtype == np.float32 for a in meta[meta_keys.SCAFFOLD_CTRL_DIFF].values())


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"w": np.full((2, 2), np.nan, np.float32), "b": CONTROL["b"]}, "entry 'w' contains NaN or Inf"),
        ({"w": np.full((2, 2), np.inf, np.float32), "b": CONTROL["b"]}, "entry 'w' contains NaN or Inf"),
        ({"w": np.ones(3, np.float32), "b": CONTROL["b"]}, "entry 'w' has shape (3,), the parameter has (2, 2)"),
        ({"w": CONTROL["w"]}, "missing ['b']"),
        ({**CONTROL, "x": np.ones(1, np.float32)}, "unexpected ['x']"),
        ({"w": [[1.0, 1.0], [1.0, 1.0]], "b": CONTROL["b"]}, "must be a float numpy array"),
        ("zeros", "must be a dict of arrays"),
    ],
)
def test_bad_controls_are_named_by_key(value, message):
    key = meta_keys.SCAFFOLD_CTRL_GLOBAL
    parsed = ControlVariate.from_meta({key: value}, key, SHAPES, allow_empty=True)
    assert parsed.value is None and message in parsed.problems[key]


def test_an_empty_global_control_means_zero_but_an_empty_diff_is_refused():
    assert ControlVariate.from_meta({"k": {}}, "k", SHAPES, allow_empty=True).value.arrays == {}
    assert not ControlVariate.from_meta({"k": {}}, "k", SHAPES, allow_empty=False).ok


def test_every_bad_scalar_is_named_by_its_key():
    parsed = FedNovaReport.from_meta({meta_keys.FEDNOVA_TAU: 0, meta_keys.FEDNOVA_A_NORM: float("nan")})
    assert set(parsed.problems) == {meta_keys.FEDNOVA_TAU, meta_keys.FEDNOVA_A_NORM}
    parsed = TrainingStats.from_meta({meta_keys.NUM_SAMPLES: -1, meta_keys.NUM_STEPS: True})
    assert set(parsed.problems) == {
        meta_keys.NUM_SAMPLES,
        meta_keys.NUM_STEPS,
        meta_keys.TRAIN_LOSS,
        meta_keys.PARAM_KEYS,
    }
    assert not RoundInfo.from_meta({}).ok


ROUND_META = {
    meta_keys.ROUND: 2,
    meta_keys.NUM_ROUNDS: 5,
    meta_keys.AGGREGATION_RULE: "scaffold",
    meta_keys.RUN_ID: "r",
}


@pytest.mark.parametrize(
    ("changes", "key", "problem"),
    [
        ({meta_keys.ROUND: 5}, meta_keys.ROUND, "must be below num_rounds=5, got 5"),
        ({meta_keys.ROUND: -1}, meta_keys.ROUND, "must be an integer >= 0, got -1"),
        ({meta_keys.NUM_ROUNDS: 0}, meta_keys.NUM_ROUNDS, "must be an integer >= 1, got 0"),
        ({meta_keys.RUN_ID: None}, meta_keys.RUN_ID, "must be text, got None"),
        ({meta_keys.AGGREGATION_RULE: 3}, meta_keys.AGGREGATION_RULE, "must be text, got 3"),
        ({meta_keys.LAST_AGGREGATED: [1]}, meta_keys.LAST_AGGREGATED, "must be a dict of site name -> round, got list"),
        (
            {meta_keys.LAST_AGGREGATED: {"site-1": 1, "site-2": -1, "site-3": "2"}},
            meta_keys.LAST_AGGREGATED,
            "must map site names to rounds >= 0; bad entries for ['site-2', 'site-3']",
        ),
    ],
)
def test_round_info_names_each_bad_entry_by_key(changes, key, problem):
    parsed = RoundInfo.from_meta({**ROUND_META, **changes})
    assert parsed.value is None and parsed.problems == {key: problem}


def test_round_info_without_confirmations_reads_as_none():
    parsed = RoundInfo.from_meta(ROUND_META)
    assert parsed.ok and parsed.value.last_aggregated is None
    assert meta_keys.LAST_AGGREGATED not in parsed.value.to_meta()
