"""The fixed stratified train/test split of datasets that publish none (digits, genotype panels and cohorts).

Its own module because both the dataset loaders (``data_prep.datasets``) and the genotype helpers
(``data_prep.genomics``) draw it, and the loaders already import the genotype helpers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["stratified_split"]


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per class, put ``round(test_fraction * n_class)`` random samples in test; return sorted (train, test) indices."""
    rng = np.random.default_rng(seed)
    test_parts = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        test_parts.append(members[: round(test_fraction * len(members))])
    test_idx = np.sort(np.concatenate(test_parts))
    train_idx = np.setdiff1d(np.arange(len(labels)), test_idx)
    return train_idx, test_idx
