"""Two silent traps for a user's own code, each refused or fixed:

(a) a data module that takes the site under another name (``site_name``): a constant for it in ``--data-args`` made
    every site load site-1's files; ``--data-site-arg site_name`` passes each site's own name, and a constant for a
    parameter that names the site is refused;
(b) a model whose constructor draws from numpy's (or Python's) global generator: ``--seed`` now seeds both wherever
    it seeds torch's, and the builder's two constructions refuse a model whose initial weights still differ.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from jobs.settings import JobBuildError
from jobs.spec import JobSpec, client_script_args

USER_CODE = """
import random

import numpy as np
import pytorch_lightning as pl
import torch
from pathlib import Path
from torch import nn


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NumpyInit(Net):
    "Initial weights from numpy's and Python's global generators (what many published models do)."

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.body.weight.copy_(torch.from_numpy(np.random.randn(2, 4)))
            self.body.bias.fill_(random.random())


class PrivateRng(Net):
    "Initial weights from an unseeded private generator: no job seed reaches it."

    def __init__(self):
        super().__init__()
        with torch.no_grad():
            self.body.weight.copy_(torch.from_numpy(np.random.default_rng().normal(size=(2, 4))))


class SiteFiles(pl.LightningDataModule):
    "Reads its site's own file, the site named by site_name (a consortium's published data module)."

    def __init__(self, site_name, root):
        super().__init__()
        self.rows = float((Path(root) / f"{site_name}.txt").read_text())

    def train_dataloader(self):
        return [self.rows]


class DefaultSite(pl.LightningDataModule):
    def __init__(self, root, site_id="site-1"):
        super().__init__()

    def train_dataloader(self):
        return []


