"""``--tracking``: the setting -> NVFlare's receiver on the server (jobs/tracking.py), its refusals at build time in
one line, the exported configs and requirements, and the ``tracking`` extra of pyproject.toml."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tomllib

from jobs.build import JobBuildError, JobSpec, export_job, main
from jobs.recipe import FedAlgRecipe
from jobs.spec import advisories
from jobs.tracking import SERVER_REQUIREMENTS, receiver_component, server_requirements, tracking_problem

REPO = Path(__file__).resolve().parents[2]
EVENTS = ["fed.analytix_log_stats"]


def _choice(**overrides) -> SimpleNamespace:
    values = {
        "name": "job",
        "client": "scaffold",
        "server": "fedyogi",
        "tracking": "tensorboard",
        "tracking_uri": None,
        "tracking_project": "nvflare-noniid",
        "wandb_mode": "offline",
    }
    return SimpleNamespace(**{**values, **overrides})


def _server_components(job_dir: Path) -> dict[str, dict]:
    config = json.loads((job_dir / "app/config/config_fed_server.json").read_text())
    return {c["id"]: c for c in config["components"]}


def _client_component_ids(job_dir: Path) -> list[str]:
    return [c["id"] for c in json.loads((job_dir / "app/config/config_fed_client.json").read_text())["components"]]


def test_tensorboard_is_the_default_and_maps_to_the_receiver_the_jobs_always_had():
    assert JobSpec(name="x").tracking == "tensorboard"
    component = receiver_component(_choice())
    assert component.path == "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver"
    assert (component.component_id, component.args) == ("tb_receiver", {"events": EVENTS})


def test_mlflow_maps_to_nvflares_receiver_with_the_uri_experiment_and_job_labels():
    component = receiver_component(_choice(tracking="mlflow", tracking_uri="sqlite:////tmp/m.db", tracking_project="e"))
    assert component.path == "nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver"
    assert component.component_id == "mlflow_receiver"
    assert component.args == {
        "tracking_uri": "sqlite:////tmp/m.db",
        "kw_args": {
            "experiment_name": "e",
            "run_name": "train",
            "experiment_tags": {},
            "run_tags": {"job": "job", "client": "scaffold", "server": "fedyogi"},
        },
        "events": EVENTS,
    }
    assert receiver_component(_choice(tracking="mlflow")).args["tracking_uri"] is None  # NVFlare's SQLite default


def test_wandb_maps_to_nvflares_receiver_with_the_project_mode_and_the_arguments_it_requires():
    component = receiver_component(_choice(tracking="wandb", tracking_project="p", wandb_mode="online"))
    assert component.path == "nvflare.app_opt.tracking.wandb.wandb_receiver.WandBReceiver"
    assert component.component_id == "wandb_receiver"
    assert component.args == {
        "wandb_args": {
            "project": "p",
            "name": "job",
            "group": "job",
            "job_type": "train",
            "config": {"job": "job", "client": "scaffold", "server": "fedyogi"},
        },
        "mode": "online",
        "events": EVENTS,
    }


def test_none_maps_to_no_receiver():
    assert receiver_component(_choice(tracking="none")) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"tracking_uri": "file:/tmp/x"},
            "tracking_uri 'file:/tmp/x' applies to --tracking mlflow only, got tracking 'tensorboard'",
        ),
        (
            {"tracking": "mlflow", "wandb_mode": "online"},
            "wandb_mode 'online' applies to --tracking wandb only, got tracking 'mlflow'",
        ),
        (
            {"tracking": "wandb", "tracking_project": " "},
            "tracking_project must name the MLflow experiment or W&B project for tracking 'wandb'",
        ),
    ],
)
def test_options_of_another_tracker_are_refused_in_one_line(overrides, message):
    assert tracking_problem(_choice(**overrides), find_module=lambda name: object()) == message


@pytest.mark.parametrize("tracker", ["mlflow", "wandb"])
def test_a_tracker_whose_package_is_missing_is_refused_with_what_to_install(tracker):
    problem = tracking_problem(_choice(tracking=tracker), find_module=lambda name: None)
    assert problem.startswith(f"tracking '{tracker}' needs the {tracker} package where the job is built")
    assert "pip install 'nvflare-noniid[tracking]'" in problem
    assert all(requirement in problem for requirement in SERVER_REQUIREMENTS[tracker])


def test_tensorboard_and_none_need_no_optional_package():
    for tracker in ("tensorboard", "none"):
        assert tracking_problem(_choice(tracking=tracker), find_module=lambda name: None) is None


def test_the_builder_refuses_a_missing_tracker_package_with_exit_code_2_and_nothing_written(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow fails, find_spec finds nothing: not installed
    out = tmp_path / "jobs"

    assert main(["--tracking", "mlflow", "--output-dir", str(out)]) == 2

    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tracking 'mlflow' needs the mlflow package") and "\n" not in err
    assert not out.exists()


def test_the_builder_refuses_an_unknown_tracker_and_a_stray_uri(tmp_path, capsys):
    assert main(["--tracking", "neptune", "--output-dir", str(tmp_path / "jobs")]) == 2

    err = capsys.readouterr().err.strip()
    assert err == "error: unknown tracking 'neptune'; choose one of ['tensorboard', 'mlflow', 'wandb', 'none']"
    with pytest.raises(JobBuildError, match=r"tracking_uri 'sqlite:///x\.db' applies to --tracking mlflow only"):
        FedAlgRecipe(tracking_uri="sqlite:///x.db")


def test_an_mlflow_job_has_the_receiver_on_the_server_and_says_what_the_server_installs(tmp_path):
    spec = JobSpec(name="ml", tracking="mlflow", tracking_uri="sqlite:////srv/mlflow.db", tracking_project="exp")

    job_dir = export_job(spec, tmp_path)

    components = _server_components(job_dir)
    assert "tb_receiver" not in components
    receiver = components["mlflow_receiver"]
    assert receiver["path"] == "nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver"
    assert receiver["args"]["tracking_uri"] == "sqlite:////srv/mlflow.db"
    assert receiver["args"]["kw_args"]["experiment_name"] == "exp"
    assert receiver["args"]["events"] == EVENTS
    assert _client_component_ids(job_dir) == ["to_fed"]
    requirements = (job_dir / "app/custom/site_requirements.txt").read_text().splitlines()
    assert requirements[-1] == server_requirements(spec)[0]
    assert requirements[-1].startswith("# --tracking mlflow: the server (only) also needs mlflow-skinny")
    assert any(note.startswith("tracking mlflow: the server must have mlflow-skinny") for note in advisories(spec))


def test_a_wandb_job_leaves_the_builders_environment_alone(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)

    recipe = FedAlgRecipe(name="wb", tracking="wandb", tracking_project="proj")
    recipe.export(str(tmp_path))

    assert "WANDB_MODE" not in os.environ  # NVFlare's WandBReceiver sets it when constructed
    receiver = _server_components(tmp_path / "wb")["wandb_receiver"]
    assert receiver["args"]["wandb_args"]["project"] == "proj"
    assert receiver["args"].get("mode", "offline") == "offline"  # NVFlare writes no argument left at its default


def test_tracking_none_forwards_and_records_nothing(tmp_path):
    spec = JobSpec(name="quiet", tracking="none")

    job_dir = export_job(spec, tmp_path)

    assert not {"tb_receiver", "mlflow_receiver", "wandb_receiver"} & set(_server_components(job_dir))
    assert _client_component_ids(job_dir) == []
    assert "--tracking" not in (job_dir / "app/custom/site_requirements.txt").read_text()
    assert not any(note.startswith("tracking") for note in advisories(spec))


def test_the_tracking_extra_is_what_the_trackers_need():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras["tracking"]) == sorted(r for needs in SERVER_REQUIREMENTS.values() for r in needs)
    assert "tracking" in (REPO / "scripts/setup_env.sh").read_text().split('install -e ".[')[1].split("]")[0]
