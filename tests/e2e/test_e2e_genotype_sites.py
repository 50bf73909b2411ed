"""A simulated consortium on disk feeding a genomics job in ``nvflare simulator``: the msprime
cohort written as one VCF.gz per site by ``python -m data_prep.genotypes simulate-sites``, a job built with the
consortium's own model and data module (examples/genomics), every site pointed at its own file, labels and the
shared SNP table through ``FEDALG_SITE_GENOTYPES`` / ``FEDALG_SITE_LABELS`` / ``FEDALG_SNP_TABLE`` with ``{site}``,
harmonising its VCF on the fly and training from the int8 streaming loader.

Smaller than the command's defaults (10,000 SNPs, 250 people per population) so the test stays near a minute (70 s on
the shared 2-core machine at load average 5, 2 minutes at 9; most of it NVFlare's start-up): 1,000 SNPs from 8
simulated regions, 20 people per population (80 people, about 27 per site)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from controllers import report

REPO = Path(__file__).resolve().parents[2]
SNPS, PER_POPULATION, ROUNDS = 1000, 20, 2


@pytest.mark.slow
def test_a_simulated_cohort_in_per_site_vcf_files_trains_in_the_simulator(tmp_path):
    env = {**os.environ, "FEDALG_CACHE_DIR": str(tmp_path / "cache")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    files = tmp_path / "consortium"
    simulate = [sys.executable, "-m", "data_prep.genotypes", "simulate-sites", "--out", str(files), "--sites", "3"]
    simulate += ["--snps", str(SNPS), "--people-per-population", str(PER_POPULATION), "--regions", "8"]
    subprocess.run(simulate, check=True, cwd=REPO, env=env, capture_output=True, timeout=300)
    cohort = json.loads((files / "cohort.json").read_text())
    assert sorted(p.name for p in files.glob("site-*.vcf.gz")) == ["site-1.vcf.gz", "site-2.vcf.gz", "site-3.vcf.gz"]

    model_args = {"arch": "cnn_transformer", "n_snps": SNPS, "num_classes": len(cohort["classes"]), "patch": 16}
    data_args = {"classes": cohort["classes"], "batch_size": 16}
    build = [sys.executable, "-m", "jobs.build", "--name", "snp_files", "--output-dir", str(tmp_path)]
    build += ["--num-rounds", str(ROUNDS), "--ship", "examples/genomics"]
    build += ["--model", "genomics.model:SnpClassifier", "--data", "genomics.data:SnpSites"]
    build += ["--model-args", json.dumps(model_args), "--data-args", json.dumps(data_args)]
    subprocess.run(build, check=True, cwd=REPO, capture_output=True, timeout=300)

    env["FEDALG_SITE_GENOTYPES"] = str(files / "{site}.vcf.gz")
    env["FEDALG_SITE_LABELS"] = str(files / "{site}.labels.csv")
    env["FEDALG_SNP_TABLE"] = str(files / "snp_table.csv")
    workspace = tmp_path / "ws"
    command = ["nvflare", "simulator", str(tmp_path / "snp_files"), "-w", str(workspace), "-n", "3", "-t", "3"]
    completed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    records = report.finished_records(workspace, completed.stdout[-3000:])
    rounds = [r for r in records if r["stage"] == "round"]
    assert [r["status"] for r in rounds] == ["aggregated"] * ROUNDS
    for record in rounds:
        for metric in ("val_accuracy", "val_loss"):
            per_site = record["site_eval"][metric]["per_site"]
            assert set(per_site) == {"site-1", "site-2", "site-3"}, metric
            assert all(math.isfinite(v) for v in per_site.values()), (metric, per_site)
        assert all(math.isfinite(v) for v in record["site_train_loss"].values())
    # Every site trained on its own file's people: all but the 20 % it keeps for validation.
    assert sum(cohort["people"].values()) == 4 * PER_POPULATION
    expected = {site: people - round(0.2 * people) for site, people in cohort["people"].items()}
    assert rounds[-1]["site_num_samples"] == expected
