"""Quality control of harmonised genotypes, per site and federated, from per-SNP genotype counts only.

A site's contribution is ``genotype_counts(matrix)``: for each SNP the number of people with 0, 1 and 2 copies of the
table's alt allele and with a missing call, an (S, 4) integer array. The counts of all sites add up to the counts of
the pooled cohort, and every statistic below is a function of that sum:

- call rate = called / (called + missing), with called = n0 + n1 + n2;
- alt allele frequency p = (n1 + 2 n2) / (2 called); minor allele frequency = min(p, 1 - p);
- Hardy-Weinberg: Pearson's chi-square with one degree of freedom against the genotype counts expected from p,
  chi2 = called (4 n0 n2 - n1^2)^2 / ((2 n0 + n1)^2 (2 n2 + n1)^2), p-value = erfc(sqrt(chi2 / 2)); a monomorphic
  SNP has p-value 1. (PLINK's default is the exact test; the chi-square is close to it for common SNPs, and is
  what fits a vectorised summary of 10^5 SNPs.)

The federated filter keeps a SNP when its global call rate and global MAF reach the thresholds; every site then uses
the same kept SNPs (the filtered SNP table), so the filter is identical everywhere by construction.

One site's counts are not "aggregates only": they are summary statistics, and over thousands of SNPs they tell
whether a given person is in the site (Homer et al., PLoS Genetics 2008; ``benchmarks/homer.py`` measures it). A site
of one person releases that person's genotypes outright. ``check_site_size`` refuses a site below the consortium's
minimum (``MIN_SITE_PEOPLE`` by default); that rules out the trivial case, it does not make the counts private.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes.formats import MISSING

__all__ = [
    "MIN_SITE_PEOPLE",
    "QcThresholds",
    "allele_stats",
    "check_min_site_people",
    "check_site_size",
    "genotype_counts",
    "hwe_pvalues",
    "implied_people",
    "qc_filter",
    "summary",
]

#: The default smallest site whose counts may leave it. Why 50 and what it does not protect: docs/genomics.md
#: ("What the counts reveal") and benchmarks/results/homer.md.
MIN_SITE_PEOPLE = 50


@dataclass(frozen=True)
class QcThresholds:
    min_call_rate: float = 0.95
    min_maf: float = 0.01

    def __post_init__(self) -> None:
        for name in ("min_call_rate", "min_maf"):
            value = getattr(self, name)
            upper = 1.0 if name == "min_call_rate" else 0.5
            if not isinstance(value, (int, float)) or not 0.0 <= value <= upper:
                raise DataPrepError(f"QC: {name} must be a number in [0, {upper}], got {value!r}")


def genotype_counts(genotypes: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """(S, 4) int64: people with 0, 1, 2 alt copies and missing, per SNP; read in row chunks (no int64 copy)."""
    if genotypes.ndim != 2:
        raise DataPrepError(f"QC: genotypes must be people x SNPs, got shape {genotypes.shape}")
    counts = np.zeros((genotypes.shape[1], 4), np.int64)
    for start in range(0, genotypes.shape[0], chunk):
        block = np.asarray(genotypes[start : start + chunk])
        for state in range(4):
            counts[:, state] += (block == state).sum(axis=0)
    outside = genotypes.shape[0] - counts.sum(axis=1)
    if outside.any():
        raise DataPrepError(f"QC: genotype states must be 0, 1, 2 or {MISSING} (SNP {int(np.argmax(outside))})")
    return counts


def implied_people(counts: np.ndarray) -> int:
    """The people behind (S, 4) counts: each SNP's row counts every person once (0, 1, 2 copies or missing), so all
    rows add up to the same number; rows that disagree are not genotype counts and are refused."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[1] != 4:
        raise DataPrepError(f"QC: genotype counts must be SNPs x 4, got shape {counts.shape}")
    rows = counts.sum(axis=1)
    if len(rows) == 0:
        return 0
    if (rows != rows[0]).any():
        odd = int(np.argmax(rows != rows[0]))
        raise DataPrepError(
            f"QC: the counts' rows add up to different numbers of people ({int(rows[0])} at SNP 0, {int(rows[odd])} "
            f"at SNP {odd}); each row must count every person once"
        )
    return int(rows[0])


