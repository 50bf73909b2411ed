"""Per-site statistics of "does joining help my site?": paired differences on the test split, t-intervals, the worst
(site, seed) pair and the per-site target. Pure functions of plain dicts; no torch, no NVFlare.

Scores come as ``run -> site -> accuracy`` (a *run* is one training seed on the same, fixed site data: the partition
does not change with the seed, so site-3 of seed 0 and site-3 of seed 1 hold the same samples and the two scores are
a pair). For a candidate model A (the kept, personal or global model) against the site's local-only model B:

- the **paired difference** of site i in run s is d_is = A_is - B_is (both scored on site i's test split, which no
  candidate was selected on);
- **per site**: the t-interval of the mean of d_i1 .. d_iS over the S runs, mean ± t_{1-a/2, S-1} sd / sqrt(S)
  (sample sd, ddof 1);
- **per setting**: the sites are fixed, only training varies, so a run's replicate is its mean over sites
  D_s = mean_i d_is, and the interval is the t-interval of D_1 .. D_S (the same formula). Pairs within a run share
  one federation and are not independent, so pooling all (site, run) pairs as S x sites observations would be too
  narrow;
- a mean **gains** when its interval lies above 0, **loses** when it lies below 0, and is **within the interval**
  otherwise. With one run there is no interval (half-width infinity): no gain or loss can be claimed.

The target (with ``--keep best``): no (site, run) pair's kept test accuracy is below its local-only model by more than
`TOLERANCE` (2 points), and the mean kept accuracy over all pairs is at least the mean local-only accuracy.

The t quantile comes from scipy (installed with scikit-learn, the ``digits`` extra), imported on first use.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: run -> site -> score (accuracy as a share, 0..1)
RunScores = Mapping[Any, Mapping[str, float]]
#: site -> run -> paired difference
Differences = Mapping[str, Mapping[Any, float]]

#: The per-site target's allowance: a kept model may trail its local-only model by at most 2 points in any pair.
TOLERANCE = 0.02
#: Accuracies are counts over a split, so a difference of exactly the allowance (1 of 50 test samples) is computed a
#: few ulps off it (0.96 - 0.98 = -0.020000000000000018); only a difference below it by more than this misses.
ROUNDING = 1e-9
#: Confidence level of every interval on the pages.
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A mean with its two-sided t-interval: ``mean ± half`` over ``n`` values (``half`` is inf for n < 2)."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half


def t_quantile(probability: float, df: int) -> float:
    """The Student t quantile t_{probability, df}."""
    from scipy.stats import t  # a benchmark-time dependency only (module docstring)

    return float(t.ppf(probability, df))


def t_interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    """Mean ± t_{(1+level)/2, n-1} * sd / sqrt(n) of ``values`` (sample sd); half-width inf for fewer than 2."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("t_interval: no values")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Interval(mean, math.inf, len(values))
    half = t_quantile((1 + level) / 2, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return Interval(mean, half, len(values))


def paired_differences(candidate: RunScores, local: RunScores) -> dict[str, dict[Any, float]]:
    """site -> run -> candidate - local, over the (site, run) pairs both have."""
    differences: dict[str, dict[Any, float]] = {}
    for run in sorted(set(candidate) & set(local), key=str):
        for site in sorted(set(candidate[run]) & set(local[run])):
            differences.setdefault(site, {})[run] = float(candidate[run][site]) - float(local[run][site])
    return differences


def site_intervals(differences: Differences, level: float = LEVEL) -> dict[str, Interval]:
    """Per site: the t-interval of its paired differences over runs."""
    return {site: t_interval(list(by_run.values()), level) for site, by_run in differences.items()}


def run_means(differences: Differences) -> dict[Any, float]:
    """Per run that every site has: the mean paired difference over sites (the setting's replicate)."""
    runs = set.intersection(*(set(by_run) for by_run in differences.values())) if differences else set()
    return {run: statistics.fmean(differences[site][run] for site in differences) for run in sorted(runs, key=str)}


def setting_interval(differences: Differences, level: float = LEVEL) -> Interval:
    """The t-interval of the per-run mean differences over sites (module docstring: the sites are fixed)."""
    return t_interval(list(run_means(differences).values()), level)


def worst_pair(differences: Differences) -> tuple[str, Any, float]:
    """The (site, run, difference) with the lowest difference."""
    pairs = [(site, run, d) for site, by_run in differences.items() for run, d in by_run.items()]
    if not pairs:
        raise ValueError("worst_pair: no pairs")
    return min(pairs, key=lambda pair: (pair[2], pair[0], str(pair[1])))


def verdict(interval: Interval) -> str:
    """'gain' when the interval lies above 0, 'loss' when below, 'within' otherwise (and always for one run)."""
    if interval.low > 0:
        return "gain"
    if interval.high < 0:
        return "loss"
    return "within"


@dataclass(frozen=True)
class TargetCheck:
    """The per-site target in one setting (module docstring)."""

    met: bool
    mean_kept: float
    mean_local: float
    #: (site, run, kept - local) of every pair below -TOLERANCE, worst first
    misses: tuple[tuple[str, Any, float], ...]
    pairs: int


def pair_values(scores: RunScores, differences: Differences) -> list[float]:
    """``scores`` at the (site, run) pairs of ``differences``: the means compare the same pairs."""
    return [float(scores[run][site]) for site, by_run in differences.items() for run in by_run]


def target_check(kept: RunScores, local: RunScores, tolerance: float = TOLERANCE) -> TargetCheck:
    """No pair's kept - local below ``-tolerance``, and mean kept >= mean local over the same pairs."""
    differences = paired_differences(kept, local)
    if not differences:
        raise ValueError("target_check: the kept and local-only scores share no (site, run) pair")
    mean_kept = statistics.fmean(pair_values(kept, differences))
    mean_local = statistics.fmean(pair_values(local, differences))
    pairs = ((site, run, d) for site, by_run in differences.items() for run, d in by_run.items())
    misses = sorted((pair for pair in pairs if pair[2] < -tolerance - ROUNDING), key=lambda miss: miss[2])
    count = sum(len(by_run) for by_run in differences.values())
    return TargetCheck(not misses and mean_kept >= mean_local, mean_kept, mean_local, tuple(misses), count)


def ranking_notes(summaries: Sequence[Any]) -> dict[str, str]:
    """'best' / 'tie' / '' per algorithm by final accuracy (each summary has ``algorithm``, ``seeds`` and ``final``,
    its (mean, std) over seeds): a gap below either side's seed std is a tie. The comparison grid's and the
    personalization reports' one ranking rule."""
    best = max(summaries, key=lambda s: s.final[0])
    notes = {}
    for s in summaries:
        gap = best.final[0] - s.final[0]
        if s is best:
            notes[s.algorithm] = "best"
        elif s.seeds > 1 and gap <= max(best.final[1], s.final[1]):
            notes[s.algorithm] = "tie"
        else:
            notes[s.algorithm] = ""
    return notes
