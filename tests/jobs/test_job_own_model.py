"""Jobs built from a user's own LightningModule and LightningDataModule by import path (examples/custom_model).

Bad user code is refused by the builder with one line naming the path, and nothing is written.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from jobs.build import main
from jobs.settings import JobBuildError
from jobs.spec import JobSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_model"
OWN = {
    "model": "custom_model.model:DigitsClassifier",
    "data": "custom_model.data:DigitsSites",
    "ship": str(EXAMPLE),
}


def build(tmp_path, capsys, *extra: str) -> tuple[int, str]:
    argv = ["--client", "scaffold", "--server", "scaffold", "--name", "own", "--output-dir", str(tmp_path / "out")]
    code = main([*argv, *extra])
    return code, capsys.readouterr().err


def test_the_example_exports_with_its_package_shipped_and_the_server_building_the_users_model(tmp_path, capsys):
    code, err = build(tmp_path, capsys, *(f"--{k}={v}" for k, v in OWN.items()), "--model-args", '{"hidden":32}')
    assert code == 0, err
    app = tmp_path / "out" / "own" / "app"
    shipped = sorted(p.name for p in (app / "custom" / "custom_model").glob("*.py"))
    assert shipped == ["__init__.py", "data.py", "model.py", "train_script.py"]
    server_config = (app / "config" / "config_fed_server.json").read_text()
    paths = [c["path"] for c in json.loads(server_config)["components"]]
    persistor = json.loads(server_config)["components"][0]["args"]["model"]  # the initial model, seeded with --seed
    assert persistor == {
        "path": "lightning_modules.own_model.seeded_user_module",
        "args": {"model": "custom_model.model:DigitsClassifier", "model_args": {"hidden": 32}, "seed": 0},
    }
    assert "controllers.evaluator.TestSetEvaluator" not in paths  # the sites evaluate a user's model
    client = json.loads((app / "config" / "config_fed_client.json").read_text())
    args = client["executors"][0]["executor"]["args"]["task_script_args"]
    assert "--model custom_model.model:DigitsClassifier --data custom_model.data:DigitsSites" in args
    assert args.endswith('--model-args {"hidden":32}')
    requirements = (app / "custom" / "site_requirements.txt").read_text().splitlines()
    assert "nvflare-noniid==0.1.0" in requirements and "nvflare>=2.9.0,<2.10" in requirements
    assert "# Shipped with the job in app/custom/ (nothing to install): custom_model" in requirements
    assert not any(line.startswith("# Must be importable") for line in requirements)


def test_a_user_package_that_is_not_shipped_is_named_in_the_site_requirements(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE.parent))  # installed here, not shipped
    code, err = build(tmp_path, capsys, f"--model={OWN['model']}", f"--data={OWN['data']}")
    assert code == 0, err
    requirements = (tmp_path / "out" / "own" / "app" / "custom" / "site_requirements.txt").read_text()
    assert "# Must be importable on every site (install the package): custom_model.data, custom_model.model" in (
        requirements
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"model": "no_such_pkg.model:Net", "data": OWN["data"]}, "cannot import module 'no_such_pkg.model'"),
        ({"model": "custom_model.model:Nope", "data": OWN["data"]}, "has no attribute 'Nope'"),
        ({"model": "custom_model.model:DigitsNet", "data": OWN["data"]}, "not a subclass of pytorch_lightning"),
        ({"model": "custom_model.model", "data": OWN["data"]}, "must look like 'package.module:ClassName'"),
        ({"model": OWN["model"], "data": "custom_model.model:DigitsClassifier"}, "not a subclass of"),
        ({"model": OWN["model"]}, "model and data go together"),
        ({"model": OWN["model"], "data": OWN["data"], "model_args": {"widht": 3}}, "bad model_args"),
        ({"script": str(EXAMPLE / "train_script.py")}, "script: give --model too"),
        ({"model": OWN["model"], "script": str(EXAMPLE / "data.pyc")}, "is not a Python file"),
        ({"final_site_eval": True}, "final_site_eval needs a user model"),
        (
            {
                "model": OWN["model"],
                "data": OWN["data"],
                "script": str(EXAMPLE / "train_script.py"),
                "final_site_eval": True,
            },
            "not --script",
        ),
    ],
)
def test_bad_user_code_is_refused_at_build_time(settings, message):
    with pytest.raises(JobBuildError, match=message):
        JobSpec(name="own", ship=OWN["ship"], **settings)


def test_a_users_own_script_travels_in_the_job_and_the_sites_get_its_file_name(tmp_path, capsys):
    script = EXAMPLE / "train_script.py"
    code, err = build(tmp_path, capsys, f"--model={OWN['model']}", f"--script={script}", f"--ship={OWN['ship']}")
    assert code == 0, err
    app = tmp_path / "out" / "own" / "app"
    assert (app / "custom" / "train_script.py").read_text() == script.read_text()
    client = json.loads((app / "config" / "config_fed_client.json").read_text())
    args = client["executors"][0]["executor"]["args"]["task_script_args"]
    assert "--script train_script.py" in args and str(EXAMPLE) not in args


def test_the_jobs_thin_client_script_runs_the_users_script_shipped_beside_it(tmp_path, capsys):
    """The client code is the installed bundle's (jobs.client), but a --script is found in the job's custom/."""
    import subprocess
    import sys

    from lightning_modules.federated import CLIENT_ENV

    probe = tmp_path / "probe_script.py"
    probe.write_text(
        f"import os, sys\nprint('PROBE', os.path.realpath(__file__), os.environ['{CLIENT_ENV}'], sys.argv)\n"
    )
    code, err = build(tmp_path, capsys, f"--model={OWN['model']}", f"--script={probe}", f"--ship={OWN['ship']}")
    assert code == 0, err
    app = tmp_path / "out" / "own" / "app"
    client = json.loads((app / "config" / "config_fed_client.json").read_text())
    args = client["executors"][0]["executor"]["args"]["task_script_args"].split()
    command = [sys.executable, "client.py", *args]
    done = subprocess.run(command, cwd=app / "custom", capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    shipped = (app / "custom" / "probe_script.py").resolve()
    assert done.stdout.strip() == f"PROBE {shipped} scaffold {[str(shipped)]}"


def test_a_data_module_without_training_data_is_refused_on_the_site(tmp_path):
    from lightning_modules.own_model import UserCodeError, build_user_data

    package = tmp_path / "nodata"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "dm.py").write_text(
        textwrap.dedent(
            """
            import pytorch_lightning as pl

            class Empty(pl.LightningDataModule):
                def __init__(self, site="site-1"):
                    super().__init__()
            """
        )
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(UserCodeError, match=r"site-7: data 'nodata\.dm:Empty' defines no train_dataloader"):
            build_user_data("nodata.dm:Empty", {}, "site-7")
    finally:
        sys.path.remove(str(tmp_path))


def test_a_bad_ship_folder_exits_2_and_writes_nothing(tmp_path, capsys):
    code, err = build(tmp_path, capsys, "--model", OWN["model"], "--data", OWN["data"], "--ship", str(tmp_path))
    assert code == 2 and "is not a package folder" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_the_data_module_is_told_its_site_and_the_number_of_sites():
    from jobs.spec import importable
    from lightning_modules.own_model import build_user_data

    with importable([EXAMPLE]):
        first = build_user_data(OWN["data"], {"alpha": 0.5}, "site-1", 3)
        second = build_user_data(OWN["data"], {"alpha": 0.5}, "site-2", 3)
    assert len(first.train) + len(first.val) != len(second.train) + len(second.val)


def test_scaffold_under_strong_label_skew_gets_a_note_pointing_to_the_measurements(tmp_path, capsys):
    code = main(["--client", "scaffold", "--server", "scaffold", "--alpha", "0.1", "--output-dir", str(tmp_path)])
    assert code == 0 and "benchmarks/results/scaffold_label_skew.md" in capsys.readouterr().err
    code = main(["--client", "scaffold", "--server", "scaffold", "--alpha", "0.5", "--output-dir", str(tmp_path)])
    assert code == 0 and "note:" not in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# What the job's client algorithm and server rule need from the user's code, refused at build time (jobs/user_checks.py)

USER_CODE = """
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn


class Plain(pl.LightningModule):
    '''No task_loss, no net: enough for FedAvg, FedProx, FedDyn and SCAFFOLD Option II.'''

    def __init__(self, optimizer="adamw"):
        super().__init__()
        self.body = nn.Linear(4, 2)
        self.optimizer = optimizer

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.body(batch[0]), batch[1])

    def configure_optimizers(self):
        if self.optimizer == "needs_trainer":  # a schedule sized from the trainer: unknowable at build time
            return torch.optim.AdamW(self.parameters(), lr=1e-3 / self.trainer.estimated_stepping_batches)
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class NoTrainingData(pl.LightningDataModule):
    def val_dataloader(self):
        return []


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return []
"""


@pytest.fixture(scope="module")
def user_package(tmp_path_factory) -> str:
    package = tmp_path_factory.mktemp("user") / "usercode"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "m.py").write_text(USER_CODE)
    return f"{package},{EXAMPLE}"


PLAIN = ["--model", "usercode.m:Plain", "--data", "usercode.m:Data"]
DIGITS = ["--model", OWN["model"], "--data", OWN["data"]]
NO_TRAINING_DATA = ["--data", "usercode.m:NoTrainingData"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--client", "fedavg", "--server", "fedavg", "--model", "usercode.m:Plain", *NO_TRAINING_DATA],
            "data 'usercode.m:NoTrainingData' defines no train_dataloader(); a site needs training data: add "
            "train_dataloader()",
        ),
        (
            ["--client", "fedmos", "--server", "fedmos", *PLAIN, "--model-args", '{"optimizer":"sgd"}'],
            "model 'usercode.m:Plain': client algorithm 'fedmos' needs the module Plain to define task_loss(batch",
        ),
        (
            ["--client", "moon", "--server", "fedavg", *PLAIN],
            "model 'usercode.m:Plain': client algorithm 'moon' needs the module Plain to have an attribute net",
        ),
        (
            ["--client", "moon", "--server", "fedavg", *DIGITS],  # the example without a projection head
            "its net.projection is missing or None",
        ),
        (
            ["--client", "fedavg", "--server", "fednova", *PLAIN],
            "model 'usercode.m:Plain': server rule 'fednova': FedNova's normalisation describes SGD steps (a_i); "
            "AdamW cannot be described — use torch.optim.SGD (momentum allowed",
        ),
        (
            ["--client", "fedprox", "--server", "fednova", *DIGITS],
            "server rule 'fednova': FedNova's normalisation describes SGD steps (a_i); AdamW cannot be described",
        ),
        (
            ["--client", "fedmos", "--server", "fedmos", *DIGITS],
            "model 'custom_model.model:DigitsClassifier': client algorithm 'fedmos' applies its update as one plain "
            "SGD step with its own momentum, so it needs torch.optim.SGD with momentum=0 and weight_decay=0; got AdamW",
        ),
    ],
    ids=[
        "no-train-dataloader",
        "fedmos-task-loss",
        "moon-net",
        "moon-projection",
        "fednova-adamw",
        "fednova-adamw-example",
        "fedmos-adamw",
    ],
)
def test_what_the_algorithms_need_from_the_users_code_is_refused_at_build_time(
    tmp_path, capsys, user_package, options, message
):
    code = main([*options, "--ship", user_package, "--name", "own", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "options",
    [
        ["--client", "fedprox", "--server", "fednova", *PLAIN, "--model-args", '{"optimizer":"sgd"}'],
        ["--client", "fedavg", "--server", "fednova", *PLAIN, "--model-args", '{"optimizer":"needs_trainer"}'],
        ["--client", "fedmos", "--server", "fedmos", *DIGITS, "--model-args", '{"optimizer":"sgd"}'],
        ["--client", "moon", "--server", "fedavg", *DIGITS, "--model-args", '{"projection_dim":8}'],
    ],
    ids=["fednova-sgd-momentum", "optimizer-needs-the-trainer", "fedmos-plain-sgd", "moon-projection"],
)
def test_what_the_algorithms_can_run_with_exports(tmp_path, capsys, user_package, options):
    code = main([*options, "--ship", user_package, "--name", "own", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert (tmp_path / "out" / "own" / "app" / "config" / "config_fed_client.json").is_file()


# --------------------------------------------------------------------------------------------------------------------
# the recipe with model= / data=


def test_the_recipe_exports_the_users_model_and_data_as_the_builder_does(tmp_path, capsys):
    from jobs.recipe import FedAlgRecipe

    settings = {"model_args": {"hidden": 32}, "data_args": {"alpha": 0.5}}
    recipe = FedAlgRecipe(name="own", client="scaffold", server="scaffold", **OWN, **settings)
    recipe.export(str(tmp_path / "recipe"))
    config = tmp_path / "recipe" / "own" / "app" / "config"
    persistor = json.loads((config / "config_fed_server.json").read_text())["components"][0]
    assert persistor["args"]["model"]["args"] == {
        "model": "custom_model.model:DigitsClassifier",
        "model_args": {"hidden": 32},
        "seed": 0,
    }
    client = json.loads((config / "config_fed_client.json").read_text())
    args = client["executors"][0]["executor"]["args"]["task_script_args"]
    assert "--model custom_model.model:DigitsClassifier --data custom_model.data:DigitsSites" in args
    assert args.endswith('--model-args {"hidden":32} --data-args {"alpha":0.5}')
    assert (tmp_path / "recipe" / "own" / "app" / "custom" / "custom_model" / "model.py").is_file()
    code, err = build(tmp_path, capsys, *DIGITS, "--ship", OWN["ship"], "--model-args", '{"hidden":32}')
    assert code == 0, err
    cli = tmp_path / "out" / "own" / "app"
    for name in ("config/config_fed_server.json", "custom/site_requirements.txt"):
        assert (cli / name).read_text() == (tmp_path / "recipe" / "own" / "app" / name).read_text(), name


def test_the_recipe_refuses_what_the_builder_refuses():
    from jobs.recipe import FedAlgRecipe

    with pytest.raises(JobBuildError, match=r"server rule 'fednova': .* AdamW cannot be described"):
        FedAlgRecipe(name="own", client="fedavg", server="fednova", **OWN)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"site_val_fraction": 0.2}, r"site_val_fraction 0\.2: applies to the built-in models only"),
        ({"site_holdout": "stratified"}, r"--site-holdout 'stratified' has no effect with --model .*holdout in"),
    ],
)
def test_a_built_in_split_setting_is_refused_with_a_user_model(setting, message):
    from jobs.settings import JobBuildError
    from jobs.spec import JobSpec

    with pytest.raises(JobBuildError, match=message):
        JobSpec(name="x", model="custom_model.model:DigitsClassifier", data="custom_model.data:DigitsSites", **setting)


def test_a_site_log_line_keeps_four_significant_digits_so_delta_is_not_printed_as_zero():
    from lightning_modules.own_model import _scalars

    line = _scalars({"privacy.delta": 1e-5, "train.loss": 0.123456, "num_samples": 3, "site": "site-1"})
    assert line == {"privacy.delta": 1e-5, "train.loss": 0.1235, "num_samples": 3}
