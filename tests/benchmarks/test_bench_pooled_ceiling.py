"""benchmarks/pooled_ceiling.py: the early-stopping choice, the training loop it drives, and the gains table, each
on cases whose answer is derived below."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from benchmarks.pooled_ceiling import check_sizes, chosen_epoch, early_stopped, gain_summary, run_scores, scores


def test_chosen_epoch_is_the_first_lowest_up_to_min_delta():
    assert chosen_epoch([1.0, 0.9, 0.8]) == 2
    assert chosen_epoch([0.3, 0.4, 0.5]) == 0
    # 0.49995 improves on 0.5 by less than 1e-4: the earlier epoch stays the choice.
    assert chosen_epoch([1.0, 0.5, 0.49995, 0.6]) == 1
    assert chosen_epoch([1.0, 0.5, 0.4998]) == 2


class Linear(torch.nn.Module):
    """The smallest module `plain_fit` trains: its own training_step and configure_optimizers."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.lr = torch.nn.Linear(2, 2), lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, index):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data(flip: bool) -> TensorDataset:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]] * 8)
    y = torch.tensor([0, 1] * 8)
    return TensorDataset(x, 1 - y if flip else y)


def test_early_stopped_keeps_the_chosen_epochs_weights():
    module = Linear(lr=0.5)
    stopped = early_stopped(module, _data(False), _data(False), 4, max_epochs=6, patience=5, seed=0)
    assert stopped.epochs_run == 6 and stopped.epoch == 6  # learnable: every epoch lowers the validation loss
    fresh = Linear(lr=0.5)
    fresh.load_state_dict(stopped.state)
    assert scores(fresh, _data(False))[0] == pytest.approx(stopped.val_loss, abs=1e-7)
    assert scores(fresh, _data(False))[1] == 1.0


def test_early_stopped_stops_after_patience_and_returns_the_start():
    """Validation labels the opposite of training's: every epoch is worse, so epoch 0 is kept and training stops
    once ``patience`` epochs have passed without a better one."""
    module = Linear(lr=0.5)
    start = {key: value.clone() for key, value in module.state_dict().items()}
    stopped = early_stopped(module, _data(False), _data(True), 4, max_epochs=50, patience=3, seed=0)
    assert (stopped.epoch, stopped.epochs_run) == (0, 3)
    assert all(torch.equal(stopped.state[key], start[key]) for key in start)


class Dropped(Linear):
    """`Linear` behind dropout: its training draws from torch's global generator."""

    def forward(self, x):
        return self.net(torch.nn.functional.dropout(x, 0.5, self.training))


def test_early_stopped_does_not_depend_on_the_global_generator():
    """Two runs with the same seed after different draws from the global generator train the same weights."""
    states = []
    for draws in (0, 7):
        module = Dropped(lr=0.5)  # seeds the global generator; the draws after it differ between the two runs
        torch.rand(draws)
        stopped = early_stopped(module, _data(False), _data(False), 4, max_epochs=3, patience=5, seed=1)
        states.append(stopped.state)
    assert all(torch.equal(states[0][key], states[1][key]) for key in states[0])


def test_gains_against_the_local_only_model():
    """Two seeds, two sites: the gains, their t-interval over the seeds' site means (t at 1 df, 12.706) and the
    worst pair, by hand."""
    cells = [
        {
            "cell": {"seed": seed},
            "site_test": {"local": {"site-1": 0.8, "site-2": 0.6}, "kept": {"site-1": 0.8, "site-2": 0.7}},
            "site_pooled_test": {"local": {"site-1": 0.3, "site-2": 0.3}, "kept": {"site-1": 0.5, "site-2": 0.5}},
        }
        for seed in (0, 1)
    ]
    ceilings = [
        {
            "sites": {
                "site-1": {"pooled": 0.7, "pooled_finetuned": 0.85},
                "site-2": {"pooled": 0.5, "pooled_finetuned": p},
            }
        }
        for p in (0.7, 0.65)
    ]
    found = run_scores(cells, ceilings)
    assert "pooled" not in found["site_pooled_test"] or not any(found["site_pooled_test"]["pooled"].values())
    assert found["site_test"]["best_on_test"][1] == {"site-1": 0.85, "site-2": 0.65}
    gains = gain_summary(found["site_test"])
    run_means = np.array([(0.05 + 0.10) / 2, (0.05 + 0.05) / 2])
    half = 12.706 * run_means.std(ddof=1) / np.sqrt(2)
    tuned = gains["pooled_finetuned"]
    assert tuned["mean"] == pytest.approx(100 * run_means.mean(), abs=1e-6)
    assert tuned["high"] - tuned["mean"] == pytest.approx(100 * half, rel=1e-3)
    assert (tuned["worst"], tuned["below_minus_2"], tuned["pairs"]) == (pytest.approx(5.0), 0, 4)
    assert gains["pooled"]["worst"] == pytest.approx(-10.0) and gains["pooled"]["below_minus_2"] == 4
    assert gains["kept"]["mean"] == pytest.approx(5.0) and gains["kept"]["high"] == pytest.approx(5.0)


def test_rebuilt_splits_must_match_the_recorded_ones():
    splits = ([0] * 10, [0] * 3, [0] * 3)
    check_sizes({"site-1": splits}, {"site-1": {"train": 10, "val": 3, "test": 3}})
    with pytest.raises(SystemExit, match="site-1: rebuilt splits"):
        check_sizes({"site-1": splits}, {"site-1": {"train": 11, "val": 3, "test": 3}})


def test_a_pair_exactly_two_points_below_is_not_counted_below_minus_two():
    """1 of 50 test samples is 2 points, computed a few ulps below -0.02 (0.96 - 0.98): the site reports' rule
    (benchmarks/site_stats.py) does not count it; one sample more does."""
    by_model = {
        "local": {0: {"site-1": 0.98, "site-2": 0.98}},
        "pooled_finetuned": {0: {"site-1": 0.96, "site-2": 0.94}},
    }
    tuned = gain_summary(by_model)["pooled_finetuned"]
    assert (tuned["below_minus_2"], tuned["pairs"]) == (1, 2)
    assert tuned["worst"] == pytest.approx(-4.0)
