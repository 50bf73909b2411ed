"""Federated QC: the server's sum of the sites' counts (closed form), the refusal of sites on other tables, the
exported job, and (slow) the job in ``nvflare simulator`` with two sites whose own filters would disagree."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.errors import DataPrepError
from data_prep.genotypes.federated_qc import QC_TABLE, combine_counts, qc_report
from data_prep.genotypes.qc import QcThresholds, allele_stats, genotype_counts, hwe_pvalues, qc_filter

M = 3
SNPS = ("rs0", "rs1", "rs2", "rs3", "rs4")
# Site 1: rs1 has one carrier in 10 people (its own MAF 0.05); site 2: nobody (MAF 0). Globally 1/40 = 0.025.
SITE_1 = np.array([[0, 0, 1, M, 0]] * 10, np.int8)
SITE_1[0, 1] = 1
SITE_2 = np.array([[1, 0, 1, M, 0]] * 10, np.int8)
THRESHOLDS = QcThresholds(min_call_rate=0.95, min_maf=0.03)


def test_the_global_counts_are_the_sum_and_the_filter_is_global() -> None:
    snps, counts = combine_counts(
        {"site-2": (SNPS, genotype_counts(SITE_2)), "site-1": (SNPS, genotype_counts(SITE_1))}
    )
    assert snps == SNPS
    np.testing.assert_array_equal(counts, genotype_counts(np.concatenate([SITE_1, SITE_2])))
    keep = qc_filter(counts, THRESHOLDS)
    # rs0: MAF 10/40; rs1: 1/40 < 0.03 globally although site 1 alone would keep it; rs3 never called; rs4 monomorphic.
    assert keep.tolist() == [True, False, True, False, False]
    assert qc_filter(genotype_counts(SITE_1), THRESHOLDS).tolist() == [False, True, True, False, False]
    report = qc_report(snps, counts, keep, THRESHOLDS, ["site-2", "site-1"])
    assert report["kept"] == ["rs0", "rs2"] and report["people"] == 20 and report["sites"] == ["site-1", "site-2"]


def test_a_snp_monomorphic_at_a_site_is_counted_by_its_called_people() -> None:
    # rs1 is monomorphic at site 2 (nobody carries the alt allele): its 10 people are called, 0 copies each, so the
    # pooled frequency is 1/40, not 1/20 (site 1 alone) and not a call rate of 1/2 (site 2 as missing).
    snps, counts = combine_counts(
        {"site-1": (SNPS, genotype_counts(SITE_1)), "site-2": (SNPS, genotype_counts(SITE_2))}
    )
    call_rate, alt_freq, maf = allele_stats(counts)
    assert call_rate[1] == 1.0 and alt_freq[1] == pytest.approx(1 / 40) and maf[1] == pytest.approx(1 / 40)
    # Globally monomorphic rs4 (MAF 0) and never-called rs3 are told apart in the report; neither passes.
    assert hwe_pvalues(counts)[4] == 1.0
    report = qc_report(snps, counts, qc_filter(counts, THRESHOLDS), THRESHOLDS, ["site-1", "site-2"])
    assert report["global_qc"]["maf"]["monomorphic"] == 1 and report["global_qc"]["maf"]["uncalled"] == 1
    assert "rs3" not in report["kept"] and "rs4" not in report["kept"]


def test_a_site_on_another_table_is_refused_by_name() -> None:
    with pytest.raises(DataPrepError, match=r"federated QC: site-2 harmonised against other SNPs than site-1"):
        combine_counts({"site-1": (SNPS, genotype_counts(SITE_1)), "site-2": (SNPS[:4], genotype_counts(SITE_2)[:4])})


def test_the_exported_job_names_the_controller_and_its_thresholds(tmp_path: Path) -> None:
    from data_prep.genotypes.cli import main

    assert main(["qc-job", "--output-dir", str(tmp_path), "--num-sites", "2", "--min-maf", "0.03"]) == 0
    app = tmp_path / "genotype_qc" / "app"
    server = json.loads((app / "config" / "config_fed_server.json").read_text())
    workflow = server["workflows"][0]
    assert workflow["path"] == "data_prep.genotypes.federated_qc.GenotypeQcController"
    assert workflow["args"] == {"min_maf": 0.03}  # NVFlare leaves default arguments out
    client = json.loads((app / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["args"]["task_script_path"] == "qc_site.py"
    assert (app / "custom" / "qc_site.py").is_file()


def test_thresholds_out_of_range_stop_the_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from data_prep.genotypes.cli import main

    assert main(["qc-job", "--output-dir", str(tmp_path), "--min-call-rate", "2"]) == 2
    assert "min_call_rate must be a number in [0, 1.0], got 2.0" in capsys.readouterr().err
    assert not (tmp_path / "genotype_qc").exists()


@pytest.mark.slow
def test_the_qc_job_in_the_simulator(tmp_path: Path) -> None:
    pytest.importorskip("cyvcf2")
    from data_prep.genotypes.cli import main
    from data_prep.genotypes.writers import Sites, write_genotype_file

    sites = Sites(["chr1"] * 5, [10, 20, 30, 40, 50], list("abcde"), ["A"] * 5, ["G"] * 5)
    for name, matrix in (("site-1", SITE_1), ("site-2", SITE_2)):
        write_genotype_file(tmp_path / f"{name}.vcf", matrix, [f"{name}-{i}" for i in range(10)], sites)
    table = tmp_path / "table.csv"
    table.write_text("snp,chrom,pos,ref,alt\n" + "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(SNPS)))
    # Sites of 10 people: below the default minimum site size (tests/data_prep/test_qc_privacy.py), so it is lowered.
    options = ["--num-sites", "2", "--min-maf", "0.03", "--min-site-people", "10"]
    assert main(["qc-job", "--output-dir", str(tmp_path / "jobs"), *options]) == 0
    env = os.environ | {"FEDALG_SITE_GENOTYPES": str(tmp_path / "{site}.vcf"), "FEDALG_SNP_TABLE": str(table)}
    nvflare = Path(sys.executable).with_name("nvflare")
    workspace = tmp_path / "ws"
    done = subprocess.run(
        [str(nvflare), "simulator", str(tmp_path / "jobs" / "genotype_qc"), "-w", str(workspace), "-n", "2", "-t", "2"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((workspace / "server" / "simulate_job" / "qc_report.json").read_text())
    assert report["kept"] == ["rs0", "rs2"] and report["sites"] == ["site-1", "site-2"]
    for site in ("site-1", "site-2"):
        with open(workspace / site / QC_TABLE, newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert [r["snp"] for r in rows] == ["rs0", "rs2"]
        assert rows[0] == {"snp": "rs0", "chrom": "1", "pos": "10", "ref": "A", "alt": "G"}
