"""Secure aggregation end to end on a loopback deployment provisioned with NVFlare's HEBuilder: the same 2-round FedAvg
job with ``--secure-aggregation plain`` and ``he`` on one started server and three sites (300 samples each).

Checked: both jobs complete with every site aggregated every round; the kits hold the contexts (the server's without
a secret key, the sites' with one); no ciphertext the server received carried a secret key; the server's saved HE
model holds ciphertexts only; a site decrypts it with its own context, and it equals the plain job's global model up
to CKKS's approximation (same seeds, same data), and is not the initial model; results grow from kilobytes to
megabytes. 67 s on the development machine (2 CPU cores, otherwise idle).
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
import torch
from nvflare.fuel.utils.class_utils import instantiate_class

from jobs.build import JobSpec, export_job
from jobs.provision import loopback
from jobs.secure_aggregation import CLIENT_CONTEXT, SERVER_CONTEXT, decrypt_global_model, job_model_shapes

pytestmark = pytest.mark.slow

NUM_SITES, ROUNDS = 3, 2
DATA = {"dataset": "fashion_mnist", "scheme": "dirichlet", "num_sites": NUM_SITES, "max_train_samples": 900}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fashion_mnist):
    """(deployment, {mode: (job folder, final meta, downloaded result)}) for plain then he."""
    pytest.importorskip("tenseal")
    root = tmp_path_factory.mktemp("he_loopback")
    settings = {"num_rounds": ROUNDS, "num_sites": NUM_SITES, "max_train_samples": DATA["max_train_samples"]}
    specs = {m: JobSpec(name=f"e2e_{m}", secure_aggregation=m, **settings) for m in ("plain", "he")}
    jobs = {m: export_job(spec, root / "jobs") for m, spec in specs.items()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))
        (root / "home").mkdir()
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", NUM_SITES, env, he=True)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        loopback.keep_server_storage_inside(deployment.server)
        for site, site_dir in deployment.sites.items():
            loopback.configure_site_data(site_dir, site, DATA)
        started, results = time.monotonic(), {}
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                for mode, job in jobs.items():
                    job_id, meta = loopback.run_job(session, deployment, job, timeout=420.0)
                    results[mode] = (job, meta, loopback.download_result(session, job_id))
            yield deployment, results
        finally:
            loopback.stop(deployment)
            left = loopback.leftover_processes(deployment)
            print(f"HE loopback deployment: {time.monotonic() - started:.1f} s from start to shutdown")
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def _rounds(result):
    lines = (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["stage"] == "round"]


def test_both_jobs_complete_with_every_site_every_round(runs):
    deployment, results = runs
    for mode, (_, meta, result) in results.items():
        assert loopback.job_problems(meta, result) == [], mode
        rounds = _rounds(result)
        assert [r["round"] for r in rounds] == list(range(ROUNDS)), mode
        assert all(r["aggregated"] == sorted(deployment.sites) and not r["rejected"] for r in rounds), mode


def test_the_server_holds_no_secret_key_and_no_plaintext_model(runs):
    import tenseal as ts

    deployment, results = runs
    server_context = ts.context_from((deployment.server / "startup" / SERVER_CONTEXT).read_bytes())
    assert not server_context.is_private()
    for site_dir in deployment.sites.values():
        assert ts.context_from((site_dir / "startup" / CLIENT_CONTEXT).read_bytes()).is_private()
    _, _, result = results["he"]
    assert all(r["private_ciphertexts"] == 0 for r in _rounds(result))
    saved = torch.load(result / "app_server" / "FL_global_model.pt", map_location="cpu", weights_only=False)["model"]
    assert saved and all(isinstance(value, bytes) for value in saved.values())  # serialised ciphertexts only


def test_a_site_decrypts_the_sum_and_it_is_the_plain_average(runs):
    deployment, results = runs
    job, _, he_result = results["he"]
    shapes = job_model_shapes(job)
    context = deployment.sites["site-1"] / "startup" / CLIENT_CONTEXT
    decrypted = decrypt_global_model(he_result / "app_server" / "FL_global_model.pt", context, shapes)
    plain = decrypt_global_model(results["plain"][2] / "app_server" / "FL_global_model.pt", context, shapes)
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    entry = next(c for c in server["components"] if c["id"] == "persistor")["args"]["model"]
    start = {k: v.numpy() for k, v in instantiate_class(entry["path"], entry["args"]).state_dict().items()}
    for name in shapes:
        np.testing.assert_allclose(decrypted[name], plain[name], atol=1e-4, err_msg=name)
    assert any(not np.allclose(decrypted[name], start[name]) for name in shapes)


def test_ciphertexts_cost_megabytes_where_plaintext_costs_kilobytes(runs):
    _, results = runs
    plain = [sum(r["result_bytes"].values()) for r in _rounds(results["plain"][2])]
    he = [sum(r["result_bytes"].values()) for r in _rounds(results["he"][2])]
    assert min(he) > 10 * max(plain)
