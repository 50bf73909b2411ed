"""Hostile genotype files, each written by hand here (VCF text, ``.bim``/``.fam``/``.pvar``/``.psam`` text, ``.bed``
bytes bit by bit, ``.pgen`` by pgenlib's own writer), with the matrix a person would derive from the file by the
harmoniser's rules (docs/genomics.md, "What harmonising does to your file").

Each case named "was: ..." gave those wrong genotypes, or a traceback, before the rule it tests existed (run against
the code of the commit before it); the others were refused or dropped before and are tested for what they give now.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cyvcf2")
pytest.importorskip("bed_reader")
pgenlib = pytest.importorskip("pgenlib")

from data_prep.errors import DataPrepError  # noqa: E402
from data_prep.genotypes.harmonise import harmonise_file, read_snp_table  # noqa: E402

M = 3  # missing
VCF_HEADER = (
    "##fileformat=VCFv4.2\n"
    '##FILTER=<ID=LowQual,Description="low quality">\n'
    '##FORMAT=<ID=GT,Number=1,Type=String,Description="Genotype">\n'
    '##FORMAT=<ID=DS,Number=1,Type=Float,Description="ALT dosage">\n'
)
# PLINK 1 .bed: 2 bits per person, lowest bits first: 00 = two copies of allele 1, 01 = missing, 10 = one, 11 = none.
BED_CODE = {2: 0b00, M: 0b01, 1: 0b10, 0: 0b11}


def vcf(path: Path, samples: list[str], lines: list[str], header: str = "") -> Path:
    columns = "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\tFORMAT\t" + "\t".join(samples)
    body = "\n".join("\t".join(line.split()) for line in lines)
    path.write_text(VCF_HEADER + header + columns + "\n" + body + "\n")
    return path


def bed_bytes(allele1_copies: np.ndarray) -> bytes:
    """SNP-major .bed of a people x SNPs matrix of allele-1 copies (3 = missing), packed here bit by bit."""
    out = bytearray(b"\x6c\x1b\x01")
    people, snps = allele1_copies.shape
    for j in range(snps):
        for start in range(0, people, 4):
            byte = 0
            for k, g in enumerate(allele1_copies[start : start + 4, j]):
                byte |= BED_CODE[int(g)] << (2 * k)
            out.append(byte)
    return bytes(out)


def plink1(folder: Path, bim: list[str], fam: list[str], allele1_copies: np.ndarray) -> Path:
    (folder / "site.bim").write_text("\n".join(bim) + "\n")
    (folder / "site.fam").write_text("\n".join(fam) + "\n")
    (folder / "site.bed").write_bytes(bed_bytes(np.asarray(allele1_copies)))
    return folder / "site.bed"


def plink2(folder: Path, pvar: str, psam: str, alt_copies: np.ndarray | None = None, dosages=None) -> Path:
    """The .pvar/.psam text as given; the .pgen from pgenlib's writer (ALT copies, -9 missing; or ALT dosages)."""
    (folder / "site.pvar").write_text(pvar)
    (folder / "site.psam").write_text(psam)
    rows = alt_copies if dosages is None else dosages
    n_people, n_snps = np.asarray(rows).shape
    writer = pgenlib.PgenWriter(
        bytes(folder / "site.pgen"), n_people, n_snps, False, dosage_present=dosages is not None
    )
    for j in range(n_snps):
        if dosages is None:
            column = np.asarray(alt_copies)[:, j].astype(np.int8)
            writer.append_biallelic(np.where(column == M, -9, column).astype(np.int8))
        else:
            writer.append_dosages(np.asarray(dosages, np.float32)[:, j].copy())
    writer.close()
    return folder / "site.pgen"


def table(folder: Path, rows: str) -> Path:
    path = folder / "table.csv"
    path.write_text("snp,chrom,pos,ref,alt\n" + rows)
    return path


def harmonise(genotypes: Path, table_path: Path, **settings):
    if not settings:
        return harmonise_file(genotypes, read_snp_table(table_path))
    from data_prep.genotypes.harmonise import HarmoniseSettings

    return harmonise_file(genotypes, read_snp_table(table_path), HarmoniseSettings(**settings))


