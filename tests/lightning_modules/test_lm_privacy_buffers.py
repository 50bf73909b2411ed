"""Buffers under DP-SGD (docs/privacy.md, "What a DP site sends"): a buffer updated from the data leaves the site in
the model's state_dict with no noise (and, read in the forward, mixes the samples across steps, which the per-sample
clipping does not bound), so a model with a buffer its module does not declare data-independent is refused, when
the job is built and again at the site before the first step. The attack first: a running-mean input standardiser
(a float mean and an integer count of the samples it saw) trained under DP-SGD released the mean of the site's
training inputs and the exact size of its secret Poisson sample.
"""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch import nn

pytest.importorskip("opacus")

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.errors import ClientAlgorithmError
from lightning_modules.privacy.dp_sgd import model_problem
from lightning_modules.privacy.release import status_of
from tests.lightning_modules.test_lm_privacy import Linear, data, dpsgd, fit, round_meta


class Standardiser(nn.Module):
    """Subtracts the running mean of the inputs it has seen in training (a float buffer) and counts them (an
    integer buffer): a common input layer, and a data-dependent statistic."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and len(x):
            with torch.no_grad():
                total = self.seen + len(x)
                self.mean.mul_(self.seen / total).add_(x.sum(0) / total)
                self.seen.fill_(int(total))
        return x - self.mean


class StandardisedLinear(Linear):
    """The test's linear classifier behind a `Standardiser`; counts the Poisson sample it trained on itself."""

    def __init__(self) -> None:
        super().__init__(d_in=5, d_out=3)
        self.norm = Standardiser(5)
        self.sampled = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.sampled += len(x)
        return nn.functional.cross_entropy(self.layer(self.norm(x)), y)


class Positions(nn.Module):
    """A constant buffer (fixed at construction from public values), declared data-independent."""

    data_independent_buffers: ClassVar[tuple[str, ...]] = ("table",)

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0, 1, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


def test_a_dp_site_refuses_a_model_with_a_running_mean_buffer_before_training(tmp_path):
    """Before the fix this fit ran and the released state_dict carried ``norm.mean`` (the mean of the training
    inputs the Poisson sample drew) and ``norm.seen`` (that sample's exact size)."""
    module, dataset = StandardisedLinear(), data(n=40)
    with pytest.raises(ClientAlgorithmError, match=r"^site-1: .*buffers \['mean', 'seen'\] of norm \(Standardiser\)"):
        fit(module, dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(0), batch_size=8)
    assert module.sampled == 0 and int(module.norm.seen) == 0  # refused before the first step: nothing learnt


def test_the_builder_refuses_data_dependent_buffers_naming_the_module_and_what_to_do():
    message = model_problem(nn.Sequential(Standardiser(5), nn.Linear(5, 3)))
    assert message.startswith("buffers ['mean', 'seen'] of 0 (Standardiser) are released with no noise")
    assert "data_independent_buffers" in message and "\n" not in message
    instance = model_problem(nn.Sequential(nn.Linear(4, 4), nn.InstanceNorm1d(4, track_running_stats=True)))
    assert instance.startswith("buffers ['running_mean', 'running_var', 'num_batches_tracked'] of 1 (InstanceNorm1d)")
    assert "track_running_stats=False" in instance
    assert model_problem(nn.Sequential(nn.Linear(4, 4), nn.InstanceNorm1d(4))) is None  # no running statistics


def test_declared_data_independent_buffers_are_admitted():
    assert model_problem(nn.Sequential(Positions(5), nn.Linear(5, 3))) is None


def test_the_sample_count_a_dp_site_sends_is_its_training_set_size_never_the_poisson_sample(tmp_path):
    """``train.num_samples`` is n_i, the size of the site's training set (declared public), not how many records
    the round's Poisson sample drew (secret: it would tell which records were drawn, given the others)."""
    module, dataset = Linear(), data(n=40)
    sampled = []
    module.training_step = lambda batch, idx, step=module.training_step: (
        sampled.append(len(batch[0])) or step(batch, idx)
    )
    meta = fit(module, dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(0), batch_size=8, epochs=3)
    assert meta[meta_keys.NUM_SAMPLES] == len(dataset) == 40
    assert len(sampled) == 15 and len(set(sampled)) > 1  # 5 Poisson batches an epoch, of varying size
    item = status_of(meta_keys.NUM_SAMPLES)
    assert item.status == "public" and "never the size of a Poisson sample" in item.what
