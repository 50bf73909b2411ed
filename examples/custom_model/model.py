"""A user's LightningModule: a small network for 8x8 digit images, trained with AdamW.

Nothing here comes from the bundle except ``algorithm_loss``, which a module adds to its loss only for client
algorithms that change the objective (MOON); every other algorithm needs nothing from the module. ``task_loss`` and
``net.embed`` are the two small protocols FedMoS / SCAFFOLD Option I and MOON use (docs/own_model.md).
"""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_modules.federated import algorithm_loss


class DigitsNet(nn.Module):
    """features -> (optional projection head) -> classifier; ``embed`` is the representation MOON contrasts."""

    def __init__(self, in_features: int = 64, hidden: int = 64, projection_dim: int = 0, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU())
        self.projection = nn.Linear(hidden, projection_dim) if projection_dim else None
        self.classifier = nn.Linear(projection_dim or hidden, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        h = self.features(x)
        return self.projection(h) if self.projection is not None else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(x))


class DigitsClassifier(pl.LightningModule):
    def __init__(
        self,
        lr: float = 3e-3,
        weight_decay: float = 1e-4,
        optimizer: str = "adamw",
        hidden: int = 64,
        projection_dim: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the server and every site build the same initial weights
            self.net = DigitsNet(hidden=hidden, projection_dim=projection_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def task_loss(self, batch, params=None):
        """Mean cross-entropy and logits, at this module's weights or at ``params`` (FedMoS, SCAFFOLD Option I)."""
        x, y = batch
        logits = self(x) if params is None else torch.func.functional_call(self, dict(params), (x,))
        return F.cross_entropy(logits, y), logits

    def training_step(self, batch, batch_idx):
        loss, logits = self.task_loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss + algorithm_loss(self, batch, logits)

    def validation_step(self, batch, batch_idx):
        loss, logits = self.task_loss(batch)
        accuracy = (logits.argmax(dim=1) == batch[1]).float().mean()
        self.log("val_loss", loss, on_epoch=True)
        self.log("val_accuracy", accuracy, on_epoch=True)

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":  # FedMoS and FedNova need plain SGD
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
