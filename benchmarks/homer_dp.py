"""Homer's membership test against the noisy QC counts, and what the noise does to the QC: ``python -m
benchmarks.homer_dp``.

The federated QC job with ``--dp-target-epsilon`` (``data_prep.genotypes.qc_noise``) has every site add discrete
Gaussian noise of sigma = z sqrt(S) to each of its (S, 4) counts, z calibrated by the bundle's accountant so that
one site's release spends epsilon at delta (``lightning_modules.privacy.accountant.noise_for_budget`` at sample rate
1, one step; epsilon inf: no noise). Per SNP count S, epsilon and seed, with 3 sites of 333 people (the docs' sizes):

1. Homer's test (``benchmarks.homer``: its population, statistic, AUC and TPR at 1 % FPR) on two views:
   - the server's in the clear QC: one site's noisy counts; members are that site's people, scored against it, and
     the non-members are scored against site i mod 3;
   - a site's own view under HE: the decrypted sum less its own noisy counts, i.e. the other two sites' noisy
     counts (two shares of noise); members are the other two sites' people. Each site's view is scored and the
     AUC averaged over the three. (Under HE the server sees ciphertexts only.)
   The attacker reads alt frequencies from the noisy counts as the QC does (negative cells at 0).
2. The QC's decisions: a second cohort of the same sizes with rare SNPs and missing calls (alt frequency ~ Beta(1, 1),
   no MAF floor; each SNP's missing rate ~ Beta(0.5, 25), mean 2 %), filtered by the job's default thresholds (call
   rate 0.95, MAF 0.01) and by MAF 0.05 on the exact sum and on the sum of the three sites' noisy counts (three
   shares): SNPs kept, and how many decisions the noise changed (kept only exactly, kept only with noise).

The noise here comes from a seeded generator so that the table repeats; at a site it is secret.
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

from benchmarks.homer import auc, draw_frequencies, draw_people, homer_statistic, tpr_at_fpr
from data_prep.genotypes.qc import QcThresholds, allele_stats, genotype_counts, qc_filter
from data_prep.genotypes.qc_noise import l2_sensitivity, noisy_counts, usable_counts
from lightning_modules.privacy.accountant import noise_for_budget

SITES, SITE_PEOPLE = 3, 333
DEFAULT_EPSILONS = (math.inf, 8.0, 4.0, 1.0)
DELTA = 1e-5
FILTERS = (QcThresholds(0.95, 0.01), QcThresholds(0.95, 0.05))


@dataclass(frozen=True)
class Cell:
    snps: int
    epsilon: float
    seed: int
    sigma: float
    server_auc: float
    server_tpr: float
    site_auc: float
    site_tpr: float
    kept_exact: tuple[int, ...]
    kept_noisy: tuple[int, ...]
    lost: tuple[int, ...]
    gained: tuple[int, ...]


def sigma_for(epsilon: float, snps: int, delta: float = DELTA) -> float:
    """Per-count sigma of one site's release at (epsilon, delta); 0 for epsilon inf."""
    if math.isinf(epsilon):
        return 0.0
    return noise_for_budget(epsilon, delta, 1.0, 1) * l2_sensitivity(snps)


