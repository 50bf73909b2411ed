"""The Lightning fit harness the client-algorithm tests share, in one place so that every test comparing two fits
builds them the same way: a quiet one-device CPU Trainer, the small MLP classifier, a seeded toy loader, one fit under
a client algorithm's callback, a detached copy of a module's weights, the one-weight `Quadratic` of the
closed-form client tests, and `FakeFlare`, NVFlare's client API fed from a list (the genotype QC site tests).

Import it as ``from tests.helpers import ...`` (tests/conftest.py puts the repository first on the path)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_modules import FederatedAlgorithm, FLClassifier


class Quadratic(nn.Module):
    """The closed-form client tests' model: one scalar weight, a frozen parameter and a BatchNorm-like buffer
    (neither may ever be touched)."""

    def __init__(self, w0: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0]))
        self.frozen = nn.Parameter(torch.tensor([2.0]), requires_grad=False)
        self.register_buffer("running_mean", torch.tensor([7.0]))


class FakeFlare:
    """NVFlare's client API as site_main uses it, fed with ``inbox``; what the site sends lands in ``sent``."""

    def __init__(self, site: str, inbox: list[Any]) -> None:
        self.site, self.inbox, self.sent = site, list(inbox), []

    def install(self, monkeypatch: Any) -> None:
        import nvflare.client as flare

        monkeypatch.setattr(flare, "init", lambda *a, **k: None)
        monkeypatch.setattr(flare, "get_site_name", lambda: self.site)
        monkeypatch.setattr(flare, "is_running", lambda: bool(self.inbox))
        monkeypatch.setattr(flare, "receive", lambda *a, **k: self.inbox.pop(0) if self.inbox else None)
        monkeypatch.setattr(flare, "send", lambda model, *a, **k: self.sent.append(model))


def quiet_trainer(max_epochs: int = 1, callbacks: Sequence[pl.Callback] = (), **trainer_kw: Any) -> pl.Trainer:
    """A one-device CPU Trainer that writes and prints nothing: no logger, checkpoints, progress bar or summary."""
    return pl.Trainer(
        max_epochs=max_epochs,
        accelerator="cpu",
        devices=1,
        callbacks=list(callbacks),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kw,
    )


def toy_loader(in_features: int, num_classes: int, n: int = 40, batch_size: int = 8) -> DataLoader:
    """``n`` uniform random samples with random labels (data seed 3), shuffled by a generator of their own (seed 5):
    the same batches in the same order in every fit."""
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(n, in_features, generator=gen)
    y = torch.randint(0, num_classes, (n,), generator=gen)
    return DataLoader(
        TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=torch.Generator().manual_seed(5)
    )


def small_mlp(in_features: int, num_classes: int, **settings: Any) -> FLClassifier:
    """The built-in MLP classifier with one hidden layer of 16; lr 0.2 and init seed 11 unless ``settings`` say
    otherwise (momentum, weight_decay, ...)."""
    return FLClassifier(
        arch="mlp",
        num_classes=num_classes,
        arch_args={"in_features": in_features, "hidden_sizes": (16,)},
        **{"lr": 0.2, "init_seed": 11, **settings},
    )


def fit_under(
    algorithm: Any,
    module: pl.LightningModule,
    loader: DataLoader,
    meta: Mapping[str, Any],
    *,
    max_epochs: int = 1,
    site: str = "site-1",
    num_samples: int = 40,
    around: tuple[pl.Callback, pl.Callback] | None = None,
    callback_args: Mapping[str, Any] | None = None,
    **trainer_kw: Any,
) -> pl.LightningModule:
    """Fit ``module`` on ``loader`` under ``algorithm``'s callback (the server's round ``meta``; ``callback_args``
    more arguments of `FederatedAlgorithm`) and return it; ``around``: callbacks placed before and after it."""
    callback = FederatedAlgorithm(
        algorithm, num_samples=num_samples, site=site, meta_source=lambda: dict(meta), **(callback_args or {})
    )
    callbacks = [around[0], callback, around[1]] if around else [callback]
    quiet_trainer(max_epochs, callbacks, **trainer_kw).fit(module, loader)
    return module


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``module``'s state_dict."""
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
