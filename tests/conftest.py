"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from data_prep import DataPrepError, load_dataset

# The repository's own ``benchmarks`` package must win over the top-level ``benchmarks`` package that opacus (the
# privacy extra) installs into site-packages: ``python -m pytest`` puts the working directory first, the ``pytest``
# script does not.
REPO = str(Path(__file__).resolve().parents[1])
if sys.path[:1] != [REPO]:
    sys.path.insert(0, REPO)
    sys.modules.pop("benchmarks", None)


@pytest.fixture(scope="session")
def fashion_mnist() -> None:
    """Use in tests that need the real dataset: skipped locally when Fashion-MNIST is absent; in CI (CI=true) its
    absence is a failure, not a skip."""
    try:
        load_dataset("fashion_mnist")
    except DataPrepError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Fashion-MNIST not installed: {exc}")


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Every test leaves torch's intra-op thread count as it found it. In-process training is bit-identical to the
    simulator's only at the same thread count: a benchmark function called in process (dp_overhead pins 1 thread)
    once left the rest of the suite on 1 thread, and the engine-equivalence and thread-independence tests failed
    after it, though each passed alone."""
    import torch  # once per session; nearly every test session imports it anyway

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
