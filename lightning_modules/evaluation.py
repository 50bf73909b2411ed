"""Evaluate a classifier on in-memory arrays (used by the server's global test evaluation).

Plain torch: the server imports this, and torchmetrics (about 1.5 s of CPU to import) would be its only reason to."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def evaluate_classifier(
    model: nn.Module, x: np.ndarray, y: np.ndarray, num_classes: int, batch_size: int = 1000
) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of ``model`` on ``(x, y)``, in eval mode, on CPU."""
    was_training = model.training
    model.eval()
    try:
        # torch.tensor copies: the server's test arrays can be read-only (torch.from_numpy warns on those).
        logits = torch.cat([model(torch.tensor(x[i : i + batch_size])) for i in range(0, len(x), batch_size)])
    finally:
        model.train(was_training)
    target = torch.tensor(y)
    loss = F.cross_entropy(logits, target).item()
    # Micro top-1 accuracy (torchmetrics' multiclass_accuracy with average="micro"); num_classes checks the logits.
    if logits.shape[1] != num_classes:
        raise ValueError(f"the model gives {logits.shape[1]} logits per sample, the dataset has {num_classes} classes")
    accuracy = (logits.argmax(dim=1) == target).double().mean().item()
    return {"test_accuracy": accuracy, "test_loss": loss}
