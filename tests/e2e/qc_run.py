"""The genotype QC job (``python -m data_prep.genotypes qc-job``) in ``nvflare simulator`` on simulated sites: each
site's ``.npz`` of 100 people drawn from one set of allele frequencies, one SNP table, the job exported with the
given options and run with a thread per site. Used by the QC's end-to-end tests."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_prep.genotypes.qc import genotype_counts
from tests.e2e.simulator_run import run_simulator_command

SITES = ("site-1", "site-2", "site-3")


def run_qc_job(
    tmp_path: Path, snps: Sequence[str], options: Sequence[str], people: int = 100
) -> tuple[Path, dict, np.ndarray]:
    """The simulator's workspace, the server's ``qc_report.json`` and the sites' exact summed counts."""
    from data_prep.genotypes.cli import main

    rng = np.random.default_rng(0)
    freqs = rng.uniform(0.0, 0.5, len(snps))
    status = np.array(["same"] * len(snps))
    total = np.zeros((len(snps), 4), np.int64)
    for site in SITES:
        genotypes = rng.binomial(2, freqs, size=(people, len(snps))).astype(np.int8)
        total += genotype_counts(genotypes)
        samples = np.array([f"{site}-{i}" for i in range(people)])
        np.savez(tmp_path / f"{site}.npz", genotypes=genotypes, samples=samples, snps=np.array(snps), status=status)
    table = tmp_path / "table.csv"
    table.write_text("snp,chrom,pos,ref,alt\n" + "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(snps)))
    assert main(["qc-job", "--output-dir", str(tmp_path / "jobs"), "--num-sites", str(len(SITES)), *options]) == 0
    env = os.environ | {"FEDALG_SITE_GENOTYPES": str(tmp_path / "{site}.npz"), "FEDALG_SNP_TABLE": str(table)}
    nvflare = Path(sys.executable).with_name("nvflare")
    workspace = tmp_path / "ws"
    command = [str(nvflare), "simulator", str(tmp_path / "jobs" / "genotype_qc"), "-w", str(workspace)]
    done = run_simulator_command([*command, "-n", str(len(SITES)), "-t", str(len(SITES))], workspace, 300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((workspace / "server" / "simulate_job" / "qc_report.json").read_text())
    return workspace, report, total
