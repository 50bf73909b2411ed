"""Every candidate of a site scored in one pass per split, with the batches shared (``--keep best``,
``--local-baseline``; lightning_modules/keep_best.py).

A classifier's candidates are scored here without a Lightning Trainer: each split (validation, test, and the
pooled test set where the job has one) is read from its loader **once**, kept as a list of batches, and every
candidate runs a plain fp32 forward over it in eval mode under ``torch.no_grad``. The result per model and split is
the (n, classes) table of log-probabilities ``log_softmax(forward(x))``, from which every score follows
(lightning_modules/site_choice.py): the mean cross-entropy is what a ``validation_step`` logging
``F.cross_entropy`` reports as ``val_loss`` (tested against ``trainer.validate`` to 1e-6), the arg-max gives the
accuracy, and the tables of two models give their mixture without another forward.

This needs batches ``(x, y, ...)`` with integer labels ``y`` and a module whose forward returns ``(N, classes)``
logits (the built-in classifier and the genomics models). `classifier_batches` returns ``None`` for anything
else, and the site then scores with Lightning as before (no mixture, no margin).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from lightning_modules.personal_scores import own_random_stream

Transfer = Callable[[Any], Any]


@dataclass
class SplitBatches:
    """A split's inputs (as the loader yields them, after the data module's transfer hook) and all its labels."""

    inputs: list[torch.Tensor]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)


def classifier_batches(loader: Iterable[Any] | None, transfer: Transfer | None = None) -> SplitBatches | None:
    """The split's batches, read once; ``None`` when there is no loader, no sample, or the batches are not
    ``(x, y)`` pairs with integer labels."""
    if loader is None:
        return None
    inputs, labels = [], []
    for batch in loader:
        batch = transfer(batch) if transfer is not None else batch
        if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], torch.Tensor):
            return None
        x, y = batch[0], batch[1]
        if y.is_floating_point() or y.ndim != 1 or not isinstance(x, torch.Tensor):
            return None
        inputs.append(x)
        labels.append(y.cpu().numpy())
    if not labels:
        return None
    return SplitBatches(inputs, np.concatenate(labels).astype(np.int64))


@torch.no_grad()
def log_probs(module: torch.nn.Module, batches: SplitBatches) -> np.ndarray | None:
    """(n, classes) float64 log-probabilities of ``module``'s fp32 forward in eval mode, on a forked random stream
    (a forward that draws leaves the site's own draws alone); ``None`` when the forward does not return
    ``(N, classes)`` logits. The module's train/eval mode is restored."""
    was_training = module.training
    module.eval()
    device = next(module.parameters()).device
    tables = []
    try:
        with own_random_stream():
            for x in batches.inputs:
                logits = module(x.to(device))
                if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or len(logits) != len(x):
                    return None
                tables.append(torch.log_softmax(logits.float(), dim=1).double().cpu().numpy())
    finally:
        module.train(was_training)
    return np.concatenate(tables)


def model_tables(module: pl.LightningModule, splits: dict[str, SplitBatches]) -> dict[str, np.ndarray] | None:
    """``log_probs`` of ``module`` on every split; ``None`` if its forward is not a classifier's."""
    tables = {}
    for name, batches in splits.items():
        table = log_probs(module, batches)
        if table is None:
            return None
        tables[name] = table
    return tables


__all__ = ["SplitBatches", "classifier_batches", "log_probs", "model_tables"]
