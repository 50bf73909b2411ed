"""Cross-site evaluation (``--cross-site-eval``): the "next patient" view of a real deployment, where no pooled test
set exists. Pure Python: the controller, the sites, the egress declaration and the report read the same names.

After the last round the bundle's controller asks every site for the two models it would use
(`SUBMIT_TASK`): the model it keeps (``--keep best``; a mixture is both states and the weight) and its own
early-stopped local-only model (``--local-baseline``), both from its private state store. It then sends every
site the other sites' models (`VALIDATE_TASK`); the site scores each on its validation split and answers with
counts only (`count_name`): how many samples it holds, how many each model classifies right, and how many only
one of the two does. From these counts, per model owner and over the other sites (`summarize`):

- ``kept_cross_site_accuracy`` and ``local_cross_site_accuracy``: the sample-weighted mean accuracy on the other
  sites' validation splits (every sample of every other site counts once);
- ``kept_minus_local_cross_site_accuracy``: the paired difference on the same samples, with its standard error
  (``..._se``) from the per-sample differences d in {-1, 0, 1}: their sum is (kept only) - (local only) and the sum
  of their squares (kept only) + (local only), so the counts give the exact sample mean and variance.

It sends site models to other sites: it is declared as a release (`submitted_data_patterns`, jobs/egress.py) and
refused under DP and secure aggregation (jobs/spec.py; docs/privacy.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "COUNTS",
    "CROSS_SITE_KEYS",
    "KEPT",
    "KEPT_FEDERATED",
    "KEPT_OWN",
    "KEPT_WEIGHT",
    "LOCAL",
    "SUBMIT_TASK",
    "VALIDATE_TASK",
    "count_name",
    "model_key",
    "owner_counts",
    "split_key",
    "submitted_data_patterns",
    "summarize",
]

#: The controller's tasks: a site sends its models; a site scores the other sites' models.
SUBMIT_TASK, VALIDATE_TASK = "cross_site_submit", "cross_site_validate"
#: The parts of a submitted model: the kept model (one state), or for a mixture its own and federated states, and
#: the site's own early-stopped local-only model. A key of the submitted weights is ``<part>/<state_dict name>``.
KEPT, KEPT_OWN, KEPT_FEDERATED, LOCAL = "kept", "kept.own", "kept.federated", "local"
PARTS = (KEPT, KEPT_OWN, KEPT_FEDERATED, LOCAL)
#: Meta of a submission: the mixture's weight of the federated model (absent for a single-state kept model).
KEPT_WEIGHT = "cross_site.kept_weight"
#: Meta of a validate task: the owners whose models it carries, and per owner the mixture weight (or None).
OWNERS, WEIGHTS = "cross_site.owners", "cross_site.weights"
#: What a validating site answers per owner (``<owner>/<count>``): its validation samples, the samples the kept and
#: the local-only model classify right, and the samples only one of them does.
COUNTS = ("num_samples", "kept_correct", "local_correct", "kept_only", "local_only")
#: The summary names per owner site (the report's columns, ``eval.``-prefixed in the metrics file).
CROSS_SITE_KEYS = (
    "kept_cross_site_accuracy",
    "local_cross_site_accuracy",
    "kept_minus_local_cross_site_accuracy",
    "kept_minus_local_cross_site_accuracy_se",
    "cross_site_samples",
    "cross_site_sites",
)


def model_key(part: str, name: str, owner: str | None = None) -> str:
    """The key of state_dict entry ``name`` of ``part`` (of ``owner``'s models, in a validate task)."""
    if part not in PARTS:
        raise ValueError(f"cross-site: unknown model part {part!r} (known: {list(PARTS)})")
    return f"{part}/{name}" if owner is None else f"{owner}/{part}/{name}"


def split_key(key: str, with_owner: bool = False) -> tuple[str | None, str, str]:
    """(owner, part, state_dict name) of a `model_key`; a key that is none is refused in one line."""
    owner, rest = key.split("/", 1) if with_owner and "/" in key else (None, key)
    part, _, name = rest.partition("/")
    if part not in PARTS or not name or (with_owner and not owner):
        raise ValueError(f"cross-site: {key!r} is not a model key ([<owner>/]<part>/<entry>, parts {list(PARTS)})")
    return owner, part, name


def count_name(owner: str, count: str) -> str:
    """The name of a validating site's count for ``owner``'s models."""
    if count not in COUNTS:
        raise ValueError(f"cross-site: unknown count {count!r} (known: {list(COUNTS)})")
    return f"{owner}/{count}"


def submitted_data_patterns(entries: Iterable[str]) -> tuple[str, ...]:
    """The data keys a site may send for `SUBMIT_TASK`: every part of the job model's entries."""
    return tuple(model_key(part, name) for part in PARTS for name in entries)


def owner_counts(metrics: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """A validating site's answer, per owner: the counts (`COUNTS`) it reported, whole numbers only."""
    out: dict[str, dict[str, int]] = {}
    for name, value in metrics.items():
        owner, _, count = str(name).rpartition("/")
        if owner and count in COUNTS and isinstance(value, int | float) and not isinstance(value, bool):
            out.setdefault(owner, {})[count] = int(value)
    return {owner: counts for owner, counts in out.items() if set(counts) == set(COUNTS)}


def summarize(pairs: Mapping[str, Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, float]]:
    """Per owner, the cross-site view (module docstring) from ``pairs[owner][validator]`` = that validator's counts
    for the owner's models. A validator that is the owner is left out (the view is the other sites'); an owner that
    no other site scored is left out. The standard error is nan below two samples."""
    out = {}
    for owner, by_validator in sorted(pairs.items()):
        others = [counts for validator, counts in by_validator.items() if validator != owner]
        n = sum(c["num_samples"] for c in others)
        if not others or n == 0:
            continue
        kept, local = sum(c["kept_correct"] for c in others), sum(c["local_correct"] for c in others)
        plus, minus = sum(c["kept_only"] for c in others), sum(c["local_only"] for c in others)
        mean = (plus - minus) / n
        se = math.sqrt(max((plus + minus - n * mean * mean) / (n - 1), 0.0) / n) if n > 1 else float("nan")
        out[owner] = dict(
            zip(CROSS_SITE_KEYS, (kept / n, local / n, mean, se, float(n), float(len(others))), strict=True)
        )
    return out
