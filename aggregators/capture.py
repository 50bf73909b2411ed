"""Capture of attack-adaptive training data: one file per round of projections, labels and sample counts.

Layout under the rule's ``dataset_capture_dir`` (nothing is written when it is unset)::

    <dataset_capture_dir>/<YYYYmmdd-HHMMSS>-<6 hex>/metadata.json
                                                   /round_00000.pt
                                                   /round_00001.pt ...

``round_XXXXX.pt`` (``torch.save`` of tensors, strings and ints only, so it loads with ``weights_only=True``):

* ``projections`` float32 (n, C): each client's stacked per-layer projections (aggregators/attention.py), the
  exact attention input of that round;
* ``malicious`` bool (n): True for a site that reported an applied attack that round (meta ``attack.applied``);
* ``num_samples`` int64 (n), ``sites`` list of n site names, ``round`` int.

``metadata.json`` records what a checkpoint trained on the capture must match: input width C, pca_components, the
layer keys and shapes, plus the rule's other settings and the software versions.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

CAPTURE_FORMAT = "attack_adaptive.capture/1"
METADATA_FILE = "metadata.json"
ROUND_GLOB = "round_*.pt"


class CaptureError(ValueError):
    """A capture folder or round file is missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class CapturedRound:
    """One captured round, as read back."""

    round_num: int
    projections: np.ndarray  # (n, C) float32
    malicious: np.ndarray  # (n,) bool
    num_samples: np.ndarray  # (n,) int64
    sites: tuple[str, ...]


def new_run_dir(root: str | Path) -> Path:
    """A fresh timestamped run folder name under ``root`` (not created: the first round creates it)."""
    return Path(root) / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def write_round(run_dir: str | Path, record: CapturedRound, metadata: Mapping[str, Any]) -> Path:
    """Write ``round_XXXXX.pt`` (and ``metadata.json`` on the first call) into ``run_dir``; returns the round file."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    meta_path = run_dir / METADATA_FILE
    if not meta_path.exists():
        meta_path.write_text(json.dumps({"format": CAPTURE_FORMAT, **metadata}, indent=2, sort_keys=True) + "\n")
    n = len(record.sites)
    if record.projections.shape[0] != n or record.malicious.shape != (n,) or record.num_samples.shape != (n,):
        raise CaptureError(f"round {record.round_num}: projections, labels, counts and sites disagree on n={n}")
    payload = {
        "round": int(record.round_num),
        "projections": torch.from_numpy(np.asarray(record.projections, np.float32).copy()),
        "malicious": torch.from_numpy(np.asarray(record.malicious, bool).copy()),
        "num_samples": torch.from_numpy(np.asarray(record.num_samples, np.int64).copy()),
        "sites": list(record.sites),
    }
    path = run_dir / f"round_{record.round_num:05d}.pt"
    torch.save(payload, path)
    return path


def read_round(path: str | Path) -> CapturedRound:
    """Load one round file safely and check its fields."""
    try:
        payload = torch.load(Path(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CaptureError(f"capture file {path} cannot be loaded: {exc}") from None
    missing = [k for k in ("round", "projections", "malicious", "num_samples", "sites") if k not in payload]
    if missing:
        raise CaptureError(f"capture file {path} lacks {missing}")
    record = CapturedRound(
        round_num=int(payload["round"]),
        projections=payload["projections"].numpy(),
        malicious=payload["malicious"].numpy().astype(bool),
        num_samples=payload["num_samples"].numpy(),
        sites=tuple(payload["sites"]),
    )
    if record.projections.ndim != 2 or record.projections.shape[0] != len(record.sites):
        raise CaptureError(f"capture file {path}: projections of shape {record.projections.shape} for {record.sites}")
    return record


def read_metadata(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / METADATA_FILE
    if not path.is_file():
        raise CaptureError(f"capture run {run_dir} has no {METADATA_FILE}")
    metadata = json.loads(path.read_text())
    if metadata.get("format") != CAPTURE_FORMAT:
        raise CaptureError(f"{path}: format {metadata.get('format')!r}, expected {CAPTURE_FORMAT}")
    return metadata


def read_capture(dataset_dir: str | Path) -> tuple[dict[str, Any], list[CapturedRound]]:
    """Every round under ``dataset_dir`` (one run folder or a folder of runs) and their shared metadata.

    All runs must agree on the attention input (width C, pca_components, layer shapes); otherwise a network could
    not be trained on them together.
    """
    dataset_dir = Path(dataset_dir)
    run_dirs = sorted({p.parent for p in dataset_dir.rglob(METADATA_FILE)})
    if not run_dirs:
        raise CaptureError(f"no capture run (a folder with {METADATA_FILE}) under {dataset_dir}")
    shared: dict[str, Any] | None = None
    rounds: list[CapturedRound] = []
    for run_dir in run_dirs:
        metadata = read_metadata(run_dir)
        signature = {k: metadata.get(k) for k in ("input_width", "pca_components", "layer_shapes")}
        if shared is None:
            shared = {**metadata, "runs": []}
        elif signature != {k: shared.get(k) for k in signature}:
            raise CaptureError(f"capture run {run_dir} was recorded for another model than {run_dirs[0]}")
        shared["runs"].append(str(run_dir))
        rounds += [read_round(path) for path in sorted(run_dir.glob(ROUND_GLOB))]
    assert shared is not None
    widths = {r.projections.shape[1] for r in rounds}
    if widths - {shared.get("input_width")}:
        raise CaptureError(f"round files have widths {sorted(widths)}, metadata says {shared.get('input_width')}")
    return shared, rounds


def capture_labels(updates_meta: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    """The malicious label vector: True where a client's meta says it applied an attack this round."""
    return np.array([bool(meta.get(key, False)) for meta in updates_meta], dtype=bool)