def check_min_site_people(value: object) -> int:
    """The consortium's ``min_site_people`` setting, refused unless it is a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise DataPrepError(f"QC: min_site_people must be a whole number of people >= 1, got {value!r}")
    return int(value)


def check_site_size(site: str, people: int, min_site_people: int, outcome: str) -> None:
    """Refuse a site whose counts come from fewer than ``min_site_people`` people, in one line: the site, its count,
    the setting and ``outcome`` (what the refusal means where it happens). The smaller the site, the more its counts
    say about each member; a one-person site's counts are that person's genotypes."""
    if people < check_min_site_people(min_site_people):
        raise DataPrepError(
            f"federated QC: {site} has {people} {'person' if people == 1 else 'people'}, below the job's "
            f"min_site_people = {min_site_people} (--min-site-people; allowed: {min_site_people} people or more); "
            f"{outcome}"
        )


def allele_stats(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(call rate, alt allele frequency, MAF) per SNP from (S, 4) counts; NaN frequency where nobody is called."""
    counts = np.asarray(counts, dtype=np.float64)
    called = counts[:, :3].sum(axis=1)
    total = called + counts[:, 3]
    with np.errstate(invalid="ignore", divide="ignore"):
        call_rate = np.where(total > 0, called / total, 0.0)
        alt_freq = (counts[:, 1] + 2 * counts[:, 2]) / (2 * called)
    return call_rate, alt_freq, np.minimum(alt_freq, 1 - alt_freq)


def hwe_pvalues(counts: np.ndarray) -> np.ndarray:
    """Hardy-Weinberg chi-square (1 df) p-values per SNP (module docstring); 1 where the test is undefined."""
    n0, n1, n2 = (np.asarray(counts, dtype=np.float64)[:, k] for k in range(3))
    called = n0 + n1 + n2
    denominator = (2 * n0 + n1) ** 2 * (2 * n2 + n1) ** 2
    with np.errstate(invalid="ignore", divide="ignore"):
        chi2 = np.where(denominator > 0, called * (4 * n0 * n2 - n1**2) ** 2 / denominator, 0.0)
    return np.array([math.erfc(math.sqrt(x / 2)) for x in chi2])


def qc_filter(counts: np.ndarray, thresholds: QcThresholds) -> np.ndarray:
    """Boolean mask of the SNPs that pass the call-rate and MAF thresholds (applied to pooled/global counts)."""
    call_rate, _, maf = allele_stats(counts)
    return (call_rate >= thresholds.min_call_rate) & (np.nan_to_num(maf, nan=0.0) >= thresholds.min_maf)


def summary(counts: np.ndarray, usable: np.ndarray | None = None) -> dict[str, object]:
    """Call rate, MAF and HWE summaries over the ``usable`` SNPs (all by default), for the harmonise report."""
    counts = np.asarray(counts)
    if usable is not None:
        counts = counts[np.asarray(usable, dtype=bool)]
    if len(counts) == 0:
        return {"snps": 0}
    call_rate, _, maf = allele_stats(counts)
    hwe = hwe_pvalues(counts)
    called = counts[:, :3].sum(axis=1) > 0
    maf = np.nan_to_num(maf, nan=0.0)
    return {
        "snps": len(counts),
        "call_rate": {
            "mean": _r(call_rate.mean()),
            "min": _r(call_rate.min()),
            "below_0.95": int((call_rate < 0.95).sum()),
        },
        "maf": {
            "mean": _r(maf.mean()),
            "median": _r(np.median(maf)),
            "monomorphic": int(((maf == 0) & called).sum()),  # a SNP nobody was called at is "uncalled"
            "uncalled": int((~called).sum()),
            "below_0.01": int((maf < 0.01).sum()),
            "below_0.05": int((maf < 0.05).sum()),
        },
        "hwe_chi2": {"min_p": _r(hwe.min()), "p_below_1e-6": int((hwe < 1e-6).sum())},
    }


def _r(value: float) -> float:
    return round(float(value), 6)
