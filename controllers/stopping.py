"""When a federation stops before its last round: a validation plateau (``--stop-patience``).

The sites score on their own validation splits every round and send the scores as ``eval.*`` meta
(controllers/engine.py ``site_eval_summary``). The stopping rule reads one of them, the first the sites report of
`PLATEAU_METRICS`:

- ``kept_pooled_val_loss``: with ``--keep-view pooled``, the loss of the model each site keeps on the pooled
  validation split it is chosen on (lightning_modules/site_choice.py);
- ``kept_val_loss``: the validation loss of the model each site keeps (``--keep best``); it improves only when a
  site found a better model, so its plateau means no site is still gaining;
- ``personal_val_loss``: the personal model's (fine-tuning, Ditto, FedPer/FedBN/FedRep without keep best);
- ``val_loss``: the received global model's.

The value of a round is the unweighted mean over the sites of each site's latest score (a site not sampled this
round counts with its last one, so partial participation does not move the mean by itself). The job stops after
round ``t`` when none of the last ``patience`` rounds lowered the best value so far by more than `MIN_DELTA`:
``t - argmin >= patience``, where ``argmin`` is the first round reaching the best value (up to `MIN_DELTA`). The
rounds before that count; ``num_rounds`` stays the cap. Each site's kept and own models are already chosen on
validation over rounds (lightning_modules/site_choice.py), so stopping later changes no site's choice for the
worse; the rule saves the rounds that no longer change anything.

A resumed job continues the rule where the stopped run left it: its history, each site's latest score and the
metric (`Plateau.state`) are checkpointed with the rule state after every round (``server_state.pt``, whose run id
and model digest already tie it to the run) and restored by `Plateau.restored`, so the resumed job stops after the
round the uninterrupted job stops after; one whose saved history already reached the plateau runs no round. A
checkpoint without it (a run without ``--stop-patience``, an older version) or with one that does not hold together
starts the history empty, with one line saying why.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The validation scores the rule reads, in order of preference (module docstring).
PLATEAU_METRICS = ("kept_pooled_val_loss", "kept_val_loss", "personal_val_loss", "val_loss")
#: An improvement smaller than this (absolute, in loss units) is no improvement.
MIN_DELTA = 1e-4


def rounds_since_best(history: Sequence[float], min_delta: float = MIN_DELTA) -> int:
    """Rounds since the value last improved on the best before it by more than ``min_delta`` (0: the latest did)."""
    best, best_index = math.inf, -1
    for index, value in enumerate(history):
        if value < best - min_delta:
            best, best_index = value, index
    return len(history) - 1 - best_index if best_index >= 0 else len(history)


def plateau_metric(site_eval: Mapping[str, Any]) -> str | None:
    """The first of `PLATEAU_METRICS` the sites reported this round (``site_eval``: the round record's summary)."""
    return next((name for name in PLATEAU_METRICS if name in site_eval), None)


def finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def update_latest(latest: dict[str, float], site_eval: Mapping[str, Any], metric: str | None) -> bool:
    """Put each site's finite score of ``metric`` in this round's ``site_eval`` summary into ``latest`` (a site
    without one keeps its last); whether the round reported the metric at all. The value of a round is then
    `latest_mean`: the unweighted mean over the sites (this rule's and controllers/model_selection.py's)."""
    per_site = (site_eval.get(metric) or {}).get("per_site", {}) if metric else {}
    latest.update({site: float(v) for site, v in per_site.items() if math.isfinite(float(v))})
    return bool(per_site)


def latest_mean(latest: Mapping[str, float]) -> float:
    return sum(latest.values()) / len(latest)


def saved_state_problem(saved: Any, rounds_attempted: int) -> str | None:
    """Why a checkpointed `Plateau.state` cannot be continued (``None``: it can): finite numbers only, a known
    metric, at most one value per round attempted, and scores to average whenever there is a history."""
    if saved is None:
        return "the checkpoint holds no history of it (a run without --stop-patience, or an older version)"
    if not isinstance(saved, Mapping):
        return f"its saved state is not a mapping ({type(saved).__name__})"
    history, latest, metric = saved.get("history"), saved.get("latest"), saved.get("metric")
    if not isinstance(history, list) or not all(finite_number(v) for v in history):
        return "its saved history is not a list of finite numbers"
    if len(history) > rounds_attempted:
        return f"its saved history has {len(history)} values for {rounds_attempted} rounds attempted"
    if not isinstance(latest, Mapping) or not all(finite_number(v) for v in latest.values()):
        return "its saved latest scores are not finite numbers by site"
    if history and not latest:
        return "its saved history has no latest scores it is the mean of"
    if (metric is not None or history) and metric not in PLATEAU_METRICS:
        return f"its saved metric {metric!r} is none of {list(PLATEAU_METRICS)}"
    return None


@dataclass
class Plateau:
    """The rule over a run (module docstring): `observe` each round's site summary, then ask `reached`."""

    patience: int
    metric: str | None = None
    latest: dict[str, float] = field(default_factory=dict)
    history: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.patience, bool) or not isinstance(self.patience, int) or self.patience < 1:
            raise ValueError(f"stop_patience must be an integer >= 1 (rounds without gain), got {self.patience!r}")

    def observe(self, site_eval: Mapping[str, Any]) -> None:
        """Take a round's ``site_eval`` summary; a round without the metric repeats the last value."""
        self.metric = self.metric or plateau_metric(site_eval)
        update_latest(self.latest, site_eval, self.metric)
        if self.latest:
            self.history.append(latest_mean(self.latest))

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the rule (`restored` reads it back): plain values only."""
        return {"metric": self.metric, "latest": dict(self.latest), "history": list(self.history)}

    @classmethod
    def restored(cls, patience: int, saved: Any, rounds_attempted: int) -> tuple[Plateau, str | None]:
        """The rule as a stopped run left it after ``rounds_attempted`` rounds (``saved``: its `state`), with the
        given ``patience``; an empty one and why when ``saved`` is missing or does not hold together."""
        problem = saved_state_problem(saved, rounds_attempted)
        if problem is not None:
            return cls(patience), problem
        latest = {str(site): float(value) for site, value in saved["latest"].items()}
        return cls(patience, saved["metric"], latest, [float(v) for v in saved["history"]]), None

    def reached(self) -> bool:
        return bool(self.history) and rounds_since_best(self.history) >= self.patience

    def note(self, round_num: int) -> dict[str, Any]:
        """What the round's record says when the rule stops the job."""
        waited = rounds_since_best(self.history)
        best = self.history[len(self.history) - 1 - waited]
        return {
            "rule": "validation plateau",
            "metric": self.metric,
            "patience": self.patience,
            "best": best,
            "rounds_without_improvement": waited,
            "after_round": round_num,
        }


__all__ = [
    "MIN_DELTA",
    "PLATEAU_METRICS",
    "Plateau",
    "finite_number",
    "latest_mean",
    "plateau_metric",
    "rounds_since_best",
    "saved_state_problem",
    "update_latest",
]