# ---- the X rule: one copy of X (males), Y, MT ----------------------------------------------------------------------


def test_vcf_calls_by_ploidy(tmp_path: Path) -> None:
    path = vcf(tmp_path / "site.vcf", ["m1", "m2", "f1"], [
        "chrX  2800000 . A G . PASS . GT 1     0    0/1",  # haploid males: 0 or 2 copies. Was: missing
        "chrY  2900000 . C T . PASS . GT 1     0    .",  # every call haploid. Was: m1 read as 1 (het)
        "chrY  3000000 . C T . PASS . GT 0/1   1    .",  # a het on Y: impossible, missing. Was: [1, M, M]
        "chrMT 150     . T C . PASS . GT 1     1    0",  # Was: [1, 1, 0]
        "chr1  1000    . A G . PASS . GT 1     0/1  1/1",  # haploid on an autosome: missing
        "chr1  2000    . A G . PASS . GT 0/0/1 0/1  0/2",  # triploid, and allele 2 of a biallelic record. Was: 0, 0
        "chr1  3000    . A G . PASS . GT 2/2   1/1/1 ./1",  # Was: 0, 2, M
    ])  # fmt: skip
    rows = "x1,X,2800000,A,G\ny1,Y,2900000,C,T\ny2,Y,3000000,C,T\nmt1,MT,150,T,C\na1,1,1000,A,G\na2,1,2000,A,G\n"
    result = harmonise(path, table(tmp_path, rows + "a3,1,3000,A,G\n"))
    expected = [[2, 2, M, 2, M, M, M], [0, 0, 2, 2, 1, 1, M], [1, M, M, 0, 2, M, M]]
    np.testing.assert_array_equal(result.genotypes, expected)
    assert result.calls == {
        "one_copy_as_homozygous": 8,  # x1: 2, y1: 2, y2: 1, mt1: 3
        "dosage_hard_called": 0,
        "invalid_allele": 2,
        "half_call": 1,
        "haploid": 1,
        "polyploid": 2,
        "heterozygous_one_copy": 1,
        "dosage_uncertain": 0,
        "dosage_ploidy_unknown": 0,
    }


# Three people, m1 and m2 male, f1 female; SNPs x1 (A>G), x2 (C>T), y1 (A>C), mt1 (G>A); table-alt copies:
ONE_COPY_TABLE = "x1,X,2800000,A,G\nx2,X,2900000,C,T\ny1,Y,3000000,A,C\nmt1,MT,150,G,A\n"
ONE_COPY_EXPECTED = [[2, M, 2, 2], [0, 2, 0, 0], [1, 0, M, 2]]


def one_copy_file(folder: Path, fmt: str) -> Path:
    """The same calls in each format's own way: a VCF writes a male's X haploid, PLINK as a homozygote with the sex
    in the .fam/.psam; m1's x2 call is a heterozygote PLINK kept for a male (missing under the rule; a VCF cannot
    write it for a one-copy call, so there it is missing)."""
    if fmt == "vcf":
        return vcf(folder / "site.vcf", ["m1", "m2", "f1"], [
            "chrX 2800000 . A G . PASS . GT 1 0 0/1",
            "chrX 2900000 . C T . PASS . GT . 1 0/0",
            "chrY 3000000 . A C . PASS . GT 1 0 .",
            "chrM 150 . G A . PASS . GT 1 0 1",
        ])  # fmt: skip
    copies = np.array([[2, 1, 2, 2], [0, 2, 0, 0], [1, 0, M, 2]])  # ALT copies as PLINK stores them
    if fmt == "bed":  # allele 1 = ALT; PLINK's numeric chromosome codes 23, 24, 26
        bim = ["23 x1 0 2800000 G A", "23 x2 0 2900000 T C", "24 y1 0 3000000 C A", "26 mt1 0 150 A G"]
        return plink1(folder, bim, ["f m1 0 0 1 -9", "f m2 0 0 1 -9", "f f1 0 0 2 -9"], copies)
    pvar = "#CHROM\tPOS\tID\tREF\tALT\n" + "".join(
        f"{chrom}\t{pos}\t{snp}\t{ref}\t{alt}\n"
        for chrom, pos, snp, ref, alt in [("X", 2800000, "x1", "A", "G"), ("X", 2900000, "x2", "C", "T"),
                                          ("Y", 3000000, "y1", "A", "C"), ("MT", 150, "mt1", "G", "A")]
    )  # fmt: skip
    return plink2(folder, pvar, "#IID\tSEX\nm1\t1\nm2\tmale\nf1\t2\n", copies)


