"""The noisy federated QC job (``qc-job --dp-target-epsilon``) in ``nvflare simulator``: three sites each write their
ledger (one Gaussian step, epsilon within the budget) before their noisy counts leave, the server's report names the
noise and no exact count, and every site writes the same filtered table."""

from __future__ import annotations

from pathlib import Path

from data_prep.genotypes.federated_qc import QC_TABLE
from lightning_modules.privacy.ledger import LEDGER_NAME, ledger_from_state
from lightning_modules.state_store import ClientStateStore
from tests.e2e.qc_run import SITES, run_qc_job

SNPS = tuple(f"rs{j}" for j in range(60))


def test_the_noisy_qc_job_in_the_simulator(tmp_path: Path) -> None:
    workspace, report, _ = run_qc_job(tmp_path, SNPS, ["--min-maf", "0.05", "--dp-target-epsilon", "8"])
    assert report["noise"]["target_epsilon"] == 8.0 and report["sites"] == list(SITES)
    tables = set()
    for site in SITES:
        store = ClientStateStore(workspace / site / "client_state", site, per_run=True)
        store.use_run("simulate_job")
        ledger = ledger_from_state(store.load(LEDGER_NAME).state)
        assert ledger.steps == 1 and ledger.segments[0].sample_rate == 1.0 and 7.9 < ledger.epsilon() <= 8.0
        tables.add((workspace / site / QC_TABLE).read_text())
    assert len(tables) == 1
