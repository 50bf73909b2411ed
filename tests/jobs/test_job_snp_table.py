"""The genomics model's size comes from the data: ``jobs.build --snp-table`` takes ``n_snps`` from
the SNP table the sites harmonised against (or a harmonised ``.npz``) and ``num_classes`` from the agreed classes, and
refuses a ``--model-args`` that says otherwise in one line naming both numbers and the fix; the genomics model declares
its head, so FedPer's ``--local-keys head`` needs no typed names. Pure, no job is exported (milliseconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from torch import nn

from jobs.build import main, model_size_from_data, snp_count
from jobs.settings import JobBuildError
from lightning_modules.personalization.local_keys import LocalKeysError, resolve_local_keys

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from genomics.model import SnpClassifier

CLASSES = ["AFR", "EUR", "ASIA"]
USER = {"model": "genomics.model:SnpClassifier", "data_args": {"classes": CLASSES}}


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "fedalg_qc_snp_table.csv"
    rows = [f"rs{i},1,{100 + i},A,G" for i in range(7)]
    path.write_text("snp,chrom,pos,ref,alt\n" + "\n".join(rows) + "\n")
    return path


def test_n_snps_and_num_classes_come_from_the_table_and_the_classes(table: Path, tmp_path: Path) -> None:
    assert snp_count(table) == 7
    npz = tmp_path / "site-1.npz"
    np.savez(npz, genotypes=np.zeros((2, 5), np.int8), snps=np.array([f"rs{i}" for i in range(5)]))
    assert snp_count(npz) == 5
    args = model_size_from_data(table, {**USER, "model_args": {"arch": "mlp", "lr": 0.001}})
    assert args == {"arch": "mlp", "lr": 0.001, "n_snps": 7, "num_classes": 3}
    assert model_size_from_data(table, {**USER, "model_args": {"n_snps": 7, "num_classes": 3}})["n_snps"] == 7


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ({"n_snps": 300}, r"--model-args n_snps=300, but .*fedalg_qc_snp_table.csv holds 7 SNPs; drop n_snps"),
        ({"num_classes": 5}, r"--model-args num_classes=5, but --data-args classes names 3 classes; drop num_classes"),
    ],
)
def test_a_typed_size_that_disagrees_with_the_data_is_refused_in_one_line(table, model_args, message) -> None:
    with pytest.raises(JobBuildError, match=message):
        model_size_from_data(table, {**USER, "model_args": model_args})


def test_the_builder_refuses_before_exporting_anything(table: Path, tmp_path: Path, capsys) -> None:
    argv = ["--name", "x", "--output-dir", str(tmp_path / "jobs"), "--model", USER["model"], "--snp-table", str(table)]
    argv += ["--model-args", '{"n_snps":300}', "--data-args", '{"classes":["AFR","EUR","ASIA"]}']
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model-args n_snps=300, but ") and "holds 7 SNPs" in err and "\n" not in err
    assert not (tmp_path / "jobs").exists()
    assert main(["--output-dir", str(tmp_path / "jobs"), "--snp-table", str(table)]) == 2
    assert "needs --model" in capsys.readouterr().err
    assert main(["--output-dir", str(tmp_path / "jobs"), "--model", USER["model"], "--snp-table", "/no/table.csv"]) == 2
    assert "--snp-table /no/table.csv: " in capsys.readouterr().err


def test_the_genomics_model_declares_its_head_for_fedper() -> None:
    model = SnpClassifier(arch="mlp", n_snps=7, num_classes=3, hidden=4)
    assert resolve_local_keys("head", model) == ("net.head.bias", "net.head.weight")
    assert resolve_local_keys("net.head.*", model) == resolve_local_keys("head", model)
    with pytest.raises(LocalKeysError, match="declares no head"):
        resolve_local_keys("head", nn.Sequential(nn.Linear(2, 2)))