@pytest.mark.parametrize("fmt", ["vcf", "bed", "pgen"])
def test_one_rule_for_one_copy_chromosomes_in_every_format(tmp_path: Path, fmt: str) -> None:
    # Was: VCF [[M, M, 1, 1], [M, M, 0, 0], [1, 0, M, 1]] (haploid calls missing, all-haploid records as hets);
    # PLINK m1's x2 heterozygote kept as 1.
    result = harmonise(one_copy_file(tmp_path, fmt), table(tmp_path, ONE_COPY_TABLE))
    np.testing.assert_array_equal(result.genotypes, ONE_COPY_EXPECTED)
    assert result.status == ("same",) * 4


def test_plink_sex_and_the_one_copy_tallies(tmp_path: Path) -> None:
    result = harmonise(one_copy_file(tmp_path, "bed"), table(tmp_path, ONE_COPY_TABLE))
    assert result.sex == {"male": 2, "female": 1, "unknown": 0}
    # One-copy calls: x1 and x2 of the males (3; m1's x2 heterozygote set missing), y1 (2 called), mt1 (3).
    assert result.calls["one_copy_as_homozygous"] == 3 + 2 + 3
    assert result.calls["heterozygous_one_copy"] == 1


def test_plink_xy_is_matched_as_x_and_stays_diploid(tmp_path: Path) -> None:
    # PLINK's --split-par writes the pseudo-autosomal part of X as chromosome XY (25). Was: absent.
    path = plink1(tmp_path, ["25 par1 0 100000 G A"], ["f m1 0 0 1 -9", "f f1 0 0 2 -9"], [[1], [2]])
    result = harmonise(path, table(tmp_path, "par1,X,100000,A,G\n"))
    assert result.status == ("same",)
    np.testing.assert_array_equal(result.genotypes, [[1], [2]])  # a male heterozygote in the PAR is a call


# ---- the dosage rule -----------------------------------------------------------------------------------------------


def test_vcf_dosages_are_hard_called_within_the_threshold(tmp_path: Path) -> None:
    path = vcf(tmp_path / "site.vcf", ["a", "b", "c", "d"], [
        "chr1 100 . A G . PASS . GT:DS 0/1:1.96 0/0:0.45 1/1:2 0/1:.",  # Was: [1, 0, 2, 1] (GT, whatever DS said)
        "chr1 200 . A G . PASS . DS 0.02 1.5 1 1.93",  # DS without GT. Was: a traceback
        "chrX 300 . A G . PASS . GT:DS 1:0.97 0:0.5 0/1:1.0 ./.:.",  # a haploid call's DS counts one copy
        "chr1 400 . A G . PASS . GT:DS 0/1:2.5 0/0:-0.2 1/1:. ./.:.",  # outside [0, 2]: invalid
    ])  # fmt: skip
    snp_table = table(tmp_path, "r1,1,100,A,G\nr2,1,200,A,G\nr3,X,300,A,G\nr4,1,400,A,G\n")
    result = harmonise(path, snp_table)
    np.testing.assert_array_equal(result.genotypes, [[2, 0, 2, M], [M, M, M, M], [2, 1, 1, 2], [1, 2, M, M]])
    assert result.calls["dosage_hard_called"] == 4  # 1.96, 0.02, 1.93, 2 x 0.97
    assert result.calls["dosage_uncertain"] == 3  # 0.45, 1.5, a haploid 0.5 (half a copy)
    assert result.calls["invalid_allele"] == 2
    strict = harmonise(path, snp_table, hard_call_threshold=0.01)
    np.testing.assert_array_equal(strict.genotypes[:, :2], [[M, M], [M, M], [2, 1], [1, M]])


