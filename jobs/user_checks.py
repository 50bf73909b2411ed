"""Build-time checks of a job with the user's own model and data (``--model``, ``--data``): what the job's client
algorithm and server rule need from them, refused before anything is written wherever it is knowable.

Knowable here: settings that have no effect with a user model (`NO_EFFECT_WITH_MODEL`); whether the data
class defines ``train_dataloader`` and can be built from ``--data-args`` (each site adds ``site`` and
``num_sites``, and its name as ``--data-site-arg``), without one constant for a parameter that names the site;
whether two constructions of the model with the job seed give the same weights (`construction_problem`); whether
the shipped packages import with nothing but themselves and the installed packages, as on a site
(`site_import_problem`); whether the model (built with ``--model-args``) has what the client algorithm declares it
needs (`lightning_modules.protocols`); and which optimizer its ``configure_optimizers()`` returns, when it returns
one without a trainer. A ``configure_optimizers`` that needs the trainer is skipped here: the site refuses the same
problem when the round starts, with the site's name.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl

from jobs.settings import JobBuildError, flag
from jobs.shipping import shipped_folders

_DATA = "your data module decides each site's data: give its settings in --data-args"
_OPTIMIZER = "your module's configure_optimizers() decides the optimizer: give its settings in --model-args"
_ATTACK = "simulated attacks run at the built-in sites only"
#: Settings the bundle's site loop never reads when the job trains the user's module on the user's data module,
#: and why; a value other than the default is refused rather than silently ignored.
NO_EFFECT_WITH_MODEL: dict[str, str] = {
    "dataset": _DATA,
    "scheme": _DATA,
    "alpha": _DATA,
    "classes_per_site": _DATA,
    "max_train_samples": _DATA,
    "partition_seed": _DATA,
    "site_holdout": "your data module draws its own validation and test splits (the genomics example's takes "
    "holdout in --data-args)",
    "batch_size": "your data module's train_dataloader() decides the batch size: give it in --data-args",
    "max_test_samples": "the server has no test set with --model: the sites evaluate on their val_dataloader()",
    "site_pooled_test": "the pooled view is the built-in dataset's published test set; with --model there is none",
    "site_pooled_val": "it takes published test images of the built-in dataset; with --model your data module's "
    "pooled_val_dataloader() gives the pooled validation split",
    "arch": "your module is the model: its constructor arguments go in --model-args",
    "arch_args": "your module is the model: its constructor arguments go in --model-args",
    "lr": _OPTIMIZER,
    "momentum": _OPTIMIZER,
    "weight_decay": _OPTIMIZER,
    "attack": _ATTACK,
    "attack_strength": _ATTACK,
    "attack_start_round": _ATTACK,
    "malicious_fraction": _ATTACK,
    "malicious_sites": _ATTACK,
}


def check_user_job(spec: Any, module: pl.LightningModule) -> None:
    """Raise `JobBuildError` (one line naming the path) for the first problem of ``spec``'s user code;
    ``module`` is the model the builder already built from ``spec.model`` and ``spec.model_args``."""
    problem = (
        ignored_setting_problem(spec)
        or data_problem(spec)
        or site_import_problem(spec)
        or construction_problem(spec, module)
        or algorithm_problem(spec, module)
    )
    if problem:
        raise JobBuildError(problem)


def ignored_setting_problem(spec: Any) -> str | None:
    """The first setting of `NO_EFFECT_WITH_MODEL` given a value other than its default, with the reason."""
    defaults = {f.name: f for f in dataclasses.fields(spec)}
    for name, why in NO_EFFECT_WITH_MODEL.items():
        declared = defaults[name]
        default = declared.default_factory() if declared.default is dataclasses.MISSING else declared.default
        value = getattr(spec, name)
        if value != default:
            return f"{flag(name)} {value!r} has no effect with --model ({why}); leave it out"
    return None


def data_problem(spec: Any) -> str | None:
    from lightning_modules.own_model import data_args_problem, training_data_problem, user_class

    if spec.data is None:  # --script without --data: the user's script brings its own data
        return None
    data_class = user_class(spec.data, pl.LightningDataModule, "data")
    return training_data_problem(spec.data, data_class) or data_args_problem(
        spec.data, data_class, spec.data_args, spec.data_site_arg
    )


def construction_problem(spec: Any, module: pl.LightningModule) -> str | None:
    """A second construction with the job seed, compared with the builder's first (``module``): the seed reaches
    torch's, numpy's and Python's global generators, so weights that still differ come from a source it does not
    reach, and the server and every site would start from different models."""
    from lightning_modules.own_model import build_user_module

    again = build_user_module(spec.model, spec.model_args, seed=spec.seed).state_dict()
    first = module.state_dict()
    differing = [name for name in first.keys() | again.keys() if not same_entry(first.get(name), again.get(name))]
    if not differing:
        return None
    return (
        f"model {spec.model!r}: two constructions with --seed {spec.seed} gave different initial weights "
        f"{sorted(differing)[:3]}: the constructor draws from a source the job seed does not reach (an unseeded "
        "generator such as numpy.random.default_rng(), the clock, os.urandom, torch.empty), so the server and every "
        "site would start from different models; seed that source from a constructor argument (--model-args)"
    )


def same_entry(a: Any, b: Any) -> bool:
    """Two state_dict entries are the same tensor, bit for bit (NaN where the other has NaN counts as equal)."""
    import torch

    if a is None or b is None:
        return a is b
    if torch.equal(a, b):
        return True
    return (
        a.shape == b.shape
        and a.is_floating_point()
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))
    )


def algorithm_problem(spec: Any, module: pl.LightningModule) -> str | None:
    """What the job's client algorithm or server rule cannot run with in ``module`` or its optimizer."""
    from aggregators.registry import RULES
    from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm
    from lightning_modules.protocols import configured_optimizer, module_problem, optimizer_problem

    try:
        algorithm = build_client_algorithm(spec.client, **spec.client_args)
    except (ClientAlgorithmError, TypeError, ValueError):
        return None  # bad client_args: the builder's client_args check refuses them with their own message
    problem = module_problem(algorithm, module)
    if problem is None:
        optimizer = configured_optimizer(module)
        problem = optimizer_problem(algorithm, RULES.get(spec.server), optimizer) if optimizer else None
    return f"model {spec.model!r}: {problem}" if problem else None


