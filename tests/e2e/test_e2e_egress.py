"""The egress gate, played as an attack: a curious server records every result it receives, in real simulator jobs.

The recorder (`tests/e2e/egress_recorder.py`) is the first of the server's result filters, so it sees each result as
it arrived from the site. Three short jobs, each of every kind the simulator runs:

- **DP-SGD, a user's module** (examples/custom_model, digits) with the final site evaluation: ``train`` and
  ``validate`` results. docs/privacy.md's DP row: the model and public meta (n_i, steps, ``privacy.*``); the site's
  scores are withheld (no ``--dp-release-site-scores``). Before the gate, the server received each site's validation
  scores in NVFlare's ``initial_metrics`` meta (the Lightning callback's ``callback_metrics``).
- **DP-SGD under the plain sum workflow** (``--secure-aggregation plain``, built-in digits MLP, site evaluation):
  the same scores arrived, and NVFlare's ``filter_history`` (the sum workflow's filter names, declared).
- **Genotype QC** (three tiny sites, counts in the clear): the counts and SNP IDs, then the kept count.

Checked: everything that arrived is in docs/privacy.md's row for the job (written out here, independently of the
bundle's declaration) and in what the job config declares; each site's result filters end with the gate. And the
refusal: a result with a weight the job does not declare never arrives (NVFlare's error reply only).
"""

from __future__ import annotations

import json
import os
import re
from fnmatch import fnmatchcase
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("opacus")

from aggregators.contracts.egress import TRANSPORT_HEADERS
from jobs.build import JobSpec, export_job
from tests.e2e.egress_recorder import beyond_declared, install, read

REPO = Path(__file__).resolve().parents[2]
SITES = 2
USER_MODEL = {
    "model": "custom_model.model:DigitsClassifier",
    "data": "custom_model.data:DigitsSites",
    "ship": str(REPO / "examples" / "custom_model"),
}
DP = {"dp_target_epsilon": 8.0, "dp_max_grad_norm": 1.0}
#: NVFlare's headers on a result (task identity, routing, round), and the one its server adds on receipt.
NVFLARE_HEADERS = {
    "__audit_event_id__",
    "__content_type__",
    "__cookie_jar__",
    "__msg_root_id__",
    "__peer_ctx__",
    "__peer_props__",
    "__rc__",
    "__task_id__",
    "__task_name__",
    "current_round",
    "num_rounds",
    "start_round",
    "fl_client",
}
#: docs/privacy.md, DP-SGD row: "the model (DP-SGD's output), public meta (n_i, steps, privacy.*, FedNova's tau and
#: ||a||_1)", with NVFlare's step count (the same number as train.num_steps; under the sum workflow the weight n_i)
#: and the names of the filters NVFlare's DXO filters applied (the sum workflow's).
DP_PUBLIC_META = (
    "train.num_samples",
    "train.num_steps",
    "train.param_keys",
    "train.round",
    "train.fit_seconds",
    "client.algorithm",
    "privacy.*",
    "fednova.*",
    "NUM_STEPS_CURRENT_ROUND",
    "filter_history",
)
#: docs/privacy.md, genotype QC row (in the clear): per-SNP counts and the SNP IDs they refer to; then the kept count.
QC_RELEASE = {"qc_counts": ({"counts"}, {"snps"}), "qc_filter": ({"none"}, {"kept"})}
#: docs/privacy.md, "genotype QC under SecAgg+": the masked counts, the kept count, each step's answer.
QC_SECAGG_RELEASE = {
    "qc_counts": ({"counts_masked"}, {"snps"}),
    "qc_filter": ({"none"}, {"kept"}),
    "qc_secagg_keys": ({"channel_pk", "mask_pk"}, set()),
    "qc_secagg_shares": ({"sealed"}, set()),
    "qc_secagg_unmask": ({"shares"}, set()),
}
PEOPLE = {"site-1": 12, "site-2": 15, "site-3": 18}