def test_a_dosage_on_x_without_gt_is_missing(tmp_path: Path) -> None:
    # Without GT nothing says whether a DS on X counts one copy (0-1) or two (0-2).
    path = vcf(tmp_path / "site.vcf", ["a", "b"], ["chrX 300 . A G . PASS . DS 1 0"])
    result = harmonise(path, table(tmp_path, "r1,X,300,A,G\n"))
    np.testing.assert_array_equal(result.genotypes, [[M], [M]])
    assert result.calls["dosage_ploidy_unknown"] == 2


def test_pgen_dosages_follow_the_same_rule(tmp_path: Path) -> None:
    dosages = [[0.0, 2.0], [0.95, 1.0], [1.5, 0.04], [1.85, 1.0], [2.0, 0.5]]
    path = plink2(tmp_path, "#CHROM\tPOS\tID\tREF\tALT\n1\t100\tr1\tA\tG\n1\t200\tr2\tC\tT\n",
                  "#IID\na\nb\nc\nd\ne\n", dosages=dosages)  # fmt: skip
    snp_table = table(tmp_path, "r1,1,100,A,G\nr2,1,200,T,C\n")  # r2 swapped
    result = harmonise(path, snp_table)
    np.testing.assert_array_equal(result.genotypes, [[0, 0], [1, 1], [M, 2], [M, 1], [2, M]])
    assert result.calls["dosage_hard_called"] == 2  # 0.95, 0.04
    assert result.calls["dosage_uncertain"] == 3  # 1.5, 1.85, 0.5
    loose = harmonise(path, snp_table, hard_call_threshold=0.2)
    np.testing.assert_array_equal(loose.genotypes[:, 0], [0, 1, M, 2, 2])


# ---- monomorphic records ---------------------------------------------------------------------------------------------


def test_monomorphic_records_in_every_format(tmp_path: Path) -> None:
    # Was: 'mismatch', every call missing.
    snp_table = table(tmp_path, "r1,1,100,A,G\nr2,1,200,C,T\nr3,1,300,A,G\n")
    expected = [[2, 2, 0], [2, 2, 0], [M, M, M]]
    site = vcf(tmp_path / "site.vcf", ["a", "b", "c"], [
        "1 100 . G . . PASS . GT 0/0 0/0 ./.",  # ALT '.': everybody G/G = two copies of the table's alt
        "1 200 . T . . PASS . GT 0/0 0/0 0/1",  # 'allele 1' does not exist here: missing, counted
        "1 300 . T . . PASS . GT 0/0 0/0 .",  # T = comp(A), the table's ref on the other strand
    ])  # fmt: skip
    result = harmonise(site, snp_table)
    np.testing.assert_array_equal(result.genotypes, expected)
    assert result.status == ("monomorphic",) * 3 and result.calls["invalid_allele"] == 1
    bim = ["1 r1 0 100 0 G", "1 r2 0 200 T 0", "1 r3 0 300 0 T"]  # PLINK 1.9's allele '0': either column
    bed = plink1(tmp_path, bim, ["f a 0 0 0 -9", "f b 0 0 0 -9", "f c 0 0 0 -9"], [[0, 2, 0], [0, 2, 0], [M, 1, M]])
    result = harmonise(bed, snp_table)
    np.testing.assert_array_equal(result.genotypes, expected)
    assert result.calls["invalid_allele"] == 1  # c's one copy of T in a T/0 record
    pvar = "#CHROM\tPOS\tID\tREF\tALT\n1\t100\tr1\tG\t.\n1\t200\tr2\tT\t.\n1\t300\tr3\tT\t.\n"
    pgen = plink2(tmp_path, pvar, "#IID\na\nb\nc\n", [[0, 0, 0], [0, 0, 0], [M, 1, M]])
    np.testing.assert_array_equal(harmonise(pgen, snp_table).genotypes, expected)


