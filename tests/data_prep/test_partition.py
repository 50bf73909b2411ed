"""Partitioners: determinism, disjointness, coverage, skew, and error messages."""

from __future__ import annotations

import numpy as np
import pytest

from data_prep import (
    SCHEMES,
    DataPrepError,
    dirichlet,
    iid,
    label_counts,
    label_quantity,
    partition,
    quantity,
    shards,
)

ALL_SCHEMES = pytest.mark.parametrize("scheme", SCHEMES)


def _split(labels: np.ndarray, scheme: str, seed: int = 0, num_sites: int = 5, **kwargs: float) -> list[np.ndarray]:
    return partition(labels, num_sites, scheme, seed=seed, **kwargs)


def _mean_site_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean Shannon entropy (nats) of the per-site label distributions: low means skewed."""
    counts = label_counts(labels, parts, 10).astype(float)
    probs = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(probs > 0, -probs * np.log(probs), 0.0)
    return float(terms.sum(axis=1).mean())


@ALL_SCHEMES
def test_same_seed_gives_identical_partition(labels: np.ndarray, scheme: str) -> None:
    first, second = _split(labels, scheme, seed=7), _split(labels, scheme, seed=7)
    assert len(first) == len(second) == 5
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "population"])  # population uses no randomness
def test_different_seed_gives_different_partition(labels: np.ndarray, scheme: str) -> None:
    first, second = _split(labels, scheme, seed=1), _split(labels, scheme, seed=2)
    assert any(len(a) != len(b) or not np.array_equal(a, b) for a, b in zip(first, second, strict=True))


@ALL_SCHEMES
def test_sites_are_disjoint_sorted_int64_and_non_empty(labels: np.ndarray, scheme: str) -> None:
    parts = _split(labels, scheme, num_sites=7)
    for part in parts:
        assert part.dtype == np.int64
        assert len(part) > 0
        assert np.all(np.diff(part) > 0), "indices must be sorted and unique within a site"
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == len(merged), "a sample was given to two sites"
    assert merged.min() >= 0 and merged.max() < len(labels)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards", "quantity", "small_sites"])
def test_every_sample_used_exactly_once(labels: np.ndarray, scheme: str) -> None:
    parts = _split(labels, scheme, num_sites=5, classes_per_site=2)  # 5 sites x 2 labels covers all 10 labels
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_dispatcher_matches_direct_functions(labels: np.ndarray) -> None:
    expected = {
        "iid": iid(labels, 4, seed=3),
        "dirichlet": dirichlet(labels, 4, seed=3, alpha=0.3, min_samples=5),
        "shards": shards(labels, 4, seed=3, classes_per_site=3),
        "quantity": quantity(labels, 4, seed=3, alpha=0.3, min_samples=5),
    }
    for scheme, parts in expected.items():
        got = partition(labels, 4, scheme, seed=3, alpha=0.3, classes_per_site=3, min_samples=5)
        for a, b in zip(got, parts, strict=True):
            np.testing.assert_array_equal(a, b)


def test_population_gives_whole_classes_round_robin() -> None:
    labels = np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 4])
    parts = partition(labels, 3, "population", seed=0)
    # classes 0 and 3 -> site-1, 1 and 4 -> site-2, 2 -> site-3
    assert [p.tolist() for p in parts] == [[0, 3, 5, 8], [1, 4, 6, 9, 10], [2, 7]]


def test_population_refuses_more_sites_than_classes() -> None:
    with pytest.raises(DataPrepError, match="6 sites but only 5 populations"):
        partition(np.arange(10) % 5, 6, "population", seed=0)


def test_iid_sizes_differ_by_at_most_one(labels: np.ndarray) -> None:
    sizes = [len(p) for p in iid(labels, 7, seed=0)]
    assert max(sizes) - min(sizes) <= 1


def test_small_alpha_is_more_skewed_than_large_alpha(labels: np.ndarray) -> None:
    skewed = _mean_site_entropy(labels, dirichlet(labels, 5, seed=0, alpha=0.1))
    balanced = _mean_site_entropy(labels, dirichlet(labels, 5, seed=0, alpha=100.0))
    assert skewed < balanced - 0.5
    assert balanced > 0.95 * np.log(10), "alpha=100 should be close to IID"


@pytest.mark.parametrize("seed", range(5))
def test_dirichlet_stops_feeding_sites_that_reached_the_average_size(labels: np.ndarray, seed: int) -> None:
    # A site below n / num_sites can receive at most one more whole class before it is closed.
    parts = dirichlet(labels, 5, seed=seed, alpha=0.05)
    assert max(len(p) for p in parts) <= len(labels) / 5 + 300


def test_dirichlet_respects_min_samples(labels: np.ndarray) -> None:
    parts = dirichlet(labels, 20, seed=0, alpha=0.1, min_samples=40)
    assert min(len(p) for p in parts) >= 40


def test_dirichlet_gives_up_with_clear_error_after_bounded_draws() -> None:
    one_class = np.zeros(20, dtype=np.int64)  # 10/10 is the only acceptable split; alpha=0.001 never draws it
    with pytest.raises(DataPrepError, match=r"dirichlet: no draw in \d+ .*larger alpha"):
        dirichlet(one_class, 2, seed=0, alpha=0.001, min_samples=10)


@pytest.mark.parametrize("k", [1, 2, 3, 10])
def test_shards_give_exactly_k_labels_per_site(labels: np.ndarray, k: int) -> None:
    parts = shards(labels, 6, seed=0, classes_per_site=k)
    assert [len(np.unique(labels[p])) for p in parts] == [k] * 6


def test_shards_use_every_label_when_sites_times_k_covers_classes(labels: np.ndarray) -> None:
    # 3 sites x 4 labels >= 10 classes although there are fewer sites than classes.
    parts = shards(labels, 3, seed=5, classes_per_site=4)
    assert set(np.unique(labels[np.concatenate(parts)])) == set(range(10))
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_shards_split_each_label_evenly_among_its_holders(labels: np.ndarray) -> None:
    counts = label_counts(labels, shards(labels, 5, seed=0, classes_per_site=4), 10)
    for column in counts.T:
        held = column[column > 0]
        assert held.max() - held.min() <= 1


def test_shards_with_fewer_slots_than_classes_use_only_dealt_labels(labels: np.ndarray) -> None:
    parts = shards(labels, 2, seed=0, classes_per_site=3)
    used = np.unique(labels[np.concatenate(parts)])
    assert len(used) == 6  # 2 sites x 3 distinct labels, no label shared while unused ones remain


#: NIID-Bench's "#C=2" dealing for 10 sites, seed 42, derived with an independent loop written from the paper's
#: description (site i: label i mod 10, then one-element draws of default_rng(42).choice(10, 1) until 2 distinct).
NIID_BENCH_C2_SEED42 = [{0, 7}, {1, 6}, {2, 4}, {3, 4}, {4, 8}, {5, 0}, {6, 2}, {7, 0}, {8, 5}, {9, 7}]


def test_label_quantity_deals_niid_benchs_labels_and_sizes() -> None:
    labels = np.repeat(np.arange(10), 60)  # 60 samples of each label
    parts = label_quantity(labels, 10, seed=42, classes_per_site=2)
    assert [set(np.unique(labels[p]).tolist()) for p in parts] == NIID_BENCH_C2_SEED42
    # Holders per label: 0 -> 3, 1 -> 1, 2 -> 2, 3 -> 1, 4 -> 3, 5 -> 2, 6 -> 2, 7 -> 3, 8 -> 2, 9 -> 1; a site's
    # size is 60 / holders summed over its two labels.
    assert [len(p) for p in parts] == [40, 90, 50, 80, 50, 50, 60, 40, 60, 80]
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))


def test_label_quantity_gives_site_i_label_i_mod_classes_first_and_k_labels(labels: np.ndarray) -> None:
    parts = label_quantity(labels, 12, seed=3, classes_per_site=3)
    for site, part in enumerate(parts):
        held = np.unique(labels[part])
        assert len(held) == 3 and site % 10 in held
    counts = label_counts(labels, parts, 10)
    for column in counts.T:  # each label split evenly among its holders
        held = column[column > 0]
        assert held.max() - held.min() <= 1


def test_label_quantity_refuses_more_labels_than_classes(labels: np.ndarray) -> None:
    with pytest.raises(DataPrepError, match="label_quantity: classes_per_site=11 but the labels have 10 classes"):
        label_quantity(labels, 10, seed=0, classes_per_site=11)


def test_quantity_sizes_vary_but_labels_stay_iid() -> None:
    labels = np.random.default_rng(0).integers(0, 10, size=20_000)
    parts = quantity(labels, 5, seed=1, alpha=0.5)
    sizes = np.array([len(p) for p in parts])
    assert sizes.std() / sizes.mean() > 0.3, f"sizes {sizes} are too even for quantity skew"
    overall = np.bincount(labels, minlength=10) / len(labels)
    for part in parts:
        if len(part) >= 500:
            site = np.bincount(labels[part], minlength=10) / len(part)
            assert 0.5 * np.abs(site - overall).sum() < 0.1


def test_no_empty_site_is_ever_returned() -> None:
    labels = np.array([0, 1], dtype=np.int64)  # each label has one sample but two holders
    with pytest.raises(DataPrepError, match="site-2 received no samples"):
        shards(labels, 2, seed=0, classes_per_site=2)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"scheme": "dirichlet", "alpha": 0.0}, "alpha must be"),
        ({"scheme": "dirichlet", "alpha": -1.0}, "alpha must be"),
        ({"scheme": "quantity", "alpha": float("nan")}, "alpha must be"),
        ({"scheme": "dirichlet", "alpha": float("inf")}, "alpha must be"),
        ({"scheme": "shards", "classes_per_site": 11}, "classes_per_site=11 but the labels have 10 classes"),
        ({"scheme": "shards", "classes_per_site": 0}, "use a value from 1 to 10"),
        ({"scheme": "random"}, "unknown partition scheme 'random'; choose one of: iid, dirichlet, shards, quantity"),
        ({"scheme": "iid", "num_sites": 3001}, "3001 sites but only 3000 samples"),
        ({"scheme": "iid", "num_sites": 0}, "num_sites must be a positive integer"),
        ({"scheme": "dirichlet", "num_sites": 301, "min_samples": 10}, "exceeds the 3000 samples"),
    ],
)
def test_bad_parameters_raise_one_line_error(labels: np.ndarray, kwargs: dict[str, object], expected: str) -> None:
    args = {"num_sites": 5, **kwargs}
    with pytest.raises(DataPrepError) as info:
        partition(labels, args.pop("num_sites"), args.pop("scheme"), seed=0, **args)  # type: ignore[arg-type]
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_non_integer_labels_are_rejected() -> None:
    with pytest.raises(DataPrepError, match="1-D integer array"):
        iid(np.zeros((4, 2)), 2, seed=0)


def test_label_counts_matches_hand_count() -> None:
    labels = np.array([0, 2, 2, 1, 0, 2])
    counts = label_counts(labels, [np.array([0, 1, 2]), np.array([3, 4, 5])], 3)
    np.testing.assert_array_equal(counts, [[1, 0, 2], [1, 1, 1]])
    assert counts.dtype == np.int64


# ---------------------------------------------------------------- small_sites (the harnesses' qty<beta>)


@pytest.mark.parametrize(
    ("num_sites", "share", "sizes"),
    [(10, 0.3, [50, 100, 150]), (7, 0.3, [50, 150]), (5, 0.2, [100]), (9, 0.5, [50, 75, 100, 125, 150])],
)
def test_small_sites_sizes_are_evenly_spaced_from_50_to_150(num_sites: int, share: float, sizes: list[int]) -> None:
    from data_prep.partition import small_site_sizes

    assert small_site_sizes(num_sites, share) == sizes


def test_small_sites_are_the_first_ones_and_the_rest_share_the_remainder_equally() -> None:
    labels = np.arange(12000) % 10
    parts = partition(labels, 10, "small_sites", seed=0, alpha=0.3)  # alpha carries beta
    assert [len(p) for p in parts] == [50, 100, 150, 1672, 1672, 1672, 1671, 1671, 1671, 1671]
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(12000))
    # labels stay IID: every large site holds each class within a few percent of a tenth
    counts = label_counts(labels, parts[3:], 10)
    assert np.all(np.abs(counts / counts.sum(axis=1, keepdims=True) - 0.1) < 0.03)


def test_small_sites_halves_round_up_not_to_even() -> None:
    from data_prep.partition import small_site_sizes

    assert len(small_site_sizes(5, 0.5)) == 3  # 2.5 sites: Python's round() would give 2


@pytest.mark.parametrize(
    ("num_sites", "share", "expected"),
    [
        (10, 0.0, r"share of small sites must be a number in \(0, 1\), got 0"),
        (10, 1.0, r"in \(0, 1\), got 1"),
        (10, True, r"in \(0, 1\), got True"),
        (10, 0.01, r"share 0.01 of 10 sites gives 0 small site\(s\); choose a share that gives 1 to 9"),
        (3, 0.9, r"share 0.9 of 3 sites gives 3 small site\(s\); choose a share that gives 1 to 2"),
    ],
)
def test_small_sites_refuses_a_share_that_gives_no_small_or_no_large_site(
    num_sites: int, share: float, expected: str
) -> None:
    with pytest.raises(DataPrepError, match=expected):
        partition(np.arange(3000) % 10, num_sites, "small_sites", seed=0, alpha=share)


def test_small_sites_refuses_large_sites_no_larger_than_the_small_ones() -> None:
    with pytest.raises(DataPrepError, match=r"900 samples leave 150 per large site after 3 small site\(s\)"):
        partition(np.arange(900) % 10, 7, "small_sites", seed=0, alpha=0.4)
