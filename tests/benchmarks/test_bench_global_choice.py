"""benchmarks/global_choice.py: the replayed choice of the delivered global model, in closed form on tiny recorded
tables, and the genomics harness's central counterpart (the epoch the same rule chooses)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.global_choice import chosen_round, chosen_round_by_accuracy, replay_setting


def test_the_chosen_round_is_the_first_lowest():
    assert chosen_round([0.9, 0.4, 0.6, 0.4]) == 1


def test_the_accuracy_counterfactual_takes_the_highest_accuracy_then_the_lower_loss_then_the_earlier_round():
    assert chosen_round_by_accuracy([0.5, 0.9, 0.9, 0.9], [0.1, 0.6, 0.4, 0.4]) == 2


def _round(folder, site: str, r: int, global_p: float, pooled_right: bool) -> None:
    """One recorded round: every validation sample's true class (0) at ``global_p`` under the received global
    model; the pooled test set's 4 samples all right or all wrong; the own (local) model fixed and poor, so the
    kept model and the stopping rule never depend on the global one's test scores."""
    labels = np.zeros(4, dtype=np.int64)
    val = np.log(np.tile([global_p, 1 - global_p], (4, 1)))
    pooled = np.log(np.tile([0.9, 0.1] if pooled_right else [0.1, 0.9], (4, 1)))
    local = np.log(np.tile([0.5, 0.5], (4, 1)))
    arrays = {"global__val": val, "global__test": val, "global__pooled": pooled,
              "local__val": local, "local__test": local, "local__pooled": local}  # fmt: skip
    arrays.update({"labels__val": labels, "labels__test": labels, "labels__pooled": labels})
    np.savez(folder / f"{site}_r{r}.npz", **arrays)


def _two_site_run(tmp_path, rounds) -> object:
    """A recorded run of two sites; ``rounds``: per round (site-1's p, site-2's p, right on the pooled set)."""
    run = tmp_path / "setting" / "fedavgm__x__s0"
    run.mkdir(parents=True)
    for r, (p1, p2, right) in enumerate(rounds):
        _round(run, "site-1", r, p1, right)
        _round(run, "site-2", r, p2, right)
    return run


def test_the_replay_takes_the_round_with_the_lowest_mean_validation_loss_over_the_sites(tmp_path):
    # Site-1's received model: p = 0.6, 0.9, 0.7; site-2's: 0.8, 0.5, 0.95. Mean loss per round:
    # r0 -(ln .6 + ln .8)/2 = 0.367; r1 -(ln .9 + ln .5)/2 = 0.399; r2 -(ln .7 + ln .95)/2 = 0.204: round 3 chosen.
    # The pooled test set: right at rounds 1 and 3 (1-based), wrong at round 2.
    run = _two_site_run(tmp_path, ((0.6, 0.8, True), (0.9, 0.5, False), (0.7, 0.95, True)))
    assert -(math.log(0.7) + math.log(0.95)) / 2 < -(math.log(0.6) + math.log(0.8)) / 2
    replayed = replay_setting(tmp_path / "setting", patience=None)["federated"]["fedavgm__x__s0"]
    # Every received model is right on every validation sample (p >= 0.5 for class 0; a tie goes to class 0), so
    # the accuracy counterfactual falls back on the loss and agrees.
    assert replayed == {"rounds": 3, "chosen_round": 3, "last": 100.0, "chosen": 100.0, "best_any_round": 100.0,
                        "chosen_round_by_accuracy": 3, "chosen_by_accuracy": 100.0}  # fmt: skip
    # Cut at round 2: the choice is round 1 (0.367 < 0.399), right on the pooled set, while the last is wrong.
    for site in ("site-1", "site-2"):
        (run / f"{site}_r2.npz").unlink()
    replayed = replay_setting(tmp_path / "setting", patience=None)["federated"]["fedavgm__x__s0"]
    assert replayed == {"rounds": 2, "chosen_round": 1, "last": 0.0, "chosen": 100.0, "best_any_round": 100.0,
                        "chosen_round_by_accuracy": 1, "chosen_by_accuracy": 100.0}  # fmt: skip


def test_the_loss_can_prefer_a_less_accurate_round_and_the_accuracy_counterfactual_says_so(tmp_path):
    # Round 1: site-1 p = 0.95 (right), site-2 p = 0.45 (wrong): mean accuracy 0.5, mean loss
    # -(ln .95 + ln .45)/2 = 0.425. Round 2: p = 0.6 and 0.55, both right: accuracy 1, loss -(ln .6 + ln .55)/2 = 0.554.
    # The loss picks round 1 (wrong on the pooled set), the accuracy round 2 (right there).
    _two_site_run(tmp_path, ((0.95, 0.45, False), (0.6, 0.55, True)))
    assert -(math.log(0.95) + math.log(0.45)) / 2 < -(math.log(0.6) + math.log(0.55)) / 2
    replayed = replay_setting(tmp_path / "setting", patience=None)["federated"]["fedavgm__x__s0"]
    assert replayed == {"rounds": 2, "chosen_round": 1, "last": 100.0, "chosen": 0.0, "best_any_round": 100.0,
                        "chosen_round_by_accuracy": 2, "chosen_by_accuracy": 100.0}  # fmt: skip


def test_the_genomics_central_model_is_chosen_by_the_same_rule_and_scoring_leaves_its_mode_alone():
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from benchmarks.genomics import ChosenEpoch

    x = torch.eye(2)
    y = torch.tensor([0, 1])
    data = SimpleNamespace(tensors=(x, y))
    sites = {"site-1": SimpleNamespace(val=data, pooled=data), "site-2": SimpleNamespace(val=data, pooled=data)}
    chosen = ChosenEpoch(sites)
    module = torch.nn.Linear(2, 2, bias=False)
    for epoch, weight in enumerate(([[0.0, 1.0], [1.0, 0.0]], [[2.0, 0.0], [0.0, 2.0]], [[1.0, 0.0], [0.0, 1.0]])):
        with torch.no_grad():
            module.weight.copy_(torch.tensor(weight))
        module.train()
        chosen.score(module, epoch)
        assert module.training
    # Epoch 1's logits (2, 0) / (0, 2) have the lowest cross-entropy, log(1 + e^-2), and classify both right.
    assert chosen.epoch == 1 and chosen.pooled_accuracy == 1.0
    assert chosen.loss == pytest.approx(math.log(1 + math.exp(-2.0)), abs=1e-6)
