"""The egress gate's rule: nothing leaves a site unless the job declares it (docs/privacy.md, "Threat model").

Every result a site sends is a DXO in an NVFlare shareable, and carries four things: its **data** (a model's
weights, the QC job's counts; for a ``METRICS`` DXO, the scores), its **meta** (the bundle's namespaced keys and
NVFlare's own, e.g. ``NUM_STEPS_CURRENT_ROUND``), NVFlare's **metrics** (the Lightning callback's validation scores,
sent as the meta entry ``initial_metrics``, or the data of a ``METRICS`` result) and its **headers**. The job
declares, per task, what each may hold (`Release`: exact names or ``fnmatch`` patterns), once, when it is built;
the site's last result filter (`aggregators.contracts.egress_gate.EgressGate`) compares the result against it (`judge`)
and strips every undeclared meta key, metric, header and top-level entry, naming them in the site's log, and refuses a
result whose data holds an undeclared key or whose DXO kind is undeclared (nothing of it is sent).

Pure Python: the job builder, the QC job and the gate read the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

__all__ = [
    "INITIAL_METRICS",
    "METRICS_KIND",
    "NVFLARE_RESULT_META",
    "PARTS",
    "TRANSPORT_HEADERS",
    "Carried",
    "Release",
    "Verdict",
    "judge",
    "undeclared",
]

#: NVFlare's headers on a site's result: the task's identity and routing, the return code, the round headers its
#: Client API sets (``current_round``, ``start_round``, ``num_rounds``, ``_validate_type``), and the peer context and
#: properties its transport adds. Data-independent; the bundle's code sets no header.
TRANSPORT_HEADERS: tuple[str, ...] = (
    "__audit_event_id__",
    "__content_type__",
    "__cookie_jar__",
    "__error__",
    "__msg_root_id__",
    "__msg_root_ttl__",
    "__pass_through__",
    "__peer_ctx__",
    "__peer_props__",
    "__rc__",
    "__reply_is_late__",
    "__task_id__",
    "__task_name__",
    "__task_operator__",
    "__topic__",
    "__workflow__",
    "_validate_type",
    "current_round",
    "num_rounds",
    "start_round",
)
#: The meta entry NVFlare's Client API puts a result's metrics into when it also carries weights.
INITIAL_METRICS = "initial_metrics"
#: The DXO kind of a result that carries metrics only (its data are the scores).
METRICS_KIND = "METRICS"
#: NVFlare's own meta on a training result: its Lightning callback's optimizer-step count (the bundle's
#: ``train.num_steps``; under the sum workflow, the FedAvg weight ``train.num_samples``).
NVFLARE_RESULT_META: tuple[str, ...] = ("NUM_STEPS_CURRENT_ROUND",)
#: The parts of a result, in the order the gate reports them.
PARTS = ("data", "meta", "metrics", "headers", "top_level")


def undeclared(names: Iterable[str], patterns: Sequence[str]) -> tuple[str, ...]:
    """The sorted names that match none of ``patterns`` (exact names or ``fnmatch`` patterns)."""
    return tuple(sorted({str(n) for n in names if not any(fnmatchcase(str(n), p) for p in patterns)}))


def _names(value: object, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence | frozenset | set):
        raise ValueError(f"egress release: {what} must be a list of names or patterns, got {value!r}")
    names = tuple(value)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise ValueError(f"egress release: {what} holds entries that are not non-empty strings: {bad}")
    return tuple(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True)
class Release:
    """What one task's result may carry: per part, exact names or ``fnmatch`` patterns (``"*"``: anything)."""

    task: str
    data_kinds: tuple[str, ...]
    data: tuple[str, ...]
    meta: tuple[str, ...]
    metrics: tuple[str, ...] = ()
    headers: tuple[str, ...] = TRANSPORT_HEADERS

    def __post_init__(self) -> None:
        if not isinstance(self.task, str) or not self.task:
            raise ValueError(f"egress release: task must be a task name, got {self.task!r}")
        for field in ("data_kinds", "data", "meta", "metrics", "headers"):
            object.__setattr__(self, field, _names(getattr(self, field), f"{self.task}: {field}"))
        if not self.data_kinds:
            raise ValueError(f"egress release: {self.task}: declares no DXO kind, so every result would be refused")

    def to_config(self) -> dict[str, Any]:
        """The gate's constructor arguments (lists of strings), as the job config holds them; the defaults (no
        metrics, NVFlare's transport headers) left out."""
        config = {
            f.name: v if isinstance(v := getattr(self, f.name), str) else list(v) for f in dataclasses.fields(self)
        }
        if self.headers == TRANSPORT_HEADERS:
            del config["headers"]
        if not self.metrics:
            del config["metrics"]
        return config

    def merged(self, other: Release) -> Release:
        """Everything either release declares, for the same task."""
        if other.task != self.task:
            raise ValueError(f"egress release: cannot merge task {other.task!r} into {self.task!r}")
        fields = ("data_kinds", "data", "meta", "metrics", "headers")
        return Release(self.task, **{f: (*getattr(self, f), *getattr(other, f)) for f in fields})


