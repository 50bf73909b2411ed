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


# ---- 2. unusable files refused, a bad site named ---------------------------------------------------------------------

TABLE_BASES = [("A", "G"), ("C", "T"), ("A", "C"), ("G", "T")]  # no A/T or C/G: none ambiguous
CODED_TABLE = "".join(
    f"rs{j},1,{100 * (j + 1)},{TABLE_BASES[j % 4][0]},{TABLE_BASES[j % 4][1]}\n" for j in range(N_SNPS)
)
_NUMBER = {"A": "1", "C": "2", "G": "3", "T": "4"}


def coded_bim(coding: str) -> list[str]:
    """The table's SNPs with allele 1 = alt, in one of the array codings a .bim may hold."""
    lines = []
    for j in range(N_SNPS):
        ref, alt = TABLE_BASES[j % 4]
        a1, a2 = {"12": ("1", "2"), "1234": (_NUMBER[alt], _NUMBER[ref]), "AB": ("B", "A")}[coding]
        lines.append(f"1 rs{j} 0 {100 * (j + 1)} {a1} {a2}")
    return lines


@pytest.mark.parametrize(
    ("coding", "fix"),
    [
        ("12", r"coded 1/2 \(plink --recode12: .*plink2 --bfile site --update-alleles"),
        ("1234", r"coded 1/2/3/4 .*plink --bfile site --alleleACGT --make-bed"),
        ("AB", r"coded A/B \(Illumina\).*array's manifest.*plink2 --bfile site --update-alleles"),
    ],
)
def test_a_bim_in_another_allele_coding_is_refused_naming_the_fix(tmp_path: Path, coding: str, fix: str) -> None:
    # Was: rc 0, all 40 SNPs 'mismatch', every column missing (a site that empties the federated QC).
    path = plink1(tmp_path, coded_bim(coding), FAM, COPIES)
    with pytest.raises(DataPrepError, match=rf"site\.bed: its alleles are {fix}"):
        harmonise(path, table(tmp_path, CODED_TABLE))


GVCF_HEADER = (
    "##GVCFBlock0-20=minGQ=0(inclusive),maxGQ=20(exclusive)\n"
    '##ALT=<ID=NON_REF,Description="Any possible alternative allele at this location">\n'
    '##INFO=<ID=END,Number=1,Type=Integer,Description="Stop position of the interval">\n'
    '##FORMAT=<ID=GQ,Number=1,Type=Integer,Description="Genotype Quality">\n'
)


def gvcf_lines(n: int) -> list[str]:
    """A GATK-style gVCF of one person over the table's first n SNPs: a reference block from each SNP to just before
    the next, and a variant record (ALT G,<NON_REF>) at every fourth SNP."""
    lines = []
    for j in range(n):
        pos, (ref, alt) = 100 * (j + 1), TABLE_BASES[j % 4]
        if j % 4 == 1:
            lines.append(f"1 {pos} . {ref} {alt},<NON_REF> . . . GT:GQ 0/1:50")
        else:
            lines.append(f"1 {pos} . {ref} <NON_REF> . . END={pos + 99} GT:GQ 0/0:40")
    return lines


def test_a_gvcf_is_refused_naming_the_bcftools_commands(tmp_path: Path) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    # Was: rc 0, 0 usable SNPs ('multiallelic' and 'mismatch'), every column missing.
    path = vcf(tmp_path / "site.g.vcf", ["p0"], gvcf_lines(N_SNPS), GVCF_HEADER)
    with pytest.raises(DataPrepError, match=r"site\.g\.vcf: a gVCF \(record 1:100 has ALT <NON_REF>\).*"
                       r"bcftools convert --gvcf2vcf --fasta-ref .* bcftools view --trim-alt-alleles"):  # fmt: skip
        harmonise(path, table(tmp_path, CODED_TABLE))


def test_a_file_of_which_almost_no_snp_fits_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    # 40 records at the table's positions whose alleles fit in no orientation (another reference), 2 that fit.
    bim = [f"1 rs{j} 0 {100 * (j + 1)} AT G" for j in range(N_SNPS)]
    bim[0], bim[1] = "1 rs0 0 100 G A", "1 rs1 0 200 T C"
    path = plink1(tmp_path, bim, FAM, COPIES)
    with pytest.raises(DataPrepError, match=r"site\.bed: only 2 of the 40 table SNPs found in it can be used "
                       r"\(mismatch 38\)"):  # fmt: skip
        harmonise(path, table(tmp_path, CODED_TABLE))


