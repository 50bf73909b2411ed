"""The bundle's built-in LightningModule: an image/vector classifier, one user of the callback path.

It knows nothing of federated learning beyond the two protocols of `lightning_modules.federated` that some
client algorithms need: ``task_loss(batch, params=None)`` (FedMoS, SCAFFOLD Option I) and a network ``net`` with
``embed`` (MOON), plus ``loss + algorithm_loss(self, batch, logits)`` in ``training_step``. The client algorithm
runs in `lightning_modules.federated.FederatedAlgorithm`, the same callback a user's own module gets, so
the built-in jobs test the path users take.

The network sits under the attribute ``net``; the server builds the same class from its import path, so the
state_dict keys (``net.conv1.weight``, ...) agree on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from lightning_modules.federated import algorithm_loss
from lightning_modules.models import seeded_model


class FLClassifier(pl.LightningModule):
    """Classifier trained with SGD; the client algorithm is attached as a callback (module docstring).

    Args:
        arch: model name from `lightning_modules.models.MODELS` (``lenet5``, ``simple_cnn``, ``mlp``).
        num_classes: number of output classes.
        arch_args: extra keyword arguments for the model constructor.
        lr, momentum, weight_decay: local SGD settings. FedAvg semantics: a fresh optimizer every round.
        init_seed: seeds the initial weights (``None``: torch's global generator, as usual).
    """

    #: Its training_step and configure_optimizers need nothing of a Trainer: the local-only model may train without
    #: one (lightning_modules/local_baseline.py, plain_fit).
    fl_plain_training = True

    def __init__(
        self,
        arch: str = "lenet5",
        num_classes: int = 10,
        arch_args: Mapping[str, Any] | None = None,
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        init_seed: int | None = None,
    ) -> None:
        super().__init__()
        # A seeded initial model makes the whole federated run reproducible (the server builds its twin,
        # lightning_modules.models.ClassifierWeights, from the same seed).
        self.net = seeded_model(arch, num_classes, arch_args, init_seed)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.train_loss = MeanMetric()
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.net.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )

    def task_loss(
        self, batch: tuple[torch.Tensor, torch.Tensor], params: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy of a batch and the logits (algorithms that need extra gradient passes call this).

        ``params`` (keyed like this module's ``state_dict``, e.g. ``net.fc1.weight``) evaluates the loss at other
        weights without touching the module's own (FedMoS: the previous iterate on the current batch).
        """
        x, y = batch
        logits = self.net(x) if params is None else torch.func.functional_call(self, dict(params), (x,))
        return F.cross_entropy(logits, y), logits

    def on_train_start(self) -> None:
        # One fit is one federated round.
        self.train_loss.reset()
        self.train_acc.reset()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, y = batch
        if len(y) == 0:
            return self.empty_batch_loss(batch)
        loss, logits = self.task_loss(batch)
        self.train_loss.update(loss.detach())
        self.train_acc.update(logits.detach(), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss + algorithm_loss(self, batch, logits)

    def empty_batch_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Under DP-SGD's Poisson sampling a batch can be empty. Its step must still be taken (the released noise
        of every step is what the accountant counts; skipping it would show the batch was empty), so the loss is
        a zero that the backward runs through (no sample contributes) and the metrics are left alone (a mean over
        nothing is not a number)."""
        return self.net(batch[0]).sum() * 0.0

    def fl_round_metrics(self) -> dict[str, float]:
        """Sent as ``train.<name>`` meta at the end of the round (`FederatedAlgorithm` asks for it): the
        round's mean task loss, exact even when an algorithm's loss term dwarfs it, and the training accuracy."""
        if not self.train_acc.update_called:
            return {"loss": float("nan"), "accuracy": float("nan")}
        return {"loss": float(self.train_loss.compute()), "accuracy": float(self.train_acc.compute())}
