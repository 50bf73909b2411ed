"""Genotype data: call encoding (closed form), bad input by site and SNP, the 1000 Genomes panel, simulated cohorts."""

from __future__ import annotations

import io

import numpy as np
import pytest

from data_prep import DataPrepError, partition
from data_prep.genomics import (
    MISSING,
    SnpTable,
    check_snp_set,
    encode_calls,
    held_out_split,
    load_1kg_panel,
    read_genotype_csv,
)

TABLE = SnpTable(("rs1", "rs2"), (("A", "G"), ("C", "T")))


def test_calls_become_copies_of_the_alternative_allele() -> None:
    calls = np.array([["AA", "CC"], ["AG", "CT"], ["GA", "TC"], ["GG", "TT"], ["--", "tt"]])
    expected = np.array([[0, 0], [1, 1], [1, 1], [2, 2], [MISSING, 2]], dtype=np.int8)
    np.testing.assert_array_equal(encode_calls(calls, TABLE, "site-1"), expected)


@pytest.mark.parametrize("call", ["AT", "A", "AGG", "XX"])
def test_a_call_that_is_not_two_alleles_of_the_snp_names_site_and_snp(call: str) -> None:
    with pytest.raises(DataPrepError, match=r"site-2: .*non-biallelic or unknown.*rs1"):
        encode_calls(np.array([[call, "CC"]]), TABLE, "site-2")


def test_a_panel_snp_with_three_alleles_is_refused_by_name() -> None:
    calls = np.array([["AA", "CC"], ["AG", "CT"], ["GT", "CC"]])
    with pytest.raises(DataPrepError, match=r"more than two alleles.*rs1 \(A/G/T\)"):
        SnpTable.from_calls(["rs1", "rs2"], calls)


def test_a_panel_table_codes_alleles_alphabetically() -> None:
    table = SnpTable.from_calls(["rs1", "rs2"], np.array([["GG", "TC"], ["GA", "TT"]]))
    assert table.alleles == (("A", "G"), ("C", "T"))


def test_a_site_file_is_matched_to_the_table_by_snp_id() -> None:
    text = "sample,rs2,rs1,population\np1,CT,GG,EUR\np2,TT,AA,EAS\n"
    data = read_genotype_csv(io.StringIO(text), TABLE, site="site-1", classes=["EAS", "EUR"])
    np.testing.assert_array_equal(data.genotypes, [[2, 1], [0, 2]])  # columns in the table's order (rs1, rs2)
    np.testing.assert_array_equal(data.labels, [1, 0])


def test_a_site_whose_snp_set_differs_is_refused_naming_the_snps() -> None:
    with pytest.raises(DataPrepError, match=r"site-3: its SNP set differs.*missing rs2; not in the panel rs9"):
        check_snp_set(["rs1", "rs9"], TABLE, "site-3")


def test_an_unknown_label_is_refused_naming_the_site() -> None:
    text = "sample,rs1,rs2,population\np1,AG,CT,XYZ\n"
    with pytest.raises(DataPrepError, match=r"site-1: labels \['XYZ'\]"):
        read_genotype_csv(io.StringIO(text), TABLE, site="site-1", classes=["EAS", "EUR"])


def test_the_1000_genomes_panel() -> None:
    panel = load_1kg_panel()
    assert panel.genotypes.shape == (2504, 127)
    assert panel.classes == ("AFR", "AMR", "EAS", "EUR", "SAS")
    assert np.bincount(panel.labels).tolist() == [661, 347, 504, 503, 489]
    assert set(np.unique(panel.genotypes)) <= {0, 1, 2}  # the panel has no missing calls
    study = load_1kg_panel(label="population", populations=("CHB", "GBR", "PUR"))
    assert study.classes == ("CHB", "GBR", "PUR") and study.genotypes.shape == (298, 127)


def test_the_held_out_split_is_stratified_and_fixed() -> None:
    labels = np.repeat([0, 1], [10, 20])
    train, test = held_out_split(labels, 0.2)
    assert np.bincount(labels[test]).tolist() == [2, 4]
    np.testing.assert_array_equal(test, held_out_split(labels, 0.2)[1])
    assert len(np.intersect1d(train, test)) == 0


def test_site_equals_population_on_the_panel() -> None:
    labels = load_1kg_panel().labels
    parts = partition(np.asarray(labels), 5, "population", seed=0)
    assert [np.unique(labels[p]).tolist() for p in parts] == [[0], [1], [2], [3], [4]]


def test_a_simulated_cohort_is_cached_and_knows_ancestry_proportions(tmp_path, monkeypatch) -> None:
    pytest.importorskip("msprime")
    from data_prep.genomics_sim import CohortSettings, simulate_cohort

    monkeypatch.setenv("FEDALG_CACHE_DIR", str(tmp_path))
    settings = CohortSettings(samples_per_population=10, n_snps=40, regions=4, region_length=100_000, seed=3)
    cohort = simulate_cohort(settings)
    assert cohort.classes == ("AFR", "EUR", "ASIA", "ADMIX")
    assert cohort.genotypes.shape == (40, 40) and set(np.unique(cohort.genotypes)) <= {0, 1, 2}
    np.testing.assert_allclose(cohort.proportions.sum(axis=1), 1.0, atol=1e-5)
    admixed = cohort.proportions[cohort.labels == 3]
    assert admixed[:, 3].max() == 0  # an admixed person's ancestry lies in the three source populations
    assert (admixed[:, :3] > 0.02).sum(axis=1).min() >= 2  # ... in at least two of them
    cached = list(tmp_path.rglob("*.npz"))
    assert len(cached) == 1
    again = simulate_cohort(settings)
    np.testing.assert_array_equal(again.genotypes, cohort.genotypes)
    assert list(tmp_path.rglob("*.npz")) == cached
