"""BGEN files (UK Biobank's imputed format) read by the dosage rule of every other format: written here by
`data_prep.genotypes.bgen.write_bgen` (v1.2, layout 2, from the format's specification) and, where plink2 is
installed, by plink2 itself (``--export bgen-1.2`` / ``bgen-1.3``), whose own hard calls of the same file are the
reference. Before this reader existed a ``.bgen`` was refused (convert it with plink2 first).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("cbgen")
pytest.importorskip("cyvcf2")
pytest.importorskip("bed_reader")

from data_prep.errors import DataPrepError
from data_prep.genotypes.bgen import write_bgen
from tests.data_prep.test_genotypes_hostile import M, harmonise, table, vcf

N_PEOPLE, N_SNPS = 12, 40
SAMPLES = [f"p{i}" for i in range(N_PEOPLE)]
POS = [100 * (j + 1) for j in range(N_SNPS)]
IDS = [f"rs{j}" for j in range(N_SNPS)]
CHROM = ["01"] * (N_SNPS - 4) + ["X"] * 4  # UK Biobank writes chromosome 1 as '01'
TABLE = "".join(f"rs{j},{'1' if j < N_SNPS - 4 else 'X'},{POS[j]},A,G\n" for j in range(N_SNPS))
GP_HEADER = '##FORMAT=<ID=GP,Number=G,Type=Float,Description="Genotype probabilities">\n'
SCALE = 65535  # 16-bit probabilities: k / 65535 exactly


def cohort(seed: int = 46) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(probabilities people x SNPs x 3 on the 16-bit grid, ploidy, missing): certain calls, adjacent-count and
    spread uncertainty, one-copy males on X, a few missing calls."""
    rng = np.random.default_rng(seed)
    calls = rng.integers(0, 3, size=(N_PEOPLE, N_SNPS))
    probs = np.eye(3)[calls]
    for i, j in zip(rng.integers(0, N_PEOPLE, 60), rng.integers(0, N_SNPS, 60), strict=True):
        low = min(calls[i, j], 1)
        weight = int(rng.integers(0, SCALE + 1)) / SCALE  # P(the higher of two adjacent counts)
        probs[i, j] = 0.0
        probs[i, j, low], probs[i, j, low + 1] = 1 - weight, weight
    probs[0, 5] = [0.5, 0, 0.5]  # dosage 1, no heterozygote
    probs[1, 6] = [21845 / SCALE, 21845 / SCALE, 21845 / SCALE]
    ploidy = np.full((N_PEOPLE, N_SNPS), 2)
    ploidy[: N_PEOPLE // 2, N_SNPS - 4 :] = 1  # males: one copy of X
    haploid = ploidy == 1
    probs[haploid] = np.eye(3)[rng.integers(0, 2, size=int(haploid.sum()))]  # P(first), P(second), 0
    probs[2, N_SNPS - 1] = [0.5, 0.5, 0]  # half a copy: missing
    missing = np.zeros((N_PEOPLE, N_SNPS), bool)
    missing[3, 7] = missing[4, 8] = True
    return probs, ploidy, missing


def write_cohort(folder: Path, probs, ploidy, missing, **options) -> Path:
    return write_bgen(folder / "site.bgen", probs, SAMPLES, CHROM, POS, IDS, [("A", "G")] * N_SNPS, bits=16,
                      ploidy=ploidy, missing=missing, **options)  # fmt: skip


def gp_vcf(folder: Path, probs, ploidy, missing) -> Path:
    """The same probabilities as a VCF's GP (a GT '0' or '0/0' only saying the call's ploidy)."""
    lines = []
    for j in range(N_SNPS):
        calls = []
        for i in range(N_PEOPLE):
            if missing[i, j]:
                calls.append(("." if ploidy[i, j] == 1 else "./.") + ":.")
            elif ploidy[i, j] == 1:
                calls.append("0:" + ",".join(f"{p:.12f}" for p in probs[i, j, :2]))
            else:
                calls.append("0/0:" + ",".join(f"{p:.12f}" for p in probs[i, j]))
        chrom = "1" if CHROM[j] == "01" else CHROM[j]
        lines.append(f"{chrom} {POS[j]} {IDS[j]} A G . PASS . GT:GP " + " ".join(calls))
    return vcf(folder / "site.vcf", SAMPLES, lines, GP_HEADER)


def test_bgen_calls_equal_the_same_probabilities_as_a_vcf_gp(tmp_path: Path) -> None:
    probs, ploidy, missing = cohort()
    (tmp_path / "b").mkdir()
    (tmp_path / "v").mkdir()
    from_bgen = harmonise(write_cohort(tmp_path / "b", probs, ploidy, missing), table(tmp_path, TABLE))
    from_vcf = harmonise(gp_vcf(tmp_path / "v", probs, ploidy, missing), table(tmp_path, TABLE))
    assert from_bgen.samples == tuple(SAMPLES) and from_bgen.counts()["same"] == N_SNPS  # '01' matched as 1
    np.testing.assert_array_equal(from_bgen.genotypes, from_vcf.genotypes)
    assert from_bgen.calls == from_vcf.calls
    assert from_bgen.genotypes[0, 5] == M and from_bgen.genotypes[1, 6] == M and from_bgen.genotypes[2, -1] == M
    assert from_bgen.genotypes[3, 7] == M and from_bgen.genotypes[4, 8] == M
    assert set(np.unique(from_bgen.genotypes[: N_PEOPLE // 2, -4:])) <= {0, 2, M}  # one copy: 0 or 2
    assert from_bgen.calls["dosage_uncertain"] > 0 and from_bgen.calls["one_copy_as_homozygous"] > 0


@pytest.mark.parametrize(
    ("higher", "call"),
    [
        (6553, 0),  # P(1 copy) 0.09999: within 0.1 of 0
        (6554, M),  # 0.10001: not
        (SCALE - 6553, 1),  # dosage 1.9 from (0, 0.9, 0.1) read the other way: P(1) 0.90001
        (SCALE - 6554, M),
    ],
)
def test_bgen_probabilities_at_the_threshold(tmp_path: Path, higher: int, call: int) -> None:
    probs, ploidy, missing = cohort()
    probs[0, 0] = [(SCALE - higher) / SCALE, higher / SCALE, 0.0]
    result = harmonise(write_cohort(tmp_path, probs, ploidy, missing), table(tmp_path, TABLE))
    assert result.genotypes[0, 0] == call


def test_bgen_with_its_ids_embedded_needs_no_sample_file(tmp_path: Path) -> None:
    probs, ploidy, missing = cohort()
    path = write_cohort(tmp_path, probs, ploidy, missing, sample_file=False)
    assert harmonise(path, table(tmp_path, TABLE)).samples == tuple(SAMPLES)


def test_bgen_without_any_sample_ids_is_refused(tmp_path: Path) -> None:
    probs, ploidy, missing = cohort()
    path = write_cohort(tmp_path, probs, ploidy, missing, sample_file=False, embed_samples=False)
    with pytest.raises(DataPrepError, match=r"site\.bgen: no sample IDs: the \.bgen embeds none and no \.sample file "
                       r"is beside it \(site\.sample\); copy the \.sample"):  # fmt: skip
        harmonise(path, table(tmp_path, TABLE))


SAMPLE_CASES = {
    # (.bgen embeds its IDs, the .sample's lines edited, the refusal)
    "one line too long": (False, lambda lines: [*lines[:2], "px px 0", *lines[2:]],
                          r"site\.bgen holds 12 people, its sample file .*site\.sample lists 13: use the \.sample "
                          r"written with this \.bgen"),
    "two people swapped": (True, lambda lines: [lines[0], lines[1], lines[3], lines[2], *lines[4:]],
                           r"embeds other sample IDs than .*site\.sample lists \(person 1: 'p0' in the \.bgen, 'p1' "
                           r"in the \.sample\)"),
    "no types line": (False, lambda lines: [lines[0], *lines[2:]], r"site\.sample: not an Oxford \.sample file"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SAMPLE_CASES))
def test_a_sample_file_that_does_not_fit_the_bgen_is_refused(tmp_path: Path, case: str) -> None:
    embed, edit, refusal = SAMPLE_CASES[case]
    probs, ploidy, missing = cohort()
    path = write_cohort(tmp_path, probs, ploidy, missing, embed_samples=embed)
    lines = (tmp_path / "site.sample").read_text().splitlines()
    (tmp_path / "site.sample").write_text("\n".join(edit(lines)) + "\n")
    with pytest.raises(DataPrepError, match=refusal):
        harmonise(path, table(tmp_path, TABLE))


def test_a_damaged_bgen_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "site.bgen"
    path.write_bytes(b"\x00" * 64)
    with pytest.raises(DataPrepError, match=r"site\.bgen: not a readable BGEN file"):
        harmonise(path, table(tmp_path, TABLE))


@pytest.mark.skipif(shutil.which("plink2") is None, reason="plink2 is not installed")
@pytest.mark.parametrize("export", [None, "bgen-1.2 bits=8", "bgen-1.3"])
def test_bgen_calls_equal_plink2s(tmp_path: Path, export: str | None) -> None:
    """plink2's hard calls (--hard-call-threshold 0.1, its default) of the same file; then plink2's own BGEN 1.2
    (8-bit) and 1.3 exports of it, read here. Autosomes and adjacent-count uncertainty only: plink2 calls a spread
    such as (0.5, 0, 0.5) a heterozygote, this rule does not (docs/genomics.md)."""
    probs, ploidy, missing = cohort()
    probs[0, 5], probs[1, 6] = np.eye(3)[0], np.eye(3)[1]
    ploidy[:] = 2
    probs[:, N_SNPS - 4 :] = np.eye(3)[np.arange(N_PEOPLE) % 3][:, None, :]
    path = write_cohort(tmp_path, probs, ploidy, missing)
    plink = ["plink2", "--bgen", str(path), "ref-first", "--sample", str(tmp_path / "site.sample"), "--out"]
    subprocess.run([*plink, str(tmp_path / "ref"), "--make-bed"], check=True, capture_output=True)
    (tmp_path / "ours").mkdir()
    reference = harmonise(tmp_path / "ref.bed", table(tmp_path, TABLE.replace(",X,", ",1,")))
    if export is None:
        ours = harmonise(path, table(tmp_path, TABLE))
    else:
        subprocess.run([*plink, str(tmp_path / "ours" / "site"), "--export", *export.split()], check=True,
                       capture_output=True)  # fmt: skip
        ours = harmonise(tmp_path / "ours" / "site.bgen", table(tmp_path, TABLE))
    assert ours.samples == reference.samples
    np.testing.assert_array_equal(ours.genotypes[:, : N_SNPS - 4], reference.genotypes[:, : N_SNPS - 4])
    assert (ours.genotypes == M).sum() > 2  # the uncertain calls are in the comparison
