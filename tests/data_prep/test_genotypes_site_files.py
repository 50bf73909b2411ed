"""Hostile genotype files, third pass: the files real sites hold that were read wrongly without a word (people
shifted by one line, files of which no SNP is usable, GP/PL-only VCFs, gVCFs, ID styles), each written by hand here
with the helpers of ``test_genotypes_hostile.py``.

Each case named "was: ..." gave those wrong genotypes (or rc 0 with nothing usable) on the code of the commit before
the rule it tests; the cross-checks against plink2 2.00a3.5 / bcftools 1.16 were run by hand, the tests do not need
either tool.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cyvcf2")
pytest.importorskip("bed_reader")
pytest.importorskip("pgenlib")

from data_prep.errors import DataPrepError
from tests.data_prep.test_genotypes_hostile import M, harmonise, plink1, plink2, table

# Seven people, 40 SNPs: enough for the .bed padding checks, which need 32 SNPs in the file.
N_SNPS = 40
COPIES = np.random.default_rng(46).integers(0, 3, size=(7, N_SNPS))  # allele-1 copies as the .bed stores them
BIM = [f"1 rs{j} 0 {100 * (j + 1)} G A" for j in range(N_SNPS)]  # allele 1 G = the table's alt
FAM = [f"f{i} p{i} 0 0 {1 + i % 2} -9" for i in range(7)]
SNP_TABLE = "".join(f"rs{j},1,{100 * (j + 1)},A,G\n" for j in range(N_SNPS))


def bed_with_fam(folder: Path, fam_lines: list[str]) -> Path:
    """The seven people's .bed and .bim, with the .fam given (as a site might have edited it)."""
    path = plink1(folder, BIM, FAM, COPIES)
    (folder / "site.fam").write_text("\n".join(fam_lines) + "\n")
    return path


# ---- 1. no shifted people --------------------------------------------------------------------------------------------


def test_the_seven_people_read_right(tmp_path: Path) -> None:
    result = harmonise(bed_with_fam(tmp_path, FAM), table(tmp_path, SNP_TABLE))
    assert result.samples == tuple(f"p{i}" for i in range(7))
    np.testing.assert_array_equal(result.genotypes, COPIES)


@pytest.mark.parametrize(
    "header",
    ["FID IID PAT MAT SEX PHENOTYPE", "FID\tIID\tPAT\tMAT\tSEX\tPHENOTYPE", "fid iid pat mat sex phenotype"],
)
def test_a_fam_header_without_hash_is_refused(tmp_path: Path, header: str) -> None:
    # 8 lines, a multiple of 4: the .bed has the size of 8 people. Was: a person 'iid' with p0's genotypes, each
    # label one person late, p6 read from the padding bits (plink2 refuses the file).
    path = bed_with_fam(tmp_path, [header, *FAM])
    with pytest.raises(DataPrepError, match=r"site\.fam: line 1 is a header \(.*\) without PLINK's leading '#'.*"
                       r"'#FID IID \.\.\.'"):  # fmt: skip
        harmonise(path, table(tmp_path, SNP_TABLE))


@pytest.mark.parametrize(
    "lines",
    [
        ["#FID IID PAT MAT SEX PHENOTYPE"],  # plink2's own .fam/.psam header
        ["# written by a site's script", "##source=array export"],  # comments before the people
        ["#FID\tIID\tPAT\tMAT\tSEX\tPHENOTYPE"],
    ],
)
def test_hash_lines_of_a_fam_are_read_as_plink2_reads_them(tmp_path: Path, lines: list[str]) -> None:
    # Was: '#FID' read as a person (FID '#FID', IID 'IID'), everybody shifted by one.
    result = harmonise(bed_with_fam(tmp_path, [*lines, *FAM]), table(tmp_path, SNP_TABLE))
    assert result.samples == tuple(f"p{i}" for i in range(7))
    np.testing.assert_array_equal(result.genotypes, COPIES)
    assert result.sex == {"male": 4, "female": 3, "unknown": 0}


def test_a_fam_with_a_named_header_reads_its_columns(tmp_path: Path) -> None:
    # plink2 reads a .fam like a .psam: with a '#IID SEX' header the columns are those it names.
    lines = ["#IID SEX", *(f"p{i} {1 + i % 2}" for i in range(7))]
    result = harmonise(bed_with_fam(tmp_path, lines), table(tmp_path, SNP_TABLE))
    assert result.samples == tuple(f"p{i}" for i in range(7)) and result.sex["male"] == 4
    np.testing.assert_array_equal(result.genotypes, COPIES)


