"""Per-site data for simulated federations (docs/design.md decision 9).

A site named ``site-i`` (NVFlare's simulator naming, ``i`` from 1 to ``num_sites``) derives its own training shard from
a `SiteDataConfig` alone: load the dataset, optionally take a seeded subset, partition the labels with the
configured scheme, and keep part ``i - 1``. Every site computes the same partition, so the shards are disjoint
without any coordination. The server evaluates on the full published test set (`test_split`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from data_prep.datasets import canonical_dataset_name, load_dataset
from data_prep.errors import DataPrepError
from data_prep.partition import LABEL_COUNT_SCHEMES, SCHEMES, partition

if TYPE_CHECKING:
    from torch.utils.data import TensorDataset

__all__ = [
    "SiteDataConfig",
    "describe",
    "partition_sites",
    "site_index",
    "site_split",
    "test_split",
    "to_tensor_dataset",
]

_SITE_NAME = re.compile(r"site-([1-9][0-9]*)")
# Separate random stream for the subset so it is independent of the partition stream drawn from the same seed.
_SUBSET_STREAM = 1


def site_index(site_name: str, num_sites: int) -> int:
    """Map ``site-1`` .. ``site-N`` to 0 .. N-1.

    Raises
    ------
    DataPrepError
        The name is not ``site-<i>`` with ``1 <= i <= num_sites`` (no leading zeros).
    """
    match = _SITE_NAME.fullmatch(site_name.strip()) if isinstance(site_name, str) else None
    if match is None:
        raise DataPrepError(
            f"site name {site_name!r} does not look like site-1 .. site-{num_sites}; name sites site-<number>"
        )
    number = int(match.group(1))
    if number > num_sites:
        raise DataPrepError(
            f"site name {site_name!r} is beyond the {num_sites} configured sites; use site-1 .. site-{num_sites} "
            "or raise num_sites"
        )
    return number - 1


@dataclass(frozen=True)
class SiteDataConfig:
    """Everything a site needs to derive its shard.

    Attributes
    ----------
    dataset
        One of `data_prep.DATASETS` (stored in canonical spelling).
    scheme
        One of `data_prep.SCHEMES`.
    num_sites
        Number of sites in the federation.
    seed
        Seed of the partition (and of the ``max_train_samples`` subset).
    alpha
        Dirichlet concentration for ``dirichlet`` and ``quantity``.
    classes_per_site
        Labels per site for ``shards`` and ``label_quantity``.
    max_train_samples
        If set, partition only a seeded random subset of this many training samples (fast tests and smoke runs).
    data_dir
        Dataset location, passed to `data_prep.load_dataset`.
    """

    dataset: str
    scheme: str
    num_sites: int
    seed: int = 0
    alpha: float = 0.5
    classes_per_site: int = 2
    max_train_samples: int | None = None
    data_dir: str | None = None

    @classmethod
    def from_namespace(cls, args: Any) -> SiteDataConfig:
        """Build from parsed command-line options named like the fields (``--num-sites`` -> ``num_sites``); a
        ``partition_seed`` that is not ``None`` seeds the partition instead of ``seed`` (the job's training seed)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "partition_seed", None) is not None:
            values["seed"] = args.partition_seed
        return cls(**values)

    def __post_init__(self) -> None:
        # Frozen dataclass: normalise the name through object.__setattr__ so equal configs compare equal.
        object.__setattr__(self, "dataset", canonical_dataset_name(self.dataset))
        if self.scheme not in SCHEMES:
            raise DataPrepError(f"unknown partition scheme {self.scheme!r}; choose one of: {', '.join(SCHEMES)}")
        _require_int("num_sites", self.num_sites, minimum=1)
        _require_int("seed", self.seed, minimum=0)
        _require_int("classes_per_site", self.classes_per_site, minimum=1)
        if self.max_train_samples is not None:
            _require_int("max_train_samples", self.max_train_samples, minimum=1)
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float) or not math.isfinite(self.alpha):
            raise DataPrepError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if self.alpha <= 0:
            raise DataPrepError(f"alpha must be > 0, got {self.alpha}; smaller alpha means more skew (try 0.1 .. 1)")


def _require_int(field: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DataPrepError(f"{field} must be an integer >= {minimum}, got {value!r}")


def describe(cfg: SiteDataConfig) -> str:
    """One-line summary of the partition settings (used in the CLI table header and plot titles)."""
    details = [cfg.dataset, cfg.scheme]
    if cfg.scheme in ("dirichlet", "quantity"):
        details.append(f"alpha={cfg.alpha:g}")
    if cfg.scheme in LABEL_COUNT_SCHEMES:
        details.append(f"k={cfg.classes_per_site}")
    details += [f"sites={cfg.num_sites}", f"seed={cfg.seed}"]
    if cfg.max_train_samples is not None:
        details.append(f"max_train={cfg.max_train_samples}")
    return "  ".join(details)


def _train_subset(cfg: SiteDataConfig) -> tuple[np.ndarray, np.ndarray]:
    """The training arrays the partition runs over: all of them, or a sorted seeded subset."""
    data = load_dataset(cfg.dataset, cfg.data_dir)
    if cfg.max_train_samples is None or cfg.max_train_samples >= len(data.train_y):
        return data.train_x, data.train_y
    rng = np.random.default_rng((cfg.seed, _SUBSET_STREAM))
    keep = np.sort(rng.choice(len(data.train_y), size=cfg.max_train_samples, replace=False))
    return data.train_x[keep], data.train_y[keep]


def _partitioned(cfg: SiteDataConfig) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    x, y = _train_subset(cfg)
    parts = partition(
        y, cfg.num_sites, cfg.scheme, seed=cfg.seed, alpha=cfg.alpha, classes_per_site=cfg.classes_per_site
    )
    return x, y, parts


def partition_sites(cfg: SiteDataConfig) -> tuple[np.ndarray, list[np.ndarray]]:
    """Return ``(train_labels, parts)``: the labels that were partitioned and every site's indices into them."""
    _, labels, parts = _partitioned(cfg)
    return labels, parts


def site_split(cfg: SiteDataConfig, site_name: str) -> tuple[np.ndarray, np.ndarray]:
    """Return the training ``(x, y)`` of one site (fresh, writable arrays)."""
    index = site_index(site_name, cfg.num_sites)
    x, y, parts = _partitioned(cfg)
    return x[parts[index]], y[parts[index]]


def test_split(cfg: SiteDataConfig) -> tuple[np.ndarray, np.ndarray]:
    """Return the full published test set ``(x, y)`` (read-only arrays shared with the in-process cache)."""
    data = load_dataset(cfg.dataset, cfg.data_dir)
    return data.test_x, data.test_y


# pytest would otherwise collect test_split as a test when a test module imports it by name.
test_split.__test__ = False  # type: ignore[attr-defined]


def to_tensor_dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
    """Wrap arrays as a ``TensorDataset`` of float32 features and int64 labels (copied: the cache stays untouched)."""
    # Imported here so that partitioning and the CLI do not pay for importing torch.
    import torch
    from torch.utils.data import TensorDataset

    if len(x) != len(y):
        raise DataPrepError(f"x has {len(x)} samples but y has {len(y)}; pass matching arrays")
    features = torch.tensor(np.asarray(x), dtype=torch.float32)
    targets = torch.tensor(np.asarray(y), dtype=torch.int64)
    return TensorDataset(features, targets)
