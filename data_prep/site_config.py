"""Where a site's training data comes from: the site's own configuration on real sites, derived shards in simulation.

A job never names a data path (docs/design.md decision 9): the same exported job runs in the simulator and on
provisioned
sites. The client script asks `resolve_site_data` and gets one of two answers, in this order:

1. ``$FEDALG_SITE_DATA`` (set in the site's environment, e.g. in its ``startup/start.sh`` shell): a site data file
   (``.npz``) or a site data config (``.json``);
2. ``<site workspace>/local/fedalg_site_data.json``, the site's local config file (``local/`` is the folder of a
   provisioned startup kit that the site owns and NVFlare never overwrites);
3. only in the NVFlare simulator (its site workspace has no ``startup/fed_client.json``): the shard derived from the
   job's data settings and the site name, as before.

A provisioned or POC site with none of these stops with `SiteDataError` naming the site, the env var and the
file it looked for. It never silently falls back to a derived shard, which would train on data the site does not own.

Config file (JSON)::

    {"train": "/data/site-1/train.npz"}      # relative paths are relative to the config file
    {"derive": true}                         # opt in to the job's derived shard (demos on one machine)

A site data file is an ``.npz`` with ``x`` (float32 features in [0, 1], ``(N, 1, 28, 28)`` for the image datasets)
and ``y`` (integer labels in ``[0, num_classes)``); ``python -m data_prep.site_config`` writes one from a derived
shard for demos and tests.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.sites import SiteDataConfig, site_index, site_split

__all__ = [
    "LOCAL_CONFIG",
    "SITE_DATA_ENV",
    "SiteData",
    "SiteDataError",
    "is_simulated_site",
    "load_site_file",
    "resolve_site_data",
    "seed_index",
    "site_workspace",
]

SITE_DATA_ENV = "FEDALG_SITE_DATA"
LOCAL_CONFIG = Path("local") / "fedalg_site_data.json"
_PROVISIONED_MARKER = Path("startup") / "fed_client.json"


class SiteDataError(DataPrepError):
    """A site has no usable data configuration (or a broken one); the message says what to set where."""


@dataclass(frozen=True)
class SiteData:
    """A site's training arrays and where they came from (printed by the client script)."""

    x: np.ndarray
    y: np.ndarray
    source: str


def site_workspace(start: Path | None = None) -> Path:
    """The site workspace that holds ``startup/`` and ``local/``: the first such folder from ``start`` (default: the
    working directory, where NVFlare runs the client script) upwards; ``start`` itself if there is none."""
    start = Path.cwd() if start is None else Path(start)
    for folder in (start, *start.parents):
        if (folder / "startup").is_dir():
            return folder
    return start


def seed_index(site: str, num_sites: int) -> int:
    """The site's number for seeding its shuffling: ``i - 1`` for ``site-i``, a stable hash for other site names
    (provisioned sites may be called anything)."""
    try:
        return site_index(site, num_sites)
    except DataPrepError:
        return zlib.crc32(site.encode()) % (2**31)


def is_simulated_site(workspace: Path) -> bool:
    """The NVFlare simulator creates an empty ``startup/``; provisioned and POC kits hold ``fed_client.json``."""
    return not (Path(workspace) / _PROVISIONED_MARKER).is_file()


def resolve_site_data(
    site: str,
    workspace: Path,
    simulation: SiteDataConfig,
    num_classes: int,
    environ: Mapping[str, str] | None = None,
) -> SiteData:
    """Return the site's training data following the order in the module docstring."""
    environ = os.environ if environ is None else environ
    configured = environ.get(SITE_DATA_ENV, "").strip()
    if configured:
        return _from_path(site, Path(configured).expanduser(), f"${SITE_DATA_ENV}", simulation, num_classes)
    local = Path(workspace) / LOCAL_CONFIG
    if local.is_file():
        return _from_path(site, local, str(local), simulation, num_classes)
    if is_simulated_site(workspace):
        x, y = site_split(simulation, site)
        return SiteData(x, y, "simulation: shard derived from the job's data settings")
    raise SiteDataError(
        f"{site}: no site-local training data configured. A provisioned site reads its own data, never the job's: "
        f"set {SITE_DATA_ENV}=/path/to/train.npz (or a .json config) in the site's environment, or write "
        f'{local} containing {{"train": "/path/to/train.npz"}} (see docs/deployment.md)'
    )


