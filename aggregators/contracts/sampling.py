"""Which sites train in a round: all of them, a fixed number, or a fraction of the population."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def clients_per_round_problem(clients_per_round: Any) -> str | None:
    """Why ``clients_per_round`` cannot be resolved for any population (``None``: it can), as one line naming the
    setting, the value and what is allowed; the engine and the controller refuse such a value when built."""
    allowed = "none (all sites), an integer count >= 1 or a fraction in (0, 1] written with a dot"
    if clients_per_round is None:
        return None
    is_count = isinstance(clients_per_round, int) and not isinstance(clients_per_round, bool)
    if is_count and clients_per_round >= 1:
        return None
    if isinstance(clients_per_round, float) and 0 < clients_per_round <= 1:  # also refuses NaN
        return None
    return f"clients_per_round must be {allowed}, got {clients_per_round!r}"


def clients_per_round_count(clients_per_round: int | float | None, population_size: int) -> int:
    """Resolve ``None`` (all sites), an ``int`` count or a ``float`` fraction in (0, 1] into a number of sites.

    A float is always a fraction (``1.0`` = everyone), an int always a count, so a JSON config is unambiguous.
    """
    if population_size <= 0:
        raise ValueError("no client is connected; nothing to sample")
    problem = clients_per_round_problem(clients_per_round)
    if problem:
        raise ValueError(problem)
    if clients_per_round is None:
        return population_size
    if isinstance(clients_per_round, float):
        # The tolerance keeps float noise (0.07 * 100 = 7.000000000000001) from adding a site.
        return max(1, math.ceil(clients_per_round * population_size - 1e-9))
    return min(clients_per_round, population_size)


def sample_sites(population: Sequence[str], count: int, seed: int, round_num: int) -> list[str]:
    """A seeded, order-independent choice of ``count`` sites for ``round_num`` (sorted for readable logs)."""
    ordered = sorted(population)
    if count >= len(ordered):
        return ordered
    rng = np.random.default_rng([seed, round_num])
    chosen = rng.choice(len(ordered), size=count, replace=False)
    return sorted(ordered[i] for i in chosen)


def select_round_sites(
    rule: Any, population: Sequence[str], count: int, state: Mapping[str, Any], seed: int, round_num: int
) -> tuple[list[str], Mapping[str, Any]]:
    """The round's sites: the rule's own ``select_sites`` when it has one, else `sample_sites`. The one site
    selection: the round engine calls it (and turns anything it raises into a failed round naming the rule).

    A rule that selects (FedMoS: by data share) returns ``(sites, state)``; the state carries the aggregation
    weights its selection implies to the rule's ``aggregate`` (and into the server checkpoint).
    """
    selection = rule.select_sites(population, count, state, seed, round_num)
    if selection is None:
        return sample_sites(population, count, seed, round_num), state
    sites, state = selection
    unknown = sorted(set(sites) - set(population))
    if not sites or unknown:
        raise ValueError(f"rule '{getattr(rule, 'name', rule)}' selected {list(sites)}: empty or not in the population")
    return list(sites), state
