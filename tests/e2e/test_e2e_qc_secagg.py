"""The federated QC with ``qc-job --secure-aggregation secagg`` in ``nvflare simulator``: 3 sites of 100 people at
300 SNPs. The server's report is the clear QC's (the keep-list computed here from the sites' files, summed in the
clear) and says secagg; every site writes the same filtered table; the server's log names the unmasked sum and the
sites sent nothing the egress gate had to strip. With ``--dp-target-epsilon`` the noisy counts (possibly negative)
go through the same masked sum and every site's ledger holds the release."""

from __future__ import annotations

from pathlib import Path

import pytest

from data_prep.genotypes.federated_qc import QC_TABLE, global_qc
from data_prep.genotypes.qc import QcThresholds
from lightning_modules.privacy.ledger import LEDGER_NAME, ledger_from_state
from lightning_modules.state_store import ClientStateStore
from tests.e2e.qc_run import SITES, run_qc_job

pytest.importorskip("flwr")
pytestmark = pytest.mark.slow
SNPS = tuple(f"rs{j}" for j in range(300))


@pytest.mark.parametrize("noise", [False, True], ids=["exact", "noisy"])
def test_the_secagg_qc_job_in_the_simulator(tmp_path: Path, noise: bool) -> None:
    options = ["--min-maf", "0.05", "--secure-aggregation", "secagg"]
    workspace, report, total = run_qc_job(tmp_path, SNPS, options + (["--dp-target-epsilon", "8"] if noise else []))
    assert report["secure_aggregation"] == "secagg" and report["sites"] == list(SITES)
    log = (workspace / "server" / "log.txt").read_text()
    assert "federated QC: unmasked the sum of 3 sites" in log, log[-3000:]
    tables = {(workspace / site / QC_TABLE).read_text() for site in SITES}
    assert len(tables) == 1
    for site in SITES:
        assert "egress" not in (workspace / site / "log.txt").read_text().lower()
    if not noise:
        keep, _ = global_qc(SNPS, total, QcThresholds(min_maf=0.05), SITES)
        assert report["kept"] == [s for s, k in zip(SNPS, keep, strict=True) if k]
        assert 0 < len(report["kept"]) < len(SNPS)
        return
    assert report["noise"]["target_epsilon"] == 8.0
    for site in SITES:
        store = ClientStateStore(workspace / site / "client_state", site, per_run=True)
        store.use_run("simulate_job")
        assert 7.9 < ledger_from_state(store.load(LEDGER_NAME).state).epsilon() <= 8.0
