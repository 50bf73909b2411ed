"""Shared fixtures for the data_prep tests: synthetic labels (fast, exact) and a tiny IDX writer."""

from __future__ import annotations

import gzip
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

IDX_TYPE_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C}


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode an array in the IDX format by hand: 0x0000, type byte, ndim byte, big-endian sizes, big-endian data."""
    code = IDX_TYPE_CODES[array.dtype]
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


@pytest.fixture
def write_idx() -> Callable[[Path, np.ndarray, bool], Path]:
    """Write ``array`` as an IDX file (gzipped when asked) and return its path."""

    def write(path: Path, array: np.ndarray, compress: bool = False) -> Path:
        payload = idx_bytes(array)
        if compress:
            path = path.with_name(path.name + ".gz")
            payload = gzip.compress(payload)
        path.write_bytes(payload)
        return path

    return write


@pytest.fixture
def labels() -> np.ndarray:
    """3,000 shuffled labels, 300 of each of 10 classes."""
    return np.random.default_rng(123).permutation(np.repeat(np.arange(10), 300)).astype(np.int64)