class TakesSite(pl.LightningDataModule):
    def __init__(self, site, client=None, **options):
        super().__init__()

    def train_dataloader(self):
        return []
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A package ``trapcode`` on the path (no --ship: no subprocess import check) and one data file per site."""
    base = tmp_path_factory.mktemp("traps")
    (base / "trapcode").mkdir()
    (base / "trapcode" / "__init__.py").write_text("")
    (base / "trapcode" / "m.py").write_text(USER_CODE)
    for i in (1, 2, 3):
        (base / f"site-{i}.txt").write_text(str(10 * i))
    sys.path.insert(0, str(base))
    yield base
    sys.path.remove(str(base))
    for name in [m for m in sys.modules if m == "trapcode" or m.startswith("trapcode.")]:
        del sys.modules[name]


def spec(root: Path, **settings) -> JobSpec:
    own = {"model": "trapcode.m:Net", "data": "trapcode.m:SiteFiles", "data_args": {"root": str(root)}}
    return JobSpec(name="traps", **{**own, **settings})


def site_rows(job: JobSpec, tmp_path: Path) -> list[float]:
    """What every site's data module loaded, built as the client script builds it from the job's command line."""
    from benchmarks.in_process import site_rounds

    return [site.data.rows for site in site_rounds(job, tmp_path).values()]


# --------------------------------------------------------------------------------------------------------------------
# (a) The site's identity reaches the parameter the data module picks its data with


def test_a_constant_for_a_site_parameter_is_refused(root):
    # Before: built, and every site loaded site-1's files (identical round-1 losses at all sites).
    with pytest.raises(JobBuildError, match=r"--data-args gives 'site_name' one value \('site-1'\) for every site"):
        spec(root, data_args={"root": str(root), "site_name": "site-1"})


def test_the_data_site_arg_gives_each_site_its_own_data(root, tmp_path):
    job = spec(root, data_site_arg="site_name")
    assert "--data-site-arg site_name" in client_script_args(job)
    assert site_rows(job, tmp_path) == [10.0, 20.0, 30.0]


def test_the_refusal_of_a_missing_site_parameter_names_data_site_arg(root):
    with pytest.raises(JobBuildError, match=r"lack the required .*\['site_name'\].*--data-site-arg site_name") as e:
        spec(root)
    assert "\n" not in str(e.value)


def test_a_data_site_arg_the_constructor_does_not_take_is_refused(root):
    with pytest.raises(
        JobBuildError, match=r"^--data-site-arg 'site' is not a parameter of SiteFiles\(site_name, root\)"
    ):
        spec(root, data_site_arg="site")


def test_a_constant_for_the_parameter_named_by_data_site_arg_is_refused(root):
    args = {"root": str(root), "site_name": "site-1"}
    with pytest.raises(JobBuildError, match=r"'site_name' one value \('site-1'\) for every site, but --data-site-arg"):
        spec(root, data_site_arg="site_name", data_args=args)


@pytest.mark.parametrize("name", ["site", "client_name"])
def test_a_constant_for_a_site_named_parameter_is_refused_even_when_supplied_or_taken_by_kwargs(root, name):
    with pytest.raises(JobBuildError, match=rf"gives '{name}' one value"):
        spec(root, data="trapcode.m:TakesSite", data_args={name: "site-2"})


def test_a_site_parameter_left_at_its_default_is_refused_when_no_site_reaches_the_module(root):
    with pytest.raises(JobBuildError, match=r"'site_id' \(default 'site-1'\) .* --data-site-arg site_id"):
        spec(root, data="trapcode.m:DefaultSite")
    assert spec(root, data="trapcode.m:DefaultSite", data_site_arg="site_id").data_site_arg == "site_id"


def test_data_site_arg_needs_a_data_module():
    with pytest.raises(JobBuildError, match=r"^data_site_arg 'site_name' .* needs --data"):
        JobSpec(name="builtin", data_site_arg="site_name")


def test_the_site_refuses_the_constant_too_naming_the_site(root):
    from lightning_modules.own_model import UserCodeError, build_user_data

    with pytest.raises(UserCodeError, match=r"^site-2: data 'trapcode.m:SiteFiles': --data-args gives 'site_name'"):
        build_user_data("trapcode.m:SiteFiles", {"root": str(root), "site_name": "site-1"}, "site-2", 3)
    data = build_user_data("trapcode.m:SiteFiles", {"root": str(root)}, "site-2", 3, site_arg="site_name")
    assert data.rows == 20.0


# --------------------------------------------------------------------------------------------------------------------
# (b) --seed seeds numpy's and Python's global generators for the model's construction


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def scramble(draw: int) -> None:
    """Whatever the process drew before building: the job seed must decide."""
    np.random.seed(draw)
    random.seed(draw)
    torch.manual_seed(draw)


def test_the_server_the_sites_and_the_in_process_runner_build_a_numpy_model_alike(root, tmp_path):
    from benchmarks.in_process import initial_params, site_rounds
    from lightning_modules.own_model import seeded_user_module

    job = spec(root, model="trapcode.m:NumpyInit", data="trapcode.m:TakesSite")
    scramble(1)
    server = weights(seeded_user_module(job.model, {}, seed=job.seed))  # the persistor of config_fed_server.json
    scramble(2)
    sites = [weights(site.module) for site in site_rounds(job, tmp_path).values()]  # the client script's UserSite
    scramble(3)
    engine = {k: torch.from_numpy(v) for k, v in initial_params(job).items()}
    scramble(4)
    other_seed = weights(seeded_user_module(job.model, {}, seed=job.seed + 1))
    assert all(same(server, site) for site in sites) and same(server, engine)
    assert not same(server, other_seed)  # the seed is what makes them equal: the check can fail


def test_seeding_numpy_and_random_leaves_the_callers_streams_as_they_were(root):
    from lightning_modules.own_model import build_user_module

    scramble(5)
    expected = (np.random.rand(), random.random(), torch.rand(1))
    scramble(5)
    build_user_module("trapcode.m:NumpyInit", {}, seed=0)
    assert (np.random.rand(), random.random()) == expected[:2] and torch.equal(torch.rand(1), expected[2])


def test_a_model_whose_initial_weights_still_differ_is_refused(root):
    with pytest.raises(JobBuildError, match=r"^model 'trapcode.m:PrivateRng': two constructions with --seed 0 .*body"):
        spec(root, model="trapcode.m:PrivateRng", data="trapcode.m:TakesSite")
    assert spec(root, model="trapcode.m:NumpyInit", data="trapcode.m:TakesSite").model == "trapcode.m:NumpyInit"
