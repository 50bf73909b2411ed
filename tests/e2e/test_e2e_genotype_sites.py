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

import numpy as np
import pytest

from controllers import report
from tests.e2e.simulator_run import run_simulator_command

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
    completed = run_simulator_command(command, workspace, env=env, timeout=900)
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


def test_a_dp_sgd_job_trains_one_round_from_per_site_vcf_files(tmp_path, monkeypatch):
    """DP-SGD over the sites' own VCF files (docs/privacy.md, "DP-SGD over genotype files"), in process: one round of
    the genomics model with DP-SGD-ready attention, each site harmonising its file and sampling its people by Poisson
    sampling from the streaming int8 loader; every site's epsilon is reported and within the budget. Tiny random
    files (no msprime, sigma given rather than calibrated): 17 s on the shared 2-core machine at load average 5,
    34 s at 7, most of it the job spec's check that imports the user code as a site would, in a subprocess."""
    pytest.importorskip("opacus")
    pytest.importorskip("cyvcf2")
    from benchmarks.in_process import quiet_lightning, run_in_process
    from data_prep.genotypes import GenotypeData
    from data_prep.genotypes.simulate import cohort_table, split_people, write_sites
    from jobs.presets import EXAMPLES
    from jobs.spec import JobSpec

    rng = np.random.default_rng(0)
    snps, people, classes = 40, 60, ("AFR", "EUR")
    cohort = GenotypeData(
        rng.integers(0, 3, size=(people, snps)).astype(np.int8),
        np.arange(people) % 2,
        classes,
        tuple(f"sim0_{10 * i}" for i in range(snps)),
        None,
        "tiny",
    )
    files = tmp_path / "consortium"
    write_sites(files, cohort, cohort_table(cohort.snps, 1000, 0), split_people(cohort.labels, 3, "iid", 0, 0.5))
    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(files / "{site}.vcf.gz"))
    monkeypatch.setenv("FEDALG_SITE_LABELS", str(files / "{site}.labels.csv"))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(files / "snp_table.csv"))
    spec = JobSpec(
        name="snp_files_dp",
        num_sites=3,
        num_rounds=1,
        model="genomics.model:SnpClassifier",
        model_args={"arch": "cnn_transformer", "attention": "linear", "n_snps": snps, "num_classes": 2, "patch": 8},
        data="genomics.data:SnpSites",
        data_args={"classes": list(classes), "batch_size": 8},
        ship=str(EXAMPLES / "genomics"),
        dp_noise_multiplier=1.0,  # given, not calibrated: calibrating sigma to a budget takes seconds per site
        dp_target_epsilon=8.0,  # a cap
        dp_delta=1e-5,
        dp_max_grad_norm=1.0,
    )
    with quiet_lightning():
        run = run_in_process(spec, tmp_path / "state", evaluate=False)
    (record,) = run.rounds
    assert record["status"] == "aggregated"
    assert record["site_num_samples"] == {f"site-{i}": 16 for i in (1, 2, 3)}  # 20 people each, 4 kept for validation
    for site, privacy in record["privacy"].items():
        assert privacy["steps"] == 2, site  # ceil(16 / 8) Poisson-sampled batches in the round's one epoch
        assert privacy["sample_rate"] == pytest.approx(0.5) and privacy["noise_multiplier"] == 1.0
        assert 0 < privacy["epsilon"] <= 8.0 and privacy["delta"] == 1e-5
