"""The attacker's recorder: a server-side task-result filter that writes down everything a site's result carries.

Not part of the bundle. `tests/e2e/test_e2e_egress.py` copies this file into an exported job's ``app/custom/`` and
puts `EgressRecorder` first in the server's ``task_result_filters``, so it sees each result exactly as it arrived
from the site (after every site-side filter, before the server's own code): the shareable's top-level keys, every
header (the peer context's property names too), the DXO's kind, data keys and meta keys (one level into dict-valued
meta, e.g. NVFlare's ``initial_metrics``). One JSON line per result, appended to ``path``.
"""

from __future__ import annotations

import json
from typing import Any

from nvflare.apis.filter import Filter
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable

DXO_KEY = "DXO"


def _names(value: Any) -> Any:
    """A dict's keys (and one level of nested dict keys); otherwise the value's type name."""
    if isinstance(value, dict):
        return {str(k): sorted(map(str, v)) if isinstance(v, dict) else type(v).__name__ for k, v in value.items()}
    return type(value).__name__


def describe(shareable: Shareable, task: str, site: str) -> dict[str, Any]:
    headers = dict(shareable.get(ReservedHeaderKey.HEADERS) or {})
    peer = headers.get(ReservedHeaderKey.PEER_CTX)
    record: dict[str, Any] = {
        "task": task,
        "site": site,
        "top_level": sorted(str(k) for k in shareable if k not in (ReservedHeaderKey.HEADERS, DXO_KEY)),
        "headers": sorted(str(k) for k in headers),
        "header_values": {str(k): repr(v)[:200] for k, v in headers.items() if k != ReservedHeaderKey.PEER_CTX},
        "peer_props": sorted(map(str, peer.get_all_public_props())) if hasattr(peer, "get_all_public_props") else [],
    }
    dxo = shareable.get(DXO_KEY)
    if isinstance(dxo, dict):
        record["data_kind"] = dxo.get("kind")
        record["data"] = sorted(map(str, dxo.get("data") or {}))
        record["meta"] = _names(dxo.get("meta") or {})
    return record


class EgressRecorder(Filter):
    """Record every result the server receives (module docstring); the result passes unchanged."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def process(self, shareable: Shareable, fl_ctx: FLContext) -> Shareable:
        headers = dict(shareable.get(ReservedHeaderKey.HEADERS) or {})
        task = str(headers.get(ReservedHeaderKey.TASK_NAME, "?"))
        peer = fl_ctx.get_peer_context()
        site = peer.get_identity_name() if peer is not None else "?"
        with open(self.path, "a") as out:
            out.write(json.dumps(describe(shareable, task, site), sort_keys=True) + "\n")
        return shareable
