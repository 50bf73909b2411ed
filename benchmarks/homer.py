"""How much one site's released genotype counts say about who is in it: ``python -m benchmarks.homer``.

The federated QC job (``data_prep.genotypes.federated_qc``) has every site send its per-SNP genotype counts. From
those counts anyone who sees them gets the site's alt allele frequency p̂_j per SNP. Homer et al. (PLoS Genetics
2008) showed that such pooled frequencies, with a reference population's frequencies r_j, tell whether a given
person y is in the pool. With y_j the person's dosage / 2 (0, ½ or 1):

    D(y) = Σ_j ( |y_j − r_j| − |y_j − p̂_j| )

A member pulled p̂ towards their own genotype, so they sit closer to p̂ than to r and score high; a non-member's
terms average out near 0. SNPs where y or p̂ is unknown (a missing call, nobody called) add nothing.

The experiment, per SNP count S, site size n and seed:

1. one population: per-SNP alt frequencies f_j ~ Beta(a, a) (``--beta``, a = 1: uniform), redrawn until the MAF is
   at least ``--min-maf`` (the repository's simulated cohort keeps MAF >= 0.05); people are drawn independently,
   dosage ~ Binomial(2, f_j) (independent SNPs, Hardy-Weinberg; real SNPs in linkage carry less independent signal
   per SNP, so this is the attacker's favourable case at a given S);
2. sites of n members, as many as it takes to have at least ``--members`` members in all; each site's counts are
   what it would send (``qc.genotype_counts``) and p̂ is read from them as the server would (``qc.allele_stats``);
3. a reference panel of ``--reference`` people and ``--non-members`` further people, disjoint from the sites and
   from each other, drawn from the same population; each non-member is scored against one site (in turn), each
   member against their own;
4. AUC (members vs non-members, ties count half) and the true-positive rate at 1 % false positives (threshold: the
   non-members' 99th percentile, members strictly above it).

Prints a markdown table (mean over the seeds, [min-max]) to stdout and, with ``--out``, to a file.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from data_prep.genotypes.qc import allele_stats, genotype_counts

DEFAULT_SNPS = (127, 1_000, 10_000)
DEFAULT_SITE_PEOPLE = (1, 10, 50, 333, 1_000)
DEFAULT_SEEDS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class Cell:
    snps: int
    site_people: int
    seed: int
    auc: float
    tpr: float


def homer_statistic(dosages: np.ndarray, pool: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Homer's D per person (rows of ``dosages``, 0/1/2 copies, NaN unknown) against pool and reference alt
    frequencies (per SNP, or per person and SNP); unknown terms count 0."""
    y = np.asarray(dosages, dtype=np.float64) / 2
    terms = np.abs(y - np.asarray(reference, dtype=np.float64)) - np.abs(y - np.asarray(pool, dtype=np.float64))
    return np.nansum(terms, axis=-1)


def pool_frequencies(counts: np.ndarray) -> np.ndarray:
    """The alt allele frequency per SNP that a site's (S, 4) counts release (NaN where nobody was called)."""
    return allele_stats(counts)[1]


def auc(members: np.ndarray, non_members: np.ndarray) -> float:
    """P(a member scores above a non-member), ties counted half (Mann-Whitney U over n1 n0)."""
    scores = np.concatenate([members, non_members])
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    upper = np.cumsum(counts)
    mid_ranks = upper - (counts - 1) / 2  # 1-based rank of each distinct value, ties averaged
    member_ranks = mid_ranks[inverse[: len(members)]].sum()
    n1, n0 = len(members), len(non_members)
    return float((member_ranks - n1 * (n1 + 1) / 2) / (n1 * n0))


def tpr_at_fpr(members: np.ndarray, non_members: np.ndarray, fpr: float = 0.01) -> float:
    """Share of members strictly above the non-members' (1 - fpr) quantile (so at most ``fpr`` of them are)."""
    threshold = np.quantile(non_members, 1 - fpr, method="higher")
    return float(np.mean(members > threshold))


def draw_frequencies(rng: np.random.Generator, snps: int, beta: float, min_maf: float) -> np.ndarray:
    """Per-SNP alt frequencies ~ Beta(beta, beta), redrawn until min(f, 1 - f) >= min_maf."""
    freqs = rng.beta(beta, beta, size=snps)
    while (low := np.minimum(freqs, 1 - freqs) < min_maf).any():
        freqs[low] = rng.beta(beta, beta, size=int(low.sum()))
    return freqs


def draw_people(rng: np.random.Generator, freqs: np.ndarray, people: int) -> np.ndarray:
    """int8 dosages (people x SNPs), Binomial(2, f_j) independently per person and SNP."""
    return rng.binomial(2, freqs, size=(people, len(freqs))).astype(np.int8)


def site_pools(members: np.ndarray, site_people: int) -> np.ndarray:
    """Each site's released frequencies (sites x SNPs): consecutive blocks of ``site_people`` members."""
    sites = len(members) // site_people
    return np.stack(
        [pool_frequencies(genotype_counts(members[s * site_people : (s + 1) * site_people])) for s in range(sites)]
    )


