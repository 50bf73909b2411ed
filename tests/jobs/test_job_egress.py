"""What each job declares its sites release (jobs/egress.py, the QC job's export), and that every exported job ends
every result chain of its sites with the egress gate (aggregators/contracts/egress_gate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aggregators.contracts.egress import NVFLARE_RESULT_META
from jobs.assembly import JOBS_DIR
from jobs.egress import job_releases
from jobs.presets import PRESETS
from jobs.spec import JobSpec, job_model

GATE = "aggregators.contracts.egress_gate.EgressGate"
DP = {"dp_target_epsilon": 8.0, "dp_max_grad_norm": 1.0}
DIGITS = {"dataset": "digits", "arch": "mlp"}


def releases(**settings):
    return {release.task: release for release in job_releases(JobSpec(name="t", **DIGITS, **settings))}


def gates(config_file: Path) -> dict[str, dict]:
    """Task -> the gate's arguments; every result chain must end with the gate."""
    config = json.loads(config_file.read_text())
    found = {}
    for chain in config.get("task_result_filters", []):
        assert chain["filters"][-1]["path"] == GATE, (config_file, chain)
        for task in chain["tasks"]:
            found[task] = chain["filters"][-1]["args"]
    return found


def test_a_dp_job_declares_the_model_and_public_meta_only():
    train, validate = releases(**DP).values()
    assert train.data == tuple(job_model(JobSpec(name="t", **DIGITS)).state_dict())
    assert train.meta == (
        "train.num_samples",
        "train.num_steps",
        "train.param_keys",
        "client.algorithm",
        "train.round",
        "train.fit_seconds",
        "privacy.*",
        "fednova.*",
        "attack.*",
        *NVFLARE_RESULT_META,
    )
    assert train.metrics == () and validate.metrics == () and validate.data_kinds == ("METRICS",)


def test_released_site_scores_are_declared_under_dp_and_without_dp():
    released = releases(**DP, dp_release_site_scores=True)["train"]
    assert "eval.*" in released.meta and released.metrics == ("*",) and "train.*" not in released.meta
    plain = releases()["train"]
    assert {"eval.*", "train.*", "train.loss"} <= set(plain.meta) and plain.metrics == ("*",)


def test_the_client_algorithms_own_meta_is_declared():
    scaffold = releases(client="scaffold", server="scaffold")["train"].meta
    assert "scaffold.ctrl.diff" in scaffold and "scaffold.ctrl.diff" not in releases()["train"].meta


def test_local_entries_are_not_declared_so_a_site_that_sent_them_is_refused():
    spec = JobSpec(name="t", **DIGITS, local_keys="net.classifier.*", site_val_fraction=0.1)
    train = {r.task: r for r in job_releases(spec)}["train"]
    assert train.data and not any(k.startswith("net.classifier") for k in train.data)


def test_the_sum_workflow_declares_what_its_filters_add():
    he = releases(secure_aggregation="he")["train"].meta
    assert {"NUM_STEPS_CURRENT_ROUND", "filter_history", "PROCESSED_KEYS", "PROCESSED_ALGORITHM"} <= set(he)
    assert "PROCESSED_KEYS" not in releases(secure_aggregation="plain")["train"].meta
    assert "filter_history" not in releases()["train"].meta


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_committed_job_gates_train_and_validate_last(name):
    found = gates(JOBS_DIR / name / "app" / "config" / "config_fed_client.json")
    assert sorted(found) == ["train", "validate"]
    assert found["train"]["data_kinds"] == ["WEIGHTS"] and found["validate"]["data_kinds"] == ["METRICS"]


@pytest.mark.parametrize("mode", ["none", "he", "secagg"])
def test_the_qc_job_gates_its_two_tasks(tmp_path, mode):
    from data_prep.genotypes.cli import main as genotypes_main

    options = ["--num-sites", "3", "--secure-aggregation", mode, "--name", "qc"]
    assert genotypes_main(["qc-job", "--output-dir", str(tmp_path), *options]) == 0
    found = gates(tmp_path / "qc" / "app" / "config" / "config_fed_client.json")
    counts = {"he": "counts_he", "secagg": "counts_masked"}.get(mode, "counts")
    assert found["qc_counts"] == {"task": "qc_counts", "data_kinds": ["WEIGHTS"], "data": [counts], "meta": ["snps"]}
    assert found["qc_filter"]["data"] == ["none"] and found["qc_filter"]["meta"] == ([] if mode == "he" else ["kept"])
    steps = {
        "qc_secagg_keys": ["channel_pk", "mask_pk"],
        "qc_secagg_shares": ["sealed"],
        "qc_secagg_unmask": ["shares"],
    }
    assert {t: found[t]["data"] for t in found if t.startswith("qc_secagg")} == (steps if mode == "secagg" else {})
