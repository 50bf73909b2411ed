"""Offline datasets, non-IID partitioners and per-site data for the federated-learning bundle.

Typical use in a client script::

    cfg = SiteDataConfig("fashion_mnist", "dirichlet", num_sites=3, alpha=0.5, seed=0)
    x, y = site_split(cfg, "site-2")
    train_set = to_tensor_dataset(x, y)

Importing this package does not import torch, scikit-learn or matplotlib; only the functions that need them do.
"""

from data_prep.datasets import DATASETS, ArrayDataset, load_dataset, read_idx
from data_prep.errors import DataPrepError
from data_prep.partition import SCHEMES, dirichlet, iid, label_quantity, partition, quantity, shards
from data_prep.report import format_counts_table, label_counts, save_counts_heatmap
from data_prep.sites import (
    SiteDataConfig,
    describe,
    partition_sites,
    site_index,
    site_split,
    test_split,
    to_tensor_dataset,
)

__all__ = [
    "DATASETS",
    "SCHEMES",
    "ArrayDataset",
    "DataPrepError",
    "SiteDataConfig",
    "describe",
    "dirichlet",
    "format_counts_table",
    "iid",
    "label_counts",
    "label_quantity",
    "load_dataset",
    "partition",
    "partition_sites",
    "quantity",
    "read_idx",
    "save_counts_heatmap",
    "shards",
    "site_index",
    "site_split",
    "test_split",
    "to_tensor_dataset",
]
