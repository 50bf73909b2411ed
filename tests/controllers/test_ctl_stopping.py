"""The stopping rule (controllers/stopping.py): the plateau in closed form, the engine stopping on it with the
reason in the round's record, a run it ended read as finished, and the settings it cannot work without refused."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from aggregators.contracts.run_records import completion_problems, stop_note, stopped_early
from aggregators.registry import build_rule
from controllers.engine import InProcessTransport, RoundEngine
from controllers.stopping import Plateau, rounds_since_best
from jobs.build import JobSpec
from jobs.settings import JobBuildError
from tests.controllers.test_ctl_engine import GLOBAL, SAMPLES, MemoryHost


@pytest.mark.parametrize(
    "history, waited",
    [
        ([], 0),
        ([1.0], 0),
        ([1.0, 0.9, 0.8], 0),
        ([1.0, 0.8, 0.9, 0.85], 2),  # best at index 1, two rounds since
        ([1.0, 0.8, 0.79995, 0.8], 2),  # 5e-5 below the best is below MIN_DELTA (1e-4): no improvement
        ([1.0, 0.8, 0.7998, 0.9], 1),  # 2e-4 below it is one
        ([0.5, 0.5, 0.5], 2),  # equal values: the first reaching the best counts
    ],
)
def test_rounds_since_best_in_closed_form(history, waited) -> None:
    assert rounds_since_best(history) == waited


def test_the_plateau_is_the_mean_over_sites_of_each_sites_latest_score() -> None:
    plateau = Plateau(patience=2)
    summary = {"kept_val_loss": {"per_site": {"a": 1.0, "b": 3.0}}, "val_loss": {"per_site": {"a": 9.0, "b": 9.0}}}
    plateau.observe(summary)
    plateau.observe({"kept_val_loss": {"per_site": {"a": 0.5}}})  # b not sampled: its last score counts
    assert plateau.metric == "kept_val_loss" and plateau.history == [2.0, 1.75]
    plateau.observe({"kept_val_loss": {"per_site": {"b": 3.0}}})
    assert not plateau.reached()
    plateau.observe({})  # a round without scores repeats the last value
    assert plateau.reached() and plateau.note(7)["best"] == 1.75 and plateau.note(7)["after_round"] == 7
    with pytest.raises(ValueError, match="stop_patience must be an integer >= 1"):
        Plateau(patience=0)


def scoring_site(losses: list[float]):
    """A site that reports ``losses[r]`` as its kept model's validation loss in round r."""

    def train(round_num: int, params: dict, meta: dict) -> tuple[dict, dict]:
        out = {k: v + np.float32(1.0) for k, v in params.items()}
        meta_out = {meta_keys.NUM_SAMPLES: SAMPLES["site-1"], meta_keys.PARAM_KEYS: ["w", "b"]}
        return out, {**meta_out, meta_keys.eval_key("kept_val_loss"): losses[round_num]}

    return train


def test_the_engine_stops_after_patience_rounds_without_improvement_and_says_why() -> None:
    losses = [1.0, 0.6, 0.7, 0.65, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]  # best 0.6 at round 1; rounds 2, 3 do not improve
    engine = RoundEngine(build_rule("fedavg"), num_rounds=10, stop_patience=2)
    host = MemoryHost()
    sites = InProcessTransport({"site-1": scoring_site(losses)})
    engine.run(("site-1",), GLOBAL, build_rule("fedavg").init_state(GLOBAL), sites, host, run_id="r")
    rounds = [r for r in host.records if r.get("stage") == "round"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    note = rounds[-1]["stopped"]
    assert note["best"] == pytest.approx(0.6) and note["rounds_without_improvement"] == 2 and note["after_round"] == 3
    assert any("validation plateau" in message for _, message in host.messages)
    assert not stopped_early(host.records) and completion_problems(host.records) == []
    assert stop_note(host.records) == note
    without = RoundEngine(build_rule("fedavg"), num_rounds=10)  # no rule: every round runs
    host = MemoryHost()
    without.run(("site-1",), GLOBAL, build_rule("fedavg").init_state(GLOBAL), sites, host, run_id="r")
    assert len([r for r in host.records if r.get("stage") == "round"]) == 10


def test_a_run_cut_short_without_the_rule_is_still_unfinished() -> None:
    records = [{"stage": "initial", "num_rounds": 5}, {"stage": "round", "round": 0}]
    assert stopped_early(records) and stop_note(records) is None


BASE = dict(name="s", dataset="digits", arch="mlp", num_rounds=5, stop_patience=2)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({}, "stop_patience stops at a plateau of the sites' validation loss: the built-in sites need a validation"),
        (
            {"site_val_fraction": 0.2, "dp_noise_multiplier": 1.0, "dp_max_grad_norm": 1.0},
            "stop_patience reads the sites' validation scores, which DP-SGD keeps at the sites",
        ),
        ({"site_val_fraction": 0.2, "stop_patience": 0}, "stop_patience must be"),
    ],
)
def test_a_stopping_rule_without_the_scores_it_reads_is_refused_in_one_line(changes, message) -> None:
    with pytest.raises(JobBuildError, match=message) as caught:
        JobSpec(**{**BASE, **changes})
    assert "\n" not in str(caught.value)


def test_the_stopping_rule_is_accepted_with_a_validation_split_and_under_dp_with_released_scores() -> None:
    JobSpec(**BASE, site_val_fraction=0.2)
    dp = {"dp_noise_multiplier": 1.0, "dp_max_grad_norm": 1.0, "dp_release_site_scores": True}
    JobSpec(**BASE, site_val_fraction=0.2, **dp)