def test_the_federated_qc_keeps_a_snp_monomorphic_at_one_site(tmp_path: Path) -> None:
    from data_prep.genotypes.federated_qc import combine_counts
    from data_prep.genotypes.qc import QcThresholds, allele_stats, genotype_counts, qc_filter

    # rs1 is rare: carried at sites 1 and 3 only; at site 2 PLINK 1.9 wrote it with allele 1 '0' (nobody has A).
    snp_table = table(tmp_path, "rs1,1,100,G,A\nrs2,1,200,C,T\n")
    site_calls = {"site-1": [[1, 0]] + [[0, 1]] * 19, "site-2": [[0, 2]] * 20, "site-3": [[2, 1]] + [[0, 0]] * 19}
    sites = {}
    for site, calls in site_calls.items():
        folder = tmp_path / site
        folder.mkdir()
        copies = np.array(calls)  # copies of A (rs1) and T (rs2), allele 1
        allele_1 = ["0" if site == "site-2" else "A", "T"]
        bim = [f"1 rs1 0 100 {allele_1[0]} G", "1 rs2 0 200 T C"]
        fam = [f"{site} p{i} 0 0 0 -9" for i in range(20)]
        result = harmonise(plink1(folder, bim, fam, copies), snp_table)
        assert result.status[0] == ("monomorphic" if site == "site-2" else "same")
        sites[site] = (result.snps, genotype_counts(result.genotypes))
    _, total = combine_counts(sites)
    pooled = genotype_counts(np.concatenate([np.array(c) for c in site_calls.values()]))
    np.testing.assert_array_equal(total, pooled)  # was: site 2's 20 people missing at rs1
    call_rate, alt_freq, _ = allele_stats(total)
    assert call_rate[0] == 1.0 and alt_freq[0] == pytest.approx(3 / 120)  # was: call rate 2/3, frequency 3/80
    assert qc_filter(total, QcThresholds(min_call_rate=0.95, min_maf=0.01)).tolist() == [True, True]


# ---- records a harmoniser must not use -------------------------------------------------------------------------------


def test_a_multiallelic_site_split_into_biallelic_records(tmp_path: Path) -> None:
    # bcftools norm -m- writes A>G,T as A>G and A>T; person a (G/T) becomes 0/1 in both. Against a table G>A, the
    # A>G record alone (swapped: 2 - 1) said a has one A, which a does not have. Was: [1, 2, 0].
    path = vcf(tmp_path / "site.vcf", ["a", "b", "c"], [
        "1 100 . A G . PASS . GT 0/1 0/0 1/1",
        "1 100 . A T . PASS . GT 0/1 0/0 0/0",
    ])  # fmt: skip
    result = harmonise(path, table(tmp_path, "rs1,1,100,G,A\n"))
    assert result.status == ("multiallelic",)
    np.testing.assert_array_equal(result.genotypes, [[M], [M], [M]])


def test_records_failing_a_filter_are_not_used(tmp_path: Path) -> None:
    # Was: used as if they had passed.
    path = vcf(tmp_path / "site.vcf", ["a", "b"], [
        "1 100 . A G . LowQual . GT 0/1 1/1",
        "1 200 . A G . PASS . GT 0/1 1/1",
        "1 300 . A G . . . GT 0/1 1/1",
    ])  # fmt: skip
    result = harmonise(path, table(tmp_path, "r1,1,100,A,G\nr2,1,200,A,G\nr3,1,300,A,G\n"))
    assert result.status == ("filtered", "same", "same")
    np.testing.assert_array_equal(result.genotypes, [[M, 1, 1], [M, 2, 2]])
    pvar = "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\n1\t100\tr1\tA\tG\t.\tq10\n1\t200\tr2\tA\tG\t.\tPASS\n"
    pgen = plink2(tmp_path, pvar, "#IID\na\nb\n", [[1, 1], [2, 2]])
    assert harmonise(pgen, table(tmp_path, "r1,1,100,A,G\nr2,1,200,A,G\n")).status == ("filtered", "same")


