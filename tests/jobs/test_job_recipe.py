"""``jobs.recipe.FedAlgRecipe``: the NVFlare 2.9 recipe exports what the builder exports, refuses what the builder
refuses. Its runs in ``SimEnv`` (through a job folder's job.py) are tested in test_recipe_job_entry.py."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest

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