def release(counts: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    return counts.astype(np.int64) if sigma == 0 else noisy_counts(counts, sigma, rng)


def frequencies(counts: np.ndarray) -> np.ndarray:
    """Alt frequencies as the QC reads them from (noisy) counts, in [0, 1] (NaN where nobody is called)."""
    return np.clip(allele_stats(usable_counts(counts))[1], 0.0, 1.0)


def scores(people: np.ndarray, pool: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return homer_statistic(people, pool, reference)


def homer_views(
    sites: list[np.ndarray], released: list[np.ndarray], outside: np.ndarray, r: np.ndarray
) -> tuple[float, float, float, float]:
    """(server AUC, server TPR, site-view AUC, site-view TPR) as in the module docstring."""
    pools = [frequencies(c) for c in released]
    other = np.arange(len(outside)) % len(sites)
    members = np.concatenate([scores(sites[s], pools[s], r) for s in range(len(sites))])
    non = np.empty(len(outside))
    for s in range(len(sites)):
        non[other == s] = scores(outside[other == s], pools[s], r)
    site_aucs, site_tprs = [], []
    for own in range(len(sites)):
        others = [s for s in range(len(sites)) if s != own]
        pool = frequencies(sum(released[s] for s in others))
        inside = np.concatenate([scores(sites[s], pool, r) for s in others])
        outside_scores = scores(outside, pool, r)
        site_aucs.append(auc(inside, outside_scores))
        site_tprs.append(tpr_at_fpr(inside, outside_scores))
    return auc(members, non), tpr_at_fpr(members, non), float(np.mean(site_aucs)), float(np.mean(site_tprs))


def qc_cohort(rng: np.random.Generator, snps: int) -> list[np.ndarray]:
    """Sites' genotypes with rare SNPs and missing calls (3 = missing), module docstring."""
    freqs = rng.beta(1.0, 1.0, size=snps)
    missing = rng.beta(0.5, 25.0, size=snps)
    people = draw_people(rng, freqs, SITES * SITE_PEOPLE)
    people[rng.random(people.shape) < missing] = 3
    return [people[s * SITE_PEOPLE : (s + 1) * SITE_PEOPLE] for s in range(SITES)]


def decisions(sites: list[np.ndarray], sigma: float, rng: np.random.Generator) -> tuple[tuple[int, ...], ...]:
    """Per filter: SNPs kept on the exact sum, on the noisy sum, kept only exactly, kept only with noise."""
    counts = [genotype_counts(g) for g in sites]
    exact = sum(counts)
    noisy = usable_counts(sum(release(c, sigma, rng) for c in counts))
    rows: list[tuple[int, int, int, int]] = []
    for thresholds in FILTERS:
        a, b = qc_filter(exact, thresholds), qc_filter(noisy, thresholds)
        rows.append((int(a.sum()), int(b.sum()), int((a & ~b).sum()), int((b & ~a).sum())))
    return tuple(tuple(column) for column in zip(*rows, strict=True))


def run_cell(snps: int, epsilon: float, seed: int, non_members: int = 1_000, reference: int = 1_000) -> Cell:
    rng = np.random.default_rng([seed, snps])
    freqs = draw_frequencies(rng, snps, 1.0, 0.05)
    people = draw_people(rng, freqs, SITES * SITE_PEOPLE + non_members + reference)
    sites = [people[s * SITE_PEOPLE : (s + 1) * SITE_PEOPLE] for s in range(SITES)]
    outside = people[SITES * SITE_PEOPLE : SITES * SITE_PEOPLE + non_members]
    r = allele_stats(genotype_counts(people[SITES * SITE_PEOPLE + non_members :]))[1]
    sigma = sigma_for(epsilon, snps)
    noise_rng = np.random.default_rng([seed, snps, 7])
    released = [release(genotype_counts(g), sigma, noise_rng) for g in sites]
    server_auc, server_tpr, site_auc, site_tpr = homer_views(sites, released, outside, r)
    kept_exact, kept_noisy, lost, gained = decisions(qc_cohort(np.random.default_rng([seed, snps, 11]), snps), sigma,
                                                     noise_rng)  # fmt: skip
    return Cell(snps, epsilon, seed, sigma, server_auc, server_tpr, site_auc, site_tpr, kept_exact, kept_noisy, lost,
                gained)  # fmt: skip


def table(cells: Sequence[Cell]) -> str:
    """Markdown: one row per (SNPs, epsilon), means over the seeds with [min-max] for the AUCs."""
    names = " / ".join(f"MAF {f.min_maf:g}" for f in FILTERS)
    lines = [
        f"| SNPs | epsilon | sigma per count | server's view AUC | TPR at 1 % FPR | a site's HE view AUC | TPR at 1 % "
        f"FPR | kept exact ({names}) | kept with noise | lost / gained by noise |",
        "|---:|---:|---:|---|---:|---|---:|---|---|---|",
    ]
    for snps, eps in sorted({(c.snps, c.epsilon) for c in cells}, key=lambda k: (k[0], -k[1])):
        group = [c for c in cells if (c.snps, c.epsilon) == (snps, eps)]

        def mean(field: str, group: list[Cell] = group) -> str:
            columns = zip(*(getattr(c, field) for c in group), strict=True)
            return " / ".join(f"{np.mean(col):.0f}" for col in columns)

        lines.append(
            f"| {snps:,} | {'inf' if math.isinf(eps) else f'{eps:g}'} | {group[0].sigma:.1f} | "
            f"{_spread([c.server_auc for c in group])} | {np.mean([c.server_tpr for c in group]):.3f} | "
            f"{_spread([c.site_auc for c in group])} | {np.mean([c.site_tpr for c in group]):.3f} | "
            f"{mean('kept_exact')} | {mean('kept_noisy')} | {mean('lost')} ; {mean('gained')} |"
        )
    return "\n".join(lines)


def _spread(values: Sequence[float]) -> str:
    return f"{np.mean(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.homer_dp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--snps", type=int, nargs="+", default=[127, 1_000, 10_000])
    parser.add_argument("--epsilons", type=float, nargs="+", default=list(DEFAULT_EPSILONS), help="inf: no noise")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--machine", default=None, help="how the report names the machine (default: CPUs, arch)")
    parser.add_argument("--out", default=None, help="also write the report here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.snps) < 1 or any(not e > 0 for e in args.epsilons):
        print("error: --snps must be >= 1 and --epsilons > 0 (inf for no noise)")
        return 2
    start = time.perf_counter()
    cells = []
    for snps in args.snps:
        for eps in args.epsilons:
            for seed in args.seeds:
                cells.append(run_cell(snps, eps, seed))
                c = cells[-1]
                print(f"S={snps} eps={eps:g} seed={seed}: {c.server_auc:.3f} {c.site_auc:.3f}", file=sys.stderr)
    seconds = time.perf_counter() - start
    machine = args.machine or f"{os.cpu_count()} CPUs, {platform.machine()}"
    command = "python -m benchmarks.homer_dp " + shlex.join(argv if argv is not None else sys.argv[1:])
    report = "\n".join(
        [
            "# Homer's membership test against the noisy QC counts",
            "",
            f"`{command.strip()}`",
            "",
            f"Machine: {machine}; Python {platform.python_version()}, numpy {np.__version__}; {seconds:.0f} s.",
            f"Model: the module docstring (benchmarks/homer_dp.py): {SITES} sites of {SITE_PEOPLE} people, delta "
            f"{DELTA:g}, epsilon per site's release (add/remove one person), each site's noise alone calibrated to "
            f"it; seeds {', '.join(map(str, args.seeds))}. Lost / gained: SNPs whose keep decision the noise changed "
            "(kept only on the exact sum ; kept only on the noisy sum), per filter.",
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
