"""Genotype files (VCF, VCF.gz, BCF, PLINK 1, PLINK 2) harmonised against the consortium's SNP table: one fixture per
format written by the test, a hand-derived expected matrix with one SNP per alignment rule, the 1000 Genomes panel
round-tripped through every format, the command, and bad input (one line naming the file and line; nothing written).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cyvcf2")
pytest.importorskip("bed_reader")
pytest.importorskip("pgenlib")

from data_prep.genotypes import GenotypeData
from data_prep.genotypes.cli import main
from data_prep.genotypes.harmonise import (
    ReferenceTable,
    align,
    harmonise_file,
    normalise_chrom,
    read_snp_table,
)
from data_prep.genotypes.writers import Sites, write_genotype_file

M = 3  # missing
FORMATS = ["vcf", "vcf.gz", "bcf", "bed", "pgen"]
SAMPLES = ["p1", "p2", "p3"]
TABLE_CSV = """snp,chrom,pos,ref,alt
rs_same,6,100,A,G
rs_swap,6,200,C,T
rs_flip,6,300,A,C
rs_flipswap,6,400,G,A
rs_ambiguous,6,500,A,T
rs_multi,6,600,A,G
rs_mismatch,6,700,A,G
rs_absent,6,800,A,G
rs_chrx,X,900,C,A
"""
# The site's file: its own IDs, "chr" names, records in its own orientation; counts of the file's ALT per person.
FILE_SITES = Sites(
    chrom=["chr6", "chr6", "chr6", "chr6", "chr6", "chr6", "chr6", "chr6", "chrX"],
    pos=[100, 200, 300, 400, 500, 600, 700, 750, 900],
    ids=["site_a", "site_b", "site_c", "site_d", "site_e", "site_f", "site_g", "site_extra", "site_x"],
    ref=["A", "T", "T", "T", "A", "A", "A", "G", "C"],
    alt=["G", "C", "G", "C", "T", "G,T", "C", "C", "A"],
)
FILE_COUNTS = np.array(
    [  # file ALT copies: p1, p2, p3 per record (columns below are records)
        [0, 0, 1, 2, 0, 0, 0, 1, 1],
        [1, 2, 1, 1, 1, 1, 1, 1, 0],
        [2, M, 0, 0, 2, 2, 2, 1, 2],
    ],
    dtype=np.int8,
)
# Derived by hand from the rules: same -> g; ref/alt swapped -> 2 - g; other strand (T/G = complement of A/C) -> g;
# other strand and swapped (T/C = complement of A/G, ALT C = comp(G) = table ref) -> 2 - g; A/T ambiguous, the
# multi-allelic record, the A/C record against A/G (no orientation fits) and the absent SNP -> all 3; missing
# stays missing.
EXPECTED = np.array(
    [
        [0, 2, 1, 0, M, M, M, M, 1],
        [1, 0, 1, 1, M, M, M, M, 0],
        [2, M, 0, 2, M, M, M, M, 2],
    ],
    dtype=np.int8,
)
STATUS = ("same", "swapped", "flipped", "flipped_swapped", "ambiguous", "multiallelic", "mismatch", "absent", "same")


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "table.csv"
    path.write_text(TABLE_CSV)
    return path


def harmonise_args(genotypes: Path, table: Path, out: Path, report: Path | None = None) -> list[str]:
    args = ["harmonise", "--genotypes", str(genotypes), "--snp-table", str(table), "--out", str(out)]
    return args + (["--report", str(report)] if report else [])


def write_site(tmp_path: Path, fmt: str, sites: Sites = FILE_SITES, counts: np.ndarray = FILE_COUNTS) -> Path:
    return write_genotype_file(tmp_path / f"site.{fmt}", counts, SAMPLES, sites)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_alignment_rule_gives_the_hand_derived_matrix(tmp_path: Path, table: Path, fmt: str) -> None:
    result = harmonise_file(write_site(tmp_path, fmt), read_snp_table(table))
    np.testing.assert_array_equal(result.genotypes, EXPECTED)
    assert result.genotypes.dtype == np.int8
    assert result.samples == tuple(SAMPLES)
    assert result.snps == tuple(read_snp_table(table).snps)
    # PLINK 1 has no multi-allelic records: the ".bim" holds the allele text "G,T", which fits A/G in no orientation.
    expected = STATUS if fmt != "bed" else tuple("mismatch" if s == "multiallelic" else s for s in STATUS)
    assert result.status == expected


@pytest.mark.parametrize(
    ("ref", "alt", "counted", "other", "status"),
    [
        ("A", "G", "G", "A", "same"),
        ("A", "G", "A", "G", "swapped"),
        ("A", "G", "C", "T", "flipped"),
        ("A", "G", "T", "C", "flipped_swapped"),
        ("A", "T", "T", "A", "ambiguous"),
        ("C", "G", "C", "G", "ambiguous"),
        ("A", "G", "C", "A", "mismatch"),
        ("a", "g", "G", "a", "same"),
    ],
)
def test_align(ref: str, alt: str, counted: str, other: str, status: str) -> None:
    assert align(ref, alt, counted, other) == status


@pytest.mark.parametrize(
    ("name", "norm"),
    [("chr6", "6"), ("6", "6"), ("CHR6", "6"), ("chrX", "X"), ("23", "X"), ("chrM", "MT"), ("26", "MT"), ("MT", "MT")],
)
def test_chromosome_names_are_reconciled(name: str, norm: str) -> None:
    assert normalise_chrom(name) == norm


@pytest.mark.parametrize("fmt", ["vcf", "bed", "pgen"])
def test_two_records_that_both_fit_a_snp_are_a_duplicate(tmp_path: Path, fmt: str) -> None:
    sites = Sites(["6", "6"], [100, 100], ["a", "b"], ["A", "G"], ["G", "A"])
    path = write_site(tmp_path, fmt, sites, np.array([[0, 2], [1, 1], [2, 0]], np.int8))
    table = ReferenceTable(("rs1",), ("A",), ("G",), ("6",), (100,))
    result = harmonise_file(path, table)
    assert result.status == ("duplicate",)
    np.testing.assert_array_equal(result.genotypes, [[M], [M], [M]])


def test_a_snp_ref_alt_table_matches_by_snp_id(tmp_path: Path) -> None:
    sites = Sites(["1", "2"], [5, 9], ["rs1", "rs2"], ["A", "C"], ["G", "T"])
    path = write_site(tmp_path, "vcf", sites, np.array([[0, 1], [2, M], [1, 0]], np.int8))
    (tmp_path / "ids.csv").write_text("snp,ref,alt\nrs2,T,C\nrs1,A,G\nrs9,A,C\n")
    result = harmonise_file(path, read_snp_table(tmp_path / "ids.csv"))
    assert result.status == ("swapped", "same", "absent")
    np.testing.assert_array_equal(result.genotypes, [[1, 0, M], [M, 2, M], [2, 1, M]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_1000_genomes_panel_round_trips_through_every_format(tmp_path: Path, fmt: str) -> None:
    from data_prep.genomics import load_1kg_panel, panel_table

    panel, snp_table = load_1kg_panel(), panel_table()
    ref = [a[0] for a in snp_table.alleles]
    alt = [a[1] for a in snp_table.alleles]
    pos = [1000 * (j + 1) for j in range(len(ref))]
    samples = [f"HG{i:05d}" for i in range(len(panel.labels))]
    path = write_genotype_file(
        tmp_path / f"panel.{fmt}",
        panel.genotypes,
        samples,
        Sites(["1"] * len(ref), pos, list(snp_table.snps), ref, alt),
    )
    table = ReferenceTable(snp_table.snps, tuple(ref), tuple(alt), ("1",) * len(ref), tuple(pos))
    result = harmonise_file(path, table)
    assert set(result.status) == {"same"} or set(result.status) <= {"same", "ambiguous"}
    usable = np.array([s == "same" for s in result.status])
    np.testing.assert_array_equal(result.genotypes[:, usable], panel.genotypes[:, usable])
    assert (result.genotypes[:, ~usable] == M).all()
    ambiguous = [{r, a} in ({"A", "T"}, {"C", "G"}) for r, a in zip(ref, alt, strict=True)]
    assert usable.tolist() == [not a for a in ambiguous]


def test_the_command_writes_the_matrix_and_the_report(tmp_path: Path, table: Path) -> None:
    path = write_site(tmp_path, "vcf.gz")
    out, report = tmp_path / "out" / "site.npz", tmp_path / "out" / "report.json"
    labels = tmp_path / "labels.csv"
    labels.write_text("sample,population\np3,EUR\np1,AFR\np2,EAS\n")
    assert main([*harmonise_args(path, table, out, report), "--labels", str(labels)]) == 0
    with np.load(out) as stored:
        np.testing.assert_array_equal(stored["genotypes"], EXPECTED)
        assert stored["genotypes"].dtype == np.int8
        assert stored["samples"].tolist() == SAMPLES
        assert stored["snps"].tolist() == list(read_snp_table(table).snps)
        assert stored["labels"].tolist() == ["AFR", "EAS", "EUR"]
    written = json.loads(report.read_text())
    assert written["alignment"] == {
        "same": 2,
        "swapped": 1,
        "flipped": 1,
        "flipped_swapped": 1,
        "ambiguous": 1,
        "multiallelic": 1,
        "duplicate": 0,
        "monomorphic": 0,
        "mismatch": 1,
        "filtered": 0,
        "id_mismatch": 0,
        "absent": 1,
    }
    assert written["usable_snps"] == 5 and written["people"] == 3
    # Usable SNPs (columns 0-3 and 8): one missing call of 15 -> mean call rate (1 + 2/3 + 1 + 1 + 1) / 5.
    assert written["qc"]["call_rate"]["mean"] == pytest.approx((4 + 2 / 3) / 5, abs=1e-6)
    assert written["qc"]["call_rate"]["min"] == pytest.approx(2 / 3, abs=1e-6)


def test_the_command_module_runs(tmp_path: Path, table: Path) -> None:
    import subprocess
    import sys

    path = write_site(tmp_path, "bed")
    out = tmp_path / "site.npz"
    done = subprocess.run(
        [sys.executable, "-m", "data_prep.genotypes", *harmonise_args(path, table, out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "3 people x 9 table SNPs (5 usable)" in done.stdout


def test_genotype_data_is_still_importable_from_its_module() -> None:
    from data_prep.genomics import GenotypeData as reexported

    assert reexported is GenotypeData


# ---- bad input: one line naming the file and the line/record; nothing written ---------------------------------------


def refused(tmp_path: Path, genotypes: Path, table: Path, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    out, report = tmp_path / "refused.npz", tmp_path / "refused.json"
    argv = harmonise_args(genotypes, table, out, report)
    assert main(argv) == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1, message
    assert match in message, message
    assert not out.exists() and not report.exists()
    assert not list(tmp_path.glob("*.tmp*"))


def test_a_vcf_that_does_not_parse(tmp_path: Path, table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.vcf"
    bad.write_text("this is not a VCF\n")
    refused(tmp_path, bad, table, f"{bad}: not a readable VCF/BCF file", capsys)


def test_a_vcf_record_that_does_not_parse(tmp_path: Path, table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_site(tmp_path, "vcf")
    lines = path.read_text().splitlines()
    record = next(i for i, line in enumerate(lines) if line.startswith("chr6\t200\t"))
    lines[record] = lines[record].replace("chr6\t200\t", "chr6\tabc\t")
    path.write_text("\n".join(lines) + "\n")
    refused(tmp_path, path, table, f"{path}: record 2 (after chr6:100) does not parse", capsys)


@pytest.mark.parametrize(("fmt", "side"), [("bed", ".bim"), ("bed", ".fam"), ("pgen", ".pvar"), ("pgen", ".psam")])
def test_a_missing_side_file(
    tmp_path: Path, table: Path, fmt: str, side: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_site(tmp_path, fmt)
    path.with_suffix(side).unlink()
    refused(tmp_path, path, table, f"{path}: its {side} file {path.with_suffix(side)} is missing", capsys)


def test_a_malformed_bim_line(tmp_path: Path, table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_site(tmp_path, "bed")
    bim = path.with_suffix(".bim")
    lines = bim.read_text().splitlines()
    lines[2] = "chr6 site_c 0"
    bim.write_text("\n".join(lines) + "\n")
    refused(tmp_path, path, table, f"{bim}: line 3: expected 6 columns", capsys)


def test_a_bed_with_a_wrong_magic_number(tmp_path: Path, table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_site(tmp_path, "bed")
    path.write_bytes(b"\x00\x00\x00" + path.read_bytes()[3:])
    refused(tmp_path, path, table, f"{path}: not a readable PLINK 1 .bed file", capsys)


@pytest.mark.parametrize("header", ["snp,chrom,ref,alt", "snp,ref", "id,chrom,pos,ref,alt"])
def test_a_table_without_the_required_columns(tmp_path: Path, header: str, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad_table.csv"
    bad.write_text(header + "\n")
    refused(tmp_path, write_site(tmp_path, "vcf"), bad, f"{bad}: line 1: the SNP table lacks column(s)", capsys)


def test_a_table_with_a_duplicated_position(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "dup_table.csv"
    bad.write_text("snp,chrom,pos,ref,alt\nrs1,6,100,A,G\nrs2,chr6,100,A,C\n")
    refused(tmp_path, write_site(tmp_path, "vcf"), bad, f"{bad}: line 3: position 6:100 is also on line 2", capsys)


def test_no_table_snp_in_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other_table.csv"
    other.write_text("snp,chrom,pos,ref,alt\nrs1,6,123456,A,G\n")
    path = write_site(tmp_path, "pgen")
    refused(tmp_path, path, other, f"{path}: none of the 1 SNPs of {other} found by chromosome and position", capsys)


@pytest.mark.parametrize("fmt", ["bed", "pgen", "vcf", "vcf.gz"])
def test_duplicated_sample_ids(tmp_path: Path, table: Path, fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / f"dup.{fmt}"
    if fmt == "vcf.gz":  # htslib refuses to write it, so the duplicate goes into a text VCF compressed by gzip
        import gzip

        text = write_genotype_file(tmp_path / "dup.vcf", FILE_COUNTS, ["p1", "p2", "p1"], FILE_SITES)
        path.write_bytes(gzip.compress(text.read_bytes()))
        text.unlink()
    else:
        write_genotype_file(path, FILE_COUNTS, ["p1", "p2", "p1"], FILE_SITES)
    refused(tmp_path, path, table, f"{path}: duplicated sample ID 'p1' (samples 1 and 3)", capsys)


def test_a_chromosome_naming_that_cannot_be_reconciled(
    tmp_path: Path, table: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sites = Sites(["NC_000006.12"], [100], ["a"], ["A"], ["G"])
    path = write_site(tmp_path, "bed", sites, np.array([[0], [1], [2]], np.int8))
    refused(tmp_path, path, table, f"{path}: record 1: chromosome 'NC_000006.12' cannot be reconciled", capsys)


def test_a_file_that_is_no_genotype_format(tmp_path: Path, table: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "site.txt"
    path.write_text("x\n")
    refused(tmp_path, path, table, f"{path}: not a genotype file; expected one of .vcf", capsys)
