"""NVFlare-native SCAFFOLD reference job, for cross-checking this bundle's SCAFFOLD (docs/scaffold_vs_nvflare.md).

Only ``tests/e2e/test_e2e_scaffold_vs_nvflare.py`` uses this module; nothing in the bundle imports it. The job is
NVFlare's own ``ScaffoldRecipe`` (server: ``nvflare.app_common.workflows.scaffold.Scaffold``, weights by step
count, c += weighted mean of delta c_i) with the bundle's model and client script run as ``--client fedavg``, so
that our client algorithm does nothing and the only SCAFFOLD correction is NVFlare's built-in Lightning handler
(``nvflare.app_opt.lightning.scaffold``), which switches on because the server sends ``scaffold_c_global``.

Two workarounds, both on NVFlare's public API, are needed to run the bundle's client script under the recipe:

1. The recipe has no "app packages" option, so its export copies a few of the bundle's modules it finds in the
   client script's imports into ``app/custom/<package>/`` (e.g. only ``lightning_modules/state_store.py``). That
   partial copy shadows the installed package (``cannot import name 'FederatedRoundCallback' from
   'lightning_modules'``). `export_reference_job` deletes those copies after ``recipe.export``: the
   packages are installed on every site, as in `jobs.build.export_job`.
2. NVFlare keeps the client control c_i inside the ``FLCallback`` that ``flare.patch`` creates (its algorithm
   handler manager). ``jobs/client.py`` builds a fresh ``Trainer`` every round and patches it, so every round gets
   a new ``FLCallback`` and NVFlare's handler restarts from c_i = 0. Run as a script (the reference job's client
   script, ``keep_fl_callback=True``), this module wraps ``flare.patch`` so that all rounds of a site share the
   first round's ``FLCallback`` (as in NVFlare's own usage: one Trainer, patched once) and then runs
   ``jobs.client.main`` unchanged. With ``keep_fl_callback=False`` the reference runs ``client.py`` as it is, to
   show the effect of the lost c_i.

Either way NVFlare's handler keeps c_i in process memory only: the reference must run with one process per site
(``nvflare simulator -t <num sites>``), never the default ``-t 1``.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from jobs.build import (
    APP_PACKAGES,
    CLIENT_SCRIPT,
    JOBS_DIR,
    JobSpec,
    client_script_args,
    dataset_num_classes,
    inside_directory,
)

WRAPPER_SCRIPT = Path(__file__).name
CONTROL_LOG_PREFIX = "nvflare-reference:"


def reference_model(spec: JobSpec) -> dict[str, Any]:
    """The same model dict as `jobs.build.build_job` gives ``PTModel`` (the recipe takes ``path`` too)."""
    return {
        "path": "lightning_modules.models.ClassifierWeights",
        "args": {"arch": spec.arch, "num_classes": dataset_num_classes(spec.dataset), "init_seed": spec.seed},
    }


def check_comparable(spec: JobSpec) -> None:
    """Refuse specs under which NVFlare's SCAFFOLD and ours are not the same algorithm (see the docs page)."""
    if spec.client != "fedavg":
        raise ValueError("the reference runs our client script as '--client fedavg': NVFlare's handler corrects")
    if spec.clients_per_round not in (None, spec.num_sites, 1.0):
        raise ValueError("NVFlare's Scaffold server scales c correctly only under full participation")
    if spec.momentum or spec.weight_decay:
        raise ValueError("compare with vanilla SGD (momentum 0, weight decay 0)")


def build_reference_recipe(spec: JobSpec, keep_fl_callback: bool = True) -> Any:
    """NVFlare's ``ScaffoldRecipe`` for ``spec``: same model, data, seed, rounds and client script options."""
    from nvflare.app_opt.pt.recipes.scaffold import ScaffoldRecipe

    check_comparable(spec)
    return ScaffoldRecipe(
        name=spec.name,
        model=reference_model(spec),
        min_clients=spec.num_sites,
        num_rounds=spec.num_rounds,
        train_script=WRAPPER_SCRIPT if keep_fl_callback else CLIENT_SCRIPT,
        train_args=client_script_args(spec),
    )


def export_reference_job(spec: JobSpec, output_dir: Path, keep_fl_callback: bool = True) -> Path:
    """Write ``output_dir/<spec.name>/`` with ``recipe.export`` and drop the partial copies of our packages."""
    output_dir = Path(output_dir).resolve()
    target = output_dir / spec.name
    if target.exists():
        shutil.rmtree(target)
    with inside_directory(JOBS_DIR):  # the script path is written as given: keep it relative to custom/
        build_reference_recipe(spec, keep_fl_callback).export(str(output_dir))
    custom = target / "app" / "custom"
    for package in APP_PACKAGES:
        shutil.rmtree(custom / package, ignore_errors=True)
    return target


def _patch_keeping_fl_callback(original_patch: Any, fl_callback_cls: type) -> Any:
    """``flare.patch`` that gives every later Trainer of this process the FLCallback of the first one."""
    kept: list[Any] = []

    def patch(trainer: Any, *args: Any, **kwargs: Any) -> None:
        if kept:
            trainer.callbacks = [*trainer.callbacks, kept[0]]
        original_patch(trainer, *args, **kwargs)
        if not kept:
            kept.extend(cb for cb in trainer.callbacks if isinstance(cb, fl_callback_cls))
        callback = next(cb for cb in trainer.callbacks if isinstance(cb, fl_callback_cls))
        _log_received_control(fl_callback_id=id(callback))

    return patch


def _log_received_control(fl_callback_id: int) -> None:
    """One line per round: the norm of the ``scaffold_c_global`` NVFlare's server sent (proof it ran)."""
    import numpy as np
    from nvflare.app_common.app_constant import AlgorithmConstants
    from nvflare.client import get_site_name, receive

    received = receive()
    control = (received.meta or {}).get(AlgorithmConstants.SCAFFOLD_CTRL_GLOBAL) if received else None
    norm = None
    if control is not None:
        norm = float(np.sqrt(sum(float(np.sum(np.asarray(v, dtype=np.float64) ** 2)) for v in control.values())))
    print(
        f"{CONTROL_LOG_PREFIX} {get_site_name()} round {received.current_round if received else None} "
        f"scaffold_c_global_norm={norm} fl_callback={fl_callback_id}",
        flush=True,
    )


def main() -> None:
    """Client entry point of the reference job: ``jobs/client.py`` with one FLCallback per site process."""
    import nvflare.client.lightning as flare

    from jobs import client

    flare.patch = _patch_keeping_fl_callback(flare.patch, flare.FLCallback)
    client.main()


if __name__ == "__main__":
    main()
