"""Faults found federating a consortium's published code by import path, each refused or
fixed: ``--seed`` seeds the user model's construction everywhere it is built; settings that have no effect with
``--model`` are refused with the reason; a data module's missing constructor arguments are refused at build time;
every site-side error names the site; the JSON options are named in their whitespace refusal."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from jobs.build import main
from jobs.settings import JOB_GROUPS, JobBuildError
from jobs.spec import JobSpec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_model"

#: A module whose constructor does not seed itself (what the consortium's published code does), and data modules
#: with a required constructor argument.
USER_CODE = """
import pytorch_lightning as pl
import torch
from torch import nn


class Unseeded(pl.LightningModule):
    def __init__(self, width=4):
        super().__init__()
        self.body = nn.Linear(width, 2)

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class NeedsPath(pl.LightningDataModule):
    def __init__(self, site, num_sites, path, batch_size=8):
        super().__init__()
        self.site, self.path = site, path

    def train_dataloader(self):
        return []


class TakesAnything(pl.LightningDataModule):
    def __init__(self, site="site-1", **options):
        super().__init__()

    def train_dataloader(self):
        return []
"""


@pytest.fixture(scope="module")
def user_package(tmp_path_factory) -> str:
    package = tmp_path_factory.mktemp("faults") / "faultcode"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "m.py").write_text(USER_CODE)
    return str(package)


def spec(user_package: str, **settings) -> JobSpec:
    own = {"model": "faultcode.m:Unseeded", "data": "faultcode.m:TakesAnything", "ship": user_package}
    return JobSpec(name="own", **{**own, **settings})


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------------------------------
# --seed seeds the construction of a user model: the server's persistor, the sites, the in-process runner


def test_the_server_and_every_site_build_the_same_initial_model_from_the_job_seed(tmp_path, capsys, user_package):
    from nvflare.fuel.utils.class_utils import instantiate_class

    from jobs.spec import importable
    from lightning_modules.own_model import UserSite
    from lightning_modules.state_store import ClientStateStore

    job = spec(user_package, seed=3)
    code = main(["--model", job.model, "--data", job.data, "--ship", user_package, "--seed", "3", "--name", "own",
                 "--output-dir", str(tmp_path / "out")])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "out" / "own" / "app" / "config" / "config_fed_server.json").read_text())
    model = config["components"][0]["args"]["model"]
    assert model["args"] == {"model": "faultcode.m:Unseeded", "model_args": {}, "seed": 3}
    args = argparse.Namespace(
        model=job.model, model_args="{}", data=job.data, data_args="{}", num_sites=2, seed=3, client="fedavg",
        client_args="{}", local_keys=None, finetune_epochs=0, precision="32-true", accelerator="cpu",
    )  # fmt: skip
    with importable([Path(user_package)]):
        torch.manual_seed(100)  # whatever the process drew before: the job seed decides
        server = weights(instantiate_class(model["path"], dict(model["args"])))
        sites = [weights(UserSite(args, s, ClientStateStore(tmp_path / s, s)).module) for s in ("site-1", "site-2")]
        other_seed = weights(instantiate_class(model["path"], {**model["args"], "seed": 4}))
    assert all(same(server, site) for site in sites)
    assert not same(server, other_seed)  # the seed is what makes them equal: the check can fail


def test_two_runners_built_with_the_same_seed_start_from_the_same_model(user_package):
    from benchmarks.in_process import initial_params
    from jobs.spec import importable

    with importable([Path(user_package)]):
        torch.manual_seed(1)
        first = initial_params(spec(user_package, seed=0))
        torch.manual_seed(2)
        second = initial_params(spec(user_package, seed=0))
        third = initial_params(spec(user_package, seed=1))
    assert all((first[k] == second[k]).all() for k in first)
    assert any((first[k] != third[k]).any() for k in first)


def test_seeding_the_construction_leaves_the_callers_random_stream_as_it_was(user_package):
    from jobs.spec import importable
    from lightning_modules.own_model import build_user_module

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with importable([Path(user_package)]):
        build_user_module("faultcode.m:Unseeded", {}, seed=0)
    assert torch.equal(torch.rand(3), expected)


# --------------------------------------------------------------------------------------------------------------------
# Settings with no effect under --model are refused with the reason


@pytest.mark.parametrize(
    ("option", "value", "reason"),
    [
        ("--lr", "0.01", "configure_optimizers() decides the optimizer"),
        ("--momentum", "0.9", "configure_optimizers() decides the optimizer"),
        ("--weight-decay", "0.1", "configure_optimizers() decides the optimizer"),
        ("--batch-size", "32", "train_dataloader() decides the batch size"),
        ("--dataset", "mnist", "your data module decides each site's data"),
        ("--scheme", "iid", "your data module decides each site's data"),
        ("--alpha", "0.1", "your data module decides each site's data"),
        ("--max-test-samples", "100", "the server has no test set with --model"),
        ("--arch", "simple_cnn", "your module is the model"),
        ("--attack", "sign_flip", "simulated attacks run at the built-in sites only"),
    ],
)
def test_a_setting_with_no_effect_under_model_is_refused_with_the_reason(
    tmp_path, capsys, user_package, option, value, reason
):
    own = ["--model", "faultcode.m:Unseeded", "--data", "faultcode.m:TakesAnything", "--ship", user_package]
    extra = ["--malicious-sites", "site-1"] if option == "--attack" else []
    code = main([*own, option, value, *extra, "--name", "own", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert f"{option} " in err and "has no effect with --model" in err and reason in err, err
    assert not (tmp_path / "out").exists()


def test_every_job_setting_is_declared_to_apply_or_not_under_model():
    """A new setting must be placed: read by the bundle's site loop or server with --model, or refused there."""
    from jobs.user_checks import NO_EFFECT_WITH_MODEL

    applies = {
        "num_sites", "seed", "site_val_fraction", "site_test_fraction", "model", "model_args", "data", "data_args",
        "data_site_arg", "script", "ship", "epochs", "pattern", "max_local_epochs", "finetune_epochs", "local_baseline",
        "keep", "keep_metric", "keep_margin", "keep_view", "precision", "devices", "client", "client_args",
        "local_keys", "server", "server_args", "num_rounds", "clients_per_round", "min_responses", "min_accepted",
        "train_timeout", "save_client_updates", "resume_from", "final_site_eval", "tracking", "tracking_uri",
        "tracking_project", "wandb_mode", "dp_noise_multiplier", "dp_max_grad_norm", "dp_delta", "dp_target_epsilon",
        "dp_release_site_scores", "secure_aggregation", "secagg_threshold", "stop_patience", "cross_site_eval",
    }  # fmt: skip
    names = {f.name for group in JOB_GROUPS for f in dataclasses.fields(group)}
    assert names - applies == set(NO_EFFECT_WITH_MODEL) and not applies & set(NO_EFFECT_WITH_MODEL)


