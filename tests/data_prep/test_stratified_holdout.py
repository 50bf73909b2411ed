"""Stratified site hold-outs (``site_holdout stratified``, the genomics module's ``holdout``): closed-form
apportionment, the label mix of the split that selects equal to the split that reports, and what it guards against."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from data_prep.splits import apportion, site_holdout_indices, stratified_roles
from jobs.build import JobSpec
from jobs.spec import client_script_args
from lightning_modules.site import builtin_split_sizes, hold_out

SPEC = JobSpec(name="tiny", dataset="digits", arch="mlp", num_rounds=1, batch_size=32)


def test_apportion_is_hamiltons_method() -> None:
    # 4 of (5, 3, 2): exact shares 2, 1.2, 0.8; floors 2, 1, 0; the one left goes to the largest remainder (0.8).
    assert apportion(np.array([5, 3, 2]), 4, np.random.default_rng(0)).tolist() == [2, 1, 1]
    # Exact shares need no remainder: 20 of (50, 30, 15, 5) is 10, 6, 3, 1.
    assert apportion(np.array([50, 30, 15, 5]), 20, np.random.default_rng(0)).tolist() == [10, 6, 3, 1]
    # Equal remainders: 2 of four singletons, in a seeded random order; never above a count, always the total.
    draws = {tuple(apportion(np.ones(4, int), 2, np.random.default_rng(seed)).tolist()) for seed in range(20)}
    assert len(draws) > 1 and all(sum(d) == 2 and max(d) == 1 for d in draws)
    assert apportion(np.array([3, 0, 1]), 4, np.random.default_rng(0)).tolist() == [3, 0, 1]
    with pytest.raises(ValueError, match="cannot apportion 5 of 4"):
        apportion(np.array([3, 1]), 5, np.random.default_rng(0))


def test_both_hold_outs_hold_the_shards_label_mix_and_validation_ignores_the_test_split() -> None:
    labels = np.array([0] * 50 + [1] * 30 + [2] * 15 + [3] * 5)
    train, val, test = site_holdout_indices(100, 0.2, 0.2, seed=3, site_index=1, labels=labels)
    assert np.bincount(labels[val]).tolist() == np.bincount(labels[test]).tolist() == [10, 6, 3, 1]
    assert sorted([*train, *val, *test]) == list(range(100))
    assert np.array_equal(val, site_holdout_indices(100, 0.2, 0.0, seed=3, site_index=1, labels=labels)[1])
    assert not np.array_equal(val, site_holdout_indices(100, 0.2, 0.2, seed=4, site_index=1, labels=labels)[1])
    # The same sizes as the label-blind hold-out: the split sizes the build checks and the reports state hold.
    assert [len(p) for p in (train, val, test)] == [len(p) for p in site_holdout_indices(100, 0.2, 0.2, 3, 1)]
    with pytest.raises(ValueError, match="site 1: 99 labels for 100 samples"):
        site_holdout_indices(100, 0.2, 0.2, 3, 1, labels=labels[:99])


def test_the_label_blind_hold_out_is_unchanged() -> None:
    """Pinned to its definition (one permutation seeded by (seed, site, 0, 2), validation first): every committed
    result drew its splits this way."""
    order = np.random.default_rng([3, 1, 0, 2]).permutation(200)
    _, val, test = site_holdout_indices(200, 0.1, 0.2, seed=3, site_index=1)
    assert np.array_equal(val, np.sort(order[:20])) and np.array_equal(test, np.sort(order[20:60]))


def _worst_share_error(labels: np.ndarray, part_labels: np.ndarray) -> float:
    """The largest |a label's count in a split - its proportional share of the shard's ``labels``| over the labels."""
    counts = np.bincount(labels, minlength=labels.max() + 1)
    share = counts * len(part_labels) / len(labels)
    return float(np.max(np.abs(np.bincount(part_labels, minlength=len(counts)) - share)))


def test_a_label_blind_hold_out_can_select_on_another_label_mix_than_it_reports_on() -> None:
    """The failure it guards against: a small label-skewed site (44 validation and 44 test samples of 220 over
    six labels) whose label-blind validation split holds a label several samples off its share; stratified, every
    label of both splits is within one sample of it, whatever the seed."""
    labels = np.repeat(np.arange(6), [90, 50, 35, 25, 15, 5])
    blind = [site_holdout_indices(220, 0.2, 0.2, seed, 0) for seed in range(30)]
    assert max(_worst_share_error(labels, labels[part]) for split in blind for part in split[1:]) > 4
    for seed in range(30):
        _, val, test = site_holdout_indices(220, 0.2, 0.2, seed, 0, labels=labels)
        assert _worst_share_error(labels, labels[val]) < 1 and _worst_share_error(labels, labels[test]) < 1


def test_stratified_roles_keeps_a_rare_label_in_training_when_its_share_rounds_down() -> None:
    labels = np.array([0] * 9 + [1])
    val, test, train = stratified_roles(labels, 2, 2, np.random.default_rng(0))
    assert 9 in train and len(val) == len(test) == 2 and set(labels[val]) == set(labels[test]) == {0}


def test_a_builtin_site_stratifies_on_request_only() -> None:
    class Args:
        seed, partition_seed, site_val_fraction, site_test_fraction, site_holdout = 0, None, 0.2, 0.2, "stratified"

    x, y = np.zeros((100, 2), dtype=np.float32), np.array([0] * 50 + [1] * 30 + [2] * 15 + [3] * 5)
    splits = hold_out(Args(), x, y, 0)
    assert np.bincount(splits.validation.tensors[1].numpy()).tolist() == [10, 6, 3, 1]
    assert np.bincount(splits.test.tensors[1].numpy()).tolist() == [10, 6, 3, 1]
    spec = dataclasses.replace(SPEC, site_val_fraction=0.1, site_test_fraction=0.2)
    assert "--site-holdout" not in client_script_args(spec)
    stratified = dataclasses.replace(spec, site_holdout="stratified")
    assert "--site-holdout stratified" in client_script_args(stratified)
    assert builtin_split_sizes(stratified) == builtin_split_sizes(spec)  # sizes do not depend on it


def test_the_genomics_data_module_stratifies_by_population(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from genomics.data import SnpSites

    kwargs = {"site": "site-2", "num_sites": 3, "split": "dirichlet", "alpha": 0.3, "val_fraction": 0.2}
    blind = SnpSites(**kwargs, test_fraction=0.2)
    split = SnpSites(**kwargs, test_fraction=0.2, holdout="stratified")
    assert [len(split.train), len(split.val), len(split.test)] == [len(blind.train), len(blind.val), len(blind.test)]
    people = np.concatenate([part.tensors[1].numpy() for part in (split.train, split.val, split.test)])
    assert max(_worst_share_error(people, part.tensors[1].numpy()) for part in (split.val, split.test)) < 1
    blind_people = np.concatenate([part.tensors[1].numpy() for part in (blind.train, blind.val, blind.test)])
    assert max(_worst_share_error(blind_people, part.tensors[1].numpy()) for part in (blind.val, blind.test)) >= 1
    plain = SnpSites(**kwargs, holdout="stratified")
    assert np.array_equal(plain.val.tensors[0].numpy(), split.val.tensors[0].numpy())
    with pytest.raises(Exception, match=r"site-2: holdout must be one of \['random', 'stratified'\], got 'label'"):
        SnpSites(**kwargs, holdout="label")
