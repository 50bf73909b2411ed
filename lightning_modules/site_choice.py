"""Which model a site keeps, chosen on its validation split over rounds and candidates (docs/personalization.md,
"Does joining help my site?").

A site compares the model it would have alone with what the federation offers, using the same rule on both sides:

- **The site's own model** (the local-only counterfactual): of the local-only models of every round so far, the one
  with the lowest validation loss (early stopping; a later round replaces the incumbent only when strictly lower).
  That is what a site training alone would keep, with the same validation split and the same budget.
- **The kept model**: the same rule over a wider set: the own model, every federated candidate of every round so far
  (the received global model where the site could use it, the personal model, and the `mixture` of the own and the
  federated model at a few validated weights). A federated candidate replaces the own model only when it is better
  on validation by more than ``margin`` standard errors of the per-sample paired difference (`beats`): a one-sided
  paired test, since a site's validation split holds tens to hundreds of samples and the best of several noisy
  scores is optimistic (the winner's curse). Otherwise the site keeps its own model, and its gain is exactly 0
  ("no gain: kept its own model").

Both sides choose on one split: the site's own validation split (``val``), or with ``keep_view pooled`` a pooled
validation split (``pooled_val``, `SELECT_SPLITS`): a reference set of the "next patient" distribution, disjoint from
every split that reports, for a site that wants a model for the cases it rarely sees rather than for its own.

Scores are per sample: the validation cross-entropy ``-log p(y | x)`` and whether the arg-max is right, from the
forward's logits (lightning_modules/split_scores.py). Everything here is plain numpy on those vectors.

The mixture (an ensemble in probability space): ``p_a(y | x) = (1 - a) p_own(y | x) + a p_fed(y | x)`` for ``a`` in
`MIXTURE_WEIGHTS`. On the site's own distribution the own model is often best; on classes the site rarely sees the
federated one is; the mixture trades between them, and validation picks the weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

#: The federated model's weight in the mixture candidates (0 is the own model, 1 the federated one).
MIXTURE_WEIGHTS = (0.25, 0.5, 0.75)
#: Default margin, in standard errors of the paired validation-loss difference: one standard error (a one-sided test
#: at about 16 %). Chosen by replaying 1.645, 1.282, 1.0, 0.5 and 0 on four tuning settings' recorded tables
#: (benchmarks/keep_rule_study.py; benchmarks/results/site_gain.md): below 1.0 the mean gain stopped rising and the
#: pairs below -2 points grew; 1.645 (a 5 % test) kept the own model at sites where the federation's was plainly better.
DEFAULT_MARGIN = 1.0
#: The split each ``keep_view`` chooses on (the own and the kept model alike).
SELECT_SPLITS = {"own": "val", "pooled": "pooled_val"}
#: Mean differences smaller than this are ties: two models' equal losses summed in another order differ by ~1e-16.
TIE = 1e-12


@dataclass
class SplitScores:
    """One model's per-sample log-probabilities of the true class on each split (``val``, ``test``, ``pooled``)."""

    log_prob: dict[str, np.ndarray] = field(default_factory=dict)  # split -> (n,) log p(y | x)
    correct: dict[str, np.ndarray] = field(default_factory=dict)  # split -> (n,) 0/1

    def loss(self, split: str) -> float:
        return float(-self.log_prob[split].mean())

    def accuracy(self, split: str) -> float:
        return float(self.correct[split].mean())


@dataclass
class Candidate:
    """A model a site could keep: its kind (`KINDS`), the round it comes from, the mixture weight (``None`` for a
    single model) and its scores."""

    kind: str
    round_num: int
    scores: SplitScores
    weight: float | None = None

    @property
    def val_loss(self) -> float:
        return self.scores.loss("val")


#: Candidate kinds; ``eval.kept_candidate`` is the index (0 global, 1 personal, 2 local, 3 mixture).
KINDS = ("global", "personal", "local", "mixture")


