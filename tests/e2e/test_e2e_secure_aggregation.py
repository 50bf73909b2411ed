"""Secure aggregation end to end on one loopback deployment provisioned with NVFlare's HEBuilder (three sites), started
once for every job here: the same 2-round FedAvg job with ``--secure-aggregation plain`` and ``he`` (300 samples per
site); a user's own LightningModule and data module under ``he`` (examples/custom_model, FedProx, 2 rounds); the
federated QC job under ``he`` and then ``none`` (three tiny genotype sites of 12, 15 and 18 people, 24 SNPs).

Checked, training: every job completes with every site aggregated every round; the kits hold the contexts (the
server's without a secret key, the sites' with one); no ciphertext the server received carried a secret key; the
server's saved HE models hold ciphertexts only; a site decrypts the built-in model and it equals the plain job's global
model up to CKKS's approximation (same seeds, same data), and is not the initial model; results grow from kilobytes to
megabytes; the user's model moved from its initial weights and the sites' scores of the received model (``eval.*``,
in clear) are recorded per round and improve.

Checked, every job (and a one-round DP-SGD job under HE with site evaluation): a curious server's recorder
(tests/e2e/egress_recorder.py, first among its result filters) finds nothing beyond what the job config's egress
gates declare, and no DP site's validation score in clear (the HE meta is not encrypted). The DP sites' withheld
scores are in their own kits (``site_scores.jsonl``), none in the server's result.

Checked, QC: the HE job completes; the server logs that it adds ciphertexts and never the clear-counts warning, and its
``qc_report.json`` names the sites and the settings only; every site writes the same filtered table and a report from
the decrypted sum (rounding error far below 0.5), equal to the plaintext filter of the pooled people and to what the
plain job's server decided.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from nvflare.fuel.utils.class_utils import instantiate_class

from aggregators.contracts.egress import TRANSPORT_HEADERS
from data_prep.genotypes.cli import main as genotypes_main
from data_prep.genotypes.federated_qc import CLEAR_COUNTS_WARNING, HE_COUNTS_NOTE, QC_TABLE, global_qc
from data_prep.genotypes.qc import QcThresholds, genotype_counts
from jobs.build import JobSpec, export_job
from jobs.provision import loopback
from jobs.secure_aggregation import CLIENT_CONTEXT, SERVER_CONTEXT, decrypt_global_model, job_model_shapes
from jobs.shipping import importable
from jobs.spec import shipped_folders
from tests.e2e import egress_recorder

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NUM_SITES, ROUNDS = 3, 2
DATA = {"dataset": "fashion_mnist", "scheme": "dirichlet", "num_sites": NUM_SITES, "max_train_samples": 900}
USER_MODEL = {
    "model": "custom_model.model:DigitsClassifier",
    "data": "custom_model.data:DigitsSites",
    "ship": str(REPO / "examples" / "custom_model"),
    "client": "fedprox",
    "client_args": {"mu": 0.01},
}
DP = {"dp_target_epsilon": 8.0, "dp_max_grad_norm": 1.0}
PEOPLE = {"site-1": 12, "site-2": 15, "site-3": 18}
SNPS = tuple(f"rs{j}" for j in range(24))
MISSING = 3
QC_OPTIONS = ["--num-sites", "3", "--min-call-rate", "0.9", "--min-maf", "0.1", "--min-site-people", "10"]


def site_genotypes(seed: int, people: int) -> np.ndarray:
    """Allele frequencies from 0 to 0.5 and missing calls up to 20 %, so both QC thresholds drop SNPs."""
    rng = np.random.default_rng(seed)
    genotypes = rng.binomial(2, np.linspace(0.0, 0.5, len(SNPS)), size=(people, len(SNPS))).astype(np.int8)
    genotypes[rng.random(genotypes.shape) < np.linspace(0.2, 0.0, len(SNPS))] = MISSING
    return genotypes


def write_sites(root: Path) -> dict[str, np.ndarray]:
    """Each QC site's harmonised .npz (``{site}.npz``) and the consortium's table."""
    genotypes = {site: site_genotypes(i, n) for i, (site, n) in enumerate(PEOPLE.items())}
    for site, matrix in genotypes.items():
        samples = np.array([f"{site}-{i}" for i in range(len(matrix))])
        status = np.array(["same"] * len(SNPS))
        np.savez(root / f"{site}.npz", genotypes=matrix, samples=samples, snps=np.array(SNPS), status=status)
    rows = "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(SNPS))
    (root / "table.csv").write_text("snp,chrom,pos,ref,alt\n" + rows)
    return genotypes


def site_outputs(kit: Path) -> tuple[list[str], dict]:
    """The kept SNPs of a site's filtered QC table and its report (both under its kit's local/)."""
    with open(kit / QC_TABLE, newline="") as handle:
        kept = [row["snp"] for row in csv.DictReader(handle)]
    return kept, json.loads((kit / QC_TABLE).with_name("qc_report.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fashion_mnist):
    """Every job of the module on one started deployment: ``(deployment, {name: ...})`` with the training jobs
    ``plain``, ``he``, ``he_user`` as (job folder, final meta, downloaded result), and ``qc`` (see below)."""
    pytest.importorskip("tenseal")
    root = tmp_path_factory.mktemp("he_loopback")
    settings = {"num_rounds": ROUNDS, "num_sites": NUM_SITES, "max_train_samples": DATA["max_train_samples"]}
    specs = {m: JobSpec(name=f"e2e_{m}", secure_aggregation=m, **settings) for m in ("plain", "he")}
    specs["he_user"] = JobSpec(
        name="e2e_he_user", secure_aggregation="he", num_rounds=ROUNDS, num_sites=NUM_SITES, **USER_MODEL
    )
    # DP-SGD under HE, one round with site evaluation: the sites' scores must not reach the server (egress gate).
    specs["he_dp"] = JobSpec(name="e2e_he_dp", secure_aggregation="he", site_val_fraction=0.2, **DP, **settings)
    specs["he_dp"] = dataclasses.replace(specs["he_dp"], num_rounds=1)
    jobs = {name: export_job(spec, root / "jobs") for name, spec in specs.items()}
    genotypes = write_sites(root)
    for mode in ("he", "none"):
        options = [*QC_OPTIONS, "--secure-aggregation", mode, "--name", f"qc_{mode}"]
        assert genotypes_main(["qc-job", "--output-dir", str(root / "jobs"), *options]) == 0
    # The curious server: every job's results recorded as they arrive (tests/e2e/egress_recorder.py).
    recorded = {name: (job, ["train", "validate"]) for name, job in jobs.items()}
    recorded |= {f"qc_{m}": (root / "jobs" / f"qc_{m}", ["qc_counts", "qc_filter"]) for m in ("he", "none")}
    for name, (job, tasks) in recorded.items():
        egress_recorder.install(job, tasks, root / f"record_{name}.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))
        (root / "home").mkdir()
        # The QC job's site inputs (read by the QC job only: the training jobs' data come from local/ or the module).
        patch.setenv("FEDALG_SITE_GENOTYPES", str(root / "{site}.npz"))
        patch.setenv("FEDALG_SNP_TABLE", str(root / "table.csv"))
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", NUM_SITES, env, he=True)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        loopback.keep_server_storage_inside(deployment.server)
        for site, site_dir in deployment.sites.items():
            loopback.configure_site_data(site_dir, site, DATA)
        started, results, seconds = time.monotonic(), {}, {}
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                for name, job in jobs.items():
                    job_started = time.monotonic()
                    job_id, meta = loopback.run_job(session, deployment, job, timeout=420.0)
                    seconds[name] = time.monotonic() - job_started
                    results[name] = (job, meta, loopback.download_result(session, job_id))
                job_started = time.monotonic()
                job_id, he_meta = loopback.run_job(session, deployment, root / "jobs" / "qc_he", timeout=300.0)
                seconds["qc_he"] = time.monotonic() - job_started
                he_result = loopback.download_result(session, job_id)
                # Read the sites' outputs now: the plain QC job writes the same files. The server's logs so far hold
                # the training jobs' too, which print neither QC line.
                he_sites = {site: site_outputs(kit) for site, kit in deployment.sites.items()}
                logs = [*deployment.server.rglob("log*.txt"), *he_result.rglob("log*.txt")]
                server_logs = "".join(path.read_text(errors="replace") for path in logs)
                job_started = time.monotonic()
                job_id, plain_meta = loopback.run_job(session, deployment, root / "jobs" / "qc_none", timeout=300.0)
                seconds["qc_none"] = time.monotonic() - job_started
                plain_result = loopback.download_result(session, job_id)
            results["records"] = {
                name: (job, egress_recorder.read(root / f"record_{name}.jsonl")) for name, (job, _) in recorded.items()
            }
            results["qc"] = {
                "he": (he_meta, he_result, he_sites, server_logs, seconds["qc_he"]),
                "plain": (plain_meta, plain_result),
                "genotypes": genotypes,
            }
            yield deployment, results
        finally:
            loopback.stop(deployment)
            left = loopback.leftover_processes(deployment)
            jobs_took = ", ".join(f"{name} {s:.1f} s" for name, s in seconds.items())
            print(f"HE loopback deployment: {time.monotonic() - started:.1f} s from start to shutdown ({jobs_took})")
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def _rounds(result):
    lines = (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == "round"]


def _initial_model(job: Path) -> dict[str, np.ndarray]:
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    entry = next(c for c in server["components"] if c["id"] == "persistor")["args"]["model"]
    return {k: v.numpy() for k, v in instantiate_class(entry["path"], entry["args"]).state_dict().items()}


def test_every_training_job_completes_with_every_site_every_round(runs):
    deployment, results = runs
    for name in ("plain", "he", "he_user"):
        _, meta, result = results[name]
        assert loopback.job_problems(meta, result) == [], name
        rounds = _rounds(result)
        assert [r["round"] for r in rounds] == list(range(ROUNDS)), name
        assert all(r["aggregated"] == sorted(deployment.sites) and not r["rejected"] for r in rounds), name


def test_the_server_holds_no_secret_key_and_no_plaintext_model(runs):
    import tenseal as ts

    deployment, results = runs
    server_context = ts.context_from((deployment.server / "startup" / SERVER_CONTEXT).read_bytes())
    assert not server_context.is_private()
    for site_dir in deployment.sites.values():
        assert ts.context_from((site_dir / "startup" / CLIENT_CONTEXT).read_bytes()).is_private()
    for name in ("he", "he_user"):
        _, _, result = results[name]
        assert all(r["private_ciphertexts"] == 0 for r in _rounds(result)), name
        saved = torch.load(result / "app_server" / "FL_global_model.pt", map_location="cpu", weights_only=False)
        assert saved["model"] and all(isinstance(value, bytes) for value in saved["model"].values()), name


def test_a_site_decrypts_the_sum_and_it_is_the_plain_average(runs):
    deployment, results = runs
    job, _, he_result = results["he"]
    shapes = job_model_shapes(job)
    context = deployment.sites["site-1"] / "startup" / CLIENT_CONTEXT
    decrypted = decrypt_global_model(he_result / "app_server" / "FL_global_model.pt", context, shapes)
    plain = decrypt_global_model(results["plain"][2] / "app_server" / "FL_global_model.pt", context, shapes)
    start = _initial_model(job)
    for name in shapes:
        np.testing.assert_allclose(decrypted[name], plain[name], atol=1e-4, err_msg=name)
    assert any(not np.allclose(decrypted[name], start[name]) for name in shapes)


def test_ciphertexts_cost_megabytes_where_plaintext_costs_kilobytes(runs):
    _, results = runs
    plain = [sum(r["result_bytes"].values()) for r in _rounds(results["plain"][2])]
    he = [sum(r["result_bytes"].values()) for r in _rounds(results["he"][2])]
    assert min(he) > 10 * max(plain)


def test_a_users_own_model_trains_under_he_and_the_sites_scores_are_recorded(runs):
    deployment, results = runs
    job, _, result = results["he_user"]
    assert (job / "app" / "custom" / "custom_model" / "model.py").is_file()  # shipped to the server and the sites
    spec = JobSpec(name="shapes", secure_aggregation="he", **USER_MODEL)
    with importable(shipped_folders(spec)):
        shapes, start = job_model_shapes(job), _initial_model(job)
    context = deployment.sites["site-2"] / "startup" / CLIENT_CONTEXT
    decrypted = decrypt_global_model(result / "app_server" / "FL_global_model.pt", context, shapes)
    assert all(np.isfinite(value).all() for value in decrypted.values())
    assert any(np.abs(decrypted[name] - start[name]).max() > 1e-3 for name in shapes)
    accuracy = [r["site_eval"]["val_accuracy"] for r in _rounds(result)]
    assert all(set(a["per_site"]) == set(deployment.sites) for a in accuracy)
    # Round 0 scores the initial model, round 1 the first aggregate: the decrypted sum trained.
    assert accuracy[1]["mean"] > accuracy[0]["mean"] + 0.1, accuracy


def test_the_qc_he_job_completes_and_the_server_reports_only_sites_and_settings(runs):
    meta, result, _, server_logs, seconds = runs[1]["qc"]["he"]
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


def test_every_qc_site_keeps_the_same_snps_as_the_plaintext_filter(runs):
    qc = runs[1]["qc"]
    _, _, sites, _, _ = qc["he"]
    pooled = genotype_counts(np.concatenate(list(qc["genotypes"].values())))
    _, expected = global_qc(SNPS, pooled, QcThresholds(0.9, 0.1), sorted(PEOPLE), 10)
    assert 0 < len(expected["kept"]) < len(SNPS)  # both thresholds dropped some SNPs
    for site, (kept, report) in sites.items():
        assert kept == expected["kept"], site
        assert report["people"] == sum(PEOPLE.values()) and report["global_qc"] == expected["global_qc"], site
        assert report["sites"] == sorted(PEOPLE) and report["he_rounding_error"] < 1e-6, site
    print(
        "CKKS rounding error per site: " + ", ".join(f"{s} {r['he_rounding_error']:.2e}" for s, (_, r) in sites.items())
    )


def test_the_plain_qc_job_on_the_same_deployment_decides_the_same(runs):
    qc = runs[1]["qc"]
    meta, result = qc["plain"]
    assert str(meta["status"]).startswith("FINISHED:COMPLETED"), meta
    plain = json.loads((result / "qc_report.json").read_text())
    he_kept = {tuple(kept) for kept, _ in qc["he"][2].values()}
    assert he_kept == {tuple(plain["kept"])}


def test_nothing_undeclared_reaches_the_server(runs):
    """A curious server recorded every result of every job (training with and without DP, QC, under HE and plain):
    nothing arrived that the job does not declare, and under DP-SGD no score of a site's validation split arrived
    in clear (NVFlare's ``initial_metrics`` or ``eval.*``), although HE leaves the meta unencrypted."""
    _, results = runs
    for name, (job, records) in results["records"].items():
        assert records, name
        assert egress_recorder.beyond_declared(records, job, TRANSPORT_HEADERS) == [], name
    dp = results["records"]["he_dp"][1]
    assert {r["site"] for r in dp if r["task"] == "train"} == {f"site-{i}" for i in range(1, NUM_SITES + 1)}
    for r in dp:
        assert "initial_metrics" not in r["meta"] and not [k for k in r["meta"] if k.startswith("eval.")], r


def test_each_dp_site_keeps_its_own_scores_in_its_kit_and_the_server_holds_none(runs):
    """The DP-SGD job under HE: the validation scores each site withheld are in its own kit (``site_scores.jsonl`` in
    its state folder, read by ``python -m controllers.report <site kit>``); the server's downloaded result holds no
    such file and no ``eval.`` score."""
    from controllers import report
    from lightning_modules.privacy.site_scores import read_site_scores

    deployment, results = runs
    for site, kit in deployment.sites.items():
        (path,) = (kit / "client_state").rglob("site_scores.jsonl")
        (record,) = read_site_scores(path)
        assert record["site"] == site and {"val_loss", "val_accuracy"} <= set(record["scores"]), record
        assert report.is_site_folder(kit)
    server = results["he_dp"][2]
    assert not list(server.rglob("site_scores.jsonl"))
    texts = [p.read_text(errors="ignore") for p in server.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl")]
    assert texts and not [t for t in texts if "eval.val_" in t]
