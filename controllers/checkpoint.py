"""Server-side files: the rule's state checkpoint and the per-round metrics log.

The rule state is written next to the global model after every round (DESIGN.md, decision 5), atomically, with
``torch.save`` of plain tensors so it loads with ``weights_only=True``.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aggregators import ClientUpdate
from lightning_modules.state_store import atomic_write_bytes

STATE_FORMAT_VERSION = 1


def _to_saveable(value: Any) -> Any:
    if isinstance(value, np.ndarray | np.generic):
        return torch.from_numpy(np.array(value, copy=True))
    if isinstance(value, Mapping):
        return {str(k): _to_saveable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_saveable(v) for v in value]
    return value


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.numpy()
    if isinstance(value, Mapping):
        return {k: _to_numpy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_numpy(v) for v in value]
    return value


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` through a temp file and ``os.replace``, so a crash never leaves half a file."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write_bytes(Path(path), buffer.getvalue())


def save_rule_state(path: Path, rule_name: str, round_num: int, state: Mapping[str, Any]) -> None:
    payload = {
        "format_version": STATE_FORMAT_VERSION,
        "rule": rule_name,
        "round": round_num,
        "state": _to_saveable(state),
    }
    atomic_torch_save(payload, path)


def load_rule_state(path: Path, rule_name: str) -> tuple[int, dict[str, Any]]:
    """The last completed round and the rule state; refuses a file written by another rule or format."""
    payload = torch.load(path, weights_only=True)
    if payload.get("format_version") != STATE_FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported server state format {payload.get('format_version')!r}")
    if payload.get("rule") != rule_name:
        raise ValueError(f"{path}: written by rule '{payload.get('rule')}', this job uses '{rule_name}'")
    return int(payload["round"]), _to_numpy(payload["state"])


def save_updates(path: Path, updates: Sequence[ClientUpdate], global_params: Mapping[str, np.ndarray]) -> None:
    """All accepted client models of a round and the global model they produced, in one ``.npz``.

    Arrays are named ``<site>/<key>`` (``<site>/__num_samples__`` holds the site's sample count) and
    ``__global__/<key>`` for the aggregated model.
    """
    arrays: dict[str, np.ndarray] = {f"__global__/{key}": np.asarray(value) for key, value in global_params.items()}
    for update in updates:
        arrays.update({f"{update.site}/{key}": np.asarray(value) for key, value in update.params.items()})
        arrays[f"{update.site}/__num_samples__"] = np.asarray(update.num_samples)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


@dataclass(frozen=True)
class RoundCapture:
    """What :func:`save_updates` wrote for one round, read back."""

    global_params: dict[str, np.ndarray]
    site_params: dict[str, dict[str, np.ndarray]]
    site_samples: dict[str, int]


def load_updates(path: Path) -> RoundCapture:
    """Read a round's ``.npz`` written by :func:`save_updates`."""
    with np.load(path) as data:
        arrays = {name: data[name] for name in data.files}
    capture = RoundCapture(global_params={}, site_params={}, site_samples={})
    for name, value in arrays.items():
        owner, key = name.split("/", 1)
        if owner == "__global__":
            capture.global_params[key] = value
        elif key == "__num_samples__":
            capture.site_samples[owner] = int(value)
        else:
            capture.site_params.setdefault(owner, {})[key] = value
    return capture


def _json_safe(value: Any) -> Any:
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def append_metrics(path: Path, record: Mapping[str, Any]) -> None:
    """Append one JSON line (NaN/Inf become null so every line stays valid JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(_json_safe(record), sort_keys=True) + "\n")
