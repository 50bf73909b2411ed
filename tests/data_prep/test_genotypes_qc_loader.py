"""QC statistics from genotype counts (closed form), the federated filter, the streaming int8 loader, and a real
site's genotype files in the genomics data module."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data_prep.errors import DataPrepError
from data_prep.genotypes.cli import write_npz
from data_prep.genotypes.harmonise import Harmonised
from data_prep.genotypes.loader import GenotypeRows, as_tokens, genotype_loader, open_matrix
from data_prep.genotypes.qc import QcThresholds, allele_stats, genotype_counts, hwe_pvalues, qc_filter

M = 3
MATRIX = np.array([[0, 1, 2, M], [1, 1, 2, M], [2, 1, M, M], [0, 0, 2, 0]], dtype=np.int8)


def test_genotype_counts_per_snp() -> None:
    np.testing.assert_array_equal(
        genotype_counts(MATRIX, chunk=3), [[2, 1, 1, 0], [1, 3, 0, 0], [0, 0, 3, 1], [1, 0, 0, 3]]
    )


def test_site_counts_add_up_to_the_pooled_counts() -> None:
    rng = np.random.default_rng(0)
    sites = [rng.integers(0, 4, size=(n, 7)).astype(np.int8) for n in (5, 11, 3)]
    pooled = genotype_counts(np.concatenate(sites))
    np.testing.assert_array_equal(sum(genotype_counts(s) for s in sites), pooled)


def test_allele_stats_closed_form() -> None:
    call_rate, alt_freq, maf = allele_stats(genotype_counts(MATRIX))
    np.testing.assert_allclose(call_rate, [1, 1, 0.75, 0.25], atol=1e-12)
    np.testing.assert_allclose(alt_freq, [(1 + 2) / 8, 3 / 8, 1.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(maf, [3 / 8, 3 / 8, 0.0, 0.0], atol=1e-12)


def test_hwe_chi_square_equals_pearsons_sum() -> None:
    n0, n1, n2 = 50, 30, 20
    n, p = n0 + n1 + n2, (n1 + 2 * n2) / (2 * (n0 + n1 + n2))
    expected = [n * (1 - p) ** 2, 2 * n * p * (1 - p), n * p**2]
    chi2 = sum((o - e) ** 2 / e for o, e in zip((n0, n1, n2), expected, strict=True))
    assert chi2 == pytest.approx(11.604878, abs=1e-6)
    pvalues = hwe_pvalues(np.array([[n0, n1, n2, 0], [25, 50, 25, 0], [10, 0, 0, 0]]))
    np.testing.assert_allclose(pvalues, [math.erfc(math.sqrt(chi2 / 2)), 1.0, 1.0], atol=1e-12)


def test_hwe_p_value_of_the_5_percent_critical_value() -> None:
    # chi2 = 3.841459 (the 95 % quantile of chi-square with 1 df) must give p = 0.05: checks erfc(sqrt(chi2/2)).
    assert math.erfc(math.sqrt(3.841459 / 2)) == pytest.approx(0.05, abs=1e-6)


def test_the_filter_keeps_snps_over_both_thresholds() -> None:
    counts = np.array([[90, 10, 0, 0], [99, 1, 0, 0], [90, 10, 0, 10], [100, 0, 0, 0]])
    # MAF 0.05, 0.005, 0.05 with call rate 100/110, monomorphic.
    keep = qc_filter(counts, QcThresholds(min_call_rate=0.95, min_maf=0.01))
    assert keep.tolist() == [True, False, False, False]


@pytest.mark.parametrize("bad", [{"min_call_rate": 1.5}, {"min_maf": 0.6}, {"min_maf": "x"}])
def test_thresholds_out_of_range_are_refused_by_name(bad: dict) -> None:
    with pytest.raises(DataPrepError, match=next(iter(bad))):
        QcThresholds(**bad)


def harmonised_npz(tmp_path: Path, genotypes: np.ndarray, labels: list[str] | None = None) -> Path:
    result = Harmonised(
        genotypes,
        tuple(f"p{i}" for i in range(len(genotypes))),
        tuple(f"rs{j}" for j in range(genotypes.shape[1])),
        ("same",) * genotypes.shape[1],
        "test",
    )
    return write_npz(tmp_path / "site.npz", result, None if labels is None else np.array(labels))


def test_the_harmonised_npz_is_memory_mapped(tmp_path: Path) -> None:
    path = harmonised_npz(tmp_path, MATRIX)
    matrix = open_matrix(path)
    assert isinstance(matrix, np.memmap) and matrix.dtype == np.int8
    np.testing.assert_array_equal(matrix, MATRIX)


def test_a_compressed_npz_is_read_into_memory(tmp_path: Path) -> None:
    np.savez_compressed(tmp_path / "c.npz", genotypes=MATRIX)
    matrix = open_matrix(tmp_path / "c.npz")
    assert not isinstance(matrix, np.memmap)
    np.testing.assert_array_equal(matrix, MATRIX)


def test_an_npz_without_genotypes_is_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "x.npz", x=MATRIX)
    with pytest.raises(DataPrepError, match=r"x.npz: holds no 'genotypes' array"):
        open_matrix(tmp_path / "x.npz")


def test_batches_are_int8_rows_in_the_sampled_order_widened_by_as_tokens() -> None:
    data = GenotypeRows(MATRIX, np.array([10, 11]), rows=np.array([3, 1]))
    x, y = data[[1, 0]]
    assert x.dtype == torch.int8  # int8 through the loader; widened on the training device
    np.testing.assert_array_equal(x.numpy(), MATRIX[[1, 3]])
    assert y.tolist() == [11, 10]
    tokens, target = as_tokens((x, y))
    assert tokens.dtype == torch.int64 and target is y
    np.testing.assert_array_equal(tokens.numpy(), MATRIX[[1, 3]])


def test_one_person_at_a_time_as_per_sample_loaders_ask() -> None:
    # Opacus's Poisson loader (DP-SGD) fetches person by person and collates; the batch must be the same.
    data = GenotypeRows(MATRIX, np.array([10, 11]), rows=np.array([3, 1]))
    x, y = data[np.int64(1)]
    assert x.dtype == torch.int8 and x.shape == (4,)
    np.testing.assert_array_equal(x.numpy(), MATRIX[1])
    assert int(y) == 11
    batch = torch.utils.data.default_collate([data[1], data[0]])
    np.testing.assert_array_equal(batch[0].numpy(), data[[1, 0]][0].numpy())
    assert batch[1].tolist() == [11, 10]


def test_the_poisson_loader_over_the_genotype_loader_yields_batches() -> None:
    # DP-SGD swaps the site's training loader for Opacus's Poisson one, which keeps the loader's collate_fn and
    # fetches person by person: the batch must still be (int8 states, targets), not a list of people.
    pytest.importorskip("opacus")
    from lightning_modules.privacy.dp_sgd import poisson_loader

    genotypes = np.arange(60, dtype=np.int8).reshape(20, 3) % 4
    data = GenotypeRows(genotypes, np.arange(20))
    loader = poisson_loader(genotype_loader(data, batch_size=5, shuffle=True))
    batches = list(loader)
    assert len(batches) == 4 and sum(len(y) for _, y in batches) > 0
    for x, y in batches:
        assert isinstance(x, torch.Tensor) and x.dtype == torch.int8 and x.shape == (len(y), 3)
        np.testing.assert_array_equal(x.numpy(), genotypes[y.numpy()])


def test_as_tokens_leaves_other_batches_alone() -> None:
    wide = (torch.tensor([[0, 2]]), torch.tensor([1]))
    assert as_tokens(wide)[0] is wide[0]
    assert as_tokens("not a batch") == "not a batch"


def test_the_shuffled_order_per_seed_is_pinned() -> None:
    """The same people in the same batches and order per seed as the int64 loader gave before the batches stayed
    int8 (recorded from it): converting on the device changed no sample and no order."""
    genotypes = np.arange(50, dtype=np.int8).reshape(25, 2) % 4
    data = GenotypeRows(genotypes, np.arange(25), rows=np.arange(25)[::-1].copy())
    loader = genotype_loader(data, batch_size=4, shuffle=True, seed=7)
    epochs = [[y.tolist() for _, y in loader] for _ in range(2)]
    assert epochs == [
        [[15, 5, 19, 23], [1, 12, 0, 4], [6, 18, 3, 24], [17, 22, 9, 8], [16, 7, 20, 2], [21, 14, 11, 13], [10]],
        [[12, 23, 1, 4], [0, 8, 17, 22], [11, 10, 6, 13], [5, 16, 24, 9], [21, 3, 7, 14], [18, 20, 19, 2], [15]],
    ]
    for x, y in loader:
        np.testing.assert_array_equal(as_tokens((x, y))[0].numpy(), genotypes[24 - y.numpy()])


def test_the_loader_visits_every_person_once_per_epoch_in_a_new_order() -> None:
    genotypes = np.arange(50, dtype=np.int8).reshape(25, 2) % 4
    data = GenotypeRows(genotypes, np.arange(25))
    loader = genotype_loader(data, batch_size=4, shuffle=True, seed=1)
    epochs = [torch.cat([y for _, y in loader]).tolist() for _ in range(2)]
    assert [len(x) for x, _ in loader] == [4] * 6 + [1]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(25))
    assert epochs[0] != epochs[1]
    for x, y in loader:
        np.testing.assert_array_equal(x.numpy(), genotypes[y.numpy()])


def test_the_loader_refuses_a_wide_copy() -> None:
    with pytest.raises(DataPrepError, match="int8"):
        GenotypeRows(MATRIX.astype(np.int64), np.arange(4))


# ---- the genomics data module with a real site's files --------------------------------------------------------------


@pytest.fixture
def snp_sites(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    monkeypatch.delitem(sys.modules, "genomics.data", raising=False)
    from genomics.data import SnpSites

    return SnpSites


def test_the_data_module_streams_a_harmonised_npz_with_its_labels(tmp_path: Path, snp_sites) -> None:
    genotypes = np.random.default_rng(0).integers(0, 4, size=(20, 6)).astype(np.int8)
    labels = ["EUR", "AFR"] * 10
    path = harmonised_npz(tmp_path, genotypes, labels)
    data = snp_sites(site="site-2", data_file=str(path), classes=["AFR", "EUR"], val_fraction=0.25, batch_size=4)
    assert isinstance(data.train, GenotypeRows) and isinstance(data.train.genotypes, np.memmap)
    assert data.num_snps == 6 and len(data.train) + len(data.val) == 20
    seen = {}
    for loader in (data.train_dataloader(), data.val_dataloader()):
        for batch in loader:
            assert batch[0].dtype == torch.int8
            x, y = data.on_after_batch_transfer(batch, 0)  # what Lightning calls once the batch is on the device
            assert x.dtype == torch.int64
            for row, label in zip(x.numpy(), y.tolist(), strict=True):
                seen[row.tobytes()] = label
    assert len(seen) == len({g.tobytes() for g in genotypes})
    expected = {genotypes[i].astype(np.int64).tobytes(): ["AFR", "EUR"].index(labels[i]) for i in range(20)}
    assert seen == {k: expected[k] for k in seen}


def test_the_data_module_harmonises_a_vcf_named_per_site(tmp_path: Path, snp_sites, monkeypatch) -> None:
    pytest.importorskip("cyvcf2")
    from data_prep.genotypes.writers import Sites, write_genotype_file

    write_genotype_file(
        tmp_path / "site-1.vcf",
        np.array([[0, 1], [2, 1], [1, 3]], np.int8),
        ["a", "b", "c"],
        Sites(["1", "1"], [10, 20], ["x", "y"], ["A", "C"], ["G", "T"]),
    )
    (tmp_path / "table.csv").write_text("snp,chrom,pos,ref,alt\nrs1,chr1,10,G,A\nrs2,1,20,C,T\n")
    (tmp_path / "labels.csv").write_text("sample,population\na,EAS\nb,EUR\nc,EAS\n")
    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(tmp_path / "{site}.vcf"))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(tmp_path / "table.csv"))
    monkeypatch.setenv("FEDALG_SITE_LABELS", str(tmp_path / "labels.csv"))
    data = snp_sites(site="site-1", classes=["EAS", "EUR"], val_fraction=0.0, batch_size=8)
    assert len(data.val) == 0
    x, y = next(iter(data.train_dataloader()))
    by_label = sorted(zip(y.tolist(), x.numpy().tolist(), strict=True))
    # rs1: the table's alt A is the file's REF (swapped, 2 - g); rs2 same orientation; sample c's rs2 is missing.
    assert by_label == [(0, [1, 3]), (0, [2, 1]), (1, [0, 1])]


def test_the_data_module_names_the_site_for_unknown_labels(tmp_path: Path, snp_sites) -> None:
    harmonised_npz(tmp_path, MATRIX, ["EUR", "XYZ", "EUR", "EUR"])
    with pytest.raises(DataPrepError, match=r"site-3: labels \['XYZ'\] are not among the classes"):
        snp_sites(site="site-3", data_file=str(tmp_path / "site.npz"), classes=["EUR"])


def test_an_npz_for_another_table_is_refused(tmp_path: Path, snp_sites) -> None:
    harmonised_npz(tmp_path, MATRIX, ["EUR"] * 4)
    (tmp_path / "table.csv").write_text("snp,chrom,pos,ref,alt\nrs0,1,1,A,G\nrs9,1,2,A,G\n")
    with pytest.raises(DataPrepError, match=r"site-1: .*site.npz: its SNPs are not those of .*table.csv"):
        snp_sites(
            site="site-1", data_file=str(tmp_path / "site.npz"), snp_table=str(tmp_path / "table.csv"), classes=["EUR"]
        )


def test_lightning_hands_the_model_int64_states_from_an_int8_loader(tmp_path: Path, snp_sites) -> None:
    """The data module's on_after_batch_transfer runs inside trainer.fit/validate (datamodule=...), so the model's
    embedding sees int64 although the loader yields int8."""
    import pytorch_lightning as pl

    genotypes = np.random.default_rng(1).integers(0, 4, size=(12, 5)).astype(np.int8)
    path = harmonised_npz(tmp_path, genotypes, ["AFR", "EUR"] * 6)
    data = snp_sites(site="site-1", data_file=str(path), classes=["AFR", "EUR"], val_fraction=0.25, batch_size=4)
    seen: list[torch.dtype] = []

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embedding, self.head = torch.nn.Embedding(4, 2), torch.nn.Linear(10, 2)

        def step(self, batch):
            seen.append(batch[0].dtype)
            return torch.nn.functional.cross_entropy(self.head(self.embedding(batch[0]).flatten(1)), batch[1])

        def training_step(self, batch, _):
            return self.step(batch)

        def validation_step(self, batch, _):
            self.step(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(Tiny(), datamodule=data)
    assert len(seen) >= 3 and set(seen) == {torch.int64}  # 3 training batches of 9 people (+ validation)