def _from_path(site: str, path: Path, origin: str, simulation: SiteDataConfig, num_classes: int) -> SiteData:
    if not path.is_file():
        raise SiteDataError(f"{site}: {origin} points to {path}, which does not exist")
    if path.suffix == ".npz":
        x, y = load_site_file(path, num_classes, site)
        return SiteData(x, y, f"{path} (from {origin})")
    if path.suffix != ".json":
        raise SiteDataError(f"{site}: {origin} points to {path}; expected a .npz data file or a .json config")
    config = _read_config(site, path)
    if config.get("derive") is True:
        x, y = site_split(simulation, site)
        return SiteData(x, y, f"shard derived from the job's data settings (opted in by {path})")
    train = config.get("train")
    if not isinstance(train, str) or not train:
        raise SiteDataError(
            f'{site}: {path} must contain {{"train": "<file>.npz"}} or {{"derive": true}}, got {sorted(config)}'
        )
    train_path = Path(train).expanduser()
    train_path = train_path if train_path.is_absolute() else path.parent / train_path
    if not train_path.is_file():
        raise SiteDataError(f"{site}: {path} names training data {train_path}, which does not exist")
    x, y = load_site_file(train_path, num_classes, site)
    return SiteData(x, y, f"{train_path} (from {path})")


def _read_config(site: str, path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SiteDataError(f"{site}: cannot read site data config {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise SiteDataError(f"{site}: site data config {path} must be a JSON object")
    return config


def load_site_file(path: Path, num_classes: int, site: str = "site") -> tuple[np.ndarray, np.ndarray]:
    """Read and check a site data file: float features, integer labels in range, matching lengths, not empty."""
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [key for key in ("x", "y") if key not in data.files]
            if missing:
                raise SiteDataError(f"{site}: {path} lacks array(s) {missing}; it holds {sorted(data.files)}")
            x, y = data["x"], data["y"]
    except (OSError, ValueError) as exc:
        if isinstance(exc, SiteDataError):
            raise
        raise SiteDataError(f"{site}: cannot read site data file {path}: {exc}") from exc
    if len(x) == 0 or len(x) != len(y):
        raise SiteDataError(f"{site}: {path} has {len(x)} samples and {len(y)} labels; need the same, at least one")
    if not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= num_classes:
        raise SiteDataError(f"{site}: {path} labels must be integers in [0, {num_classes}), got {y.dtype}")
    if not np.issubdtype(x.dtype, np.floating) or not np.isfinite(x).all():
        raise SiteDataError(f"{site}: {path} features must be finite floats (scaled to [0, 1]), got {x.dtype}")
    return x.astype(np.float32, copy=False), y.astype(np.int64, copy=False)


def write_site_file(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    """Write ``x``/``y`` in the site data file format (creates parent folders)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, x=np.asarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.int64))
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.site_config",
        description="Write a site data file (.npz) from a derived shard, for demos and tests of real-site runs.",
    )
    parser.add_argument("--site", required=True, help="site name, site-1 .. site-N")
    parser.add_argument("--output", type=Path, required=True, help="the .npz file to write")
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--scheme", default="dirichlet")
    parser.add_argument("--num-sites", type=int, default=3)
    parser.add_argument("--alpha", type=float, default=0.5)
    parser.add_argument("--classes-per-site", type=int, default=2)
    parser.add_argument("--max-train-samples", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-dir", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    x, y = site_split(SiteDataConfig.from_namespace(args), args.site)
    print(f"wrote {write_site_file(args.output, x, y)}: {len(y)} samples")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
