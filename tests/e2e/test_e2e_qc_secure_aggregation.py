"""The federated QC job under homomorphic encryption on a loopback deployment provisioned with NVFlare's HEBuilder:
three tiny sites (12, 15 and 18 people, 24 SNPs), ``qc-job --secure-aggregation he``, then the plain QC job on the same
started deployment as the reference.

Checked: the HE job completes; the server logs that it adds ciphertexts and never the clear-counts warning, and its
``qc_report.json`` names the sites and the settings only; every site writes the same filtered table and a report
from the decrypted sum (rounding error far below 0.5), equal to the plaintext filter of the pooled people and to what
the plain job's server decided. 46-75 s on the development machine (2 shared CPU cores; three runs), the HE
job 16-27 s of it.
"""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep.genotypes.cli import main as genotypes_main
from data_prep.genotypes.federated_qc import CLEAR_COUNTS_WARNING, HE_COUNTS_NOTE, QC_TABLE, global_qc
from data_prep.genotypes.qc import QcThresholds, genotype_counts
from jobs.provision import loopback

pytestmark = pytest.mark.slow

PEOPLE = {"site-1": 12, "site-2": 15, "site-3": 18}
SNPS = tuple(f"rs{j}" for j in range(24))
MISSING = 3
OPTIONS = ["--num-sites", "3", "--min-call-rate", "0.9", "--min-maf", "0.1", "--min-site-people", "10"]


def site_genotypes(seed: int, people: int) -> np.ndarray:
    """Allele frequencies from 0 to 0.5 and missing calls up to 20 %, so both thresholds drop SNPs."""
    rng = np.random.default_rng(seed)
    genotypes = rng.binomial(2, np.linspace(0.0, 0.5, len(SNPS)), size=(people, len(SNPS))).astype(np.int8)
    genotypes[rng.random(genotypes.shape) < np.linspace(0.2, 0.0, len(SNPS))] = MISSING
    return genotypes


def write_sites(root: Path) -> dict[str, np.ndarray]:
    """Each site's harmonised .npz (``{site}.npz``) and the consortium's table."""
    genotypes = {site: site_genotypes(i, n) for i, (site, n) in enumerate(PEOPLE.items())}
    for site, matrix in genotypes.items():
        samples = np.array([f"{site}-{i}" for i in range(len(matrix))])
        status = np.array(["same"] * len(SNPS))
        np.savez(root / f"{site}.npz", genotypes=matrix, samples=samples, snps=np.array(SNPS), status=status)
    rows = "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(SNPS))
    (root / "table.csv").write_text("snp,chrom,pos,ref,alt\n" + rows)
    return genotypes


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(deployment, he result, he site outputs, plain result, genotypes, seconds of the HE job)."""
    pytest.importorskip("tenseal")
    root = tmp_path_factory.mktemp("qc_he_loopback")
    genotypes = write_sites(root)
    for mode in ("he", "none"):
        options = [*OPTIONS, "--secure-aggregation", mode, "--name", f"qc_{mode}"]
        assert genotypes_main(["qc-job", "--output-dir", str(root / "jobs"), *options]) == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))
        (root / "home").mkdir()
        patch.setenv("FEDALG_SITE_GENOTYPES", str(root / "{site}.npz"))
        patch.setenv("FEDALG_SNP_TABLE", str(root / "table.csv"))
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", len(PEOPLE), env, he=True)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        loopback.keep_server_storage_inside(deployment.server)
        started = time.monotonic()
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                job_started = time.monotonic()
                job_id, he_meta = loopback.run_job(session, deployment, root / "jobs" / "qc_he", timeout=300.0)
                he_seconds = time.monotonic() - job_started
                he_result = loopback.download_result(session, job_id)
                # Read the sites' outputs now: the plain job writes the same files.
                he_sites = {site: site_outputs(kit) for site, kit in deployment.sites.items()}
                logs = [*deployment.server.rglob("log*.txt"), *he_result.rglob("log*.txt")]
                server_logs = "".join(path.read_text(errors="replace") for path in logs)
                job_id, plain_meta = loopback.run_job(session, deployment, root / "jobs" / "qc_none", timeout=300.0)
                plain_result = loopback.download_result(session, job_id)
            yield {
                "he": (he_meta, he_result, he_sites, server_logs, he_seconds),
                "plain": (plain_meta, plain_result),
                "genotypes": genotypes,
            }
        finally:
            loopback.stop(deployment)
            left = loopback.leftover_processes(deployment)
            print(f"QC HE loopback deployment: {time.monotonic() - started:.1f} s from start to shutdown")
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def site_outputs(kit: Path) -> tuple[list[str], dict]:
    """The kept SNPs of a site's filtered table and its report (both under its kit's local/)."""
    with open(kit / QC_TABLE, newline="") as handle:
        kept = [row["snp"] for row in csv.DictReader(handle)]
    return kept, json.loads((kit / QC_TABLE).with_name("qc_report.json").read_text())


def test_the_he_job_completes_and_the_server_reports_only_sites_and_settings(runs):
    meta, result, _, server_logs, seconds = runs["he"]
    assert str(meta["status"]).startswith("FINISHED:COMPLETED"), meta
    report = json.loads((result / "qc_report.json").read_text())
    assert report == {
        "secure_aggregation": "he",
        "sites": sorted(PEOPLE),
        "thresholds": {"min_call_rate": 0.9, "min_maf": 0.1, "min_site_people": 10},
        "table_snps": len(SNPS),
    }
    assert HE_COUNTS_NOTE in server_logs and CLEAR_COUNTS_WARNING not in server_logs
    print(f"QC HE job: {seconds:.1f} s from submission to completion")


def test_every_site_keeps_the_same_snps_as_the_plaintext_filter(runs):
    _, _, sites, _, _ = runs["he"]
    pooled = genotype_counts(np.concatenate(list(runs["genotypes"].values())))
    _, expected = global_qc(SNPS, pooled, QcThresholds(0.9, 0.1), sorted(PEOPLE), 10)
    assert 0 < len(expected["kept"]) < len(SNPS)  # both thresholds dropped some SNPs
    for site, (kept, report) in sites.items():
        assert kept == expected["kept"], site
        assert report["people"] == sum(PEOPLE.values()) and report["global_qc"] == expected["global_qc"], site
        assert report["sites"] == sorted(PEOPLE) and report["he_rounding_error"] < 1e-6, site
    print(
        "CKKS rounding error per site: " + ", ".join(f"{s} {r['he_rounding_error']:.2e}" for s, (_, r) in sites.items())
    )


def test_the_plain_job_on_the_same_deployment_decides_the_same(runs):
    meta, result = runs["plain"]
    assert str(meta["status"]).startswith("FINISHED:COMPLETED"), meta
    plain = json.loads((result / "qc_report.json").read_text())
    he_kept = {tuple(kept) for kept, _ in runs["he"][2].values()}
    assert he_kept == {tuple(plain["kept"])}
