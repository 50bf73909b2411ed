"""Seeded hold-outs: the fixed stratified train/test split of datasets that publish none (digits, genotype panels and
cohorts), and every site's own validation and test hold-out of its shard.

Its own module because both the dataset loaders (``data_prep.datasets``) and the genotype helpers
(``data_prep.genomics``) draw it, and the loaders already import the genotype helpers.
"""

from __future__ import annotations

import numpy as np

__all__ = ["HOLDOUTS", "apportion", "holdout_size", "site_holdout_indices", "stratified_roles", "stratified_split"]

#: How a site draws its validation and test hold-outs: ``random`` (one seeded permutation, blind to the labels) or
#: ``stratified`` (every label in the same share in each part: `stratified_roles`).
HOLDOUTS = ("random", "stratified")


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
    n: int,
    val_fraction: float,
    test_fraction: float,
    seed: int,
    site_index: int,
    labels: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(training, validation, test) indices of a site's ``n`` samples, disjoint, each in the shard's order.

    ``holdout_size(n, val_fraction)`` samples validate, the next ``holdout_size(n, test_fraction, n_val)`` test, the
    rest trains. Without ``labels``: one seeded permutation per (seed, site), validation first. With the shard's
    ``labels``: `stratified_roles`, so both hold-outs hold every label in the shard's proportions (the same sizes).
    Either way the validation split is the same with and without a test split (adding one only shrinks the
    training part), and nothing depends on anything but (seed, site, n, fractions, labels): every round and process
    of a site agrees.
    """
    rng = np.random.default_rng([seed, site_index, 0, 2])  # 2: a stream apart from the round's and the epochs'
    n_val = holdout_size(n, val_fraction)
    n_test = holdout_size(n, test_fraction, n_val)
    if labels is not None:
        if len(labels) != n:
            raise ValueError(f"site {site_index}: {len(labels)} labels for {n} samples")
        val, test, train = stratified_roles(np.asarray(labels), n_val, n_test, rng)
        return train, val, test
    order = rng.permutation(n)
    role = np.zeros(n, dtype=np.int8)  # 0 train, 1 validation, 2 test
    role[order[:n_val]] = 1
    role[order[n_val : n_val + n_test]] = 2
    return np.flatnonzero(role == 0), np.flatnonzero(role == 1), np.flatnonzero(role == 2)


def apportion(counts: np.ndarray, total: int, rng: np.random.Generator) -> np.ndarray:
    """Integer shares of ``total`` proportional to ``counts`` by largest remainders (Hamilton's method): they sum to
    ``total`` (at most ``counts.sum()``), each is the floor or the ceiling of ``count * total / counts.sum()``,
    and equal remainders go in a seeded random order. Always draws one number per count from ``rng``, so what
    the caller draws next does not depend on ``total``."""
    counts = np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    tiebreak = rng.random(len(counts))
    if not 0 <= total <= n:
        raise ValueError(f"cannot apportion {total} of {n}")
    if n == 0:
        return np.zeros(len(counts), dtype=np.int64)
    shares, remainders = np.divmod(counts * total, n)  # integers: no float ties that are not ties
    left = total - int(shares.sum())
    # Remainders sum to n * left and each is below n, so the `left` largest are all positive: a count is never
    # exceeded.
    order = np.lexsort((tiebreak, -remainders))
    shares[order[:left]] += 1
    return shares


def stratified_roles(
    labels: np.ndarray, n_val: int, n_test: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(validation, test, training) positions of ``labels``: ``n_val`` and ``n_test`` samples apportioned over the
    labels in proportion to their counts (`apportion`: validation over the whole shard, test over what validation
    left), each label's members drawn at random. So the two hold-outs hold every label within one sample of the
    shard's proportion, and the split that selects has the label mix of the split that reports."""
    classes, inverse = np.unique(labels, return_inverse=True)
    counts = np.bincount(inverse, minlength=len(classes))
    val_shares = apportion(counts, n_val, rng)
    test_shares = apportion(counts - val_shares, n_test, rng)
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for label, (n_v, n_t) in enumerate(zip(val_shares, test_shares, strict=True)):
        members = rng.permutation(np.flatnonzero(inverse == label))
        for part, chunk in zip(parts, np.split(members, [n_v, n_v + n_t]), strict=True):
            part.append(chunk)
    val, test, train = (np.sort(np.concatenate(part)).astype(np.int64) for part in parts)
    return val, test, train
