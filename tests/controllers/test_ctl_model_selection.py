"""The global model a job delivers (controllers/model_selection.py): the rule in closed form, the engine handing the
host the model the sites scored best (not the last one), nothing chosen with site-held entries, and the choice
carried across a resume so that a resumed job never replaces the best model with a worse one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from aggregators.registry import build_rule
from controllers.engine import InProcessTransport, RoundEngine
from controllers.fedalg_controller import STATE_FILE
from controllers.model_selection import BestGlobal, saved_best_problem
from tests.controllers.test_ctl_engine import GLOBAL, SAMPLES, MemoryHost
from tests.controllers.test_ctl_resume import FakeEngineController


def test_the_best_round_is_the_lowest_mean_over_each_sites_latest_score() -> None:
    best = BestGlobal()
    summary = {"val_loss": {"per_site": {"a": 1.0, "b": 3.0}}, "kept_val_loss": {"per_site": {"a": 0.1, "b": 0.1}}}
    assert best.observe(summary, 0) and best.metric == "val_loss" and best.value == 2.0  # not the kept model's
    assert best.observe({"val_loss": {"per_site": {"a": 0.5}}}, 1)  # b not sampled: its last score counts
    assert best.value == pytest.approx(1.75) and best.round == 1
    assert not best.observe({"val_loss": {"per_site": {"a": 0.5}}}, 2)  # equal: the earlier model stays
    assert not best.observe({}, 3) and best.round == 1  # a round without scores chooses nothing
    assert not best.observe({"val_loss": {"per_site": {"a": float("nan")}}}, 4) and best.round == 1
    assert best.observe({"val_loss": {"per_site": {"b": 2.0}}}, 5) and best.value == pytest.approx(1.25)
    assert best.note() == {"sent_in_round": 6, "metric": "val_loss", "mean_over_sites": pytest.approx(1.25)}


def test_the_pooled_validation_score_is_preferred_where_the_job_chooses_on_it() -> None:
    best = BestGlobal()
    best.observe({"val_loss": {"per_site": {"a": 0.1}}, "global_pooled_val_loss": {"per_site": {"a": 2.0}}}, 0)
    assert best.metric == "global_pooled_val_loss" and best.value == 2.0


def scoring_site(losses: list[float]):
    """A site whose received global model scores ``losses[r]`` on its validation split in round r, and that moves
    the model by +1 each round (so the model sent in round r is GLOBAL + r)."""

    def train(round_num: int, params: dict, meta: dict) -> tuple[dict, dict]:
        out = {k: v + np.float32(1.0) for k, v in params.items()}
        meta_out = {meta_keys.NUM_SAMPLES: SAMPLES["site-1"], meta_keys.PARAM_KEYS: ["w", "b"]}
        return out, {**meta_out, meta_keys.eval_key("val_loss"): losses[round_num]}

    return train


class BestHost(MemoryHost):
    def __init__(self) -> None:
        super().__init__()
        self.best: list[tuple[int, dict]] = []

    def save_best(self, round_num, params) -> None:
        self.best.append((round_num, {k: v.copy() for k, v in params.items()}))


def test_the_engine_hands_over_the_model_the_sites_scored_best_not_the_last_one() -> None:
    # The swing: the model sent in round 2 scores best; the last rounds are worse, and the last model is unscored.
    losses = [1.0, 0.6, 0.3, 0.9, 0.5]
    engine = RoundEngine(build_rule("fedavg"), num_rounds=5)
    host = BestHost()
    sites = InProcessTransport({"site-1": scoring_site(losses)})
    engine.run(("site-1",), GLOBAL, build_rule("fedavg").init_state(GLOBAL), sites, host, run_id="r")
    assert [r for r, _ in host.best] == [0, 1, 2]
    _, params = host.best[-1]
    assert all(np.array_equal(params[k], GLOBAL[k] + np.float32(2.0)) for k in GLOBAL)  # the model sent in round 2
    rounds = [r for r in host.records if r.get("stage") == "round"]
    assert [("best_global" in r) for r in rounds] == [True, True, True, False, False]
    assert rounds[2]["best_global"] == {"sent_in_round": 3, "metric": "val_loss", "mean_over_sites": 0.3}


def test_a_job_with_site_held_entries_chooses_no_global_model() -> None:
    engine = RoundEngine(build_rule("fedavg"), num_rounds=3, local_keys=("b",))
    assert engine.best_global is None


@pytest.mark.parametrize(
    ("saved", "why"),
    [
        (None, "older version"),
        ({"metric": "val_loss"}, "not {metric, latest, value, round}"),
        ({"metric": "val_loss", "latest": {"a": 1.0}, "value": 1.0, "round": 7}, "round 7, not one of its 3"),
        ({"metric": "val_loss", "latest": {"a": math.inf}, "value": 1.0, "round": 1}, "not finite numbers"),
        ({"metric": "val_loss", "latest": {"a": 1.0}, "value": math.nan, "round": 1}, "value is not a finite"),
    ],
)
def test_a_best_model_state_that_does_not_hold_together_starts_again_and_says_why(saved, why) -> None:
    restored, problem = BestGlobal.restored(saved, rounds_attempted=3)
    assert restored == BestGlobal() and why in problem and "\n" not in problem
    assert saved_best_problem(BestGlobal().state(), 0) is None  # a run whose sites have scored nothing yet


#: The sites' common validation loss of the received model per round: best at round 2; a resumed job that forgot it
#: would take round 4's worse model (0.6) as its first best.
LOSS = (1.0, 0.7, 0.4, 0.8, 0.6, 0.9)


class BestSavingController(FakeEngineController):
    """Fake sites that report ``LOSS[round]`` for the received model; the best model is written where the
    persistor would write it."""

    def send_model_and_wait(self, targets, data, min_responses=None, timeout=0):
        results = super().send_model_and_wait(targets, data, min_responses, timeout)
        for result in results:
            result.meta[meta_keys.eval_key("val_loss")] = LOSS[data.current_round]
        return results

    def save_best_model(self, model) -> None:
        tensors = {k: torch.from_numpy(np.array(v, copy=True)) for k, v in model.params.items()}
        torch.save({"model": tensors, "round": model.meta["round"]}, self.app_dir / "best_FL_global_model.pt")


@pytest.mark.parametrize("interrupted_after", [1, 3])
def test_a_resumed_job_keeps_the_best_model_of_the_rounds_before_it(tmp_path, interrupted_after) -> None:
    def run(name: str, **settings) -> BestSavingController:
        controller = BestSavingController(tmp_path / name / "app", server="fedavg", num_rounds=len(LOSS), **settings)
        controller.run()
        return controller

    straight = run("straight", clients_per_round=None)
    first = run("first", clients_per_round=None, stop_after=interrupted_after + 1)
    resumed = run("resumed", clients_per_round=None, resume_from=str(first.app_dir))
    if interrupted_after == 3:  # the best (round 2) came before the resume: the resumed job writes no best
        assert not (resumed.app_dir / "best_FL_global_model.pt").exists()
        best_file = first.app_dir / "best_FL_global_model.pt"
    else:
        best_file = resumed.app_dir / "best_FL_global_model.pt"
    mine = torch.load(best_file, weights_only=True)
    theirs = torch.load(straight.app_dir / "best_FL_global_model.pt", weights_only=True)
    assert mine["round"] == theirs["round"] == 2
    assert all(torch.equal(mine["model"][k], theirs["model"][k]) for k in theirs["model"])
    saved = [torch.load(c.app_dir / STATE_FILE, weights_only=True)["best_global"] for c in (straight, resumed)]
    assert saved[0] == saved[1] and saved[0]["round"] == 2
    assert not resumed.warnings, resumed.warnings


def test_the_report_names_the_best_model_and_that_models_test_accuracy(tmp_path, capsys) -> None:
    from aggregators.contracts.run_records import best_global
    from controllers import report
    from tests.controllers.test_ctl_report import initial, round_record, write_metrics

    def note(sent_in_round: int) -> dict:
        return {"sent_in_round": sent_in_round, "metric": "val_loss", "mean_over_sites": 0.25}

    records = [initial(4), *(round_record(i, test_accuracy=0.5 + i / 10) for i in range(4))]
    records[2]["best_global"] = note(2)  # round 1 (0-based) scored the model round 0 produced: accuracy 0.5
    assert best_global(records) == (note(2), records[1])
    assert best_global([records[0], {**records[1], "best_global": note(1)}]) == (note(1), records[0])  # the initial
    resumed = [{"stage": "resumed", "round": 2, "test_accuracy": 0.7}, {**records[4], "best_global": note(4)}]
    assert best_global(resumed) == (note(4), resumed[0])  # a resumed job's first round scores what it resumed from
    assert best_global([resumed[0], {**records[4], "best_global": note(2)}]) == (note(2), None)  # not in this file
    assert best_global(records[:2]) is None
    assert report.main([str(write_metrics(tmp_path / "ws", records)), "--plot", str(tmp_path / "p.png")]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("best global model")]
    assert "sent in round 2 (mean val_loss over the sites 0.2500; global test accuracy 0.5000)" in line
    assert line.endswith("best_FL_global_model.pt")
