"""The stopping rule across a resume: a job stopped and resumed stops after the round the uninterrupted job
stops after, because the rule's history (controllers/stopping.py) is checkpointed with the rule state and restored.

Driven through the controller's ``run()`` with the in-process fakes of tests/controllers/test_ctl_resume.py, whose
sites here also report their kept model's validation loss (``eval.kept_val_loss``) every round.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from aggregators.contracts import meta_keys
from aggregators.contracts.run_records import completion_problems, stop_note
from controllers.fedalg_controller import STATE_FILE
from controllers.stopping import Plateau
from tests.controllers.test_ctl_resume import FakeEngineController

NUM_ROUNDS = 10
PATIENCE = 3
#: The sites' common validation loss per round: best 0.5 at round 2 (0-based), rounds 3, 4, 5 are worse, so with
#: patience 3 the uninterrupted job stops after round 5 (t - argmin = 5 - 2 >= 3), with all sites a round or two of
#: three (the sites not sampled count with their latest score). Each later round improves, so a rule that forgot
#: the rounds before a resume after round 2, 3 or 4 would not stop after round 5 and would run all 10 rounds.
LOSS = (1.0, 0.7, 0.5, 0.8, 0.8, 0.8, 0.3, 0.2, 0.1, 0.0)
STOPS_AFTER = 5
#: Each site's offset on top of LOSS: with two sites a round, the mean over the sites' latest scores depends on the
#: scores the sites not sampled this round reported before (the rule's ``latest``), which must survive as well.
OFFSET = {"site-1": 0.0, "site-2": 0.25, "site-3": 0.5}


class ScoringSitesController(FakeEngineController):
    """Sites that report ``LOSS[round] + OFFSET[site]`` as their kept model's validation loss with every result; the
    controller's info lines are kept in ``infos``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.infos: list[str] = []

    def info(self, msg, *args, **kwargs) -> None:
        self.infos.append(msg)

    def send_model_and_wait(self, targets, data, min_responses=None, timeout=0):
        results = super().send_model_and_wait(targets, data, min_responses, timeout)
        for result in results:
            loss = LOSS[data.current_round] + OFFSET[result.meta["client_name"]]
            result.meta[meta_keys.eval_key("kept_val_loss")] = loss
        return results


