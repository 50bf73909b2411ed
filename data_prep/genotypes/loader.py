"""A streaming loader for large genotype matrices: int8 in memory (or memory-mapped from disk) and int8 through the
loader, converted to the model's int64 tokens by `as_tokens` once a batch is on the training device. A site
with 10^4 people x 10^5 SNPs holds 1 GB of int8, never the 8 GB an int64 copy of the matrix would take.

`open_matrix` memory-maps the ``genotypes`` member of an uncompressed ``.npz`` (what ``python -m
data_prep.genotypes harmonise`` writes) or a ``.npy``: a member stored without compression is the bytes of a ``.npy``
file inside the zip, at an offset the zip's local header gives. A compressed ``.npz`` is read into memory (int8).

`GenotypeRows` is indexed by a *list* of people and `genotype_loader` hands it one batch of indices
at a time (a ``BatchSampler`` with ``DataLoader(batch_size=None)``), so gathering rows happens once per batch, not
per person. Rows are read in ascending order within a batch (sequential on disk) and the batch is then put back in
the sampled order.

Why the batches stay int8 (measured, benchmarks/results/genotype_io.md): at 10^5 SNPs a batch of 128 people is
12.8 MB of int8 gathered from the memory map in a few ms, but its int64 copy is 102 MB, and writing it took 85-230
ms on the host, which bounded the loader at about 600 samples/s. Moved as int8, the batch crosses to a GPU with 8x
fewer bytes and is widened there (``as_tokens`` in the data module's ``on_after_batch_transfer``).
"""

from __future__ import annotations

import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler, default_collate

from data_prep.errors import DataPrepError

__all__ = ["GenotypeRows", "as_tokens", "collate_rows", "genotype_loader", "open_matrix"]

_LOCAL_HEADER = 30  # bytes of a zip local file header before its file name and extra field


def open_matrix(path: str | Path, key: str = "genotypes") -> np.ndarray:
    """The int8 people x SNPs matrix of ``path`` (``.npy`` or ``.npz``), memory-mapped when stored uncompressed."""
    path = Path(path)
    matrix = np.load(path, mmap_mode="r") if path.suffix == ".npy" else _npz_member(path, key)
    if matrix.dtype != np.int8 or matrix.ndim != 2:
        raise DataPrepError(f"{path}: {key!r} must be a 2-D int8 matrix, got {matrix.dtype} of shape {matrix.shape}")
    return matrix


def _npz_member(path: Path, key: str) -> np.ndarray:
    try:
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(f"{key}.npy")
            if info.compress_type != zipfile.ZIP_STORED:
                with archive.open(info) as member:
                    return np.lib.format.read_array(member)
        with open(path, "rb") as handle:
            handle.seek(info.header_offset)
            local = handle.read(_LOCAL_HEADER)
            name_length = int.from_bytes(local[26:28], "little")
            extra_length = int.from_bytes(local[28:30], "little")
            handle.seek(info.header_offset + _LOCAL_HEADER + name_length + extra_length)
            version = np.lib.format.read_magic(handle)
            read_header = (
                np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(handle)
            offset = handle.tell()
    except KeyError:
        raise DataPrepError(f"{path}: holds no {key!r} array") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataPrepError(f"{path}: not a readable .npz file ({exc})") from None
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")


class GenotypeRows(Dataset):
    """People of an int8 matrix, a batch at a time: ``dataset[list_of_indices]`` -> ``(int8 states, target)``
    (`as_tokens` widens the states for the model's embedding, on the device)."""

    def __init__(self, genotypes: np.ndarray, targets: np.ndarray | torch.Tensor, rows: np.ndarray | None = None):
        if genotypes.dtype != np.int8 or genotypes.ndim != 2:
            raise DataPrepError(
                f"the streaming loader reads a 2-D int8 matrix, got {genotypes.dtype} {genotypes.shape}"
            )
        self.genotypes, self.targets = genotypes, torch.as_tensor(np.asarray(targets))
        self.rows = np.arange(len(genotypes)) if rows is None else np.asarray(rows, dtype=np.int64)
        if len(self.targets) != len(self.rows):
            raise DataPrepError(f"{len(self.rows)} people but {len(self.targets)} targets")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(index, int | np.integer):  # one person: what per-sample loaders (Opacus's Poisson one) ask for
            states, target = self[[int(index)]]
            return states[0], target[0]
        index = np.asarray(index, dtype=np.int64)
        rows = self.rows[index]
        ascending = np.argsort(rows, kind="stable")  # sequential reads from a memory map, then the asked order
        block = np.empty((len(rows), self.genotypes.shape[1]), np.int8)
        block[ascending] = self.genotypes[rows[ascending]]
        return torch.from_numpy(block), self.targets[torch.from_numpy(index)]


def as_tokens(batch: Any) -> Any:
    """``(states, target)`` with int8 ``states`` widened to int64 (an embedding's index type) where they are now;
    any other batch unchanged. For a data module's ``on_after_batch_transfer``: after the copy to the device."""
    narrow = isinstance(batch, tuple | list) and batch and isinstance(batch[0], torch.Tensor)
    return (batch[0].long(), *batch[1:]) if narrow and batch[0].dtype == torch.int8 else batch


def collate_rows(batch: Any) -> Any:
    """The genotype loader's ``collate_fn``: a batch `GenotypeRows` gathered at once (a tuple) passes as it is;
    a list of people, one ``dataset[i]`` each, is stacked. Opacus's Poisson loader (DP-SGD) keeps the loader's
    ``collate_fn`` and fetches person by person: with PyTorch's default for ``batch_size=None`` (``default_convert``)
    its batches would stay lists of people."""
    return batch if isinstance(batch, tuple) else default_collate(batch)


def genotype_loader(
    data: GenotypeRows, batch_size: int, shuffle: bool = False, seed: int | None = None, num_workers: int = 0
) -> DataLoader:
    """Batches of ``data``: a new shuffled order every epoch when ``shuffle`` (from ``seed``, else from torch's global
    generator, as ``DataLoader(shuffle=True)`` does); the last batch may be short."""
    if batch_size < 1:
        raise DataPrepError(f"batch_size must be >= 1, got {batch_size}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    order = RandomSampler(data, generator=generator) if shuffle else SequentialSampler(data)
    batches = BatchSampler(order, batch_size, drop_last=False)
    return DataLoader(data, batch_size=None, sampler=batches, num_workers=num_workers, collate_fn=collate_rows)