def test_a_fam_with_more_people_than_the_bed_is_refused(tmp_path: Path) -> None:
    # 5 people take 2 bytes per SNP, as 6, 7 or 8 would: bed-reader reads a sixth person from the padding bits
    # (00 = two copies of allele 1). Was: a person p5 with genotype 2 at every SNP.
    copies = np.random.default_rng(0).integers(0, 3, size=(5, 40))
    bim = [f"1 s{j} 0 {100 * (j + 1)} G A" for j in range(40)]
    fam = [f"f p{i} 0 0 0 -9" for i in range(6)]
    path = plink1(tmp_path, bim, fam, copies)
    snp_table = table(tmp_path, "".join(f"rs{j},1,{100 * (j + 1)},A,G\n" for j in range(40)))
    with pytest.raises(DataPrepError, match=r"the last person of .*site\.fam \('p5'\) reads as two copies of allele 1"):
        harmonise(path, snp_table)
    (tmp_path / "site.fam").write_text("\n".join(fam[:5]) + "\n")
    np.testing.assert_array_equal(harmonise(path, snp_table).genotypes, copies)


# ---- genome build ----------------------------------------------------------------------------------------------------


def test_a_file_on_another_build_is_refused_by_its_rsids(tmp_path: Path) -> None:
    # The table's positions on one build, the file's on another: at 20 of the table's positions the file has other
    # SNPs (their own rsIDs), whose alleles happen to fit. Was: 20 'same' SNPs, every genotype another SNP's.
    bim = [f"1 rs{1000 + j} 0 {5000 + 100 * j} G A" for j in range(20)]
    path = plink1(tmp_path, bim, [f"f p{i} 0 0 0 -9" for i in range(4)], np.ones((4, 20), int))
    rows = "".join(f"rs{9000 + j},1,{5000 + 100 * j},A,G\n" for j in range(20))
    with pytest.raises(DataPrepError, match=r"20 of the 20 table SNPs found by position carry another ID"):
        harmonise(path, table(tmp_path, rows))


def test_a_few_disagreeing_rsids_are_dropped_and_counted(tmp_path: Path) -> None:
    bim = [f"1 rs{1000 + j} 0 {5000 + 100 * j} G A" for j in range(40)]
    bim[7] = "1 rs77 0 5700 G A"  # one merged or misplaced rsID: 1 of 40 = 2.5 %
    path = plink1(tmp_path, bim, [f"f p{i} 0 0 0 -9" for i in range(4)], np.ones((4, 40), int))
    rows = "".join(f"rs{1000 + j},1,{5000 + 100 * j},A,G\n" for j in range(40))
    result = harmonise(path, table(tmp_path, rows))
    assert result.status[7] == "id_mismatch" and result.counts()["same"] == 39
    assert (result.genotypes[:, 7] == M).all()
    assert result.ids == {"compared": 40, "disagree": 1, "share": 0.025, "max_share": 0.05,
                          "disagreements": [{"snp": "rs1007", "position": "1:5700", "file_ids": "rs77"}]}  # fmt: skip
    with pytest.raises(DataPrepError, match=r"above max_id_disagreement 1\.0%"):
        harmonise(path, table(tmp_path, rows), max_id_disagreement=0.01)


def test_a_header_on_another_build_is_refused(tmp_path: Path) -> None:
    header = "##contig=<ID=chr1,length=249250621>\n"  # chromosome 1 of GRCh37
    path = vcf(tmp_path / "site.vcf", ["a"], ["chr1 100 rs5;rs6 A G . PASS . GT 0/1"], header)
    snp_table = table(tmp_path, "rs6,1,100,A,G\n")
    with pytest.raises(DataPrepError, match=r"declares genome build GRCh37 \(##contig chr1 length=249250621\)"):
        harmonise(path, snp_table, genome_build="GRCh38")
    result = harmonise(path, snp_table, genome_build="GRCh37")
    assert result.build == {"declared": "GRCh37", "evidence": "##contig chr1 length=249250621", "required": "GRCh37"}
    assert result.ids["compared"] == 1 and result.ids["disagree"] == 0  # rs6 is among the record's IDs