# --------------------------------------------------------------------------------------------------------------------
# A data module's constructor arguments, checked at build time (site and num_sites come from the site)


def test_a_data_modules_missing_required_argument_is_refused_at_build_time(user_package):
    with pytest.raises(JobBuildError, match=r"lack the required constructor argument\(s\) \['path'\] of NeedsPath"):
        spec(user_package, data="faultcode.m:NeedsPath")
    built = spec(user_package, data="faultcode.m:NeedsPath", data_args={"path": "/x"})  # site, num_sites supplied
    assert built.data_args == {"path": "/x"}


def test_a_data_arg_the_constructor_does_not_take_is_refused_unless_it_takes_any(user_package):
    with pytest.raises(JobBuildError, match=r"data_args \['pth'\] are not constructor arguments of NeedsPath"):
        spec(user_package, data="faultcode.m:NeedsPath", data_args={"path": "/x", "pth": 1})
    assert spec(user_package, data_args={"anything": 1}).data_args == {"anything": 1}


def test_the_site_refuses_the_same_missing_argument_naming_the_site(user_package):
    from jobs.spec import importable
    from lightning_modules.own_model import UserCodeError, build_user_data

    with (
        importable([Path(user_package)]),
        pytest.raises(UserCodeError, match=r"^site-2: data 'faultcode.m:NeedsPath': data_args {} lack the required"),
    ):
        build_user_data("faultcode.m:NeedsPath", {}, "site-2", 3)


# --------------------------------------------------------------------------------------------------------------------
# Every site-side error names the site; the JSON options are named in their refusal


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        ("nowhere_pkg.m:Net", "faultcode.m:TakesAnything", r"^site-3: model 'nowhere_pkg.m:Net': cannot import"),
        ("faultcode.m:Unseeded", "nowhere_pkg.d:Data", r"^site-3: data 'nowhere_pkg.d:Data': cannot import"),
        ("faultcode.m:Nope", "faultcode.m:TakesAnything", r"^site-3: model 'faultcode.m:Nope': module .* no attribute"),
    ],
)
def test_an_import_error_at_a_site_names_the_site(tmp_path, user_package, model, data, message):
    from jobs.spec import importable
    from lightning_modules.own_model import UserCodeError, UserSite
    from lightning_modules.state_store import ClientStateStore

    args = argparse.Namespace(
        model=model, model_args="{}", data=data, data_args="{}", num_sites=3, seed=0, client="fedavg",
        client_args="{}", local_keys=None, finetune_epochs=0, precision="32-true", accelerator="cpu",
    )  # fmt: skip
    with importable([Path(user_package)]), pytest.raises(UserCodeError, match=message):
        UserSite(args, "site-3", ClientStateStore(tmp_path, "site-3"))


@pytest.mark.parametrize(("name", "option"), [("data_args", "--data-args"), ("model_args", "--model-args")])
def test_whitespace_in_a_json_option_is_refused_naming_the_option(user_package, name, option):
    data = {"data": "faultcode.m:TakesAnything"}
    with pytest.raises(JobBuildError, match=rf"^{option} must not contain whitespace") as caught:
        spec(user_package, **data, **{name: {"width" if name == "model_args" else "x": "a b"}})
    assert "client hyperparameters" not in str(caught.value)
