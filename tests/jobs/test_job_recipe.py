"""``jobs.recipe.FedAlgRecipe``: the NVFlare 2.9 recipe exports what the builder exports, refuses what the builder
refuses, and runs in ``SimEnv`` (small: 3 sites, 2 rounds), where it also streams TensorBoard curves to the server."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
from nvflare.recipe import SimEnv

from jobs.build import PRESETS, JobBuildError, JobSpec, export_job
from jobs.recipe import FedAlgRecipe

REPO = Path(__file__).resolve().parents[2]


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}


def test_recipe_export_equals_the_committed_scaffold_job(tmp_path):
    preset = PRESETS["scaffold"]
    recipe = FedAlgRecipe(name="scaffold", client="scaffold", server="scaffold", num_rounds=preset.num_rounds)

    recipe.export(tmp_path)

    committed = REPO / "jobs" / "scaffold"
    assert _files(tmp_path / "scaffold") == _files(committed)
    for path in _files(committed):
        assert filecmp.cmp(tmp_path / "scaffold" / path, committed / path, shallow=False), path


def test_recipe_carries_hyperparameters_like_the_builder(tmp_path):
    settings = {"alpha": 0.1, "precision": "bf16-mixed", "min_responses": 2, "train_timeout": 600}
    recipe = FedAlgRecipe(
        name="prox", client="fedprox", client_args={"mu": 0.1}, server="fedavg", min_clients=4, **settings
    )
    recipe.export(tmp_path / "recipe")
    spec = JobSpec(name="prox", client="fedprox", client_args={"mu": 0.1}, num_sites=4, **settings)
    export_job(spec, tmp_path / "builder")

    for config in ("config_fed_server.json", "config_fed_client.json"):
        recipe_config = json.loads((tmp_path / "recipe/prox/app/config" / config).read_text())
        assert recipe_config == json.loads((tmp_path / "builder/prox/app/config" / config).read_text())
    meta = json.loads((tmp_path / "recipe/prox/meta.json").read_text())
    assert meta["min_clients"] == 2  # the job runs on while min_responses (2) of its 4 sites are alive
    server = (tmp_path / "recipe/prox/app/config/config_fed_server.json").read_text()
    assert '"min_responses": 2' in server and '"train_timeout": 600' in server


def test_recipe_export_to_a_relative_folder_lands_relative_to_the_caller(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    FedAlgRecipe(name="rel").export("out")

    assert (tmp_path / "out" / "rel" / "meta.json").is_file()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"client": "nope"}, "unknown client"),
        ({"dataset": "digits", "arch": "lenet5"}, "does not fit"),
        ({"precision": "16-mixed"}, "precision"),
    ],
)
def test_recipe_refuses_what_the_builder_refuses(kwargs, match):
    with pytest.raises(JobBuildError, match=match):
        FedAlgRecipe(**kwargs)


def test_recipe_runs_in_simenv_and_streams_tensorboard_curves(tmp_path):
    recipe = FedAlgRecipe(
        name="recipe_sim",
        client="scaffold",
        server="scaffold",
        num_rounds=2,
        min_clients=3,
        dataset="digits",
        arch="mlp",
    )

    run = recipe.execute(SimEnv(num_clients=3, workspace_root=str(tmp_path / "sim")))
    workspace = Path(run.get_result())

    server = workspace / "server" / "simulate_job"
    records = [json.loads(line) for line in (server / "metrics" / "round_metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["stage"] == "round"] == [0, 1]
    assert all(r["aggregated"] == ["site-1", "site-2", "site-3"] for r in records if r["stage"] == "round")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for site in ("site-1", "site-2", "site-3"):
        events = EventAccumulator(str(server / "tb_events" / site))
        events.Reload()
        assert {"train_loss", "train_accuracy"} <= set(events.Tags()["scalars"]), site
        losses = events.Scalars("train_loss")
        assert [e.step for e in losses] == [0, 1]
        logged = {r["round"]: r["site_train_loss"][site] for r in records if r["stage"] == "round"}
        assert [e.value for e in losses] == pytest.approx([logged[0], logged[1]], rel=1e-6)