@pytest.mark.parametrize(
    ("lines", "build"),
    [
        (["##reference=file:///refs/Homo_sapiens_assembly38.fasta", "##contig=<ID=chr1,length=248956422>"], "GRCh38"),
        (["##reference=ftp://ftp.1000genomes.ebi.ac.uk/vol1/ftp/technical/reference/human_g1k_v37.fasta.gz"], "GRCh37"),
        (["##contig=<ID=1,assembly=b37,length=249250621>"], "GRCh37"),
        (["##contig=<ID=chr1,length=248956422>", "##contig=<ID=chrX,length=155270560>"], "conflicting"),
        (["##contig=<ID=chr22,length=50818468>"], None),
    ],
)
def test_declared_build(lines: list[str], build: str | None) -> None:
    from data_prep.genotypes.formats import declared_build

    assert declared_build(lines)[0] == build


def test_an_indel_record_at_a_snp_position_does_not_block_it(tmp_path: Path) -> None:
    # An unnormalised VCF: a multi-allelic indel beside the SNP at the same position. Was: 'multiallelic', all missing.
    path = vcf(tmp_path / "site.vcf", ["a", "b"], [
        "1 100 . C CA,CAA . PASS . GT 1/2 0/0",
        "1 100 . C T . PASS . GT 0/1 1/1",
    ])  # fmt: skip
    result = harmonise(path, table(tmp_path, "rs1,1,100,C,T\n"))
    assert result.status == ("same",)
    np.testing.assert_array_equal(result.genotypes, [[1], [2]])


def test_semicolon_separated_vcf_ids_are_matched(tmp_path: Path) -> None:
    # Was: 'absent' (the ID 'rs4;rs4b' compared whole).
    path = vcf(tmp_path / "site.vcf", ["a", "b"], ["1 100 rs4;rs4b A G . PASS . GT 0/1 1/1"])
    (tmp_path / "ids.csv").write_text("snp,ref,alt\nrs4b,A,G\n")
    result = harmonise_file(path, read_snp_table(tmp_path / "ids.csv"))
    assert result.status == ("same",)
    np.testing.assert_array_equal(result.genotypes, [[1], [2]])


def test_a_file_whose_ids_sit_one_snp_further_is_refused(tmp_path: Path) -> None:
    # Another build: the same rsIDs, each at the next table SNP's position; the alleles fit by flip or swap.
    lines = ["1 100 rsOTHER T C . PASS . GT 1/1 1/1", "1 200 rsT1 G A . PASS . GT 0/1 0/0",
             "1 300 rsT2 C T . PASS . GT 1/1 0/1", "1 400 rsT3 A G . PASS . GT 0/0 0/1"]  # fmt: skip
    path = vcf(tmp_path / "site.vcf", ["a", "b"], lines)
    snp_table = table(tmp_path, "rsT1,1,100,A,G\nrsT2,1,200,A,G\nrsT3,1,300,G,A\n")
    with pytest.raises(DataPrepError, match=r"3 of the 3 table SNPs found by position carry another ID in the file .*"
                       r"e\.g\. rsT1 at 1:100 is rsOTHER\): it is on another genome build"):  # fmt: skip
        harmonise(path, snp_table)


def test_a_truncated_pgen_and_a_compressed_pvar_are_refused_in_one_line(tmp_path: Path) -> None:
    pvar = "#CHROM\tPOS\tID\tREF\tALT\n" + "".join(f"1\t{100 * (j + 1)}\tr{j}\tA\tG\n" for j in range(40))
    path = plink2(tmp_path, pvar, "#IID\n" + "".join(f"p{i}\n" for i in range(50)), np.ones((50, 40), int))
    path.write_bytes(path.read_bytes()[:300])  # was: "read_range() error 4"
    snp_table = table(tmp_path, "".join(f"r{j},1,{100 * (j + 1)},A,G\n" for j in range(40)))
    with pytest.raises(DataPrepError, match=r"site\.pgen: the \.pgen ends before the records its header indexes "
                       r"\(300 bytes; .*\): the file is truncated"):  # fmt: skip
        harmonise(path, snp_table)
    path.with_suffix(".pvar").rename(tmp_path / "site.pvar.zst")  # was: "its .pvar file ... is missing"
    with pytest.raises(DataPrepError, match=r"site\.pgen: its \.pvar is zstd-compressed \(.*site\.pvar\.zst\)"):
        harmonise(path, snp_table)


