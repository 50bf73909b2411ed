"""Cross-site evaluation after the last round (``cross_site_eval``; the names and the arithmetic are in
`aggregators.contracts.cross_site`): the bundle's controller runs it as two more tasks, over any transport.

1. `aggregators.contracts.cross_site.SUBMIT_TASK` to every site of the job: each answers with its kept and its
   local-only model, read from its private state store under the run id the task carries (the store is keyed by the
   controller's run id, which NVFlare's ``CrossSiteModelEval`` cannot send: it has no task meta);
2. `aggregators.contracts.cross_site.VALIDATE_TASK` to each site in turn, carrying the models of every other site that
   submitted (never a site's own): it answers with counts on its validation split;
3. the per-owner view (`aggregators.contracts.cross_site.summarize`), written with the raw counts to
   ``<run dir>/metrics/cross_site_scores.json`` (`CROSS_SITE_SCORES_FILE`).

A site that sends no models, or no counts, is named in the log and left out; nothing else stops.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aggregators.contracts import cross_site, meta_keys
from aggregators.contracts.run_records import CROSS_SITE_SCORES_FILE

__all__ = ["CROSS_SITE_SCORES_FILE", "Answer", "cross_site_record", "run_cross_site"]


@dataclass
class Answer:
    """One site's answer to a cross-site task."""

    site: str
    params: Mapping[str, Any] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)


#: ``ask(task, targets, params, meta)``: send one task to ``targets``, return their answers.
Ask = Callable[[str, Sequence[str], dict[str, Any], dict[str, Any]], list[Answer]]


def run_cross_site(ask: Ask, sites: Sequence[str], run_id: str, warn: Callable[[str], None]) -> dict[str, Any]:
    """Steps 1-3 of the module docstring; returns the record `cross_site_record` writes."""
    submitted: dict[str, Answer] = {}
    for answer in ask(cross_site.SUBMIT_TASK, list(sites), {}, {meta_keys.RUN_ID: run_id}):
        if answer.site in sites and answer.params:
            submitted[answer.site] = answer
    missing = sorted(set(sites) - set(submitted))
    if missing:
        warn(f"cross-site evaluation: no models from {missing}; they are neither scored nor scoring")
    pairs: dict[str, dict[str, dict[str, int]]] = {}
    for validator in sorted(submitted):
        owners = [site for site in sorted(submitted) if site != validator]
        if not owners:
            continue
        params = {f"{owner}/{key}": value for owner in owners for key, value in submitted[owner].params.items()}
        weights = {owner: submitted[owner].meta.get(cross_site.KEPT_WEIGHT) for owner in owners}
        meta = {meta_keys.RUN_ID: run_id, cross_site.OWNERS: owners, cross_site.WEIGHTS: weights}
        answers = [a for a in ask(cross_site.VALIDATE_TASK, [validator], params, meta) if a.site == validator]
        counts = cross_site.owner_counts(answers[0].metrics) if answers else {}
        if set(counts) != set(owners):
            warn(f"cross-site evaluation: {validator} scored {sorted(counts)} of {owners}")
        for owner, owner_counts in counts.items():
            if owner in owners:
                pairs.setdefault(owner, {})[validator] = owner_counts
    return {"sites": cross_site.summarize(pairs), "pairs": pairs}


def cross_site_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The file's content: per site the summary under its ``eval.`` names, and the counts per (owner, validator)."""
    sites = {
        site: {meta_keys.eval_key(name): value for name, value in summary.items()}
        for site, summary in record["sites"].items()
    }
    return {"sites": sites, "pairs": record["pairs"]}
