"""Per-site data: site names, config validation, site shards, the test split, and tensor wrapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data_prep import (
    DataPrepError,
    SiteDataConfig,
    load_dataset,
    partition_sites,
    site_index,
    site_split,
    test_split,
    to_tensor_dataset,
)


@pytest.mark.parametrize(("name", "expected"), [("site-1", 0), ("site-2", 1), ("site-10", 9), (" site-3 ", 2)])
def test_site_index_maps_names_to_zero_based_indices(name: str, expected: int) -> None:
    assert site_index(name, 10) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("site-4", "beyond the 3 configured sites"),
        ("site-0", "does not look like site-1 .. site-3"),
        ("site-01", "does not look like"),
        ("client-1", "does not look like"),
        ("site-", "does not look like"),
        ("", "does not look like"),
    ],
)
def test_site_index_rejects_bad_names(name: str, expected: str) -> None:
    with pytest.raises(DataPrepError) as info:
        site_index(name, 3)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_config_normalises_dataset_name() -> None:
    assert SiteDataConfig("Fashion-MNIST", "iid", 2).dataset == "fashion_mnist"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"dataset": "cifar10"}, "unknown dataset 'cifar10'; choose one of"),
        ({"scheme": "label"}, "unknown partition scheme 'label'"),
        ({"alpha": 0.0}, "alpha must be > 0"),
        ({"alpha": -0.5}, "alpha must be > 0"),
        ({"alpha": float("nan")}, "alpha must be a finite number"),
        ({"num_sites": 0}, "num_sites must be an integer >= 1"),
        ({"num_sites": True}, "num_sites must be an integer >= 1"),
        ({"seed": -1}, "seed must be an integer >= 0"),
        ({"classes_per_site": 0}, "classes_per_site must be an integer >= 1"),
        ({"max_train_samples": 0}, "max_train_samples must be an integer >= 1"),
    ],
)
def test_config_rejects_bad_values(kwargs: dict[str, object], expected: str) -> None:
    settings: dict[str, object] = {"dataset": "digits", "scheme": "dirichlet", "num_sites": 3, **kwargs}
    with pytest.raises(DataPrepError) as info:
        SiteDataConfig(**settings)  # type: ignore[arg-type]
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_sites_together_hold_the_training_set_once() -> None:
    cfg = SiteDataConfig("digits", "dirichlet", num_sites=4, alpha=0.5, seed=3)
    data = load_dataset("digits")
    shards = [site_split(cfg, f"site-{i}") for i in range(1, 5)]
    assert sum(len(y) for _, y in shards) == len(data.train_y)
    labels, parts = partition_sites(cfg)
    for (x, y), part in zip(shards, parts, strict=True):
        np.testing.assert_array_equal(x, data.train_x[part])
        np.testing.assert_array_equal(y, labels[part])


def test_site_split_is_deterministic_and_seed_dependent() -> None:
    cfg = SiteDataConfig("digits", "shards", num_sites=3, classes_per_site=2, seed=1)
    x1, y1 = site_split(cfg, "site-2")
    x2, y2 = site_split(cfg, "site-2")
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(y1, y2)
    _, other = site_split(SiteDataConfig("digits", "shards", num_sites=3, classes_per_site=2, seed=2), "site-2")
    assert len(other) != len(y1) or not np.array_equal(other, y1)


def test_max_train_samples_partitions_a_seeded_subset() -> None:
    cfg = SiteDataConfig("digits", "iid", num_sites=3, seed=0, max_train_samples=300)
    labels, parts = partition_sites(cfg)
    assert len(labels) == 300 and sum(len(p) for p in parts) == 300
    again, _ = partition_sites(cfg)
    np.testing.assert_array_equal(labels, again)
    other, _ = partition_sites(SiteDataConfig("digits", "iid", num_sites=3, seed=1, max_train_samples=300))
    assert not np.array_equal(labels, other)


def test_site_split_returns_writable_copies() -> None:
    x, _ = site_split(SiteDataConfig("digits", "iid", num_sites=2), "site-1")
    x[0, 0] = 42.0  # must not raise, and must not leak into the cached dataset
    assert load_dataset("digits").train_x.max() <= 1.0


def test_site_split_rejects_site_outside_federation() -> None:
    with pytest.raises(DataPrepError, match="beyond the 2 configured sites"):
        site_split(SiteDataConfig("digits", "iid", num_sites=2), "site-3")


def test_more_sites_than_samples_is_reported() -> None:
    cfg = SiteDataConfig("digits", "iid", num_sites=10, max_train_samples=5)
    with pytest.raises(DataPrepError, match="10 sites but only 5 samples"):
        site_split(cfg, "site-1")


def test_test_split_is_the_full_published_test_set() -> None:
    x, y = test_split(SiteDataConfig("digits", "shards", num_sites=5, classes_per_site=1))
    assert x.shape == (359, 64) and set(np.unique(y)) == set(range(10))


def test_to_tensor_dataset_types_and_length() -> None:
    x, y = site_split(SiteDataConfig("digits", "iid", num_sites=2), "site-2")
    dataset = to_tensor_dataset(x, y)
    features, target = dataset[0]
    assert len(dataset) == len(y)
    assert features.dtype == torch.float32 and features.shape == (64,)
    assert target.dtype == torch.int64 and int(target) == int(y[0])


def test_to_tensor_dataset_rejects_length_mismatch() -> None:
    with pytest.raises(DataPrepError, match="x has 3 samples but y has 2"):
        to_tensor_dataset(np.zeros((3, 2), dtype=np.float32), np.zeros(2, dtype=np.int64))
