"""The attacker's recorder: a server-side task-result filter that writes down everything a site's result carries.

Not part of the bundle. `install` copies this file into an exported job's ``app/custom/`` and puts `EgressRecorder`
first in the server's ``task_result_filters``, so it sees each result exactly as it arrived from the site (after every
site-side filter, before the server's own code): the shareable's top-level keys, every header (the peer context's
property names too), the DXO's kind, data keys and meta keys (one level into dict-valued meta, e.g. NVFlare's
``initial_metrics``). One JSON line per result, appended to ``path``. `beyond_declared` compares the records with
what the job config declares (the egress gates' arguments). Used by tests/e2e/test_e2e_egress.py (simulator) and
tests/e2e/test_e2e_secure_aggregation.py (the loopback deployment).
"""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatchcase
from pathlib import Path
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


# ---- for the tests (not used by the server) -------------------------------------------------------------------------

GATE = "aggregators.contracts.egress_gate.EgressGate"
#: The header NVFlare's server adds to a result on receipt (after the site's gate).
SERVER_ADDED_HEADERS = ("fl_client",)


def install(job: Path, tasks: list[str], record: Path) -> None:
    """Make ``job``'s server the attacker: the recorder first among its result filters, for ``tasks``."""
    shutil.copy(Path(__file__), Path(job) / "app" / "custom" / Path(__file__).name)
    config_file = Path(job) / "app" / "config" / "config_fed_server.json"
    config = json.loads(config_file.read_text())
    recorder = {"path": "egress_recorder.EgressRecorder", "args": {"path": str(record)}}
    config["task_result_filters"] = [{"tasks": tasks, "filters": [recorder]}, *config.get("task_result_filters", [])]
    config_file.write_text(json.dumps(config, indent=2))


def read(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(record).read_text().splitlines()]


def declared_gates(job: Path) -> dict[str, dict[str, Any]]:
    """The gate's arguments per task, as the job config declares them; every result chain must end with the gate."""
    config = json.loads((Path(job) / "app" / "config" / "config_fed_client.json").read_text())
    gates = {}
    for chain in config["task_result_filters"]:
        last = chain["filters"][-1]
        if last["path"] != GATE:
            raise AssertionError(f"{job}: a result chain does not end with the egress gate: {chain}")
        gates.update({task: last["args"] for task in chain["tasks"]})
    return gates


def _undeclared(names: Any, patterns: Any) -> list[str]:
    return sorted(n for n in names if not any(fnmatchcase(n, p) for p in patterns))


def beyond_declared(records: list[dict[str, Any]], job: Path, transport_headers: Any) -> list[str]:
    """Everything the records hold that the job config does not declare, one line per result and part."""
    gates, problems = declared_gates(job), []
    for r in records:
        where, gate = f"{r['site']} {r['task']}", gates.get(r["task"])
        if gate is None:
            problems.append(f"{where}: no gate declares this task")
            continue
        if r.get("data_kind") not in gate["data_kinds"]:
            problems.append(f"{where}: kind {r.get('data_kind')}")
        is_metrics = r.get("data_kind") == "METRICS"  # its data are scores
        initial = r.get("meta", {}).get("initial_metrics", [])  # NVFlare's scores beside the weights
        parts = {
            "data": [] if is_metrics else _undeclared(r.get("data", []), gate["data"]),
            "meta": _undeclared(r.get("meta", {}), [*gate["meta"], "initial_metrics"]),
            "metrics": _undeclared([*initial, *(r.get("data", []) if is_metrics else [])], gate.get("metrics", [])),
            "headers": _undeclared(r["headers"], [*gate.get("headers", transport_headers), *SERVER_ADDED_HEADERS]),
        }
        problems += [f"{where}: undeclared {part} {names}" for part, names in parts.items() if names]
        problems += [f"{where}: top-level {r['top_level']}"] if r["top_level"] else []
    return problems
