"""A user's LightningDataModule: each site's own training and validation data.

In simulation (no ``data_file``) every site takes its share of scikit-learn's 8x8 digits, split across ``num_sites``
sites with a seeded Dirichlet draw over labels (label skew), then 20 % of the share for validation. A real site
passes ``data_file``: an ``.npz`` with ``x`` (N x 64 floats) and ``y`` (N labels) that stays on the site.
"""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


def site_number(site: str) -> int:
    """``site-3`` -> 2 (the simulator names its sites site-1 ... site-N)."""
    try:
        return int(site.rsplit("-", 1)[1]) - 1
    except (IndexError, ValueError):
        raise ValueError(f"simulated data needs sites named site-1 ... site-N (or a data_file), got {site!r}") from None


def dirichlet_share(labels: np.ndarray, num_sites: int, site_index: int, alpha: float, seed: int) -> np.ndarray:
    """Indices of one site's share: each label's samples split over the sites with Dirichlet(alpha) proportions."""
    rng = np.random.default_rng(seed)
    share = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        cuts = (np.cumsum(rng.dirichlet([alpha] * num_sites))[:-1] * len(members)).astype(int)
        share.append(np.split(members, cuts)[site_index])
    return np.sort(np.concatenate(share))


class DigitsSites(pl.LightningDataModule):
    def __init__(
        self,
        site: str = "site-1",
        num_sites: int = 3,
        alpha: float = 0.5,
        batch_size: int = 32,
        val_fraction: float = 0.2,
        seed: int = 0,
        data_file: str | None = None,
    ) -> None:
        super().__init__()
        if data_file is not None:
            stored = np.load(data_file)
            x, y = stored["x"], stored["y"]
        else:
            from sklearn.datasets import load_digits

            digits = load_digits()
            index = dirichlet_share(digits.target, num_sites, site_number(site), alpha, seed)
            x, y = digits.data[index] / 16.0, digits.target[index]
        order = np.random.default_rng([seed, 1]).permutation(len(y))
        n_val = round(val_fraction * len(y))
        self.val = _tensors(x[order[:n_val]], y[order[:n_val]])
        self.train = _tensors(x[order[n_val:]], y[order[n_val:]])
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val, batch_size=256)


def _tensors(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    return TensorDataset(torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.long))
