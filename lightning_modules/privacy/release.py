"""What leaves a site each round, and whether DP protects it: the privacy ledger of items (docs/privacy.md).

Under DP-SGD the model update is (epsilon, delta)-DP for one person of the site's data; everything computed from it
and from public values (SCAFFOLD's Option II control, its norms) is post-processing and costs nothing more. Every
other item that leaves a site is a side channel unless it depends on public values only. Sample counts are treated
as public, as cross-silo federations usually do (each site's size is known to the consortium): that is a choice,
stated here and in the docs. The rest (training loss and accuracy, scores on the site's validation data, any meta
this table does not know) is **withheld** under DP by default: dropped from the result before it is sent, its key
listed in ``privacy.withheld``.

`RELEASED` lists every item a site of this bundle can send, with its status: the items every site sends, then
those each registered client algorithm declares on its class (``released``,
lightning_modules/algorithms/capabilities.py), then the withheld ones. A test checks that every meta key the
bundle's client algorithms send appears in it, and docs/privacy.md shows the same table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

from aggregators.contracts import meta_keys
from aggregators.types import declared
from lightning_modules.algorithms.capabilities import Released, Status
from lightning_modules.algorithms.registry import CLIENT_ALGORITHMS

__all__ = [
    "RELEASED",
    "SITE_SCORES",
    "Item",
    "Status",
    "declared_meta",
    "release",
    "released_by",
    "status_of",
    "unaccounted_keys",
]

#: One released item (a meta key or pattern, what it is, its status); declared by the algorithms as ``Released``.
Item = Released

SENT_BY_EVERY_SITE: tuple[Item, ...] = (
    Item("<weights>", "the trainable parameters after local DP-SGD training", "dp"),
    Item(
        "<buffers>",
        "non-trainable entries: only buffers their module declares data-independent (data_independent_buffers); "
        "a model with any other buffer (BatchNorm, InstanceNorm's running statistics, a running-mean input "
        "standardiser, a sample counter) is refused under DP, at build time and at the site",
        "public",
    ),
    Item(
        meta_keys.NUM_SAMPLES,
        "the size n_i of the site's training set (the FedAvg weight), never the size of a Poisson sample (secret): "
        "treated as public",
        "public",
    ),
    Item(meta_keys.NUM_STEPS, "optimizer steps: epochs x steps per epoch, a function of n_i under Poisson", "public"),
    Item(meta_keys.PARAM_KEYS, "names of the trainable parameters", "public"),
    Item(meta_keys.CLIENT_ALGORITHM, "the client algorithm's name", "public"),
    Item(meta_keys.TRAINED_ROUND, "the round the result was trained in", "public"),
    Item(meta_keys.FIT_SECONDS, "wall seconds of the fit: timing, set by n_i and the hardware", "public"),
    Item("privacy.*", "epsilon, delta, sigma, q, steps, C: functions of the settings and n_i", "public"),
    Item("fednova.*", "FedNova's tau and ||a||_1: the step count and the lr schedule", "public"),
    Item("attack.*", "simulated attacks (experiments): whether and how this site attacked", "public"),
)
#: Items a secure-aggregation workflow's own site filter adds after the site's release (declared to the egress gate
#: by that workflow, jobs/secure_aggregation.py, not by every training job).
SENT_BY_MECHANISM: tuple[Item, ...] = (
    Item(
        meta_keys.SECAGG_ROUND,
        "under --secure-aggregation secagg: the round a masked result belongs to (the server matches it to the "
        "round's key stage)",
        "public",
    ),
)
#: Data-dependent items no epsilon covers, withheld under DP (the catch-all last).
WITHHELD: tuple[Item, ...] = (
    Item(meta_keys.TRAIN_LOSS, "mean training loss: computed on the data outside DP", "withheld"),
    Item("train.*", "the module's own round metrics (training accuracy, ...): computed on the data", "withheld"),
    Item(
        "eval.*",
        "scores of the global, personal, local-only or kept model on the site's validation or test data, and which "
        "candidate the site kept (sent, unaccounted, only with "
        "--dp-release-site-scores)",
        "withheld",
    ),
    Item("*", "anything else (a user's algorithm's meta): unknown, so withheld", "withheld"),
)


def released_by(algorithm_cls: type) -> tuple[Item, ...]:
    """The items the algorithm's own class declares it sends (``released``), never inherited: a subclass may send
    what its parent does not (undeclared: `aggregators.types.UndeclaredCapability`, one line)."""
    return tuple(declared(algorithm_cls, "released"))


#: Every item, in the order `status_of` matches them: each algorithm's own items before the withheld ones.
RELEASED: tuple[Item, ...] = (
    SENT_BY_EVERY_SITE
    + SENT_BY_MECHANISM
    + tuple(item for cls in CLIENT_ALGORITHMS.values() for item in released_by(cls))
    + WITHHELD
)


def status_of(key: str) -> Item:
    """The first item of `RELEASED` whose pattern matches ``key`` (the catch-all last)."""
    return next(item for item in RELEASED if fnmatchcase(key, item.pattern))


#: What ``--dp-release-site-scores`` lets leave a DP site although no epsilon covers it.
SITE_SCORES = "eval.*"


def release(meta: Mapping[str, Any], unaccounted: Sequence[str] = ()) -> tuple[dict[str, Any], list[str]]:
    """The meta a DP site sends (everything whose status is not ``withheld``, and the withheld keys matching a
    pattern of ``unaccounted``, which the job chose to release) and the sorted withheld keys."""

    def sent(key: str) -> bool:
        return status_of(key).status != "withheld" or any(fnmatchcase(key, p) for p in unaccounted)

    kept = {key: value for key, value in meta.items() if sent(key)}
    return kept, sorted(set(meta) - set(kept))


def unaccounted_keys(meta: Mapping[str, Any]) -> list[str]:
    """The keys of ``meta`` that leave the site with no epsilon covering them (status ``withheld``)."""
    return sorted(key for key in meta if status_of(key).status == "withheld")


def declared_meta(client: str, private: bool, release_site_scores: bool = False) -> tuple[str, ...]:
    """The meta keys (patterns) a training site of a job declares it sends, for the egress gate
    (`aggregators.contracts.egress`): every site's items and the job's client algorithm's (``released``); without DP
    also the withheld families (``train.*``, ``eval.*``: a job without DP releases them), never the catch-all; under DP
    only what is not withheld, and ``eval.*`` when the job releases the site scores (``--dp-release-site-scores``)."""
    items = SENT_BY_EVERY_SITE + released_by(CLIENT_ALGORITHMS[client])
    if private:
        patterns = [item.pattern for item in items if item.status != "withheld"]
        patterns += [SITE_SCORES] if release_site_scores else []
    else:
        patterns = [item.pattern for item in items + WITHHELD if item.pattern != "*"]
    return tuple(dict.fromkeys(p for p in patterns if not p.startswith("<")))