def run_recorded(simulate, job: Path, tasks: list[str], num_clients: int, env: dict | None = None) -> list[dict]:
    record = job.parent.parent / "record.jsonl"
    install(job, tasks, record)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        completed = simulate(job, job.parent.parent / "ws", num_clients=num_clients, threads=num_clients)
    assert record.is_file(), completed.stdout[-3000:] + completed.stderr[-3000:]
    return read(record)


def undeclared(names, patterns) -> list[str]:
    return sorted(n for n in names if not any(fnmatchcase(n, p) for p in patterns))


def model_keys(spec: JobSpec) -> set[str]:
    from jobs.spec import job_model

    return set(job_model(spec).state_dict())


def check_against_config(records: list[dict], job: Path) -> None:
    assert beyond_declared(records, job, TRANSPORT_HEADERS) == []


def check_dp_row(records: list[dict], weights: set[str], tasks: set[str]) -> None:
    """Nothing but docs/privacy.md's DP row arrived: no scores, no training loss, no undeclared header."""
    assert {r["task"] for r in records} == tasks
    for r in records:
        where = f"{r['site']} {r['task']}"
        assert not undeclared(r["meta"], DP_PUBLIC_META), f"{where}: undeclared meta arrived: {r['meta']}"
        assert not set(r["data"]) - weights, f"{where}: undeclared data: {r['data']}"
        if r["data_kind"] == "METRICS":
            assert r["data"] == [], f"{where}: scores arrived: {r['data']}"
        assert not set(r["headers"]) - NVFLARE_HEADERS, f"{where}: undeclared headers: {r['headers']}"
        assert r["top_level"] == [], where


@pytest.fixture(scope="module")
def dp_user_job(tmp_path_factory, simulate):
    spec = JobSpec(name="egress_dp_user", num_sites=SITES, num_rounds=1, final_site_eval=True, **USER_MODEL, **DP)
    root = tmp_path_factory.mktemp("egress_dp_user")
    job = export_job(spec, root / "jobs")
    return spec, job, run_recorded(simulate, job, ["train", "validate"], SITES)


def gate_lines(workspace: Path) -> list[str]:
    """The egress gate's lines in the sites' logs."""
    logs = sorted(workspace.glob("site-*/**/log.txt"))
    return [m.group(1) for log in logs for m in re.finditer(r"(site-\d+: egress gate[^\n]*)", log.read_text())]


def test_a_dp_sites_scores_never_reach_the_server(dp_user_job):
    spec, job, records = dp_user_job
    assert len(records) == 2 * SITES  # a train and a validate result from every site
    check_dp_row(records, model_keys(spec), {"train", "validate"})
    check_against_config(records, job)
    # The scores NVFlare's Lightning callback attached were stripped at the sites, each named in the site's log.
    stripped = "egress gate stripped from the train result what the job does not declare: metrics "
    expected = {f"site-{i}: {stripped}['val_accuracy', 'val_loss']" for i in range(1, SITES + 1)}
    assert set(gate_lines(job.parent.parent / "ws")) == expected


def test_the_sum_workflow_under_dp_sends_only_the_dp_row(tmp_path, simulate):
    spec = JobSpec(
        name="egress_dp_plain",
        dataset="digits",
        arch="mlp",
        num_sites=SITES,
        num_rounds=1,
        site_val_fraction=0.2,
        secure_aggregation="plain",
        **DP,
    )
    job = export_job(spec, tmp_path / "jobs")
    records = run_recorded(simulate, job, ["train"], SITES)
    assert len(records) == SITES
    check_dp_row(records, model_keys(spec), {"train"})
    check_against_config(records, job)


def write_qc_sites(root: Path) -> None:
    snps = [f"rs{j}" for j in range(24)]
    for i, (site, people) in enumerate(PEOPLE.items()):
        rng = np.random.default_rng(i)
        genotypes = rng.binomial(2, np.linspace(0.05, 0.5, len(snps)), size=(people, len(snps))).astype(np.int8)
        samples = np.array([f"{site}-{k}" for k in range(people)])
        np.savez(root / f"{site}.npz", genotypes=genotypes, samples=samples, snps=np.array(snps),
                 status=np.array(["same"] * len(snps)))  # fmt: skip
    rows = "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(snps))
    (root / "table.csv").write_text("snp,chrom,pos,ref,alt\n" + rows)


