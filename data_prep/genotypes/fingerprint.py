"""Genotype fingerprints: a person's hard calls at a fixed panel of SNPs, hashed, so that two sites can find a person
enrolled at both by private set intersection (`data_prep.genotypes.psi`) without showing each other anyone's ID or
calls.

**The panel.** Every site derives the same panel from the consortium's SNP table alone: its autosomal SNPs ordered
by the SHA-256 of their IDs, the first ``panels x panel_size``, cut into ``panels`` disjoint sub-panels of
``panel_size`` SNPs. The table should hold common SNPs (the rule's false-match rate below depends on it: use the
federated QC's filtered table run with a high ``--min-maf``).

**The fingerprints.** Per person and sub-panel, the SHA-256 of the panel's identity (its SNP IDs, so tables that
differ never match) and the person's 0/1/2 calls there. A sub-panel where the person has a missing call gives no
fingerprint (two people missing at the same SNPs would otherwise match). A site's items are the set of its people's
fingerprints (two people with one fingerprint, e.g. identical twins, share the item).

**A match.** A person is taken to be at the other site when at least ``min_panels`` of their fingerprints are in the
intersection. One discordant call (a genotyping error, a different array's call) changes one sub-panel's fingerprint
only: with the defaults (8 sub-panels of 16 SNPs, 3 to match) a person is still found with up to 5 discordant calls
in distinct sub-panels, and with any 5 discordant or missing calls wherever they fall.

**False matches.** Two unrelated people (Hardy-Weinberg, independent SNPs) have the same call at a SNP of minor
allele frequency p with probability s(p) = (1-p)^4 + 4p^2(1-p)^2 + p^4, a sub-panel's fingerprints agree with the
product q of s over its SNPs, and the pair is matched when at least ``min_panels`` of the independent sub-panels agree
(`false_match_probability`, a Poisson-binomial tail). Per pair of people, at the defaults: 2.0e-19 at p = 0.5,
7.8e-17 at p = 0.3, 7.2e-13 at p = 0.2, 9.3e-7 at p = 0.1: with 10^4 people at each of two sites (10^8 pairs) the
expected false matches are below 10^-4 for p >= 0.2 and about 90 at p = 0.1, hence a table of common SNPs. Relatives
share more calls (a parent and child at p = 0.5 agree at a SNP with probability 1/2: 2e-13 per pair) and identical
twins are one genotype: they are matched, and nothing in the genotypes could tell them apart.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data_prep.errors import DataPrepError

__all__ = [
    "DEFAULT_MIN_PANELS",
    "DEFAULT_PANELS",
    "DEFAULT_PANEL_SIZE",
    "Panel",
    "false_match_probability",
    "fingerprint_panel",
    "fingerprints",
    "matched_people",
    "same_call_probability",
]

DEFAULT_PANELS = 8
DEFAULT_PANEL_SIZE = 16
DEFAULT_MIN_PANELS = 3
MISSING = 3
_AUTOSOMES = frozenset(str(c) for c in range(1, 23))


@dataclass(frozen=True)
class Panel:
    """The sub-panels: each a tuple of column indices into the table's SNPs, and the panel's identity (a digest of
    its SNP IDs, the same at every site with the same table)."""

    columns: tuple[tuple[int, ...], ...]
    identity: str
    min_panels: int


def fingerprint_panel(
    snps: Sequence[str],
    chroms: Sequence[str],
    panels: int = DEFAULT_PANELS,
    panel_size: int = DEFAULT_PANEL_SIZE,
    min_panels: int = DEFAULT_MIN_PANELS,
) -> Panel:
    """The sub-panels of a SNP table (its IDs and normalised chromosomes, in table order; module docstring)."""
    if not 1 <= min_panels <= panels or panel_size < 1:
        raise DataPrepError(
            f"fingerprint panel: need 1 <= min_panels <= panels and panel_size >= 1, got panels {panels}, panel_size "
            f"{panel_size}, min_panels {min_panels}"
        )
    autosomal = [j for j, chrom in enumerate(chroms) if str(chrom) in _AUTOSOMES]
    if len(autosomal) < panels * panel_size:
        raise DataPrepError(
            f"fingerprint panel: the SNP table has {len(autosomal)} autosomal SNPs, the panel needs {panels} x "
            f"{panel_size} = {panels * panel_size}; use a larger table or fewer/smaller sub-panels"
        )
    ordered = sorted(autosomal, key=lambda j: hashlib.sha256(snps[j].encode()).hexdigest())[: panels * panel_size]
    columns = tuple(tuple(ordered[k * panel_size : (k + 1) * panel_size]) for k in range(panels))
    identity = hashlib.sha256("\n".join(",".join(snps[j] for j in c) for c in columns).encode()).hexdigest()
    return Panel(columns, identity, min_panels)


def fingerprints(genotypes: np.ndarray, panel: Panel) -> list[list[str]]:
    """Each person's fingerprints (people x table SNPs, 0/1/2, 3 missing): one per sub-panel without a missing call."""
    out: list[list[str]] = []
    for row in np.asarray(genotypes):
        mine = []
        for k, columns in enumerate(panel.columns):
            calls = row[list(columns)]
            if (calls == MISSING).any():
                continue
            text = f"{panel.identity}|{k}|{''.join(str(int(c)) for c in calls)}"
            mine.append(hashlib.sha256(text.encode()).hexdigest())
        out.append(mine)
    return out


def matched_people(person_items: Sequence[Sequence[str]], intersection: Sequence[str], min_panels: int) -> list[int]:
    """The people (row indices) with at least ``min_panels`` fingerprints in the intersection."""
    shared = set(intersection)
    return [i for i, items in enumerate(person_items) if sum(item in shared for item in items) >= min_panels]


def same_call_probability(maf: np.ndarray | float) -> np.ndarray:
    """s(p): two unrelated people share the genotype at a SNP of minor allele frequency p (Hardy-Weinberg)."""
    p = np.asarray(maf, np.float64)
    return (1 - p) ** 4 + 4 * p**2 * (1 - p) ** 2 + p**4


def false_match_probability(panel_mafs: Sequence[Sequence[float]], min_panels: int) -> float:
    """P(two unrelated people match): at least ``min_panels`` sub-panels agree, sub-panel k with probability the
    product of s(p) over its SNPs' frequencies ``panel_mafs[k]`` (a Poisson-binomial tail)."""
    agree = [float(np.prod(same_call_probability(np.asarray(mafs)))) for mafs in panel_mafs]
    tail = np.zeros(len(agree) + 1)
    tail[0] = 1.0
    for q in agree:  # the distribution of the number of agreeing sub-panels, one sub-panel at a time
        tail[1:] = tail[1:] * (1 - q) + tail[:-1] * q
        tail[0] *= 1 - q
    return float(tail[min_panels:].sum())
