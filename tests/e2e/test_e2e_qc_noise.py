"""The noisy federated QC job (``qc-job --dp-target-epsilon``) in ``nvflare simulator``: three sites each write their
ledger (one Gaussian step, epsilon within the budget) before their noisy counts leave, the server's report names the
noise and no exact count, and every site writes the same filtered table."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from data_prep.genotypes.federated_qc import QC_TABLE
from lightning_modules.privacy.ledger import LEDGER_NAME, ledger_from_state
from lightning_modules.state_store import ClientStateStore
from tests.e2e.simulator_run import run_simulator_command

SNPS = tuple(f"rs{j}" for j in range(60))
SITES = ("site-1", "site-2", "site-3")


def test_the_noisy_qc_job_in_the_simulator(tmp_path: Path) -> None:
    from data_prep.genotypes.cli import main

    rng = np.random.default_rng(0)
    freqs = rng.uniform(0.0, 0.5, len(SNPS))
    status = np.array(["same"] * len(SNPS))
    for site in SITES:
        genotypes = rng.binomial(2, freqs, size=(100, len(SNPS))).astype(np.int8)
        samples = np.array([f"{site}-{i}" for i in range(100)])
        np.savez(tmp_path / f"{site}.npz", genotypes=genotypes, samples=samples, snps=np.array(SNPS), status=status)
    table = tmp_path / "table.csv"
    table.write_text("snp,chrom,pos,ref,alt\n" + "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(SNPS)))
    options = ["--num-sites", "3", "--min-maf", "0.05", "--dp-target-epsilon", "8"]
    assert main(["qc-job", "--output-dir", str(tmp_path / "jobs"), *options]) == 0
    env = os.environ | {"FEDALG_SITE_GENOTYPES": str(tmp_path / "{site}.npz"), "FEDALG_SNP_TABLE": str(table)}
    nvflare = Path(sys.executable).with_name("nvflare")
    workspace = tmp_path / "ws"
    command = [str(nvflare), "simulator", str(tmp_path / "jobs" / "genotype_qc"), "-w", str(workspace), "-n", "3"]
    done = run_simulator_command([*command, "-t", "3"], workspace, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((workspace / "server" / "simulate_job" / "qc_report.json").read_text())
    assert report["noise"]["target_epsilon"] == 8.0 and report["sites"] == list(SITES)
    tables = set()
    for site in SITES:
        store = ClientStateStore(workspace / site / "client_state", site, per_run=True)
        store.use_run("simulate_job")
        ledger = ledger_from_state(store.load(LEDGER_NAME).state)
        assert ledger.steps == 1 and ledger.segments[0].sample_rate == 1.0 and 7.9 < ledger.epsilon() <= 8.0
        tables.add((workspace / site / QC_TABLE).read_text())
    assert len(tables) == 1