def mixture_scores(
    own_log_probs: Mapping[str, np.ndarray],
    fed_log_probs: Mapping[str, np.ndarray],
    weight: float,
) -> dict[str, np.ndarray]:
    """Per split, the (n, classes) log-probabilities of ``(1 - weight) p_own + weight p_fed``, computed in log space
    (`np.logaddexp`) so that confident models do not underflow."""
    if not 0.0 < weight < 1.0:
        raise ValueError(f"mixture weight must lie in (0, 1), got {weight}")
    return {
        split: np.logaddexp(math.log1p(-weight) + own_log_probs[split], math.log(weight) + fed_log_probs[split])
        for split in own_log_probs
    }


def scores_from_tables(log_probs: Mapping[str, np.ndarray], labels: Mapping[str, np.ndarray]) -> SplitScores:
    """Per-sample scores from (n, classes) log-probabilities and integer labels, for every split in both."""
    scores = SplitScores()
    for split, table in log_probs.items():
        y = labels[split]
        scores.log_prob[split] = table[np.arange(len(y)), y]
        scores.correct[split] = (table.argmax(axis=1) == y).astype(np.float64)
    return scores


def lower_is_better(metric: str) -> bool:
    """Losses and errors: lower is better; anything else (accuracy, AUC, ...): higher."""
    return any(word in metric.lower() for word in ("loss", "error", "mae", "mse"))


def paired_mean_se(first: np.ndarray, second: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of ``first - second`` over the same samples (sd with n - 1; nan below 2 samples)."""
    a, b = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired samples must be two vectors of one length, got {a.shape} and {b.shape}")
    d = a - b
    if len(d) < 2:
        return (float(d.mean()) if len(d) else float("nan")), float("nan")
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def beats(challenger: Candidate, incumbent: Candidate, margin: float, split: str = "val") -> bool:
    """Whether ``challenger``'s loss on the validation ``split`` is below ``incumbent``'s by more than ``margin``
    standard errors of the per-sample paired difference (``margin`` 0: lower on the mean by more than `TIE`)."""
    mean, se = paired_mean_se(-challenger.scores.log_prob[split], -incumbent.scores.log_prob[split])
    if not math.isfinite(mean):
        return False
    if margin == 0:
        return mean < -TIE
    return math.isfinite(se) and mean + margin * se < -TIE


def early_stopped(incumbent: Candidate | None, latest: Candidate, split: str = "val") -> Candidate:
    """The own model after this round: the latest local-only model if its loss on the validation ``split`` is
    strictly lower than the incumbent's (or there is none, or the incumbent's is not finite), else the incumbent."""
    if incumbent is None or not math.isfinite(incumbent.scores.loss(split)):
        return latest
    return latest if latest.scores.loss(split) < incumbent.scores.loss(split) else incumbent


def keep(own: Candidate | None, challengers: Sequence[Candidate], margin: float, split: str = "val") -> Candidate:
    """The model a site keeps: the challenger with the lowest loss on the validation ``split`` (ties to the earlier
    one) if it `beats` the own model by ``margin``, else the own model. Without an own model (no local-only
    baseline) the best challenger, with no margin."""
    finite = [c for c in challengers if math.isfinite(c.scores.loss(split))]
    if not finite:
        if own is None:
            raise ValueError("keep: no candidate with a finite validation loss")
        return own
    best = min(finite, key=lambda c: c.scores.loss(split))  # min keeps the first of equal values
    if own is None:
        return best
    return best if beats(best, own, margin, split) else own


__all__ = [
    "DEFAULT_MARGIN",
    "KINDS",
    "MIXTURE_WEIGHTS",
    "SELECT_SPLITS",
    "Candidate",
    "SplitScores",
    "beats",
    "early_stopped",
    "keep",
    "lower_is_better",
    "mixture_scores",
    "paired_mean_se",
    "scores_from_tables",
]
