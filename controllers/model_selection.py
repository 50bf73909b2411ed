"""Which global model a job delivers: the round's model the sites scored best on their validation splits.

Under strong label skew the global model swings from round to round: each round's local epochs pull it towards the
sites' own labels, and the average lands in a different place each time. Measured on recorded runs
(benchmarks/results/site_gain.md, "The global model a job delivers"): on 1000 Genomes with Dirichlet 0.2 over 9
sites, the last round's global model scored 84.4 % on the pooled test people (3 seeds), while the round the sites'
validation splits pointed to scored 92.7 %. The last round is where the job happened to stop, not a choice.

The rule (NVFlare's best-model selection, on the scores the sites already send): every round each site scores the
global model it received on its own validation split before training (``eval.val_loss``; with ``keep_view pooled``
on the pooled validation split, ``eval.global_pooled_val_loss``). The round's value is the unweighted mean over the
sites of each site's latest score, as the stopping rule's (controllers/stopping.py; a site not sampled counts with
its last one). The best global model is the one sent in the round with the lowest value so far; a later round
replaces it only when strictly lower, so ties keep the earlier, shorter-trained model. The server saves it beside
the last one (NVFlare's ``GLOBAL_BEST_MODEL_AVAILABLE`` event: ``best_FL_global_model.pt`` in the app folder) and
the round's metrics record says so (``best_global``).

What it does not choose: the model after the last aggregation has no validation score unless the job asks the sites
for one (``--final-site-eval``), so it is never the best one; a job with ``--local-keys`` (FedPer, FedBN, FedRep)
selects nothing, since its global model carries the initial values of the site-held entries and no site would use it
as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controllers.stopping import finite_number, latest_mean, update_latest

#: The received global model's validation score, in order of preference: on the pooled validation split where the
#: job chooses on it (``keep_view pooled``), else on the site's own.
SELECTION_METRICS = ("global_pooled_val_loss", "val_loss")


def selection_metric(site_eval: Mapping[str, Any]) -> str | None:
    """The first of `SELECTION_METRICS` the sites reported this round (``site_eval``: the round record's summary)."""
    return next((name for name in SELECTION_METRICS if name in site_eval), None)


@dataclass
class BestGlobal:
    """The rule over a run (module docstring): `observe` each round's site summary; ``round`` is the round whose
    sent model is the best so far (``None``: none scored yet)."""

    metric: str | None = None
    latest: dict[str, float] = field(default_factory=dict)
    value: float = math.inf
    round: int | None = None

    def observe(self, site_eval: Mapping[str, Any], round_num: int) -> bool:
        """Take round ``round_num``'s ``site_eval`` summary (the sites' scores of the model sent in that round);
        whether that model is the new best."""
        self.metric = self.metric or selection_metric(site_eval)
        if not update_latest(self.latest, site_eval, self.metric) or not self.latest:
            return False  # a round without scores chooses nothing
        mean = latest_mean(self.latest)
        if mean < self.value:
            self.value, self.round = mean, round_num
            return True
        return False

    def note(self) -> dict[str, Any]:
        """What the metrics record says of the best model (rounds 1-based, as the logs count them)."""
        return {"sent_in_round": None if self.round is None else self.round + 1, "metric": self.metric,
                "mean_over_sites": self.value}  # fmt: skip

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (`restored` reads it back): plain values only."""
        return {"metric": self.metric, "latest": dict(self.latest), "value": self.value, "round": self.round}

    @classmethod
    def restored(cls, saved: Any, rounds_attempted: int) -> tuple[BestGlobal, str | None]:
        """The rule as a stopped run left it after ``rounds_attempted`` rounds, or an empty one and why."""
        problem = saved_best_problem(saved, rounds_attempted)
        if problem is not None:
            return cls(), problem
        latest = {str(site): float(v) for site, v in saved["latest"].items()}
        return cls(saved["metric"], latest, float(saved["value"]), saved["round"]), None


def saved_best_problem(saved: Any, rounds_attempted: int) -> str | None:
    """Why a checkpoint's best-model state cannot be continued (``None``: it can)."""
    if saved is None:
        return "the checkpoint holds no best-global-model state (an older version); the selection starts again"
    if not isinstance(saved, Mapping) or set(saved) != {"metric", "latest", "value", "round"}:
        return "the checkpoint's best-global-model state is not {metric, latest, value, round}; it starts again"
    best_round, latest = saved["round"], saved["latest"]
    if best_round is not None and (
        isinstance(best_round, bool) or not isinstance(best_round, int) or not 0 <= best_round < rounds_attempted
    ):
        return f"the checkpoint's best global model comes from round {best_round!r}, not one of its {rounds_attempted}"
    if not isinstance(latest, Mapping) or not all(finite_number(v) for v in latest.values()):
        return "the checkpoint's best-global-model scores are not finite numbers per site; the selection starts again"
    if not isinstance(saved["value"], int | float) or (best_round is not None and not finite_number(saved["value"])):
        return "the checkpoint's best-global-model value is not a finite number; the selection starts again"
    return None


__all__ = ["SELECTION_METRICS", "BestGlobal", "saved_best_problem", "selection_metric"]
