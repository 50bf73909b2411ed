"""Fixtures shared by every test folder."""

from __future__ import annotations

import os

import pytest

from data_prep import DataPrepError, load_dataset


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
