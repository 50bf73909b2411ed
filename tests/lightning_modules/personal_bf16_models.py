"""User model and data for ``test_lm_personal_bf16.py``: the built-in BatchNorm CNN of ``jobs/fedbn``
(`lightning_modules.models.BatchNormCNN`, whose ``classifier`` is its declared head) trained with AdamW, on a
few random 28 x 28 images per site, and 16 more to validate on. The module notes its state at the start and end of
every epoch and the dtype of its logits and where they were computed, so the test can see each FedRep phase and that
autocast computed in bf16."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_modules.models import BatchNormCNN

NUM_CLASSES = 3


class AdamWBatchNormCNN(pl.LightningModule):
    def __init__(self, lr: float = 1e-2, weight_decay: float = 0.1) -> None:
        super().__init__()
        self.net = BatchNormCNN(num_classes=NUM_CLASSES)
        self.lr, self.weight_decay = lr, weight_decay
        #: (round-local epoch, "start" | "end", state_dict copy), appended every epoch of every fit
        self.snapshots: list[tuple[int, str, dict[str, torch.Tensor]]] = []
        self.logit_dtypes: set[torch.dtype] = set()
        self.device_types: set[str] = set()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.logit_dtypes.add(logits.dtype)
        self.device_types.add(logits.device.type)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def _snapshot(self, when: str) -> None:
        state = {key: value.detach().clone() for key, value in self.state_dict().items()}
        self.snapshots.append((self.current_epoch, when, state))

    def on_train_epoch_start(self) -> None:  # after the callbacks' hook: the site's own entries are loaded
        self._snapshot("start")

    def on_train_epoch_end(self) -> None:
        self._snapshot("end")


class RandomImages(pl.LightningDataModule):
    def __init__(self, site: str = "site-1", samples: int = 48) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(int(site.rsplit("-", 1)[-1]))
        self.x = torch.randn(samples, 1, 28, 28, generator=generator) + int(site.rsplit("-", 1)[-1])
        self.y = torch.randint(0, NUM_CLASSES, (samples,), generator=generator)
        # Drawn after the training data, which stays what it was: the validation split every personal method needs.
        self.val = TensorDataset(self.x[:16] + torch.randn(16, 1, 28, 28, generator=generator), self.y[:16])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(self.x, self.y), batch_size=16, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=16)
