"""Capture files of attack-adaptive aggregation: written per round under a timestamped run folder, read back."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aggregators.capture import CapturedRound, CaptureError, new_run_dir, read_capture, read_round, write_round

META = {"input_width": 3, "pca_components": 10, "layer_shapes": {"w": [3]}}


def _record(round_num: int) -> CapturedRound:
    return CapturedRound(
        round_num=round_num,
        projections=np.arange(6, dtype=np.float32).reshape(2, 3) + round_num,
        malicious=np.array([False, True]),
        num_samples=np.array([10, 20], dtype=np.int64),
        sites=("site-1", "site-2"),
    )


def test_round_trip(tmp_path) -> None:
    run_dir = new_run_dir(tmp_path / "capture")
    assert not run_dir.exists()  # created by the first round only
    for r in range(2):
        write_round(run_dir, _record(r), META)
    assert sorted(p.name for p in run_dir.iterdir()) == ["metadata.json", "round_00000.pt", "round_00001.pt"]
    back = read_round(run_dir / "round_00001.pt")
    np.testing.assert_array_equal(back.projections, _record(1).projections)
    np.testing.assert_array_equal(back.malicious, [False, True])
    np.testing.assert_array_equal(back.num_samples, [10, 20])
    assert back.sites == ("site-1", "site-2") and back.round_num == 1
    metadata, rounds = read_capture(tmp_path / "capture")
    assert metadata["input_width"] == 3 and len(rounds) == 2 and len(metadata["runs"]) == 1
    assert json.loads((run_dir / "metadata.json").read_text())["format"] == "attack_adaptive.capture/1"


def test_runs_for_different_models_are_refused(tmp_path) -> None:
    write_round(tmp_path / "a", _record(0), META)
    write_round(tmp_path / "b", _record(0), {**META, "layer_shapes": {"v": [3]}})
    with pytest.raises(CaptureError, match="another model"):
        read_capture(tmp_path)


def test_inconsistent_record_and_empty_folder_are_errors(tmp_path) -> None:
    bad = CapturedRound(0, np.zeros((2, 3), np.float32), np.array([True]), np.array([1, 1]), ("a", "b"))
    with pytest.raises(CaptureError, match="disagree"):
        write_round(tmp_path / "run", bad, META)
    with pytest.raises(CaptureError, match="no capture run"):
        read_capture(tmp_path / "empty")
