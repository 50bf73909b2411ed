"""A simulated consortium on disk (``python -m data_prep.genotypes simulate-sites``): the table's positions and
alleles, the split, the per-site files harmonising back to the cohort exactly, the labels, and bad settings refused
with nothing written. A hand-made cohort stands in for msprime's (the msprime run itself is the slow e2e test)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cyvcf2")

from data_prep.errors import DataPrepError
from data_prep.genotypes import GenotypeData
from data_prep.genotypes.cli import main
from data_prep.genotypes.harmonise import harmonise_file, read_snp_table
from data_prep.genotypes.simulate import ALLELE_PAIRS, cohort_table, split_people, write_sites
from data_prep.genotypes.site import read_labels

COMPLEMENT = {"A": "T", "T": "A", "C": "G", "G": "C"}


def small_cohort(people: int = 12, snps: int = 6) -> GenotypeData:
    rng = np.random.default_rng(3)
    ids = tuple(f"sim{j // 3}_{100 * j + 7}" for j in range(snps))  # regions 0, 1, ...: 3 SNPs each
    return GenotypeData(
        genotypes=rng.integers(0, 3, size=(people, snps)).astype(np.int8),
        labels=np.arange(people) % 3,
        classes=("AFR", "EUR", "ASIA"),
        snps=ids,
    )


def test_the_regions_lie_end_to_end_on_chromosome_1() -> None:
    table = cohort_table(("sim0_0", "sim0_999", "sim2_5"), region_length=1000, seed=0)
    assert table.chrom == ("1", "1", "1")
    assert table.pos == (1, 1000, 2006)  # region r, 0-based offset p -> r * 1000 + p + 1


def test_no_snp_gets_a_strand_ambiguous_allele_pair() -> None:
    table = cohort_table(tuple(f"sim0_{j}" for j in range(400)), region_length=1000, seed=1)
    pairs = set(zip(table.ref, table.alt, strict=True))
    assert pairs <= set(ALLELE_PAIRS) and len(pairs) == len(ALLELE_PAIRS)
    assert all(COMPLEMENT[r] != a for r, a in pairs)
    assert cohort_table(tuple(f"sim0_{j}" for j in range(400)), 1000, seed=1) == table  # seeded


@pytest.mark.parametrize("bad", ["rs12", "sim0_x", "sim_12"])
def test_an_id_that_is_not_a_simulated_position_is_refused(bad: str) -> None:
    with pytest.raises(DataPrepError, match=rf"simulated SNP ID '{bad}' is not sim<region>_<position>"):
        cohort_table((bad,), region_length=1000, seed=0)


def test_overlapping_regions_are_refused() -> None:
    with pytest.raises(DataPrepError, match="region_length 10 is too short"):
        cohort_table(("sim0_12", "sim1_2"), region_length=10, seed=0)


def test_every_person_goes_to_exactly_one_site() -> None:
    parts = split_people(np.arange(30) % 3, 3, "dirichlet", seed=0, alpha=0.5)
    assert sorted(np.concatenate(parts).tolist()) == list(range(30))


@pytest.mark.parametrize("fmt", ["vcf.gz", "bed", "vcf.gz,bed"])
def test_each_site_file_harmonises_back_to_its_people(tmp_path: Path, fmt: str) -> None:
    pytest.importorskip("bed_reader")
    cohort = small_cohort()
    table = cohort_table(cohort.snps, region_length=1000, seed=0)
    parts = split_people(cohort.labels, 2, "iid", seed=0, alpha=0.5)
    write_sites(tmp_path, cohort, table, parts, fmt)
    summary = json.loads((tmp_path / "cohort.json").read_text())
    formats = fmt.split(",") * (2 // len(fmt.split(",")))  # each site its own format when a list is given
    assert summary == {
        "classes": ["AFR", "EUR", "ASIA"],
        "snps": 6,
        "people": {"site-1": 6, "site-2": 6},
        "genotypes": f"{{site}}.{fmt}" if len(set(formats)) == 1 else None,
        "files": {"site-1": f"site-1.{formats[0]}", "site-2": f"site-2.{formats[1]}"},
        "labels": "{site}.labels.csv",
    }
    written_table = read_snp_table(tmp_path / "snp_table.csv")
    assert written_table.snps == cohort.snps and written_table.pos == table.pos
    for index, people in enumerate(parts):
        site = f"site-{index + 1}"
        result = harmonise_file(tmp_path / summary["files"][site], written_table)
        assert set(result.status) == {"same"}  # the orientation the table gives
        np.testing.assert_array_equal(result.genotypes, cohort.genotypes[people])  # copies of the table's ALT
        labels = read_labels(str(tmp_path / f"{site}.labels.csv"), "population", result.samples)
        assert labels.tolist() == [cohort.classes[c] for c in cohort.labels[people]]
    assert not list(tmp_path.glob(".simulate-*"))  # the scratch folder is gone


def test_an_unknown_format_writes_nothing(tmp_path: Path) -> None:
    cohort = small_cohort()
    with pytest.raises(DataPrepError, match=r"--format must be one of vcf, vcf.gz, bcf, bed, pgen, got 'csv'"):
        write_sites(tmp_path, cohort, cohort_table(cohort.snps, 1000, 0), [np.arange(12)], "csv")
    assert list(tmp_path.iterdir()) == []


def test_the_command_refuses_bad_settings_in_one_line(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["simulate-sites", "--out", str(out), "--snps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "error: simulated cohort: n_snps must be an integer >= 1, got 0"
    assert not out.exists()
