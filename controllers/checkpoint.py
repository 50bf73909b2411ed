"""Server-side files: the rule's state checkpoint, the resume point it makes, and the per-round metrics log.

The rule state is written next to the global model after every round (docs/design.md, decision 5), atomically, with
``torch.save`` of plain tensors so it loads with ``weights_only=True``. It records the round, the run id and the
SHA-256 of the global model it belongs to, so `load_resume_point` can restart a stopped job from a previous
run's server app folder (``server_state.pt`` + the persistor's ``FL_global_model.pt``) and refuse a model and a
state that do not belong together.

A server that dies between the two writes must still leave a pair that belongs together (a machine that loses
power does not choose its moment). So a round's state is written first beside the final name
(``server_state.pt.pending``, `pending_state_path`), then the persistor saves the model, then the pending state
takes the final name (`commit_rule_state`, one rename). Killed before the model is saved, the folder holds the
previous round's model and state (the pending file names another model and is ignored); killed after it, the new
model and the pending state that names it, which `load_resume_point` takes. A pending state is used only when its
digest is the model's, so it never pairs a model with a state that was not saved with it.

Rounds that did not aggregate. The round engine (``controllers/engine.py``) writes the checkpoint after *every*
round, also after one that failed (too few valid results, a rule error, a non-finite aggregate); the model and state
are then the unchanged ones. ``round`` is the last round *attempted*, ``last_aggregated_round`` the last one whose
aggregate was used (``None``: none yet). A resumed job continues at ``round + 1``: a failed round is not re-run,
because the uninterrupted job would not have re-run it either (it moved on with the model unchanged), and resuming
must give what the uninterrupted job gives. Files written before this field existed have it absent; their
``round`` was always an aggregated round.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aggregators.types import ClientUpdate
from lightning_modules.state_store import atomic_write_bytes, durable_rename

STATE_FORMAT_VERSION = 1
THIS_ROUND = object()  # save_rule_state's default: the saved round is also the last aggregated one


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


def params_digest(params: Mapping[str, np.ndarray]) -> str:
    """SHA-256 over keys, dtypes, shapes and bytes: equal digests mean bit-identical models across runs."""
    digest = hashlib.sha256()
    for key in sorted(params):
        array = np.ascontiguousarray(params[key])
        digest.update(f"{key}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def pending_state_path(path: Path) -> Path:
    """Where a round's state waits until the model it belongs to is saved (module docstring)."""
    path = Path(path)
    return path.with_name(path.name + ".pending")


def commit_rule_state(path: Path) -> None:
    """Give the pending state (`pending_state_path`) the final name ``path``, durably: after this one rename the
    state and the model it names are the folder's resume point."""
    durable_rename(pending_state_path(path), Path(path))


def save_rule_state(
    path: Path,
    rule_name: str,
    round_num: int,
    state: Mapping[str, Any],
    run_id: str | None = None,
    global_sha256: str | None = None,
    last_aggregated_round: int | object | None = THIS_ROUND,
    last_aggregated_sites: Mapping[str, int] | None = None,
    population: Sequence[str] | None = None,
    released_steps: Mapping[str, int] | None = None,
    stopping: Mapping[str, Any] | None = None,
    best_global: Mapping[str, Any] | None = None,
) -> None:
    """Write the rule state after ``round_num`` (0-based, the last round attempted); ``global_sha256`` ties it to
    the model of that round; ``last_aggregated_round`` is the last round whose aggregate was used (``None``: none
    yet; by default ``round_num`` itself, i.e. this round aggregated); ``population`` the job's sites;
    ``released_steps`` the DP-SGD steps each site's last result reported (public: the sites' ``privacy.steps``);
    ``stopping`` the stopping rule's history after this round (``controllers.stopping.Plateau.state``);
    ``best_global`` the best-model selection's (``controllers.model_selection.BestGlobal.state``)."""
    payload = {
        "format_version": STATE_FORMAT_VERSION,
        "rule": rule_name,
        "round": round_num,
        "state": _to_saveable(state),
    }
    if run_id is not None:
        payload["run_id"] = run_id
    if global_sha256 is not None:
        payload["global_sha256"] = global_sha256
    payload["last_aggregated_round"] = round_num if last_aggregated_round is THIS_ROUND else last_aggregated_round
    if last_aggregated_sites is not None:  # the sites' confirmations (transactional client state) survive a resume
        payload["last_aggregated_sites"] = dict(last_aggregated_sites)
    if population is not None:  # a resumed job keeps every site in it, also one that is down when it resumes
        payload["population"] = sorted(population)
    if released_steps:  # a resumed job still stops a DP site on a stale ledger (lightning_modules/privacy/ledger.py)
        payload["released_steps"] = dict(released_steps)
    if stopping is not None:  # a resumed job stops after the round the uninterrupted one stops after
        payload["stopping"] = _to_saveable(stopping)
    if best_global is not None:  # a resumed job replaces the best model only with a better one
        payload["best_global"] = _to_saveable(best_global)
    atomic_torch_save(payload, path)