def _records(app_dir: Path) -> list[dict]:
    lines = (app_dir.parent / "metrics" / "round_metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _rounds(app_dir: Path) -> list[dict]:
    return [r for r in _records(app_dir) if r.get("stage") == "round"]


def _run(tmp_path: Path, name: str, **settings) -> ScoringSitesController:
    settings = {"server": "fedavg", "num_rounds": NUM_ROUNDS, "stop_patience": PATIENCE, **settings}
    controller = ScoringSitesController(tmp_path / name / "app", **settings)
    controller.run()
    return controller


@pytest.mark.parametrize("clients_per_round", [None, 2], ids=["all-sites", "two-of-three"])
@pytest.mark.parametrize("interrupted_after", [2, 3, 4])
def test_a_resumed_job_stops_after_the_round_the_uninterrupted_job_stops_after(
    tmp_path, clients_per_round, interrupted_after
) -> None:
    straight = _run(tmp_path, "straight", clients_per_round=clients_per_round)
    straight_rounds = _rounds(straight.app_dir)
    stopped_after = straight_rounds[-1]["round"]
    assert "stopped" in straight_rounds[-1] and stopped_after == STOPS_AFTER
    if clients_per_round is None:  # every site every round: the mean is LOSS + 0.25, closed form
        assert straight_rounds[-1]["stopped"]["best"] == pytest.approx(LOSS[2] + 0.25, abs=1e-12)

    first = _run(tmp_path, "first", clients_per_round=clients_per_round, stop_after=interrupted_after + 1)
    assert [r["round"] for r in _rounds(first.app_dir)] == list(range(interrupted_after + 1))
    resumed = _run(tmp_path, "resumed", clients_per_round=clients_per_round, resume_from=str(first.app_dir))
    resumed_rounds = _rounds(resumed.app_dir)
    assert [r["round"] for r in resumed_rounds] == list(range(interrupted_after + 1, stopped_after + 1))
    assert resumed_rounds[-1]["stopped"] == straight_rounds[-1]["stopped"]  # best, rounds waited, after_round
    assert resumed.sent_targets == straight.sent_targets[interrupted_after + 1 :]
    assert not resumed.warnings, resumed.warnings
    # The rule's whole state after the last round, each site's latest score included, is the uninterrupted job's.
    saved = [torch.load(c.app_dir / STATE_FILE, weights_only=True)["stopping"] for c in (straight, resumed)]
    assert saved[0] == saved[1] and saved[0]["history"]


def test_a_resumed_job_whose_saved_history_already_reached_the_plateau_runs_no_round_and_says_so(tmp_path) -> None:
    """The checkpoint of the round the rule stopped after (the run ended there by the rule, or was cut off right
    then): the uninterrupted job ran no further, so the resumed job runs nothing and its record carries the note."""
    straight = _run(tmp_path, "straight", clients_per_round=None)
    note = _rounds(straight.app_dir)[-1]["stopped"]
    resumed = _run(tmp_path, "resumed", clients_per_round=None, resume_from=str(straight.app_dir))
    assert resumed.rounds_run == 0 and _rounds(resumed.app_dir) == []
    (record,) = _records(resumed.app_dir)
    assert record["stage"] == "resumed" and record["stopped"] == note
    # The run reader calls it a finished run (it ended by its rule), not one cut off after round 0.
    assert stop_note([record]) == note and completion_problems([record]) == []
    (line,) = [m for m in resumed.infos if "validation plateau" in m]
    assert f"after round {STOPS_AFTER + 1}" in line and "no round to run" in line, line


def test_a_smaller_patience_on_resume_applies_to_the_saved_history(tmp_path) -> None:
    """Cut off after round 4 with patience 3 (two rounds since the best of round 2), resumed with patience 2: the
    history already satisfies the new patience, so the resumed job runs nothing, as an uninterrupted patience-2 job
    would have stopped after round 4."""
    first = _run(tmp_path, "first", clients_per_round=None, stop_after=5)
    resumed = _run(tmp_path, "resumed", clients_per_round=None, stop_patience=2, resume_from=str(first.app_dir))
    (record,) = _records(resumed.app_dir)
    assert resumed.rounds_run == 0 and record["stopped"]["after_round"] == 4
    assert record["stopped"]["patience"] == 2 and record["stopped"]["rounds_without_improvement"] == 2


def test_a_checkpoint_without_the_history_starts_it_empty_and_says_why_in_one_line(tmp_path) -> None:
    """A stopped run without ``--stop-patience`` (or written before the history was checkpointed) kept none: the
    resumed job counts from its first round, as before, and warns once."""
    first = _run(tmp_path, "first", clients_per_round=None, stop_patience=None, stop_after=4)
    payload = torch.load(first.app_dir / STATE_FILE, weights_only=True)
    assert "stopping" not in payload  # nothing recorded for a rule the run did not use
    resumed = _run(tmp_path, "resumed", clients_per_round=None, resume_from=str(first.app_dir))
    (warning,) = [w for w in resumed.warnings if "stop-patience" in w]
    assert "\n" not in warning and "no history" in warning and "round 5" in warning
    assert "stopped" not in _rounds(resumed.app_dir)[-1]  # rounds 4-9 only: 0.52, 0.51, then improvements


def _saved(**changes) -> dict:
    saved = {"metric": "kept_val_loss", "latest": {"site-1": 0.5, "site-2": 0.75}, "history": [1.0, 0.8, 0.7]}
    return {**saved, **changes}


@pytest.mark.parametrize(
    "saved, why",
    [
        (None, "no history"),
        ([1.0], "not a mapping"),
        (_saved(metric="accuracy"), "metric 'accuracy'"),
        (_saved(history=[1.0, math.nan]), "history"),
        (_saved(history=[1.0, "0.5"]), "history"),
        (_saved(history=[1.0] * 5), "5 values for 3 rounds"),
        (_saved(latest={"site-1": math.inf}), "latest"),
        (_saved(latest=[0.5]), "latest"),
        (_saved(latest={}), "latest"),  # a history needs the scores it is the mean of
        (_saved(metric=None), "metric"),
    ],
)
def test_a_saved_history_that_does_not_hold_together_is_dropped_with_the_reason(saved, why) -> None:
    plateau, problem = Plateau.restored(PATIENCE, saved, rounds_attempted=3)
    assert plateau == Plateau(PATIENCE) and why in problem and "\n" not in problem


def test_a_saved_history_round_trips_and_keeps_counting() -> None:
    plateau = Plateau(PATIENCE)
    for loss in (1.0, 0.5, 0.6):
        plateau.observe({"kept_val_loss": {"per_site": {"site-1": loss, "site-2": loss + 0.5}}})
    state = plateau.state()
    restored, problem = Plateau.restored(PATIENCE, state, rounds_attempted=3)
    assert problem is None and restored == plateau and restored.history == pytest.approx([1.25, 0.75, 0.85], abs=1e-12)
    restored.observe({"kept_val_loss": {"per_site": {"site-2": 1.1}}})  # site-1's last score still counts
    assert restored.history[-1] == pytest.approx((0.6 + 1.1) / 2, abs=1e-12) and not restored.reached()
    restored.observe({})
    assert restored.reached() and restored.note(4)["best"] == pytest.approx(0.75, abs=1e-12)
    empty, problem = Plateau.restored(PATIENCE, Plateau(PATIENCE).state(), rounds_attempted=0)
    assert problem is None and empty == Plateau(PATIENCE)  # a run whose sites reported no score yet
