"""Seeded hold-outs: the fixed stratified train/test split of datasets that publish none (digits, genotype panels and
cohorts), and every site's own validation and test hold-out of its shard.

Its own module because both the dataset loaders (``data_prep.datasets``) and the genotype helpers
(``data_prep.genomics``) draw it, and the loaders already import the genotype helpers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["holdout_size", "site_holdout_indices", "stratified_split"]


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


def holdout_size(n: int, fraction: float, taken: int = 0) -> int:
    """Samples a ``fraction`` of ``n`` holds out: at least one when the fraction is positive, and never so many that
    fewer than one of the ``n - taken`` samples left stays for training."""
    if fraction <= 0:
        return 0
    return max(0, min(max(1, round(fraction * n)), n - taken - 1))


def site_holdout_indices(
    n: int, val_fraction: float, test_fraction: float, seed: int, site_index: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(training, validation, test) indices of a site's ``n`` samples, disjoint, each in the shard's order.

    One seeded permutation per (seed, site): its first ``holdout_size(n, val_fraction)`` entries are the validation
    split, the next ``holdout_size(n, test_fraction, n_val)`` the test split, the rest trains. The validation split
    is therefore the same with and without a test split (adding one only shrinks the training part), and none of
    the three depends on anything but (seed, site, n, fractions): every round and process of a site agrees.
    """
    rng = np.random.default_rng([seed, site_index, 0, 2])  # 2: a stream apart from the round's and the epochs'
    order = rng.permutation(n)
    n_val = holdout_size(n, val_fraction)
    n_test = holdout_size(n, test_fraction, n_val)
    role = np.zeros(n, dtype=np.int8)  # 0 train, 1 validation, 2 test
    role[order[:n_val]] = 1
    role[order[n_val : n_val + n_test]] = 2
    return np.flatnonzero(role == 0), np.flatnonzero(role == 1), np.flatnonzero(role == 2)
