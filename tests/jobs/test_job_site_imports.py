"""A site needs neither matplotlib nor scikit-learn (nor scipy): the client's import + set-up path (the committed
job's own client script, run as NVFlare's client process runs it, up to its first round) imports none of them from
the bundle's code, so a site installed without the ``plots`` and ``digits`` extras starts without them.

Lightning's torchmetrics imports scipy and matplotlib by itself whenever they are installed (they are in this test
environment), so the check watches the ``import`` statements executed by the bundle's own modules and by the client
script, not what ends up in ``sys.modules``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import startup
from data_prep.optional import require

REPO = Path(__file__).resolve().parents[2]
WATCH = """
import builtins, json, os, sys
from benchmarks.startup import ROOT, harness
PACKAGES = ("aggregators", "controllers", "data_prep", "jobs", "lightning_modules")
OURS = tuple(os.path.join(str(ROOT), p) + os.sep for p in PACKAGES)
SCRIPT = os.path.realpath(sys.argv[1])
OPTIONAL = {"matplotlib", "sklearn", "scipy"}
seen = []
original = builtins.__import__

def watched(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.split(".")[0] in OPTIONAL:
        where = os.path.realpath(sys._getframe(1).f_code.co_filename)  # the file whose import statement this is
        if where.startswith(OURS) or where == SCRIPT:
            seen.append([where, name])
    return original(name, globals, locals, fromlist, level)

builtins.__import__ = watched
"""
RUN_CLIENT = (
    WATCH
    + """
harness(sys.argv[1], sys.argv[2:])
print("WATCHED " + json.dumps(seen))
"""
)


@pytest.mark.parametrize("job", ["scaffold", "fedavg"])
def test_the_client_set_up_path_imports_no_optional_package(tmp_path, monkeypatch, job):
    from jobs.build import export_job
    from jobs.presets import PRESETS

    # The job exported by this process's builder (the same files), not by a new interpreter importing torch and NVFlare
    # as startup.prepare does for other code versions: half of this test's time. What is watched is the client's run.
    monkeypatch.setattr(startup, "export_job", lambda root, name, out_dir: export_job(PRESETS[name], out_dir))
    version = startup.prepare(job, REPO, job, tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", RUN_CLIENT, str(version.script), *version.script_args],
        capture_output=True,
        text=True,
        cwd=version.workspace,
        env=startup.code_env(REPO),
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert result["script_s"] > 0  # the script ran up to its first round
    [watched] = [line for line in done.stdout.splitlines() if line.startswith("WATCHED ")]
    assert json.loads(watched.removeprefix("WATCHED ")) == []


def test_the_watch_sees_an_optional_import_from_the_bundle(tmp_path):
    """The check above can fail: a bundle module importing matplotlib is recorded."""
    code = WATCH + (
        "import data_prep.report as r\nr.save_counts_heatmap(__import__('numpy').ones((2, 2)), sys.argv[2], 't')\n"
        "print('WATCHED ' + json.dumps(seen))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "-", str(tmp_path / "h.png")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=startup.code_env(REPO),
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [watched] = [line for line in done.stdout.splitlines() if line.startswith("WATCHED ")]
    assert [str(REPO / "data_prep" / "report.py"), "matplotlib.figure"] in json.loads(watched.removeprefix("WATCHED "))


def test_a_missing_optional_package_names_the_extra_that_installs_it():
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'nvflare-noniid\[plots\]'") as caught:
        require("fedalg_no_such_package.sub", "plots", "the report's plot")
    assert "the report's plot needs fedalg_no_such_package" in str(caught.value)
    assert require("json", "plots", "x") is json


# --------------------------------------------------------------------------------------------------------------------
# The build-time import check of shipped user code sees what a site sees: the shipped folders and installed packages

SHIPPED_MODEL = """
import pytorch_lightning as pl
import torch
from torch import nn

import {sibling}.helpers  # a sibling package beside this one: importable where the user builds, not at a site


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.body(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return []
"""


def user_packages(root: Path, shipped: str, sibling: str) -> None:
    for name in (shipped, sibling):
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text("")
    (root / shipped / "m.py").write_text(SHIPPED_MODEL.format(sibling=sibling))
    (root / sibling / "helpers.py").write_text("VALUE = 1\n")


def test_a_shipped_package_importing_an_unshipped_sibling_is_refused_naming_both(tmp_path, capsys):
    from jobs.build import main

    user_packages(tmp_path / "code", "shippedpkg26", "siblingpkg26")
    own = ["--model", "shippedpkg26.m:Net", "--data", "shippedpkg26.m:Data"]
    out = ["--name", "own", "--output-dir", str(tmp_path / "out")]
    code = main([*own, "--ship", str(tmp_path / "code" / "shippedpkg26"), *out])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "No module named 'siblingpkg26'" in err and "['shippedpkg26']" in err, err
    assert not (tmp_path / "out").exists()
    both = ",".join(str(tmp_path / "code" / name) for name in ("shippedpkg26", "siblingpkg26"))
    assert main([*own, "--ship", both, *out]) == 0, capsys.readouterr().err  # shipping the sibling too fixes it