@pytest.mark.parametrize("fmt", ["bed", "pgen"])
def test_one_iid_under_two_fids_is_refused_saying_why(tmp_path: Path, fmt: str) -> None:
    if fmt == "bed":
        path = plink1(tmp_path, ["1 r1 0 100 G A"], ["fam1 p1 0 0 0 -9", "fam2 p1 0 0 0 -9"], [[1], [2]])
        side = "site.fam"
    else:
        pvar = "#CHROM\tPOS\tID\tREF\tALT\n1\t100\tr1\tA\tG\n"
        path = plink2(tmp_path, pvar, "#FID\tIID\nfam1\tp1\nfam2\tp1\n", [[1], [2]])
        side = "site.psam"
    with pytest.raises(DataPrepError, match=rf"IID 'p1' is in .*{side} twice, under FIDs 'fam1' and 'fam2' "
                       r"\(samples 1 and 2\): PLINK tells people apart by FID\+IID"):  # fmt: skip
        harmonise(path, table(tmp_path, "r1,1,100,A,G\n"))


# ---- the command -----------------------------------------------------------------------------------------------------


def test_the_report_says_what_harmonising_did(tmp_path: Path) -> None:
    from data_prep.genotypes.cli import main

    path = one_copy_file(tmp_path, "bed")
    out, report = tmp_path / "site.npz", tmp_path / "report.json"
    argv = ["harmonise", "--genotypes", str(path), "--snp-table", str(table(tmp_path, ONE_COPY_TABLE)),
            "--out", str(out), "--report", str(report), "--hard-call-threshold", "0.2"]  # fmt: skip
    assert main(argv) == 0
    written = json.loads(report.read_text())
    assert written["calls"]["set_missing"]["heterozygous_one_copy"] == 1
    assert written["calls"]["one_copy_as_homozygous"] == 8
    assert written["ids"]["compared"] == 4 and written["ids"]["disagreements"] == []  # the file names x1 ... too
    assert written["genome_build"] == {"declared": None, "evidence": "", "required": None}
    assert written["sex"] == {"male": 2, "female": 1, "unknown": 0}
    assert written["settings"] == {
        "hard_call_threshold": 0.2,
        "max_id_disagreement": 0.05,
        "genome_build": None,
        "min_person_call_rate": 0.9,
    }
    # m1 is called at 3 of the 4 SNPs (x2 set missing), f1 at 3 (no Y): both named below 0.9.
    assert written["person_call_rate"] == {
        "mean": pytest.approx(10 / 12),
        "min": 0.75,
        "threshold": 0.9,
        "below": [{"sample": "m1", "call_rate": 0.75}, {"sample": "f1", "call_rate": 0.75}],
    }
    assert written["dropped"] == {}


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--hard-call-threshold", "0.5", "hard_call_threshold must be a number in [0, 0.5), got 0.5"),
        ("--max-id-disagreement", "1.5", "max_id_disagreement must be a share in [0, 1], got 1.5"),
    ],
)
def test_settings_out_of_range_are_refused(
    tmp_path: Path, option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from data_prep.genotypes.cli import main

    path = one_copy_file(tmp_path, "vcf")
    argv = ["harmonise", "--genotypes", str(path), "--snp-table", str(table(tmp_path, ONE_COPY_TABLE)),
            "--out", str(tmp_path / "x.npz"), option, value]  # fmt: skip
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not (tmp_path / "x.npz").exists()


def test_the_harmonise_command_does_not_import_torch() -> None:
    code = "import sys, data_prep.genotypes.cli, data_prep.genotypes.site; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