# --------------------------------------------------------------------------------------------------------------------
# Importing the shipped packages as a site will
# --------------------------------------------------------------------------------------------------------------------
#: Run in a fresh interpreter: ``-E`` drops PYTHONPATH and the script drops the working directory from the path, so
#: only the copied packages (argv[1]) and what is installed (site-packages, the bundle) can be imported.
_IMPORT_AS_A_SITE = """
import importlib, os, sys
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]
sys.path.insert(0, sys.argv[1])
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(f"{name}: {type(exc).__name__}: {exc}")
        raise SystemExit(1)
"""


def site_import_problem(spec: Any) -> str | None:
    """Why the user's modules that come from shipped packages fail to import where a site imports them: a folder
    holding copies of the shipped packages (the job's ``custom/``) and the installed packages, nothing else. In the
    builder's own process the folders that hold the shipped packages are on the path, so a shipped package that
    imports an unshipped sibling would pass there and fail at every site."""

    folders = shipped_folders(spec)
    shipped = sorted(folder.name for folder in folders)
    modules = sorted(
        {path.partition(":")[0] for path in (spec.model, spec.data) if path and path.split(".")[0] in shipped}
    )
    if not modules:
        return None
    failure = imported_as_a_site(tuple(str(f) for f in folders), tuple(modules), _fingerprint(folders))
    if failure is None:
        return None
    return (
        f"{failure} (imported as a site imports it: the shipped packages {shipped} plus the installed packages); "
        "ship the missing package too (--ship a,b) or install it on the server and on every site"
    )


@functools.lru_cache(maxsize=32)
def imported_as_a_site(folders: tuple[str, ...], modules: tuple[str, ...], fingerprint: tuple) -> str | None:
    """``module: Error: message`` for the first of ``modules`` that fails to import in a fresh interpreter with
    copies of ``folders`` and the installed packages only; ``None`` when all import. Cached per content
    (``fingerprint``): the interpreter imports torch and Lightning, seconds per job."""
    with tempfile.TemporaryDirectory(prefix="fedalg_site_imports_") as custom:
        for folder in folders:
            shutil.copytree(folder, Path(custom) / Path(folder).name, ignore=shutil.ignore_patterns("__pycache__"))
        done = subprocess.run(
            [sys.executable, "-E", "-c", _IMPORT_AS_A_SITE, custom, *modules],
            cwd=custom,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if done.returncode == 0:
        return None
    lines = done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or ["no output"]
    return lines[-1]


def _fingerprint(folders: list[Path]) -> tuple:
    """The names, sizes and modification times of every file under ``folders`` (what the import depends on)."""
    return tuple(
        (str(path), stat.st_size, stat.st_mtime_ns)
        for folder in folders
        for path in sorted(folder.rglob("*.py"))
        if (stat := path.stat())
    )
