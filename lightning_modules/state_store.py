"""Per-site, on-disk store for client algorithm state that must outlive a round.

Why disk and not memory: ``nvflare simulator JOB -n 3`` runs with one thread by default, and then every client-round
is a fresh process whose working directory is the site workspace. State held in memory (SCAFFOLD's c_i, FedDyn's
per-client state, MOON's previous local model) would silently reset to zero every round and the algorithm would
quietly degrade to something else. On real sites the same file lets a crashed client come back with its state.
So each algorithm writes its state here at round end and reads it at round start (docs/design.md decision 4).

A bad file is never used and never dropped silently: every problem raises `StateStoreError` naming the site,
the file and the problem. Algorithm state must be fp32 (or fp64) — bf16/fp16 would quantise the small per-round
differences these states accumulate — so `ClientStateStore.save` rejects other floating dtypes.

File layout (``<root>/<site>/<algorithm>.state``, format version `FORMAT_VERSION`)::

    MAGIC (8 bytes) | header length (uint32 BE) | header (UTF-8 JSON) | SHA-256 of the bytes so far (32) | payload

The header holds the format version, site name, algorithm, round number, payload size and the SHA-256 of the payload;
the payload is ``torch.save`` of the state mapping and is read back with ``torch.load(..., weights_only=True)``, so a
state file cannot execute code. Files are written atomically: temp file in the same directory, flush, fsync,
``os.replace``.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import re
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FORMAT_VERSION",
    "STATE_DIR_ENV",
    "ClientStateStore",
    "StateStoreError",
    "StoredState",
    "atomic_write_bytes",
    "default_state_root",
    "durable_rename",
]

FORMAT_VERSION = 1
STATE_DIR_ENV = "FLALGO_STATE_DIR"
MAGIC = b"FLALGOST"
_PREFIX = struct.Struct(">8sI")
_DIGEST_SIZE = hashlib.sha256().digest_size
_SUFFIX = ".state"
_PENDING_SUFFIX = ".pending"
# Names become path components, so keep them to a conservative, portable alphabet (no separators, no leading dot).
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_ALLOWED_FLOAT_DTYPES = (torch.float32, torch.float64)

ExpectedSpec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class StateStoreError(RuntimeError):
    """A client state file is missing pieces, corrupt, mismatched, or the state given to ``save`` is not storable."""


@dataclass(frozen=True)
class StoredState:
    """State read back from disk together with the metadata it was written with."""

    state: dict[str, Any]
    round_num: int
    site_name: str
    algorithm: str
    version: int
    path: Path


def default_state_root() -> Path:
    """Return ``$FLALGO_STATE_DIR`` if set, else ``./client_state`` under the current working directory.

    NVFlare runs the client script with the site workspace as working directory, so the default keeps each site's
    state inside its own workspace. The result is absolute so a later ``chdir`` cannot move it.
    """
    configured = os.environ.get(STATE_DIR_ENV)
    root = Path(configured).expanduser() if configured else Path("client_state")
    return root if root.is_absolute() else Path.cwd() / root


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(f"{kind} must match {_NAME_RE.pattern!r} (it becomes a file name), got {value!r}")
    return value


def is_writer() -> bool:
    """Whether this process writes state: all but global ranks 1.. of a site trained with DDP, where every rank
    computes the same state and rank 0 alone persists it."""
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or (
        torch.distributed.get_rank() == 0
    )


class ClientStateStore:
    """Reads and writes one site's algorithm state files under ``<root>/<site_name>/`` (on a DDP site, only global
    rank 0 writes; the other ranks read).

    With ``per_run``, the files of each federated run live under ``<root>/<run id>/<site_name>/`` once
    `use_run` names the run (the client-algorithm callback does so from the server's meta each round). The
    run id is the server's, kept when a stopped job is resumed (``resume_from``) although NVFlare gives the resumed
    job a new job id, so the sites find the state the checkpoint's global model and rule state belong to.
    """

    def __init__(self, root: str | os.PathLike[str], site_name: str, *, per_run: bool = False) -> None:
        self.base_root = Path(root)
        self.root = self.base_root
        self.per_run = per_run
        self.site_name = _check_name("site_name", site_name)

    def use_run(self, run_id: str | None) -> None:
        """Keep this run's files under ``<root>/<run_id>/`` (stores made with ``per_run`` only; no-op otherwise)."""
        if self.per_run and run_id:
            self.root = self.base_root / _check_name("run_id", str(run_id))

    def path(self, algorithm: str) -> Path:
        """Return the file that holds ``algorithm``'s state for this site (it may not exist)."""
        return self.root / self.site_name / f"{_check_name('algorithm', algorithm)}{_SUFFIX}"

    def pending_path(self, algorithm: str) -> Path:
        """The file of state written by a round the server has not confirmed yet (see `settle`)."""
        return self.path(algorithm).with_suffix(_PENDING_SUFFIX)

    def save(self, algorithm: str, state: Mapping[str, Any], *, round_num: int, pending: bool = False) -> Path:
        """Atomically replace ``algorithm``'s state file with ``state`` as of round ``round_num``; return its path.

        With ``pending``, the state goes to a pending file that `load` does not read until `settle`
        commits it. Values may be tensors, bool/int/float/str/None, and lists, tuples or str-keyed dicts of those.
        Tensors are stored detached, on CPU, contiguous and compact (a view does not drag its whole storage along).
        """
        target = self.pending_path(algorithm) if pending else self.path(algorithm)
        if isinstance(round_num, bool) or not isinstance(round_num, int) or round_num < 0:
            raise self._error(target, f"round_num must be a non-negative int, got {round_num!r}")
        if not isinstance(state, Mapping):
            raise self._error(target, f"state must be a mapping, got {type(state).__name__}")
        # Serialise fully before touching the disk so a failure here cannot leave a partial file behind.
        payload = _serialize(self._prepare_mapping(target, "", state))
        header = {
            "format_version": FORMAT_VERSION,
            "site_name": self.site_name,
            "algorithm": algorithm,
            "round_num": round_num,
            "payload_size": len(payload),
            "payload_sha256": hashlib.sha256(payload).hexdigest(),
        }
        if is_writer():
            remove_stale_temporaries(target)
            atomic_write_bytes(target, _encode_file(header, payload))
        return target

    def load(self, algorithm: str, *, expected: ExpectedSpec | None = None) -> StoredState | None:
        """Return the stored state for ``algorithm``, or ``None`` when this site has no file for it yet.

        With ``expected`` (key → (shape, dtype)), every listed key must be a tensor of that shape and dtype, and no
        other top-level tensor may be present (extra tensors mean the file belongs to a different model).
        Any problem raises `StateStoreError`.
        """
        return self._load_file(self.path(algorithm), algorithm, expected)

    def latest(self, algorithm: str, *, expected: ExpectedSpec | None = None) -> StoredState | None:
        """The state the site wrote last: the pending one if there is one, else the committed one (for inspection:
        tests, audits; a round starts from `load`)."""
        pending = self.pending_path(algorithm)
        return (
            self._load_file(pending, algorithm, expected)
            if pending.exists()
            else self.load(algorithm, expected=expected)
        )

    def _load_file(self, target: Path, algorithm: str, expected: ExpectedSpec | None) -> StoredState | None:
        try:
            raw = target.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._error(target, f"cannot read file ({exc.strerror or exc})") from exc
        header, payload = self._decode_file(target, raw)
        self._check_header(target, header, algorithm, len(payload))
        if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
            raise self._error(target, "payload checksum mismatch (file is corrupt)")
        state = self._deserialize(target, payload)
        if expected is not None:
            self._check_expected(target, state, expected)
        return StoredState(
            state=state,
            round_num=header["round_num"],
            site_name=header["site_name"],
            algorithm=header["algorithm"],
            version=header["format_version"],
            path=target,
        )

    def clear(self, algorithm: str) -> None:
        """Delete ``algorithm``'s state files (committed and pending) for this site; missing files are no error."""
        if not is_writer():
            return
        self.path(algorithm).unlink(missing_ok=True)
        self.pending_path(algorithm).unlink(missing_ok=True)

    def settle(self, algorithm: str, round_num: int, last_aggregated: Mapping[str, int] | None) -> str | None:
        """Commit or discard the pending state of ``algorithm`` at the start of round ``round_num``.

        The pending state was written in round ``p``. It is committed (it becomes the state `load` reads) when
        the server's ``last_aggregated`` names round ``p`` for this site, i.e. the site's result of round ``p`` is in
        the global model; it is discarded when the server aggregated without it (rejected, late, failed round), and
        when ``p >= round_num`` (the same round trained again: a replay starts from the committed state). Without
        ``last_aggregated`` (a server that sends no confirmations) it is committed. Returns ``"committed"``,
        ``"discarded"`` or ``None`` (nothing pending).
        """
        pending = self.pending_path(algorithm)
        if not pending.exists() or not is_writer():
            return None
        written = self._pending_round(pending, algorithm)
        confirmed = last_aggregated is None or last_aggregated.get(self.site_name) == written
        if written < round_num and confirmed:
            durable_rename(pending, self.path(algorithm))
            return "committed"
        pending.unlink()
        return "discarded"

    def settle_all(self, round_num: int, last_aggregated: Mapping[str, int] | None) -> dict[str, str | None]:
        """`settle` every pending state of this site (e.g. once a job has ended: its last confirmations)."""
        folder = self.root / self.site_name
        return {p.stem: self.settle(p.stem, round_num, last_aggregated) for p in sorted(folder.glob("*.pending"))}

    def _pending_round(self, pending: Path, algorithm: str) -> int:
        header, payload = self._decode_file(pending, pending.read_bytes())
        self._check_header(pending, header, algorithm, len(payload))
        return int(header["round_num"])

    def _error(self, target: Path, problem: str) -> StateStoreError:
        # One line, so that log scrapers and the NVFlare error summary show the whole message.
        return StateStoreError(f"client state of site {self.site_name!r} in {target}: {' '.join(problem.split())}")

    def _prepare_mapping(self, target: Path, prefix: str, mapping: Mapping[Any, Any]) -> dict[str, Any]:
        prepared: dict[str, Any] = {}
        for key, value in mapping.items():
            if not isinstance(key, str):
                raise self._error(target, f"state keys must be str, got {key!r} under {prefix!r}")
            prepared[key] = self._prepare_value(target, f"{prefix}.{key}" if prefix else key, value)
        return prepared

    def _prepare_value(self, target: Path, key: str, value: Any) -> Any:
        """Validate one state value and return the form that is written (tensors: detached, CPU, compact copy)."""
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and value.dtype not in _ALLOWED_FLOAT_DTYPES:
                raise self._error(
                    target, f"key {key!r} has dtype {value.dtype}; algorithm state must be float32 or float64"
                )
            # clone: a view would otherwise serialise its whole underlying storage.
            return value.detach().to("cpu").clone(memory_format=torch.contiguous_format)
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (list, tuple)):
            items = [self._prepare_value(target, f"{key}[{i}]", item) for i, item in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return self._prepare_mapping(target, key, value)
        raise self._error(target, f"key {key!r} has unsupported type {type(value).__name__}")

    def _decode_file(self, target: Path, raw: bytes) -> tuple[dict[str, Any], bytes]:
        if len(raw) < _PREFIX.size:
            raise self._error(target, f"truncated file ({len(raw)} bytes, no complete header)")
        magic, header_len = _PREFIX.unpack_from(raw)
        if magic != MAGIC:
            raise self._error(target, "not a client state file (bad magic bytes)")
        header_end = _PREFIX.size + header_len
        if len(raw) < header_end + _DIGEST_SIZE:
            raise self._error(target, f"truncated file ({len(raw)} bytes, header incomplete)")
        header_bytes = raw[_PREFIX.size : header_end]
        if hashlib.sha256(raw[:header_end]).digest() != raw[header_end : header_end + _DIGEST_SIZE]:
            raise self._error(target, "header checksum mismatch (file is corrupt)")
        try:
            header = json.loads(header_bytes.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._error(target, f"corrupt header ({exc})") from exc
        if not isinstance(header, dict):
            raise self._error(target, "corrupt header (not a JSON object)")
        return header, raw[header_end + _DIGEST_SIZE :]

    def _check_header(self, target: Path, header: dict[str, Any], algorithm: str, payload_len: int) -> None:
        version = header.get("format_version")
        if version != FORMAT_VERSION:
            raise self._error(target, f"unsupported format version {version!r} (this code reads {FORMAT_VERSION})")
        if header.get("site_name") != self.site_name:
            raise self._error(target, f"file belongs to site {header.get('site_name')!r}")
        if header.get("algorithm") != algorithm:
            raise self._error(target, f"file holds algorithm {header.get('algorithm')!r}, expected {algorithm!r}")
        for key, kind in (("round_num", int), ("payload_size", int), ("payload_sha256", str)):
            if not isinstance(header.get(key), kind) or isinstance(header.get(key), bool):
                raise self._error(target, f"corrupt header (field {key!r} missing or mistyped)")
        if payload_len < header["payload_size"]:
            raise self._error(target, f"truncated file (payload {payload_len} of {header['payload_size']} bytes)")
        if payload_len > header["payload_size"]:
            raise self._error(target, f"corrupt file ({payload_len - header['payload_size']} extra bytes)")

    def _deserialize(self, target: Path, payload: bytes) -> dict[str, Any]:
        try:
            state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch raises several unrelated types for undecodable data
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise self._error(target, f"payload cannot be decoded ({first_line})") from exc
        if not isinstance(state, dict):
            raise self._error(target, f"payload is a {type(state).__name__}, not a dict")
        return state

    def _check_expected(self, target: Path, state: Mapping[str, Any], expected: ExpectedSpec) -> None:
        for key, (shape, dtype) in expected.items():
            if key not in state:
                raise self._error(target, f"missing key {key!r}")
            value = state[key]
            if not isinstance(value, torch.Tensor):
                raise self._error(target, f"key {key!r} is a {type(value).__name__}, not a tensor")
            if tuple(value.shape) != tuple(shape):
                raise self._error(
                    target, f"shape mismatch for key {key!r}: file {tuple(value.shape)}, expected {tuple(shape)}"
                )
            if value.dtype != dtype:
                raise self._error(target, f"dtype mismatch for key {key!r}: file {value.dtype}, expected {dtype}")
        extra = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and k not in expected)
        if extra:
            raise self._error(target, f"unexpected tensor keys {extra}")


def _serialize(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def _encode_file(header: dict[str, Any], payload: bytes) -> bytes:
    header_bytes = json.dumps(header, sort_keys=True).encode("utf-8")
    head = _PREFIX.pack(MAGIC, len(header_bytes)) + header_bytes
    return head + hashlib.sha256(head).digest() + payload


def remove_stale_temporaries(target: Path) -> list[Path]:
    """Remove the temporary files an earlier write of ``target`` left when its process was killed between creating
    and renaming them (`atomic_write_bytes`); return them. Readers never read these files, so they are only
    litter; a site's store has one writer, so no live write of ``target`` is racing this one."""
    stale = sorted(target.parent.glob(f".{glob.escape(target.name)}.*.tmp")) if target.parent.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` so that readers see either the old file or the complete new one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def durable_rename(source: Path, target: Path) -> None:
    """Rename ``source`` to ``target`` in one step and make the rename survive a power loss (the pending state's
    commit here, the server's pending rule state in controllers/checkpoint.py)."""
    os.replace(source, target)
    _fsync_dir(Path(target).parent)


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable across power loss; directories cannot be opened this way on Windows.
    if os.name != "posix":
        return
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
