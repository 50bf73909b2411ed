"""Non-IID partitioners: split sample indices among federated sites using only the labels.

Every scheme returns one sorted int64 index array per site. The result is a pure function of
``(labels, num_sites, scheme, seed, parameters)``: each site can recompute the whole partition on its own and take its
part, with no coordination (docs/design.md decision 9). No sample is given to two sites and no site is left empty.

Schemes (the settings of NIID-Bench, Li et al., "Federated Learning on Non-IID Data Silos: An Experimental Study",
ICDE 2022, arXiv:2102.02079):

``iid``
    Shuffle, then cut into ``num_sites`` near-equal parts.
``dirichlet``
    Label skew. For every class, draw site proportions ``p ~ Dir(alpha)`` and cut that class's samples accordingly;
    a site that already holds ``>= n / num_sites`` samples gets no more (keeps sizes from running away). Redraw the
    whole partition until every site has ``min_samples`` samples. Small alpha: few classes per site; large alpha:
    near IID.
``shards``
    "#C=k" label skew. Every site holds exactly ``k`` distinct labels; each label's samples are split evenly among the
    sites that hold it. Labels are dealt least-used first, so every label is used whenever ``num_sites * k >= classes``
    (otherwise the samples of unassigned labels are left out). Every label is shared by about the same number of
    sites, so site sizes are about equal.
``label_quantity``
    "#C=k" label skew dealt as NIID-Bench deals it (and Flower's ``niid_bench`` baseline after it): site ``i``'s first
    label is ``i mod classes``, its other ``k - 1`` labels are drawn uniformly at random (a draw it already holds is
    drawn again); each label's samples are shuffled and split evenly among its holders in site order. A label can be
    held by one site or by several, so site sizes differ (with 10 sites, k = 2 and seed 42 on Fashion-MNIST: 4,000 to
    9,000 samples). Used to reproduce NIID-Bench's tables with its own split.
``population``
    Site = population (label shift, and for genotype data covariate shift with it): all samples of class ``c`` go
    to site ``c mod num_sites``, so each site holds whole classes and no class is split. Needs
    ``num_sites <= classes``.
``quantity``
    Quantity skew. Labels stay IID; site sizes follow ``Dir(alpha)`` proportions (redrawn until every site has
    ``min_samples`` samples).
``small_sites``
    Quantity skew with a few small sites beside large ones (the harnesses' ``qty<beta>``). Labels stay IID. With
    ``share`` = beta (passed as ``alpha`` through `partition`), the first ``s = round(beta * num_sites)``
    sites (site-1 .. site-s; 1 <= s < num_sites; halves round up) are small: small site ``k`` (k = 0 .. s - 1)
    holds ``round(50 + 100 k / (s - 1))`` samples, i.e. sizes evenly spaced from 50 to 150
    (`SMALL_SITE_SIZES`; one small site holds 100). The other sites share the remaining samples near-equally
    (sizes differ by at most one) and each must end up larger than 150. The sizes are of the whole shard, before a
    site holds out its validation and test splits.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from data_prep.errors import DataPrepError

__all__ = [
    "LABEL_COUNT_SCHEMES",
    "SCHEMES",
    "dirichlet",
    "iid",
    "label_quantity",
    "partition",
    "population",
    "quantity",
    "shards",
    "small_sites",
]

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "shards", "quantity", "population", "label_quantity", "small_sites")
#: The "#C=k" schemes: the ones that read ``classes_per_site``.
LABEL_COUNT_SCHEMES: tuple[str, ...] = ("shards", "label_quantity")
MAX_DRAWS = 1000
#: The smallest and the largest small site of ``small_sites`` (samples in the shard).
SMALL_SITE_SIZES: tuple[int, int] = (50, 150)


def iid(labels: np.ndarray, num_sites: int, *, seed: int) -> list[np.ndarray]:
    """Uniformly random, near-equal split (sizes differ by at most one)."""
    labels = _check_labels(labels, num_sites)
    order = np.random.default_rng(seed).permutation(len(labels))
    return _finish(np.array_split(order, num_sites), "iid")


def dirichlet(
    labels: np.ndarray, num_sites: int, *, seed: int, alpha: float = 0.5, min_samples: int = 10
) -> list[np.ndarray]:
    """Per-class Dirichlet(alpha) label skew; every sample is used exactly once."""
    labels = _check_labels(labels, num_sites)
    _check_alpha(alpha)
    _check_min_samples(min_samples, num_sites, len(labels))
    rng = np.random.default_rng(seed)
    for _ in range(MAX_DRAWS):
        parts = _dirichlet_draw(labels, num_sites, alpha, rng)
        if min(len(part) for part in parts) >= min_samples:
            return _finish(parts, "dirichlet")
    raise DataPrepError(
        f"dirichlet: no draw in {MAX_DRAWS} gave all {num_sites} sites at least {min_samples} samples "
        f"(alpha={alpha}, {len(labels)} samples); use a larger alpha, fewer sites or more samples"
    )


def _dirichlet_draw(labels: np.ndarray, num_sites: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """One NIID-Bench draw: for each class, Dirichlet proportions over the sites that are not yet full."""
    cap = len(labels) / num_sites
    pieces: list[list[np.ndarray]] = [[] for _ in range(num_sites)]
    sizes = np.zeros(num_sites, dtype=np.int64)
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        proportions = rng.dirichlet(np.full(num_sites, alpha))
        # Sites already at the average size get nothing more, which keeps one site from swallowing the data set.
        open_sites = proportions * (sizes < cap)
        if open_sites.sum() > 0:
            proportions = open_sites / open_sites.sum()
        cuts = (np.cumsum(proportions)[:-1] * len(members)).astype(np.int64)
        for site, chunk in enumerate(np.split(members, cuts)):
            pieces[site].append(chunk)
            sizes[site] += len(chunk)
    return [np.concatenate(site_pieces) for site_pieces in pieces]


def shards(labels: np.ndarray, num_sites: int, *, seed: int, classes_per_site: int = 2) -> list[np.ndarray]:
    """Label skew "#C=k": every site gets exactly ``classes_per_site`` distinct labels."""
    labels = _check_labels(labels, num_sites)
    classes = np.unique(labels)
    _check_classes_per_site(classes_per_site, len(classes), "shards")
    rng = np.random.default_rng(seed)
    holders = _deal_labels(len(classes), num_sites, classes_per_site, rng)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_sites)]
    for class_pos, label in enumerate(classes):
        if not holders[class_pos]:
            continue  # only when num_sites * k < number of classes: this label's samples stay unused
        members = rng.permutation(np.flatnonzero(labels == label))
        _split_among(members, holders[class_pos], parts)
    return _finish([np.concatenate(site_parts) for site_parts in parts], "shards")


def label_quantity(labels: np.ndarray, num_sites: int, *, seed: int, classes_per_site: int = 2) -> list[np.ndarray]:
    """Label skew "#C=k" as NIID-Bench deals it: site i holds label ``i mod classes`` and k - 1 random others.

    The random stream is used in NIID-Bench's order (every site's draws, then one in-place shuffle per class), so
    with the same seed and the same sample order the split is NIID-Bench's own.
    """
    labels = _check_labels(labels, num_sites)
    classes = np.unique(labels)
    _check_classes_per_site(classes_per_site, len(classes), "label_quantity")
    rng = np.random.default_rng(seed)
    held = [_niid_bench_labels(site, len(classes), classes_per_site, rng) for site in range(num_sites)]
    parts: list[list[np.ndarray]] = [[] for _ in range(num_sites)]
    for class_pos, label in enumerate(classes):
        members = np.flatnonzero(labels == label)
        rng.shuffle(members)
        holders = [site for site in range(num_sites) if class_pos in held[site]]
        if holders:  # a label nobody drew (fewer sites than labels) stays unused
            _split_among(members, holders, parts)
    return _finish([np.concatenate(site_parts) for site_parts in parts], "label_quantity")


def _niid_bench_labels(site: int, num_classes: int, k: int, rng: np.random.Generator) -> list[int]:
    """One site's labels under NIID-Bench's rule: ``site mod classes`` first, then uniform draws until k distinct."""
    held = [site % num_classes]
    while len(held) < k:
        draw = int(rng.choice(num_classes, 1)[0])  # one-element draws: the stream NIID-Bench's seed gives
        if draw not in held:
            held.append(draw)
    return held


def _split_among(members: np.ndarray, holders: list[int], parts: list[list[np.ndarray]]) -> None:
    """Cut one label's (already shuffled) samples into near-equal chunks, one per holder, in the holders' order."""
    for site, chunk in zip(holders, np.array_split(members, len(holders)), strict=True):
        parts[site].append(chunk)


def _check_classes_per_site(classes_per_site: int, num_classes: int, scheme: str) -> None:
    if isinstance(classes_per_site, bool) or not isinstance(classes_per_site, int | np.integer):
        raise DataPrepError(f"classes_per_site must be an integer, got {classes_per_site!r}")
    if not 1 <= classes_per_site <= num_classes:
        raise DataPrepError(
            f"{scheme}: classes_per_site={classes_per_site} but the labels have {num_classes} classes; "
            f"use a value from 1 to {num_classes}"
        )


def _deal_labels(num_classes: int, num_sites: int, k: int, rng: np.random.Generator) -> list[list[int]]:
    """Give each site k distinct class positions, always picking among the least-used ones (random tie-break).

    Least-used-first means no label is used twice before every label is used once, hence full coverage when
    ``num_sites * k >= num_classes``, and labels are shared by about the same number of sites.
    """
    usage = np.zeros(num_classes, dtype=np.int64)
    site_labels: list[set[int]] = [set() for _ in range(num_sites)]
    for _ in range(k):
        for site in rng.permutation(num_sites):
            free = np.array([c for c in range(num_classes) if c not in site_labels[site]])
            least = free[usage[free] == usage[free].min()]
            choice = int(rng.choice(least))
            site_labels[site].add(choice)
            usage[choice] += 1
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for site, chosen in enumerate(site_labels):
        for class_pos in chosen:
            holders[class_pos].append(site)
    return holders


def quantity(
    labels: np.ndarray, num_sites: int, *, seed: int, alpha: float = 0.5, min_samples: int = 10
) -> list[np.ndarray]:
    """Quantity skew: IID labels, site sizes proportional to a Dirichlet(alpha) draw."""
    labels = _check_labels(labels, num_sites)
    _check_alpha(alpha)
    _check_min_samples(min_samples, num_sites, len(labels))
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(labels))
    for _ in range(MAX_DRAWS):
        cuts = (np.cumsum(rng.dirichlet(np.full(num_sites, alpha)))[:-1] * len(labels)).astype(np.int64)
        parts = np.split(order, cuts)
        if min(len(part) for part in parts) >= min_samples:
            return _finish(parts, "quantity")
    raise DataPrepError(
        f"quantity: no draw in {MAX_DRAWS} gave all {num_sites} sites at least {min_samples} samples "
        f"(alpha={alpha}, {len(labels)} samples); use a larger alpha, fewer sites or more samples"
    )


def small_site_sizes(num_sites: int, share: float) -> list[int]:
    """The sizes of ``small_sites``'s small sites (site-1 first): ``round(share * num_sites)`` sizes evenly spaced
    over `SMALL_SITE_SIZES` (the middle one for a single small site)."""
    if isinstance(share, bool) or not isinstance(share, int | float | np.integer | np.floating) or not 0 < share < 1:
        raise DataPrepError(f"small_sites: the share of small sites must be a number in (0, 1), got {share!r}")
    small = _round_half_up(share * num_sites)
    if not 1 <= small < num_sites:
        raise DataPrepError(
            f"small_sites: share {share:g} of {num_sites} sites gives {small} small site(s); "
            f"choose a share that gives 1 to {num_sites - 1}"
        )
    low, high = SMALL_SITE_SIZES
    if small == 1:
        return [_round_half_up((low + high) / 2)]
    return [_round_half_up(low + (high - low) * k / (small - 1)) for k in range(small)]


def _round_half_up(value: float) -> int:
    """Rounding as a reader expects it (2.5 -> 3; Python's round gives 2)."""
    return math.floor(value + 0.5)


def small_sites(labels: np.ndarray, num_sites: int, *, seed: int, share: float = 0.3) -> list[np.ndarray]:
    """Quantity skew with small sites (module docstring): IID labels, the first sites small, the rest equal."""
    labels = _check_labels(labels, num_sites)
    sizes = small_site_sizes(num_sites, share)
    large = num_sites - len(sizes)
    rest = len(labels) - sum(sizes)
    if rest // large <= SMALL_SITE_SIZES[1]:
        raise DataPrepError(
            f"small_sites: {len(labels)} samples leave {rest // large} per large site after {len(sizes)} small "
            f"site(s) of {sizes}; a large site needs more than {SMALL_SITE_SIZES[1]}: use more samples or fewer sites"
        )
    order = np.random.default_rng(seed).permutation(len(labels))
    cuts = np.cumsum(sizes)
    return _finish([*np.split(order[: cuts[-1]], cuts[:-1]), *np.array_split(order[cuts[-1] :], large)], "small_sites")


def population(labels: np.ndarray, num_sites: int, *, seed: int = 0) -> list[np.ndarray]:
    """Site = population: class ``c`` goes whole to site ``c mod num_sites`` (``seed`` is not needed)."""
    labels = _check_labels(labels, num_sites)
    classes = np.unique(labels)
    if num_sites > len(classes):
        raise DataPrepError(
            f"population: {num_sites} sites but only {len(classes)} populations (classes); a site holds whole "
            "populations, so use at most as many sites as populations"
        )
    return _finish([np.flatnonzero(np.isin(labels, classes[s::num_sites])) for s in range(num_sites)], "population")


_SCHEME_FUNCTIONS: dict[str, Callable[..., list[np.ndarray]]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "shards": shards,
    "label_quantity": label_quantity,
    "quantity": quantity,
    "population": population,
    "small_sites": small_sites,
}


def partition(
    labels: np.ndarray,
    num_sites: int,
    scheme: str,
    *,
    seed: int,
    alpha: float = 0.5,
    classes_per_site: int = 2,
    min_samples: int = 10,
) -> list[np.ndarray]:
    """Split ``range(len(labels))`` among ``num_sites`` sites with the named scheme (one of `SCHEMES`).

    Parameters that a scheme does not use are ignored (``alpha`` for iid/shards, ``classes_per_site`` except
    shards/label_quantity, ``min_samples`` for iid/shards/small_sites). For ``small_sites`` ``alpha`` is the share
    of small sites (beta).

    Returns
    -------
    list[np.ndarray]
        One sorted int64 index array per site, pairwise disjoint, none empty.

    Raises
    ------
    DataPrepError
        Unknown scheme or impossible parameters.
    """
    if scheme not in _SCHEME_FUNCTIONS:
        raise DataPrepError(f"unknown partition scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}")
    if scheme in ("dirichlet", "quantity"):
        return _SCHEME_FUNCTIONS[scheme](labels, num_sites, seed=seed, alpha=alpha, min_samples=min_samples)
    if scheme in LABEL_COUNT_SCHEMES:
        return _SCHEME_FUNCTIONS[scheme](labels, num_sites, seed=seed, classes_per_site=classes_per_site)
    if scheme == "population":
        return population(labels, num_sites)
    if scheme == "small_sites":  # alpha carries the share of small sites: no new field in every caller's settings
        return small_sites(labels, num_sites, seed=seed, share=alpha)
    return iid(labels, num_sites, seed=seed)


# ---------------------------------------------------------------- validation


def _check_labels(labels: np.ndarray, num_sites: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise DataPrepError(f"labels must be a 1-D integer array, got shape {labels.shape} and dtype {labels.dtype}")
    if isinstance(num_sites, bool) or not isinstance(num_sites, int | np.integer) or num_sites < 1:
        raise DataPrepError(f"num_sites must be a positive integer, got {num_sites!r}")
    if num_sites > len(labels):
        raise DataPrepError(f"{num_sites} sites but only {len(labels)} samples; use fewer sites or more samples")
    return labels


def _check_alpha(alpha: float) -> None:
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float | np.integer | np.floating)
        or not math.isfinite(alpha)
        or alpha <= 0
    ):
        raise DataPrepError(f"alpha must be a finite number > 0, got {alpha!r}; smaller alpha means more skew")


def _check_min_samples(min_samples: int, num_sites: int, num_samples: int) -> None:
    if isinstance(min_samples, bool) or not isinstance(min_samples, int | np.integer) or min_samples < 1:
        raise DataPrepError(f"min_samples must be a positive integer, got {min_samples!r}")
    if min_samples * num_sites > num_samples:
        raise DataPrepError(
            f"{num_sites} sites x min_samples={min_samples} exceeds the {num_samples} samples; "
            "use fewer sites, a smaller min_samples or more samples"
        )


def _finish(parts: list[np.ndarray], scheme: str) -> list[np.ndarray]:
    """Sort each site's indices as int64 and refuse empty sites (a site with no data cannot train)."""
    result = [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]
    for site, part in enumerate(result, start=1):
        if len(part) == 0:
            raise DataPrepError(f"{scheme}: site-{site} received no samples; use fewer sites or more samples per class")
    return result