def test_a_vcf_without_any_call_field_is_refused(tmp_path: Path) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    header = '##FORMAT=<ID=AD,Number=R,Type=Integer,Description="Allelic depths">\n'
    lines = [f"1 {100 * (j + 1)} rs{j} A G . PASS . AD 10,0 5,5" for j in range(3)]
    path = vcf(tmp_path / "site.vcf", ["a", "b"], lines, header)
    # Was: rc 0, every call missing.
    with pytest.raises(DataPrepError, match=r"site\.vcf: record 1:100 has no call field \(FORMAT AD; none of GT, DS, "
                       r"GP, PL\)"):  # fmt: skip
        harmonise(path, table(tmp_path, "rs0,1,100,A,G\nrs1,1,200,A,G\nrs2,1,300,A,G\n"))


def _site_counts(n_people: int, n_snps: int, missing: bool, seed: int) -> np.ndarray:
    from data_prep.genotypes.qc import genotype_counts

    calls = np.random.default_rng(seed).integers(0, 3, size=(n_people, n_snps)).astype(np.int8)
    if missing:
        calls[:] = M
    return genotype_counts(calls)


def test_the_federated_qc_names_the_site_that_would_empty_the_table() -> None:
    from data_prep.genotypes.federated_qc import check_no_site_empties_the_table, combine_counts
    from data_prep.genotypes.qc import QcThresholds, qc_filter

    snps = tuple(f"rs{j}" for j in range(200))
    sites = {f"site-{k}": (snps, _site_counts(60, 200, k == 3, k)) for k in (1, 2, 3)}
    _, total = combine_counts(sites)
    thresholds = QcThresholds(min_call_rate=0.95, min_maf=0.01)
    assert qc_filter(total, thresholds).sum() == 0  # was: the QC kept 0 of 200 SNPs for every site, naming nobody
    with pytest.raises(DataPrepError, match=r"federated QC: site-3's counts would leave 0 of the 200 SNPs \(200 "
                       r"without site-3\); its call rate is 0\.000 .*fix site-3's genotype file"):  # fmt: skip
        check_no_site_empties_the_table(sites, total, thresholds)
    good = {site: sites[site] for site in ("site-1", "site-2")}
    check_no_site_empties_the_table(good, combine_counts(good)[1], thresholds)  # two good sites: 200 of 200 kept


def test_a_site_whose_calls_are_missing_refuses_before_sending() -> None:
    from data_prep.genotypes.federated_qc import check_site_calls

    with pytest.raises(DataPrepError, match=r"federated QC: site-3: its call rate over the 200 table SNPs is 0\.000 "
                       r"\(below 0\.5\).*nothing sent"):  # fmt: skip
        check_site_calls("site-3", _site_counts(60, 200, True, 3))
    check_site_calls("site-1", _site_counts(60, 200, False, 1))


def test_the_gvcf_converted_as_the_refusal_says_is_read_right(tmp_path: Path) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    # What bcftools 1.16 wrote for gvcf_lines(8) with the refusal's commands (the INFO AN/AC it adds kept out of the
    # header here): reference blocks became ALT '.' records, the variant sites lost <NON_REF>.
    lines = [
        f"1 {100 * (j + 1)} . {TABLE_BASES[j % 4][0]} {TABLE_BASES[j % 4][1] if j % 4 == 1 else '.'} . . . GT:GQ "
        + ("0/1:50" if j % 4 == 1 else "0/0:40")
        for j in range(8)
    ]
    path = vcf(tmp_path / "site.vcf", ["p0"], lines, GVCF_HEADER)  # the gVCF header lines stay
    result = harmonise(path, table(tmp_path, "".join(CODED_TABLE.splitlines(keepends=True)[:8])))
    np.testing.assert_array_equal(result.genotypes, [[0, 1, 0, 0, 0, 1, 0, 0]])
    assert result.status.count("monomorphic") == 6 and result.status.count("same") == 2