@pytest.mark.parametrize("mode", ["none", "secagg"])
def test_a_qc_site_sends_only_its_counts_and_snp_ids(tmp_path, simulate, mode):
    """In the clear: the QC row's counts and SNP IDs. Under SecAgg+ (docs/privacy.md, "genotype QC under SecAgg+"):
    the masked counts instead, and each key and unmask step's answer."""
    from data_prep.genotypes.cli import main as genotypes_main

    release = QC_RELEASE if mode == "none" else QC_SECAGG_RELEASE
    write_qc_sites(tmp_path)
    options = ["--num-sites", "3", "--min-maf", "0.01", "--min-site-people", "10", "--name", "egress_qc"]
    options += ["--secure-aggregation", mode]
    assert genotypes_main(["qc-job", "--output-dir", str(tmp_path / "jobs"), *options]) == 0
    job = tmp_path / "jobs" / "egress_qc"
    env = {"FEDALG_SITE_GENOTYPES": str(tmp_path / "{site}.npz"), "FEDALG_SNP_TABLE": str(tmp_path / "table.csv")}
    records = run_recorded(simulate, job, list(release), len(PEOPLE), env)
    assert sorted((r["task"], r["site"]) for r in records) == sorted((t, s) for t in release for s in PEOPLE)
    for r in records:
        data, meta = release[r["task"]]
        assert set(r["data"]) <= data and set(r["meta"]) <= meta, r
        assert not set(r["headers"]) - NVFLARE_HEADERS, r
    check_against_config(records, job)


def test_the_recorder_sees_what_arrives(tmp_path):
    """The recorder itself: a result with a stray header, meta and metrics is written down name by name."""
    from nvflare.apis.dxo import DXO, DataKind

    from tests.e2e.egress_recorder import describe

    dxo = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}, meta={"train.num_samples": 3, "initial_metrics": {"a": 1}})
    shareable = dxo.to_shareable()
    shareable.set_header("stray", 1)
    record = describe(shareable, "train", "site-1")
    assert record["data"] == ["w"] and record["meta"] == {"initial_metrics": ["a"], "train.num_samples": "int"}
    assert "stray" in record["headers"] and os.fspath(tmp_path)


def test_a_result_with_undeclared_weights_is_refused_and_nothing_of_it_arrives(tmp_path, simulate, round_metrics):
    """The refusal, in a real job: the job declares one model entry fewer than its sites send (as if a site leaked a
    local entry), so each site's gate refuses its training result. The server receives NVFlare's error reply only
    (no DXO: no weights, no meta), the round fails without a valid result, and the site's log names the key."""
    digits = {"dataset": "digits", "arch": "mlp", "max_train_samples": 300}
    job = export_job(JobSpec(name="egress_refuse", num_sites=SITES, num_rounds=1, **digits), tmp_path / "jobs")
    config_file = job / "app" / "config" / "config_fed_client.json"
    config = json.loads(config_file.read_text())
    gate = next(c["filters"][-1]["args"] for c in config["task_result_filters"] if c["tasks"] == ["train"])
    gate["data"].remove("net.classifier.bias")
    config_file.write_text(json.dumps(config, indent=2))
    records = run_recorded(simulate, job, ["train", "validate"], SITES)
    assert records and all("data_kind" not in r and "__rc__" in r["headers"] for r in records), records
    refused = "egress gate refused the train result, nothing of it sent: undeclared data keys ['net.classifier.bias']"
    lines = gate_lines(tmp_path / "ws")
    assert lines and all(refused in line for line in lines), lines
    rounds = [r for r in round_metrics(tmp_path / "ws") if r["stage"] == "round"]
    assert rounds[0]["aggregated"] == [] and "0 valid result" in rounds[0]["failure"]
