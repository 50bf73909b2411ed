"""benchmarks/stopping_sensitivity.py on recorded runs built by hand: every verdict derived below."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.stopping_sensitivity import main, sensitivity, targets_met

LABELS = np.zeros(4, dtype=np.int64)
RIGHT = {4: [0.9] * 4, 3: [0.9, 0.9, 0.9, 0.4], 2: [0.9, 0.9, 0.4, 0.4]}  # test p of class 0: n of 4 right


def _table(p_right: list[float]) -> np.ndarray:
    p = np.asarray(p_right)
    return np.log(np.stack([p, 1 - p], axis=1))


# Per run and round: (samples right on test of the federated models, of the local-only model). On validation the
# local-only model improves every round (p 0.6, 0.7, 0.8 on every sample) and the federated models (global and
# personal alike) improve too and stay above it (0.90, 0.92, 0.95) with a paired standard error of 0: each round the
# site's own model is that round's local-only model and it keeps that round's global model (mixtures lie between the
# two; the earlier kept model is worse). The mean kept validation loss falls every round: the rule stops after the
# last one. Gains on test, in points: seed 0: +50, 0, +25; seed 1: +50, -25, +25. The pooled split repeats the test.
RUNS = {"s0": [(4, 2), (3, 3), (4, 3)], "s1": [(4, 2), (2, 3), (4, 3)]}
LOCAL_VAL, FED_VAL = [0.6, 0.7, 0.8], [0.90, 0.92, 0.95]


@pytest.fixture
def setting(tmp_path):
    for seed, rounds in RUNS.items():
        run = tmp_path / "setting" / f"fedavgm__dir0.3__d0__{seed}"
        run.mkdir(parents=True)
        for r, (fed_right, local_right) in enumerate(rounds):
            arrays = {}
            for model, right, val in (
                ("global", fed_right, FED_VAL[r]),
                ("personal", fed_right, FED_VAL[r]),
                ("local", local_right, LOCAL_VAL[r]),
            ):
                arrays[f"{model}__val"] = _table([val] * 4)
                arrays[f"{model}__test"] = arrays[f"{model}__pooled"] = _table(RIGHT[right])
            labels = {f"labels__{split}": LABELS for split in ("val", "test", "pooled")}
            np.savez(run / f"site-1_r{r}.npz", **arrays, **labels)
    return tmp_path / "setting"


def test_every_fixed_round_and_the_rules_round_give_the_hand_derived_verdicts(setting):
    found = sensitivity(setting, patience=5, from_round=1)
    assert found["rule_rounds"] == [3, 3]
    assert found["at_rule"]["gain"] == pytest.approx((25.0, 25.0, 25.0))  # no spread over seeds: the interval is 0
    assert found["met_at_rule"] == {"own +3": True, "no pair < -2": True, "pooled +15": True}
    assert sorted(found["fixed"]) == [1, 2, 3]
    assert found["fixed"][1]["gain"][0] == pytest.approx(50.0)
    assert found["fixed"][2]["gain"][0] == pytest.approx(-12.5) and found["fixed"][2]["below2"] == 1
    assert found["fixed"][2]["pooled"][0] == pytest.approx(-12.5)
    assert found["same_verdict"] == {"own +3": 2, "no pair < -2": 2, "pooled +15": 2}  # round 2 differs
    # The -25 pair of round 2 is one test sample of 4: paired differences 0, 0, -1, 0, standard error 0.25, so 25
    # points lie within 1.96 standard errors (49 points) of 0.
    assert found["fixed"][2]["below2_within_noise"] == 1 and found["most_below2_beyond_noise"] == 0
    late = sensitivity(setting, patience=5, from_round=1, last_window=2)
    assert late["last_window"] == 2 and late["same_verdict_last"] == {"own +3": 1, "no pair < -2": 1, "pooled +15": 1}
    assert sorted(sensitivity(setting, patience=5, from_round=3)["fixed"]) == [3]


def test_an_interval_that_cannot_be_computed_is_not_above_zero():
    one_run = {"gain": (5.0, float("nan"), float("nan")), "pooled": None, "below2": 0}
    assert targets_met(one_run) == {"own +3": False, "no pair < -2": True, "pooled +15": False}


def test_the_command_prints_one_row_per_setting_and_writes_the_record_and_the_plot(setting, tmp_path, capsys):
    out = ["--json", str(tmp_path / "s.json"), "--plot", str(tmp_path / "s.png")]
    assert main([str(setting), "--from-round", "2", "--last", "1", *out]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| setting | 3")]
    same = "met; same at 1 of 2, 1 of the last 1"
    assert rows == [
        f"| setting | 3, 3 | +25.0 / +25.0 | 2–3 | {same} | {same} | {same} | -12.5 to +25.0 | -12.5 to +25.0 | 0 |"
    ]
    record = json.loads((tmp_path / "s.json").read_text())
    assert record["settings"]["setting"]["same_verdict"]["own +3"] == 1
    assert (tmp_path / "s.png").stat().st_size > 0


def test_a_folder_without_a_federated_run_is_refused(tmp_path):
    (tmp_path / "empty" / "central__dir0.3__d0__s0").mkdir(parents=True)
    with pytest.raises(ValueError, match="no recorded federated run"):
        sensitivity(tmp_path / "empty", patience=5)
    for option in ("--from-round", "--last"):
        with pytest.raises(SystemExit):
            main([str(tmp_path / "empty"), option, "0"])
