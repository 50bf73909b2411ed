"""``python -m jobs.provision.loopback``'s command line without a deployment: ``--stop WORKSPACE`` stops a kept
deployment and only it (a deployment in ``/tmp/fl`` is not one in ``/tmp/fl2`` beside it), each site's shard is the
one the job's own record derives in simulation, and a run ends with the final accuracy and the report command.
A real kept deployment stopped from another process: tests/e2e/test_e2e_loopback_stop.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep import SiteDataConfig
from jobs.build import JobSpec, export_job
from jobs.provision import loopback

REPO = Path(__file__).resolve().parents[2]


def fake_deployment(workspace: Path, port: int = 8002) -> Path:
    """The files `loopback.provision` leaves in ``workspace`` that `deployment_in` reads (no kits' contents)."""
    kit = workspace / "provision" / "fedalg" / "prod_00"
    for name in ("localhost", "site-1", "site-2", loopback.ADMIN):
        (kit / name).mkdir(parents=True)
    loopback.write_project(workspace / "project.yml", port, ["site-1", "site-2"])
    return kit


def sleeper(*args: str) -> subprocess.Popen:
    """A process whose command line names ``args`` (as a participant's names its kit)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *args])


def test_a_kept_deployment_is_read_back_from_its_workspace(tmp_path):
    kit = fake_deployment(tmp_path / "fl", port=12345)
    deployment = loopback.deployment_in(tmp_path / "fl")
    assert deployment.port == 12345
    assert deployment.server == kit / "localhost" and deployment.admin == kit / loopback.ADMIN
    assert deployment.sites == {"site-1": kit / "site-1", "site-2": kit / "site-2"}
    assert deployment.processes == {}


@pytest.mark.parametrize(
    ("cmdline", "named"),
    [
        (["python3", "-m", "server_train", "-m", "{ws}/provision/fedalg/prod_00/localhost"], True),
        (["bash", "{ws}"], True),
        (["python3", "-u", "--workspace={ws}/x"], True),
        (["python3", "-m", "server_train", "-m", "{ws}2/provision/fedalg/prod_00/localhost"], False),
        (["bash", "{ws}-old/startup/sub_start.sh"], False),
        (["python3", "-c", "pass"], False),
    ],
)
def test_a_command_line_names_the_workspace_only_as_itself_or_a_path_inside_it(tmp_path, cmdline, named):
    workspace = tmp_path / "fl"
    assert loopback.names_workspace([a.format(ws=workspace) for a in cmdline], workspace) is named


def test_stop_ends_the_processes_of_its_workspace_and_leaves_the_deployment_beside_it(tmp_path):
    fake_deployment(tmp_path / "fl")
    ours = [sleeper(str(tmp_path / "fl" / "provision" / "fedalg" / "prod_00" / name)) for name in ("localhost", "x")]
    other = sleeper(str(tmp_path / "fl2" / "provision" / "fedalg" / "prod_00" / "localhost"))
    try:
        assert loopback.main(["--stop", str(tmp_path / "fl")]) == 0
        for process in ours:
            assert process.wait(timeout=20) is not None
        assert other.poll() is None, "stopping /fl ended a process of /fl2"
    finally:
        for process in [*ours, other]:
            process.kill()
            process.wait(timeout=20)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "pass a job folder and --workspace DIR to run it, or --stop WORKSPACE"),
        (["jobs/scaffold"], "pass a job folder and --workspace DIR to run it, or --stop WORKSPACE"),
        (["jobs/scaffold", "--stop", "{tmp}/fl"], "--stop WORKSPACE stops a kept deployment and takes no job"),
        (["--stop", "{tmp}/fl", "--workspace", "{tmp}/x"], "--stop WORKSPACE stops a kept deployment and takes no"),
        (["--stop", "{tmp}/missing"], "missing: no loopback deployment there (expected"),
    ],
)
def test_bad_input_is_one_line_and_stops_or_starts_nothing(tmp_path, capsys, argv, expected):
    assert loopback.main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    assert not (tmp_path / "x").exists()


def test_each_site_gets_the_shard_the_jobs_own_record_derives_in_simulation(tmp_path):
    """The job's data settings, not the driver's defaults: a record with another skew, seed and partition seed."""
    spec = JobSpec(
        name="skewed", client="fedavg", server="fedavg", alpha=0.1, seed=3, partition_seed=7, max_train_samples=1200
    )
    folder = export_job(spec, tmp_path)
    deployed = SiteDataConfig(**loopback.site_data_settings(folder, spec.num_sites, None))
    assert deployed == SiteDataConfig.from_namespace(spec)
    assert deployed.seed == 7 and deployed.alpha == 0.1 and deployed.max_train_samples == 1200
    assert loopback.site_data_settings(folder, spec.num_sites, 500)["max_train_samples"] == 500


def test_a_folder_without_a_record_gets_the_drivers_defaults(tmp_path):
    settings = loopback.site_data_settings(tmp_path, 4, None)
    assert settings == {
        "dataset": "fashion_mnist",
        "scheme": "dirichlet",
        "num_sites": 4,
        "max_train_samples": loopback.DEFAULT_TRAIN_SAMPLES,
    }


def test_the_committed_demo_job_keeps_the_drivers_sample_count():
    """jobs/scaffold records no sample count (the whole training set): the driver's 3,000, as before."""
    settings = loopback.site_data_settings(REPO / "jobs" / "scaffold", 3, None)
    assert settings["max_train_samples"] == loopback.DEFAULT_TRAIN_SAMPLES


def test_a_run_ends_with_the_final_accuracy_and_the_report_command(tmp_path):
    result = tmp_path / "transfer" / "job-1" / "workspace"
    (result / "metrics").mkdir(parents=True)
    records = [
        {"stage": "initial", "round": None, "num_rounds": 2, "test_accuracy": 0.1},
        {"stage": "round", "round": 0, "status": "aggregated", "test_accuracy": 0.5},
        {"stage": "round", "round": 1, "status": "aggregated", "test_accuracy": 0.6812345},
    ]
    (result / "metrics" / "round_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert loopback.result_summary(result).splitlines() == [
        "final global test accuracy: 0.6812",
        f"summary: python -m controllers.report {tmp_path / 'transfer' / 'job-1'}",
    ]
