"""The genomics model's size must be the site's data's: a job whose ``n_snps`` or ``num_classes``
disagrees with the file the site read is refused at the site, in one line naming the setting and the fix, before
anything is trained or scored.

Before: the ``cnn_transformer`` padded a 6-SNP file up to the job's 16 SNPs and trained without a word; the MLP
crashed inside ``F.linear`` with a shape error that named neither the setting nor the file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl

from data_prep.errors import DataPrepError
from data_prep.genotypes.cli import write_npz
from data_prep.genotypes.harmonise import Harmonised

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from genomics.data import SnpSites
from genomics.model import SnpClassifier, data_shape_problem

CLASSES = ["AFR", "EUR"]
PEOPLE, SNPS = 24, 6


@pytest.fixture
def site_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # a simulated site: no startup kit above it
    genotypes = np.random.default_rng(0).integers(0, 4, size=(PEOPLE, SNPS)).astype(np.int8)
    result = Harmonised(
        genotypes, tuple(f"p{i}" for i in range(PEOPLE)), tuple(f"rs{j}" for j in range(SNPS)), ("same",) * SNPS, "t"
    )
    return write_npz(tmp_path / "site-1.npz", result, np.array([CLASSES[i % 2] for i in range(PEOPLE)]))


def fit(module: pl.LightningModule, data: pl.LightningDataModule) -> pl.Trainer:
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(module, datamodule=data)
    return trainer


@pytest.mark.parametrize(
    ("model_args", "expected"),
    [
        ({"arch": "cnn_transformer", "n_snps": 16, "patch": 8}, "n_snps=16, but the site's data has 6 SNPs"),
        ({"arch": "mlp", "n_snps": 10}, "n_snps=10, but the site's data has 6 SNPs"),
        ({"arch": "mlp", "n_snps": SNPS, "num_classes": 5}, r"num_classes=5, but the site's data has 2 classes"),
    ],
)
def test_a_model_that_disagrees_with_the_sites_file_is_refused_before_training(site_file, model_args, expected) -> None:
    data = SnpSites(site="site-1", data_file=str(site_file), classes=CLASSES, batch_size=8)
    module = SnpClassifier(**{"num_classes": 2, "d_model": 16, "hidden": 8, **model_args})
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(DataPrepError, match=f"^site-1: the job's model_args {expected}") as refused:
        fit(module, data)
    message = str(refused.value)
    assert "\n" not in message and str(site_file) in message and "rebuild the job with" in message
    assert all((before[k] == v).all() for k, v in module.state_dict().items())  # nothing trained


def test_a_model_of_the_files_size_trains(site_file) -> None:
    data = SnpSites(site="site-1", data_file=str(site_file), classes=CLASSES, batch_size=8)
    fit(SnpClassifier(arch="mlp", n_snps=SNPS, num_classes=2, hidden=8), data)


def test_the_check_reads_through_a_wrapping_data_module(site_file) -> None:
    """DP-SGD wraps the site's data module (Opacus's DPLightningDataModule): the check looks inside."""
    inner = SnpSites(site="site-1", data_file=str(site_file), classes=CLASSES)

    class Wrapper(pl.LightningDataModule):
        datamodule = inner

    problem = data_shape_problem(SnpClassifier(arch="mlp", n_snps=7, num_classes=2).hparams, Wrapper())
    assert problem is not None and problem.startswith("site-1: the job's model_args n_snps=7")


def test_data_without_a_shape_is_not_checked() -> None:
    assert data_shape_problem(SnpClassifier(arch="mlp", n_snps=7).hparams, object()) is None
    assert data_shape_problem(SnpClassifier(arch="mlp", n_snps=7).hparams, None) is None