def load_rule_state(path: Path, rule_name: str) -> tuple[int, dict[str, Any]]:
    """The last completed round and the rule state; refuses a file written by another rule or format."""
    payload = _read_state_payload(path, rule_name)
    return int(payload["round"]), _to_numpy(payload["state"])


def _pending_payload(state_path: Path, rule_name: str, digest: str) -> dict[str, Any] | None:
    """The pending state beside ``state_path`` when it was saved with the model whose digest is ``digest``."""
    pending = pending_state_path(state_path)
    if not pending.is_file():
        return None
    payload = _read_state_payload(pending, rule_name)
    return payload if payload.get("global_sha256") == digest else None


def _read_state_payload(path: Path, rule_name: str) -> dict[str, Any]:
    payload = torch.load(path, weights_only=True)
    if payload.get("format_version") != STATE_FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported server state format {payload.get('format_version')!r}")
    if payload.get("rule") != rule_name:
        raise ValueError(f"{path}: written by rule '{payload.get('rule')}', this job uses '{rule_name}'")
    return payload


@dataclass(frozen=True)
class ResumePoint:
    """Where a stopped job continues: the next round to run (after the last one attempted, aggregated or not), the
    global model and rule state after that round, and the last round whose aggregate was used (``None``: none)."""

    next_round: int
    global_params: dict[str, np.ndarray]
    state: dict[str, Any]
    run_id: str | None
    last_aggregated_round: int | None = None
    last_aggregated_sites: dict[str, int] | None = None  # None: a checkpoint written without them
    population: tuple[str, ...] | None = None  # None: a checkpoint written without it
    released_steps: dict[str, int] | None = None  # None: a checkpoint written without it (no DP site reported)
    stopping: dict[str, Any] | None = None  # None: written without --stop-patience or by an older version
    best_global: dict[str, Any] | None = None  # None: written by an older version or with local keys


GLOBAL_MODEL_FILE = "FL_global_model.pt"  # the name NVFlare's PTFileModelPersistor writes into the app folder


def load_global_model(path: Path) -> dict[str, np.ndarray]:
    """The persistor's global model file as numpy arrays (``{"model": state_dict, ...}`` or a bare state_dict)."""
    payload = torch.load(path, weights_only=True, map_location="cpu")
    model = payload.get("model", payload) if isinstance(payload, Mapping) else None
    if not isinstance(model, Mapping) or not all(isinstance(v, torch.Tensor) for v in model.values()):
        raise ValueError(f"{path}: not a model checkpoint (expected a state_dict of tensors under 'model')")
    return {key: value.numpy() for key, value in model.items()}


def load_resume_point(folder: Path, rule_name: str, state_file: str = "server_state.pt") -> ResumePoint:
    """Read ``folder/server_state.pt`` and ``folder/FL_global_model.pt`` written by a previous run of the job; the
    job continues after the last round attempted (module docstring: rounds that did not aggregate).

    Refuses a state from another rule or format, and a model whose digest differs from the one recorded with the
    state and from a pending state's (module docstring: the files come from different runs).
    """
    folder = Path(folder)
    state_path, model_path = folder / state_file, folder / GLOBAL_MODEL_FILE
    for path in (state_path, model_path):
        if not path.is_file():
            raise FileNotFoundError(f"cannot resume: {path} does not exist")
    payload = _read_state_payload(state_path, rule_name)
    global_params = load_global_model(model_path)
    digest = params_digest(global_params)
    recorded = payload.get("global_sha256")
    if recorded is None:
        raise ValueError(f"cannot resume: {state_path} records no global model digest (written by an older version)")
    if recorded != digest:
        payload = _pending_payload(state_path, rule_name, digest)  # killed after the model, before the rename
    if payload is None:
        raise ValueError(
            f"cannot resume: {model_path} is not the model that {state_path} was saved with; "
            "the files come from different runs or the model was changed after the run"
        )
    last_round, state = int(payload["round"]), _to_numpy(payload["state"])
    aggregated = payload.get("last_aggregated_round", last_round)  # older files: every saved round had aggregated
    return ResumePoint(
        next_round=last_round + 1,
        global_params=global_params,
        state=state,
        run_id=payload.get("run_id"),
        last_aggregated_round=None if aggregated is None else int(aggregated),
        last_aggregated_sites=payload.get("last_aggregated_sites"),
        population=tuple(payload["population"]) if "population" in payload else None,
        released_steps=payload.get("released_steps"),
        stopping=payload.get("stopping"),
        best_global=payload.get("best_global"),
    )


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
    """What `save_updates` wrote for one round, read back."""

    global_params: dict[str, np.ndarray]
    site_params: dict[str, dict[str, np.ndarray]]
    site_samples: dict[str, int]


def load_updates(path: Path) -> RoundCapture:
    """Read a round's ``.npz`` written by `save_updates`."""
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
