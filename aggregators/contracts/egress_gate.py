"""The egress gate at every site: the last filter on every result it sends (NVFlare glue for `egress`).

The job builder (`jobs.egress`, and the QC job's export) puts one `EgressGate` per task at the end of the sites'
``task_result_filters``, with the job's declared `aggregators.contracts.egress.Release` for that task as its arguments.
It strips what the release does not declare and logs the names with the site's name; a result whose data holds an
undeclared key (or whose DXO kind is undeclared) is refused: the filter raises, NVFlare sends an error reply
instead, and nothing of the result leaves.
"""

from __future__ import annotations

from collections.abc import Sequence

from nvflare.apis.dxo import from_shareable
from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable

from aggregators.contracts.egress import (
    INITIAL_METRICS,
    METRICS_KIND,
    TRANSPORT_HEADERS,
    Carried,
    Release,
    Verdict,
    judge,
)

DXO_KEY = "DXO"  # where NVFlare's DXO.update_shareable puts the DXO


class EgressRefused(RuntimeError):
    """A result carried data the job does not declare: nothing of it is sent."""


class EgressGate(Filter):
    """Strip or refuse what a site's result carries beyond the job's declared release for ``task``."""

    def __init__(
        self,
        task: str,
        data_kinds: Sequence[str],
        data: Sequence[str],
        meta: Sequence[str],
        metrics: Sequence[str] | None = None,
        headers: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        # Kept as given (lists of strings, None for the defaults): NVFlare's job API writes the constructor arguments
        # from these attributes, and only those that differ from the defaults.
        self.task, self.data_kinds, self.data, self.meta = task, list(data_kinds), list(data), list(meta)
        self.metrics = None if metrics is None else list(metrics)
        self.headers = None if headers is None else list(headers)
        self.release = Release(
            task,
            self.data_kinds,
            self.data,
            self.meta,
            self.metrics or (),
            TRANSPORT_HEADERS if headers is None else self.headers,
        )

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        site = fl_ctx.get_identity_name() or "site"
        headers = shareable.get(ReservedHeaderKey.HEADERS)
        headers = headers if isinstance(headers, dict) else {}
        top_level = [k for k in shareable if k not in (ReservedHeaderKey.HEADERS, DXO_KEY)]
        dxo = from_shareable(shareable) if DXO_KEY in shareable else None
        carried = Carried.of(
            dxo.data_kind if dxo else None, dxo.data if dxo else None, dxo.meta if dxo else None, headers, top_level
        )
        verdict = judge(carried, self.release)
        if verdict.refuse:
            self.log_error(fl_ctx, verdict.describe(site, self.task))
            raise EgressRefused(verdict.describe(site, self.task))
        if verdict.clean:
            return shareable
        self.log_warning(fl_ctx, verdict.describe(site, self.task))
        return strip(shareable, dxo, verdict)


def strip(shareable: Shareable, dxo: object, verdict: Verdict) -> Shareable:
    """Remove the verdict's names from the shareable (in place) and return it."""
    headers = shareable.get(ReservedHeaderKey.HEADERS)
    for name in verdict.strip.get("headers", ()):
        headers.pop(name, None)
    for name in verdict.strip.get("top_level", ()):
        shareable.pop(name, None)
    if dxo is None:
        return shareable
    for name in verdict.strip.get("meta", ()):
        dxo.meta.pop(name, None)
    metrics = set(verdict.strip.get("metrics", ()))
    if metrics:
        if dxo.data_kind == METRICS_KIND:
            dxo.data = {k: v for k, v in dxo.data.items() if k not in metrics}
        initial = dxo.meta.get(INITIAL_METRICS)
        if isinstance(initial, dict):
            kept = {k: v for k, v in initial.items() if k not in metrics}
            if kept:
                dxo.meta[INITIAL_METRICS] = kept
            else:
                dxo.meta.pop(INITIAL_METRICS)
    dxo.update_shareable(shareable)
    return shareable
