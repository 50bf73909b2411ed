"""The noisy QC under HE (``qc-job --dp-target-epsilon E --secure-aggregation he``), without a deployment: three sites
run the noisy site script (``lightning_modules.privacy.qc_release.site_main``) with NVFlare and the contexts replaced
by fakes, the real controller adds their ciphertexts, and every site filters the decrypted noisy sum. Checked with
the secret key the test holds: each site encrypted noisy counts (not its exact ones) after writing its ledger, the
sum rounds exactly to the sum of the noisy counts, and every site keeps the SNPs the filter keeps on that sum with
negative cells at 0."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from data_prep.genotypes.federated_qc import ENCRYPTED_COUNTS, GenotypeQcController, from_wire
from data_prep.genotypes.qc import QcThresholds, genotype_counts, qc_filter
from data_prep.genotypes.qc_noise import usable_counts
from lightning_modules.privacy.ledger import LEDGER_NAME, ledger_from_state
from lightning_modules.privacy.qc_release import site_main
from lightning_modules.state_store import ClientStateStore
from tests.data_prep.test_qc_secure_aggregation import (  # noqa: F401 (site_context, server_context: fixtures)
    SNPS,
    FakeServerRun,
    copy_of,
    server_context,
    site_context,
    site_genotypes,
    write_site_files,
)
from tests.helpers import FakeFlare

ts = pytest.importorskip("tenseal")
secure_qc = pytest.importorskip("data_prep.genotypes.secure_qc")
RUN = "qc-he-run"
HE = ["--secure-aggregation", "he", "--min-call-rate", "0.9", "--min-maf", "0.05", "--min-site-people", "40"]


def run_noisy_site(monkeypatch: pytest.MonkeyPatch, folder: Path, site: str, message: FLModel) -> list[FLModel]:
    import nvflare.client as flare

    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(folder / "site.npz"))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(folder / "table.csv"))
    monkeypatch.setenv("FLALGO_STATE_DIR", str(folder / "state"))
    fake = FakeFlare(site, [message])
    fake.install(monkeypatch)
    monkeypatch.setattr(flare, "get_job_id", lambda: RUN)
    site_main(["--out", str(folder / "filtered.csv"), *HE, "--dp-target-epsilon", "8"])
    return fake.sent


def test_every_site_filters_the_noisy_sum_and_none_sent_its_exact_counts(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    site_context: ts.Context,  # noqa: F811 (the imported fixture)
    server_context: ts.Context,  # noqa: F811
) -> None:
    people = {"site-1": 40, "site-2": 55, "site-3": 70}
    genotypes = {site: site_genotypes(i, n) for i, (site, n) in enumerate(people.items())}
    for site, matrix in genotypes.items():
        write_site_files(tmp_path / site, matrix)
    monkeypatch.setattr(secure_qc, "load_client_context", lambda site, startup: copy_of(site_context))
    monkeypatch.setattr(secure_qc, "load_server_context", lambda fl_ctx: server_context)

    request = FLModel(params={"none": np.zeros(1)}, meta={"step": "qc_counts", "secure_aggregation": "he"})
    answers, noisy = [], {}
    for site in people:
        (sent,) = run_noisy_site(monkeypatch, tmp_path / site, site, request)
        assert set(sent.params) == {ENCRYPTED_COUNTS}
        values = ts.ckks_vector_from(site_context, from_wire(sent.params[ENCRYPTED_COUNTS])).decrypt()
        noisy[site] = np.rint(values).astype(np.int64).reshape(len(SNPS), 4)
        assert not np.array_equal(noisy[site], genotype_counts(genotypes[site]))
        store = ClientStateStore(tmp_path / site / "state", site, per_run=True)
        store.use_run(RUN)
        assert ledger_from_state(store.load(LEDGER_NAME).state).steps == 1
        answers.append(FLModel(params=sent.params, meta={**sent.meta, "client_name": site}))

    server = FakeServerRun(tmp_path / "server", answers)
    (tmp_path / "server").mkdir()
    controller = GenotypeQcController(0.9, 0.05, 40, "he", dp_target_epsilon=8.0)
    server.attach(controller).run()
    report = json.loads((tmp_path / "server" / "qc_report.json").read_text())
    assert report["noise"]["target_epsilon"] == 8.0 and "kept" not in report
    _, message = server.sent

    total = sum(noisy.values())
    expected = [s for s, k in zip(SNPS, qc_filter(usable_counts(total), QcThresholds(0.9, 0.05)), strict=True) if k]
    for site in people:
        (ack,) = run_noisy_site(monkeypatch, tmp_path / site, site, message)
        assert ack.meta == {}
        rows = (tmp_path / site / "filtered.csv").read_text().splitlines()[1:]
        assert [row.split(",")[0] for row in rows] == expected
        site_report = json.loads((tmp_path / site / "qc_report.json").read_text())
        assert site_report["noise"]["target_epsilon"] == 8.0 and site_report["he_rounding_error"] < 1e-6
        store = ClientStateStore(tmp_path / site / "state", site, per_run=True)
        store.use_run(RUN)
        assert ledger_from_state(store.load(LEDGER_NAME).state).steps == 1  # the filter step spends nothing