def attack(
    members: np.ndarray, non_members: np.ndarray, reference: np.ndarray, site_people: int
) -> tuple[np.ndarray, np.ndarray]:
    """Scores of the members (each against their own site) and of the non-members (each against site i mod k)."""
    pools = site_pools(members, site_people)
    r = pool_frequencies(genotype_counts(reference))
    own = np.arange(len(members)) // site_people
    other = np.arange(len(non_members)) % len(pools)
    member_scores = np.concatenate([homer_statistic(members[own == s], pools[s], r) for s in range(len(pools))])
    non_scores = np.empty(len(non_members))
    for s in range(len(pools)):
        non_scores[other == s] = homer_statistic(non_members[other == s], pools[s], r)
    return member_scores, non_scores


def run_cell(
    snps: int,
    site_people: int,
    seed: int,
    members: int = 333,
    non_members: int = 1_000,
    reference: int = 1_000,
    beta: float = 1.0,
    min_maf: float = 0.05,
) -> Cell:
    """One (S, n, seed) experiment (module docstring): AUC and TPR at 1 % FPR."""
    rng = np.random.default_rng([seed, snps, site_people])
    freqs = draw_frequencies(rng, snps, beta, min_maf)
    sites = math.ceil(members / site_people)
    people = draw_people(rng, freqs, sites * site_people + non_members + reference)
    inside = people[: sites * site_people]
    outside, panel = people[len(inside) : len(inside) + non_members], people[len(inside) + non_members :]
    member_scores, non_scores = attack(inside, outside, panel, site_people)
    return Cell(snps, site_people, seed, auc(member_scores, non_scores), tpr_at_fpr(member_scores, non_scores))


def table(cells: Sequence[Cell]) -> str:
    """Markdown: one row per (SNPs, site size), mean over seeds with [min-max]."""
    lines = [
        "| SNPs | people per site | AUC mean [min-max] | TPR at 1 % FPR mean [min-max] |",
        "|---:|---:|---|---|",
    ]
    keys = sorted({(c.snps, c.site_people) for c in cells})
    for snps, n in keys:
        group = [c for c in cells if (c.snps, c.site_people) == (snps, n)]
        lines.append(f"| {snps:,} | {n:,} | {_spread([c.auc for c in group])} | {_spread([c.tpr for c in group])} |")
    return "\n".join(lines)


def _spread(values: Sequence[float]) -> str:
    return f"{np.mean(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.homer", description=__doc__.split("\n\n")[0], epilog="Model: the module docstring."
    )
    ints = {"type": int, "nargs": "+"}
    parser.add_argument("--snps", **ints, default=list(DEFAULT_SNPS), help="SNP counts S")
    parser.add_argument("--site-people", **ints, default=list(DEFAULT_SITE_PEOPLE), help="site sizes n")
    parser.add_argument("--seeds", **ints, default=list(DEFAULT_SEEDS))
    parser.add_argument("--members", type=int, default=333, help="members scored per cell (sites of n added)")
    parser.add_argument("--non-members", type=int, default=1_000)
    parser.add_argument("--reference", type=int, default=1_000, help="reference panel size")
    parser.add_argument("--beta", type=float, default=1.0, help="alt frequencies ~ Beta(beta, beta)")
    parser.add_argument("--min-maf", type=float, default=0.05)
    parser.add_argument("--machine", default=None, help="how the report names the machine (default: CPUs, arch)")
    parser.add_argument("--out", default=None, help="also write the report here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [f"--{n.replace('_', '-')}" for n in ("members", "non_members", "reference") if getattr(args, n) < 1]
    bad += ["--site-people"] if min(args.site_people) < 1 else []
    bad += ["--snps"] if min(args.snps) < 1 else []
    if bad or not 0 <= args.min_maf < 0.5 or args.beta <= 0:
        print(f"error: {', '.join(bad) or '--beta/--min-maf'} out of range (counts >= 1, beta > 0, 0 <= min-maf < 0.5)")
        return 2
    start = time.perf_counter()
    cells = []
    for snps in args.snps:
        for n in args.site_people:
            for seed in args.seeds:
                cells.append(
                    run_cell(snps, n, seed, args.members, args.non_members, args.reference, args.beta, args.min_maf)
                )
                print(f"S={snps} n={n} seed={seed}: AUC {cells[-1].auc:.4f}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    machine = args.machine or f"{os.cpu_count()} CPUs, {platform.machine()}"
    command = "python -m benchmarks.homer " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = "\n".join(
        [
            "# Homer's membership test on one site's genotype counts",
            "",
            f"`{command.strip()}`",
            "",
            f"Machine: {machine}; Python {platform.python_version()}, numpy {np.__version__}; {seconds:.0f} s.",
            f"Model: one population, alt frequencies ~ Beta({args.beta:g}, {args.beta:g}) with MAF >= "
            f"{args.min_maf:g}, "
            f"independent SNPs; >= {args.members} members per cell in sites of n, {args.non_members} non-members, "
            f"a reference panel of {args.reference}; seeds {', '.join(map(str, args.seeds))}.",
            "",
            table(cells),
            "",
        ]
    )
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
