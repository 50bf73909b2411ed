"""``aggregators.contracts.sampling``: how many sites train in a round and which ones (seeded, order independent)."""

from __future__ import annotations

import random

import pytest

from aggregators.contracts.sampling import clients_per_round_count, sample_sites

SITES = [f"site-{i}" for i in range(1, 11)]


@pytest.mark.parametrize(
    ("clients_per_round", "population", "expected"),
    [
        (None, 10, 10),
        (None, 1, 1),
        (3, 10, 3),
        (1, 10, 1),
        (10, 10, 10),
        (15, 10, 10),  # a count is capped at the population
        (0.7, 10, 7),
        (0.3, 10, 3),
        # Float noise just above an integer must not add a site:
        (0.07, 100, 7),  # 0.07 * 100 = 7.000000000000001
        (0.14, 50, 7),  # 0.14 * 50 = 7.000000000000001
        (0.28, 100, 28),  # 0.28 * 100 = 28.000000000000004
        (0.57, 100, 57),  # 56.99999999999999 just below an integer still rounds up to 57
        (0.1, 10, 1),
        (0.25, 10, 3),  # 2.5 -> rounded up
        (0.01, 10, 1),  # never zero sites
        (1.0, 10, 10),
        (1.0, 3, 3),
        (0.5, 3, 2),
    ],
)
def test_clients_per_round_count(clients_per_round, population, expected):
    assert clients_per_round_count(clients_per_round, population) == expected


@pytest.mark.parametrize("bad", [0, -1, 1.5, 0.0, -0.5, float("nan"), float("inf"), True, False, "3", [3]])
def test_bad_clients_per_round_raise(bad):
    with pytest.raises(ValueError):
        clients_per_round_count(bad, 10)


@pytest.mark.parametrize("population", [0, -1])
def test_empty_population_raises(population):
    with pytest.raises(ValueError, match="no client"):
        clients_per_round_count(None, population)


def test_sample_is_a_sorted_subset_of_the_right_size():
    for round_num in range(20):
        # Execute
        chosen = sample_sites(SITES, 3, seed=0, round_num=round_num)

        # Assert
        assert len(chosen) == 3
        assert len(set(chosen)) == 3
        assert set(chosen) <= set(SITES)
        assert chosen == sorted(chosen)


def test_same_seed_and_round_give_the_same_sites():
    for round_num in range(5):
        assert sample_sites(SITES, 3, seed=42, round_num=round_num) == sample_sites(
            list(SITES), 3, seed=42, round_num=round_num
        )


def test_rounds_draw_different_sites_and_every_site_gets_a_turn():
    # Execute
    draws = [tuple(sample_sites(SITES, 3, seed=0, round_num=r)) for r in range(50)]

    # Assert: C(10, 3) = 120 possible draws; a sampler that ignores the round gives one draw only.
    assert len(set(draws)) >= 20
    assert {site for draw in draws for site in draw} == set(SITES)


def test_different_seeds_give_different_schedules():
    schedule_0 = [sample_sites(SITES, 3, seed=0, round_num=r) for r in range(10)]
    schedule_1 = [sample_sites(SITES, 3, seed=1, round_num=r) for r in range(10)]
    assert schedule_0 != schedule_1


def test_sample_does_not_depend_on_population_order():
    # Prepare
    shuffled = list(SITES)
    random.Random(3).shuffle(shuffled)
    assert shuffled != SITES

    for round_num in range(10):
        # Execute / Assert
        assert sample_sites(shuffled, 4, seed=5, round_num=round_num) == sample_sites(
            SITES, 4, seed=5, round_num=round_num
        )
        assert sample_sites(tuple(reversed(SITES)), 4, seed=5, round_num=round_num) == sample_sites(
            SITES, 4, seed=5, round_num=round_num
        )


@pytest.mark.parametrize("count", [10, 11, 100])
def test_count_at_or_above_population_returns_everyone_sorted(count):
    assert sample_sites(list(reversed(SITES)), count, seed=0, round_num=0) == sorted(SITES)


def test_full_pipeline_fraction_then_sample():
    # Execute
    count = clients_per_round_count(0.7, len(SITES))
    chosen = sample_sites(SITES, count, seed=1, round_num=2)

    # Assert
    assert len(chosen) == 7