def test_the_command_writes_nothing_for_an_unusable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from data_prep.genotypes.cli import main

    path = plink1(tmp_path, coded_bim("1234"), FAM, COPIES)
    out = tmp_path / "site.npz"
    argv = ["harmonise", "--genotypes", str(path), "--snp-table", str(table(tmp_path, CODED_TABLE)), "--out", str(out),
            "--report", str(tmp_path / "report.json")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--alleleACGT" in err
    assert not out.exists() and not (tmp_path / "report.json").exists()


# ---- 3. GP/PL read by the dosage rule; one threshold rule in every format --------------------------------------------

GP_HEADER = (
    '##FORMAT=<ID=GP,Number=G,Type=Float,Description="Genotype probabilities">\n'
    '##FORMAT=<ID=PL,Number=G,Type=Integer,Description="Phred-scaled genotype likelihoods">\n'
)
BOUNDARY_DS = ["0.100", "0.900", "1.100", "1.900", "0.101", "0.899", "1.101", "1.899"]
BOUNDARY_CALLS = [0, 1, 1, 2, M, M, M, M]  # plink2 2.00a3.5 (--vcf dosage=DS, --make-bed): 0, 1, 1, 2 for the first 4


def _boundary_gp(ds: str) -> str:
    """The GP of two adjacent genotypes whose dosage is ``ds`` (0.100 -> 0.9,0.1,0)."""
    value = float(ds)
    low = int(value)
    probs = [0.0, 0.0, 0.0]
    probs[low], probs[low + 1] = round(low + 1 - value, 3), round(value - low, 3)
    return ",".join(f"{p:g}" for p in probs)


@pytest.mark.parametrize("field", ["DS", "GP"])
def test_vcf_dosages_at_the_threshold(tmp_path: Path, field: str) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    # Was (DS): all eight missing (float32 0.1 is 0.10000000149, beyond 0.1); GP: never read, all missing.
    values = BOUNDARY_DS if field == "DS" else [_boundary_gp(ds) for ds in BOUNDARY_DS]
    samples = [f"p{i}" for i in range(len(values))]
    path = vcf(tmp_path / "site.vcf", samples, [f"1 100 rs1 A G . PASS . {field} " + " ".join(values)], GP_HEADER)
    result = harmonise(path, table(tmp_path, "rs1,1,100,A,G\n"))
    np.testing.assert_array_equal(result.genotypes[:, 0], BOUNDARY_CALLS)
    assert result.calls["dosage_hard_called"] == 4 and result.calls["dosage_uncertain"] == 4


def test_pgen_dosages_at_the_threshold(tmp_path: Path) -> None:
    dosages = [[float(ds)] for ds in BOUNDARY_DS]
    path = plink2(tmp_path, "#CHROM\tPOS\tID\tREF\tALT\n1\t100\trs1\tA\tG\n",
                  "#IID\n" + "".join(f"p{i}\n" for i in range(len(dosages))), dosages=dosages)  # fmt: skip
    result = harmonise(path, table(tmp_path, "rs1,1,100,A,G\n"))
    np.testing.assert_array_equal(result.genotypes[:, 0], BOUNDARY_CALLS)


def test_gp_and_pl_only_vcfs_are_hard_called_by_the_dosage_rule(tmp_path: Path) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    # Was: every call missing (GT and DS only were read), rc 0.
    path = vcf(tmp_path / "site.vcf", ["a", "b", "c", "d"], [
        "1 100 rs1 A G . PASS . GP 0.5,0,0.5 0.95,0.05,0 .,.,. 0,0.02,0.98",  # (0.5, 0, 0.5): dosage 1, no het
        "1 200 rs2 A G . PASS . GP 0.001,0.998,0.001 0.2,0.8,0 0.3,0.3,0.4 0,0,1",
        "1 300 rs3 A G . PASS . PL 0,30,60 60,0,60 0,0,0 .",  # likelihoods, a flat prior
        "X 400 rs4 A G . PASS . GT:GP 1:0.04,0.96 0:0.5,0.5 0/1:0,1,0 1/1:0,0.05,0.95",  # a haploid GP: two values
    ], GP_HEADER)  # fmt: skip
    result = harmonise(path, table(tmp_path, "rs1,1,100,A,G\nrs2,1,200,A,G\nrs3,1,300,A,G\nrs4,X,400,A,G\n"))
    np.testing.assert_array_equal(result.genotypes, [[M, 1, 0, 2], [0, M, 1, M], [M, M, M, 1], [2, 2, M, 2]])
    assert result.calls["dosage_uncertain"] == 5  # (0.5, 0, 0.5), 0.2/0.8, 0.3/0.3/0.4, PL 0,0,0, a haploid 0.5
    assert result.calls["dosage_hard_called"] == 6


def test_a_gp_beside_a_gt_wins_as_a_ds_does(tmp_path: Path) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    # An imputed file's GT is a best guess however uncertain; PL beside a caller's GT is not used (the GT stands).
    path = vcf(tmp_path / "site.vcf", ["a", "b"], [
        "1 100 rs1 A G . PASS . GT:GP 0/1:0.4,0.5,0.1 1/1:0,0.02,0.98",
        "1 200 rs2 A G . PASS . GT:PL 0/1:10,0,10 0/0:0,3,30",
    ], GP_HEADER)  # fmt: skip
    result = harmonise(path, table(tmp_path, "rs1,1,100,A,G\nrs2,1,200,A,G\n"))
    np.testing.assert_array_equal(result.genotypes, [[M, 1], [2, 0]])


# ---- 4. honest advice: ID styles, the SNP table, the mitochondrion, a .pvar INFO with a space ------------------------

ID_ROWS = "".join(f"rs{100 + j},1,{100 * (j + 1)},{TABLE_BASES[j % 4][0]},{TABLE_BASES[j % 4][1]}\n" for j in range(20))


@pytest.mark.parametrize("style", ["rs{}.1", "RS{}", "Rs{}.12"])
def test_id_styles_on_the_right_build_are_the_same_ids(tmp_path: Path, style: str) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    # Was: refused, "20 of the 20 table SNPs ... carry another ID ... lift it over" (lifting a right file over
    # corrupts it).
    lines = [f"1 {100 * (j + 1)} {style.format(100 + j)} {TABLE_BASES[j % 4][0]} {TABLE_BASES[j % 4][1]} . PASS . "
             "GT 0/1 1/1" for j in range(20)]  # fmt: skip
    result = harmonise(vcf(tmp_path / "site.vcf", ["a", "b"], lines), table(tmp_path, ID_ROWS))
    assert result.counts()["same"] == 20 and result.ids["disagree"] == 0 and result.ids["compared"] == 20


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("rs9,1,0,A,G", r"line 2: pos 0 is not a position \(>= 1\).*unplaced"),
        ("rs9,1,-5,A,G", r"line 2: pos -5 is not a position \(>= 1\)"),
        ("rs9,1,100,1,2", r"line 2: alleles '1'/'2' are not A/C/G/T"),
        ("rs9,1,100,A,B", r"line 2: alleles 'A'/'B' are not A/C/G/T"),
        ("rs9,1,100,A,-", r"line 2: alleles 'A'/'-' are not A/C/G/T"),
    ],
)
def test_the_snp_table_is_validated(tmp_path: Path, row: str, message: str) -> None:
    from data_prep.genotypes.harmonise import read_snp_table

    # Was: accepted (position 0 and negative positions from unplaced '0 0' probes; any allele text).
    path = tmp_path / "table.csv"
    path.write_text("snp,chrom,pos,ref,alt\n" + row + "\n")
    with pytest.raises(DataPrepError, match=rf"table\.csv: {message}"):
        read_snp_table(path)


