"""``--secure-aggregation secagg`` at build time: the same admissions as ``he`` (one line each), its own bad input
(fewer than 3 sites, a threshold the sites cannot meet or that is no majority), and what the exported job wires: the
SecAgg+ controller and aggregator at the server; at the sites the state, the stages' executor, the share-opening
filter first on the task data, the masking filter before the egress gate, and a gate on every stage's answer. The
run itself: tests/e2e/test_e2e_secagg.py; the protocol: tests/aggregators/test_secagg.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.build import JobBuildError, JobSpec, export_job, main
from jobs.egress import job_releases
from jobs.secure_aggregation import CLIENT_REFUSALS, RULE_REFUSALS, SUM_CLIENTS

pytest.importorskip("flwr")

SECAGG = {"secure_aggregation": "secagg", "dataset": "digits", "arch": "mlp"}


def _paths(entries: list) -> list[str]:
    return [f["path"] for entry in entries for f in entry["filters"]]


@pytest.mark.parametrize("rule", sorted(RULE_REFUSALS))
def test_a_rule_that_needs_individual_updates_is_refused_as_under_he(rule):
    with pytest.raises(JobBuildError) as refused:
        JobSpec(name="sa", server=rule, **SECAGG)
    message = str(refused.value)
    assert message.startswith(f"secure_aggregation 'secagg' with server '{rule}': the rule {RULE_REFUSALS[rule]}")
    assert "\n" not in message


@pytest.mark.parametrize("client", sorted(CLIENT_REFUSALS))
def test_a_client_that_needs_the_bundles_controller_is_refused_as_under_he(client):
    with pytest.raises(JobBuildError, match=rf"^secure_aggregation 'secagg' with client '{client}': the algorithm "):
        JobSpec(name="sa", client=client, **SECAGG)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"num_sites": 2}, r"^secure_aggregation 'secagg': secagg needs at least 3 sites, got 2: .*"),
        ({"num_sites": 3, "secagg_threshold": 4}, r"^secure_aggregation 'secagg': secagg threshold 4 cannot be met: "),
        (
            {"num_sites": 5, "secagg_threshold": 2},
            r"^secure_aggregation 'secagg': secagg threshold 2 is not a majority",
        ),
        ({"save_client_updates": True}, r"^secure_aggregation 'secagg': save_client_updates: "),
        (
            {"dataset": "fashion_mnist", "arch": "bn_cnn"},
            r"^secure_aggregation 'secagg': the model's entries \[.*num_batches_tracked.*\] are integers ",
        ),
    ],
)
def test_bad_input_is_refused_in_one_line(settings, message):
    with pytest.raises(JobBuildError, match=message) as refused:
        JobSpec(name="sa", **{**SECAGG, **settings})
    assert "\n" not in str(refused.value)


def test_a_threshold_without_secagg_is_refused():
    with pytest.raises(JobBuildError, match=r"^secure_aggregation 'he': secagg_threshold: applies to "):
        JobSpec(name="he", secure_aggregation="he", secagg_threshold=2)


def test_the_builder_refuses_two_sites_in_one_line_and_writes_nothing(capsys, tmp_path):
    args = ["--secure-aggregation", "secagg", "--num-sites", "2", "--dataset", "digits", "--arch", "mlp"]
    assert main([*args, "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("error: secure_aggregation 'secagg': secagg needs at least 3 sites, got 2") and "\n" not in err
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("client", SUM_CLIENTS)
def test_admitted_like_he(client):
    client_args = {"mu": 0.01} if client == "fedprox" else {}
    JobSpec(name="sa", client=client, client_args=client_args, **SECAGG)
    JobSpec(name="sa", server="fedadam", **SECAGG)
    assert JobSpec(name="sa", num_sites=5, **SECAGG).secagg_threshold is None  # the smallest majority, 3


def test_the_exported_job_wires_secagg_around_the_bundles_client(tmp_path):
    job = export_job(JobSpec(name="sa", num_sites=5, secagg_threshold=4, **SECAGG), tmp_path)
    config = job / "app" / "config"
    server, site = (json.loads((config / f"config_fed_{s}.json").read_text()) for s in ("server", "client"))
    (workflow,) = server["workflows"]
    assert workflow["path"] == "controllers.secagg.SecAggScatterAndGather"
    assert workflow["args"]["threshold"] == 4 and workflow["args"]["min_clients"] == 5
    aggregator = next(c for c in server["components"] if c["id"] == "aggregator")
    assert aggregator["path"] == "controllers.secagg.SecAggAggregator"
    executors = {tuple(e["tasks"]): e["executor"]["path"] for e in site["executors"]}
    assert executors[("secagg_keys", "secagg_shares", "secagg_unmask")] == "controllers.secagg_site.SecAggExecutor"
    assert "controllers.secagg_site.SecAggSite" in [c["path"] for c in site["components"]]
    assert _paths(site["task_data_filters"])[0] == "controllers.secagg_site.SecAggTaskData"
    by_task = {tuple(entry["tasks"]): [f["path"] for f in entry["filters"]] for entry in site["task_result_filters"]}
    assert by_task[("train",)] == [
        "controllers.secure_aggregation.SampleCountWeight",
        "controllers.secagg_site.SecAggMask",
        "aggregators.contracts.egress_gate.EgressGate",
    ]
    for task in ("secagg_keys", "secagg_shares", "secagg_unmask"):
        assert by_task[(task,)] == ["aggregators.contracts.egress_gate.EgressGate"]
    requirements = (job / "app" / "custom" / "site_requirements.txt").read_text()
    assert "flwr==1.41.0" in requirements and "tenseal" not in requirements


def test_the_egress_gate_declares_the_masked_result_and_each_stages_answer():
    releases = {r.task: r for r in job_releases(JobSpec(name="sa", **SECAGG))}
    assert releases["train"].data_kinds == ("WEIGHT_DIFF",)
    assert "secagg.round" in releases["train"].meta and "PROCESSED_KEYS" not in releases["train"].meta
    assert releases["secagg_keys"].data == ("channel_pk", "mask_pk")
    assert releases["secagg_shares"].data == ("sealed",)
    assert releases["secagg_unmask"].data == ("shares",)
    assert {r.data_kinds for t, r in releases.items() if t.startswith("secagg_")} == {("SECAGG_STAGE",)}
    plain = {r.task: r for r in job_releases(JobSpec(name="pl", secure_aggregation="plain"))}
    assert plain["train"].data_kinds == ("WEIGHTS",) and not any(t.startswith("secagg_") for t in plain)


def test_committed_jobs_train_as_before():
    """The new setting is recorded (null) in every committed job's job_spec.json; no job's config names secagg."""
    from jobs.build import JOBS_DIR

    records = list(Path(JOBS_DIR).glob("*/job_spec.json"))
    assert records
    for record in records:
        assert json.loads(record.read_text())["settings"]["secagg_threshold"] is None, record
        for config in record.parent.glob("app*/config/config_fed_*.json"):
            assert "secagg" not in config.read_text(), config


def test_job_py_in_the_simulator_refuses_fewer_processes_than_sites():
    from types import SimpleNamespace

    from jobs.job_entry import check_args

    spec = JobSpec(name="sa", num_sites=5, **SECAGG)
    args = SimpleNamespace(env="sim", startup_kit=None, project=None, threads=3, verbose=False)
    with pytest.raises(JobBuildError, match=r"^--threads 3: under secagg every site keeps .*use --threads 5 or leave"):
        check_args(args, spec)
    check_args(SimpleNamespace(**{**vars(args), "threads": None}), spec)
