"""benchmarks/candidate_headroom.py on a recorded run built by hand: every column's value derived below."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.candidate_headroom import headroom, main

LABELS = np.zeros(4, dtype=np.int64)


def _table(p_right: list[float]) -> np.ndarray:
    """Per sample, the true class (0) at probability p (right where p > 0.5)."""
    p = np.asarray(p_right)
    return np.log(np.stack([p, 1 - p], axis=1))


# Per round: (validation p, test p) of each model. The own (local-only) model is the same every round, so it stays
# round 0's (test 3 of 4 right). The personal model is confident on validation in round 0 (test 2 of 4) and less so
# in round 1 (test 4 of 4): validation early-stops it at round 0. The global model is round 0's (1 of 4) both ways.
ROUNDS = [
    {
        "local": ([0.8] * 4, [0.9, 0.9, 0.9, 0.4]),
        "personal": ([0.9] * 4, [0.9, 0.9, 0.4, 0.4]),
        "global": ([0.55] * 4, [0.9, 0.4, 0.4, 0.4]),
    },
    {
        "local": ([0.8] * 4, [0.9, 0.9, 0.9, 0.4]),
        "personal": ([0.6] * 4, [0.9] * 4),
        "global": ([0.55] * 4, [0.9, 0.4, 0.4, 0.4]),
    },
]


@pytest.fixture
def setting(tmp_path):
    run = tmp_path / "setting" / "fedavgm__dir0.3__d0__s0"
    run.mkdir(parents=True)
    (tmp_path / "setting" / "central__dir0.3__d0__s0").mkdir()  # a central cell: not a federation, left out
    for r, models in enumerate(ROUNDS):
        arrays = {
            f"{m}__{split}": _table(p) for m, ps in models.items() for split, p in zip(("val", "test"), ps, strict=True)
        }
        np.savez(run / f"site-1_r{r}.npz", **arrays, labels__val=LABELS, labels__test=LABELS)
    return tmp_path / "setting"


def test_every_column_is_the_hand_derived_value(setting):
    # The shipped rule keeps round 0's personal model (lower validation loss on every sample: paired SE 0) and in
    # round 1 keeps it again over the round's models and mixtures (it is the earlier kept, still best on validation).
    found = headroom(setting, patience=None)
    assert found["sites"] == 1
    expected = {
        "own": 75.0,
        "kept": -25.0,
        "global early-stopped": -50.0,
        "global last": -50.0,
        "personal early-stopped": -25.0,
        "personal last": 25.0,
        "best on test": 0.0,  # of own (75), personal early-stopped (50) and global (25)
    }
    assert found["mean"] == pytest.approx(expected, abs=1e-9)


def test_the_command_prints_one_row_per_setting_and_writes_the_record(setting, tmp_path, capsys):
    assert main([str(setting), "--patience", "0", "--json", str(tmp_path / "h.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| setting | 1 ")]
    assert rows == ["| setting | 1 | 75.0 | -25.0 | -50.0 | -50.0 | -25.0 | +25.0 | +0.0 |"]
    assert (tmp_path / "h.json").exists()