@dataclasses.dataclass(frozen=True)
class Carried:
    """What a result carries, by name: its DXO kind, data keys, meta keys, metric names, header names and any
    top-level shareable entry beside the headers and the DXO."""

    data_kind: str | None
    data: tuple[str, ...] = ()
    meta: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    headers: tuple[str, ...] = ()
    top_level: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        data_kind: str | None,
        data: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None,
        headers: Mapping[str, Any] | None = None,
        top_level: Iterable[str] = (),
    ) -> Carried:
        """From a DXO's parts: a ``METRICS`` DXO's data are metrics; ``initial_metrics`` in the meta are metrics."""
        data, meta = dict(data or {}), dict(meta or {})
        metrics = tuple(map(str, data)) if data_kind == METRICS_KIND else ()
        initial = meta.get(INITIAL_METRICS)
        if isinstance(initial, Mapping):
            metrics += tuple(map(str, initial))
        return cls(
            data_kind=data_kind,
            data=() if data_kind == METRICS_KIND else tuple(map(str, data)),
            meta=tuple(str(k) for k in meta if k != INITIAL_METRICS or not isinstance(initial, Mapping)),
            metrics=metrics,
            headers=tuple(map(str, headers or {})),
            top_level=tuple(map(str, top_level)),
        )


@dataclasses.dataclass(frozen=True)
class Verdict:
    """`judge`'s answer: the names to strip, per part, and why the result is refused (empty: it is not)."""

    strip: Mapping[str, tuple[str, ...]]
    refuse: str = ""

    @property
    def clean(self) -> bool:
        return not self.refuse and not any(self.strip.values())

    def describe(self, site: str, task: str) -> str:
        """One log line naming everything removed, or why nothing is sent."""
        if self.refuse:
            return f"{site}: egress gate refused the {task} result, nothing of it sent: {self.refuse}"
        removed = "; ".join(f"{part} {list(names)}" for part, names in self.strip.items() if names)
        return f"{site}: egress gate stripped from the {task} result what the job does not declare: {removed}"


def judge(carried: Carried, release: Release) -> Verdict:
    """What to strip from ``carried`` and whether to refuse it, against ``release`` (module docstring)."""
    if carried.data_kind is None and not (carried.data or carried.meta or carried.metrics):
        pass  # no DXO (an error reply): only headers and top-level entries to check
    elif carried.data_kind not in release.data_kinds:
        return Verdict({}, f"DXO kind {carried.data_kind!r} is not declared (declared: {list(release.data_kinds)})")
    data = undeclared(carried.data, release.data)
    if data:
        shown = list(data[:10]) + ([f"... {len(data) - 10} more"] if len(data) > 10 else [])
        return Verdict({"data": data}, f"undeclared data keys {shown}")
    strip = {
        "meta": undeclared(carried.meta, release.meta),
        "metrics": undeclared(carried.metrics, release.metrics),
        "headers": undeclared(carried.headers, release.headers),
        "top_level": tuple(sorted(set(carried.top_level))),
    }
    return Verdict({part: names for part, names in strip.items() if names})