def test_a_repeated_snp_id_in_the_table_is_refused(tmp_path: Path) -> None:
    from data_prep.genotypes.harmonise import read_snp_table

    path = tmp_path / "table.csv"
    path.write_text("snp,chrom,pos,ref,alt\nrs1,1,100,A,G\nrs1,1,200,A,G\n")
    with pytest.raises(DataPrepError, match=r"line 3: SNP 'rs1' is also on line 2"):
        read_snp_table(path)


def test_hg19_chrm_is_not_matched_to_the_rcrs_mt(tmp_path: Path) -> None:
    from tests.data_prep.test_genotypes_hostile import vcf

    # hg19's chrM is another mitochondrial sequence (NC_001807, 16,571 bp) than GRCh37's MT and GRCh38's chrM (the
    # rCRS, 16,569 bp): the same position is another base. Was: matched, its calls in the table's MT columns.
    header = "##contig=<ID=chr1,length=249250621>\n##contig=<ID=chrM,length=16571>\n"
    lines = ["chr1 100 rs100 A G . PASS . GT 0/1 1/1", "chrM 150 mt150 G A . PASS . GT 1 0"]
    path = vcf(tmp_path / "site.vcf", ["a", "b"], lines, header)
    snp_table = table(tmp_path, "rs100,1,100,A,G\nmt150,MT,150,G,A\n")
    with pytest.raises(DataPrepError, match=r"site\.vcf: its mitochondrial records are on hg19's chrM \(##contig chrM "
                       r"length=16571; NC_001807\).*rCRS"):  # fmt: skip
        harmonise(path, snp_table)
    rcrs = vcf(tmp_path / "rcrs.vcf", ["a", "b"], lines, header.replace("16571", "16569"))
    np.testing.assert_array_equal(harmonise(rcrs, snp_table).genotypes, [[1, 2], [2, 0]])


def test_a_pvar_info_with_a_space_is_read_as_plink2_reads_it(tmp_path: Path) -> None:
    # plink2 splits .pvar lines at tabs. Was: "line 2: 9 columns, the header names 8".
    pvar = "#CHROM\tPOS\tID\tREF\tALT\tQUAL\tFILTER\tINFO\n1\t100\trs1\tA\tG\t.\tPASS\tNOTE=two words\n"
    path = plink2(tmp_path, pvar, "#IID\na\nb\n", [[1], [2]])
    result = harmonise(path, table(tmp_path, "rs1,1,100,A,G\n"))
    np.testing.assert_array_equal(result.genotypes, [[1], [2]])