def test_a_hash_line_among_the_people_is_refused(tmp_path: Path) -> None:
    # Two .fam files pasted together. Was: a person '#FID' and everybody after shifted (plink2 refuses it).
    path = bed_with_fam(tmp_path, [*FAM[:3], "#FID IID PAT MAT SEX PHENOTYPE", *FAM[3:6]])
    with pytest.raises(DataPrepError, match=r"site\.fam: line 4 starts with '#' after the first person"):
        harmonise(path, table(tmp_path, SNP_TABLE))


def test_a_fam_one_line_too_long_is_refused_whatever_its_length(tmp_path: Path) -> None:
    # 8 lines for a .bed of 7 people: the same .bed size. Was: p7 with genotype 2 at every SNP (the padding check
    # was skipped for a line count that is a multiple of 4).
    path = bed_with_fam(tmp_path, [*FAM, "f7 p7 0 0 1 -9"])
    with pytest.raises(DataPrepError, match=r"the last person of .*site\.fam \('p7'\) reads as two copies of allele 1 "
                       r"at all 40 SNPs of the \.bed"):  # fmt: skip
        harmonise(path, table(tmp_path, SNP_TABLE))


@pytest.mark.parametrize("dropped", [6, 2])
def test_a_fam_one_line_too_short_is_refused(tmp_path: Path, dropped: int) -> None:
    # 6 people listed, 7 in the .bed (both 2 bytes a SNP). Was: the seventh person silently left out or, a middle
    # line deleted, everybody after it labelled with the previous person's genotypes.
    path = bed_with_fam(tmp_path, [line for i, line in enumerate(FAM) if i != dropped])
    with pytest.raises(DataPrepError, match=r"site\.bed holds calls past the 6 people of .*site\.fam \(in the padding "
                       r"bits of SNP 1\): the \.fam lists fewer people"):  # fmt: skip
        harmonise(path, table(tmp_path, SNP_TABLE))


def test_the_padding_check_reads_the_whole_bed_not_only_the_table_snps(tmp_path: Path) -> None:
    # A table of 3 SNPs: too few read to tell padding from a person before; the .bed's 40 SNPs tell.
    path = bed_with_fam(tmp_path, [*FAM, "f7 p7 0 0 1 -9"])
    with pytest.raises(DataPrepError, match=r"reads as two copies of allele 1 at all 40 SNPs"):
        harmonise(path, table(tmp_path, "".join(SNP_TABLE.splitlines(keepends=True)[:3])))


PVAR = "#CHROM\tPOS\tID\tREF\tALT\n" + "".join(f"1\t{100 * (j + 1)}\trs{j}\tA\tG\n" for j in range(N_SNPS))
ALT_COPIES = COPIES  # the .pgen counts ALT G, the table's alt


@pytest.mark.parametrize(
    ("header", "person"),
    [
        ("FID IID SEX", "f{i} p{i} {sex}"),
        ("IID SEX", "p{i} {sex}"),
        ("FID\tIID\tPAT\tMAT\tSEX", "f{i}\tp{i}\t0\t0\t{sex}"),
    ],
)
def test_a_psam_header_without_hash_is_refused(tmp_path: Path, header: str, person: str) -> None:
    # A header line and six people for a .pgen of 7. Was: read as the .fam layout, a person 'IID' first and every
    # label one person late ('IID SEX': refused as duplicated sample IDs, the cause unsaid).
    body = [person.format(i=i, sex=1 + i % 2) for i in range(6)]
    path = plink2(tmp_path, PVAR, "\n".join([header, *body]) + "\n", ALT_COPIES)
    with pytest.raises(DataPrepError, match=r"site\.psam: line 1 is a header \(.*\) without PLINK's leading '#'"):
        harmonise(path, table(tmp_path, SNP_TABLE))


def test_comments_before_a_psam_header_are_skipped(tmp_path: Path) -> None:
    # Was: '# hello' read as a .fam-layout person 'hello', then '#IID' as another.
    psam = "# hello\n##meta=1\n#IID\tSEX\n" + "".join(f"p{i}\t{1 + i % 2}\n" for i in range(7))
    result = harmonise(plink2(tmp_path, PVAR, psam, ALT_COPIES), table(tmp_path, SNP_TABLE))
    assert result.samples == tuple(f"p{i}" for i in range(7)) and result.sex["male"] == 4
    np.testing.assert_array_equal(result.genotypes, ALT_COPIES)


def test_a_psam_with_another_count_than_the_pgen_is_refused_saying_so(tmp_path: Path) -> None:
    psam = "#IID\n" + "".join(f"p{i}\n" for i in range(8))
    path = plink2(tmp_path, PVAR, psam, ALT_COPIES)
    with pytest.raises(DataPrepError, match=r"site\.pgen holds 7 people, its \.psam .* lists 8: use the \.psam "
                       r"written with this \.pgen"):  # fmt: skip
        harmonise(path, table(tmp_path, SNP_TABLE))
    assert M == 3
