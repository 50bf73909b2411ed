"""The bundle's NVFlare client: what every site runs for a job, through the job's thin client script.

The code lives here, in the installed bundle, not in the job: each exported job's ``app/custom/client.py`` is a
thin launcher (``jobs/site_script/client.py``, copied by the builder) that imports this module and calls
`main`, so the bundle must be installed on every site (the job's ``site_requirements.txt``). This module
still runs as a script too (``python -m jobs.client``, or its installed path for jobs without ``custom/``).

Per round: receive the global model (NVFlare's FLCallback loads it into the module), train locally with
Lightning under the configured client algorithm, send the weights back with namespaced meta
(``train.num_samples`` is the FedAvg weight), and stream the round's training loss/accuracy to the server's
TensorBoard receiver. In simulation each site derives its own shard of the dataset from its site name
(``site-1`` ... ``site-N``) and the job's data settings; a provisioned site reads its own data, configured on the
site (``$FEDALG_SITE_DATA`` or ``local/fedalg_site_data.json``, see ``data_prep/site_config.py``).

Start-up and round latency (docs/deployment.md, section 9): a simulated site keeps its derived
shard in its workspace for its later client-rounds, and NVFlare's in-process Client API polls are shortened to
``$FEDALG_CLIENT_POLL_S`` (0.02 s).

Runs as ``python client.py --help`` (in a job's ``app/custom/``) outside NVFlare too, to show the options.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

LOG = logging.getLogger("fedalg.client")

#: The site's environment variable for `shorten_client_polls` (seconds, > 0).
CLIENT_POLL_ENV = "FEDALG_CLIENT_POLL_S"
#: NVFlare 2.9's in-process Client API checks every 0.5 s for a new task (trainer side) and for the trainer's result
#: (executor side), and has no setting for it ("the frozen surface deliberately drops the knob"): up to 1 s of
#: idle waiting every round. A check is a Python attribute read, so 50 a second cost nothing measurable.
DEFAULT_CLIENT_POLL_S = 0.02
_IN_PROCESS_BACKEND = "nvflare.app_common.executors.client_api.in_process_backend"
#: Simulation only: the folder of the site workspace where a site keeps its derived shard between client-rounds
#: (the simulator empties the workspace when it starts, so a shard never outlives its simulation).
SHARD_CACHE_DIR = "fedalg_shards"


def build_parser() -> argparse.ArgumentParser:
    """The client options, from the one declaration of every setting (``jobs/settings.py``): the job's client-side
    settings plus the site's own (data folder, accelerator). Values are checked as the builder checks them, so a
    hand-written command line is refused with the same one-line messages."""
    from jobs.settings import CLIENT, JOB_GROUPS, SITE, ClientArgumentParser, SiteSettings, add_arguments

    parser = ClientArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, (*JOB_GROUPS, SiteSettings), sides=(CLIENT, SITE), json_as_text=True)
    return parser


def log_round_metrics(tracker: object, meta: dict, round_num: int) -> None:
    """Send the round's training loss and accuracy to the server (TensorBoard event files, one folder per site)."""
    from aggregators.contracts import meta_keys

    for tag, key in (("train_loss", meta_keys.TRAIN_LOSS), ("train_accuracy", meta_keys.TRAIN_ACCURACY)):
        value = meta.get(key)
        if value is not None:
            tracker.add_scalar(tag, float(value), global_step=round_num)


def client_poll_seconds(environ: Mapping[str, str] | None = None) -> float:
    """The poll period this site asked for in ``$FEDALG_CLIENT_POLL_S``, else `DEFAULT_CLIENT_POLL_S`."""
    raw = (os.environ if environ is None else environ).get(CLIENT_POLL_ENV, "").strip()
    if not raw:
        return DEFAULT_CLIENT_POLL_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < 60:  # also refuses nan/inf: 0 would busy-wait, a minute would stall every round
        raise SystemExit(f"error: {CLIENT_POLL_ENV}={raw!r} must be a number of seconds in (0, 60)")
    return seconds


def shorten_client_polls(seconds: float) -> list[str]:
    """Set NVFlare's in-process Client API poll periods (task pick-up and result hand-back) to ``seconds``.

    Only when this script runs inside NVFlare's client job process (in-process mode: the executor's backend module
    is loaded and the API object is on NVFlare's data bus); elsewhere (``--help``, tests, and the torchrun ranks of
    ``--devices N``, whose external-process Client API waits on events) nothing is touched. Returns what was
    changed, for the log. Neither period takes part in training, so results are bit-identical.
    """
    backend = sys.modules.get(_IN_PROCESS_BACKEND)
    if backend is None:
        return []
    from nvflare.client.api_spec import CLIENT_API_KEY
    from nvflare.fuel.data_event.data_bus import DataBus

    changed = []
    api = DataBus().get_data(CLIENT_API_KEY)
    if isinstance(getattr(api, "result_check_interval", None), int | float):
        api.result_check_interval = seconds  # the trainer's wait for the next task
        changed.append("task pick-up")
    if isinstance(getattr(backend, "_RESULT_POLL_INTERVAL", None), int | float):
        backend._RESULT_POLL_INTERVAL = seconds  # the executor's wait for the trainer's result, read every check
        changed.append("result hand-back")
    return changed


def derives_simulated_shard(workspace: Path, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `data_prep.site_config.resolve_site_data` would derive the job's shard for this site (no site
    data in ``$FEDALG_SITE_DATA`` or ``local/``, and a simulator workspace): the same checks, in its order."""
    from data_prep.site_config import LOCAL_CONFIG, SITE_DATA_ENV, is_simulated_site

    environ = os.environ if environ is None else environ
    configured = environ.get(SITE_DATA_ENV, "").strip() or (workspace / LOCAL_CONFIG).is_file()
    return not configured and is_simulated_site(workspace)


def shard_cache_path(workspace: Path, site: str, config: Any, num_classes: int) -> Path:
    """Where this site keeps its derived shard: named by everything the shard depends on."""
    key = json.dumps([dataclasses.asdict(config), site, num_classes, os.environ.get("FASHION_MNIST_DIR")])
    return workspace / SHARD_CACHE_DIR / f"{site}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"


def read_shard(path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """A cached shard, or ``None`` when it is missing or unreadable (then the site derives it again)."""
    try:
        with np.load(path, allow_pickle=False) as saved:
            x, y = saved["x"], saved["y"]
    except (OSError, ValueError, KeyError):
        return None
    return (x, y) if len(x) == len(y) > 0 else None


def write_shard(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """Write atomically: a client-round killed mid-write leaves no half file for the next one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.stem}.{os.getpid()}.npz")
    np.savez(scratch, x=x, y=y)
    os.replace(scratch, path)


def site_training_data(site: str, args: argparse.Namespace, num_classes: int) -> Any:
    """The site's training data (`data_prep.site_config.resolve_site_data`). A simulated site keeps its derived
    shard in its workspace: under ``-t 1`` every client-round is a new process, and deriving the shard reads the
    whole dataset again (1.4 s and 400 MB for Fashion-MNIST); the cached arrays are the same bits."""
    from data_prep import SiteDataConfig
    from data_prep.site_config import SiteData, resolve_site_data, site_workspace

    workspace, config = site_workspace(), SiteDataConfig.from_namespace(args)
    if not derives_simulated_shard(workspace):
        return resolve_site_data(site, workspace, config, num_classes)
    path = shard_cache_path(workspace, site, config, num_classes)
    cached = read_shard(path)
    if cached is not None:
        return SiteData(*cached, f"simulation: shard derived from the job's data settings (kept in {path})")
    data = resolve_site_data(site, workspace, config, num_classes)
    write_shard(path, data.x, data.y)
    return data


def main(argv: Sequence[str] | None = None, *, client_script: str | None = None) -> None:
    """Run a site's side of the job: ``argv`` are the job's client options (default ``sys.argv[1:]``, as NVFlare or
    torchrun pass them); ``client_script`` is the job's client script, beside which a ``--script`` user script is
    shipped (default: this file, when it runs as the script itself)."""
    args = build_parser().parse_args(argv)
    poll = client_poll_seconds()
    changed = shorten_client_polls(poll)
    if changed:
        print(f"client API polls ({', '.join(changed)}) every {poll:g} s (${CLIENT_POLL_ENV})")
    if args.script is not None:  # the user's own training script, shipped beside this one
        from lightning_modules.own_model import run_user_script

        run_user_script(args, client_script or __file__)
    elif args.model is not None:  # the user's own LightningModule and data module (lightning_modules/own_model.py)
        from lightning_modules.own_model import run_site

        run_site(args)
    else:
        run_builtin(args)


def run_builtin(args: argparse.Namespace) -> None:
    """The bundle's own model and datasets: set up once, then one local training per received global model."""
    import nvflare.client as flare_api
    import nvflare.client.lightning as flare
    from nvflare.client.tracking import SummaryWriter

    from aggregators.contracts import meta_keys
    from data_prep.site_config import seed_index
    from jobs.settings import dataset_num_classes
    from lightning_modules.cross_site import is_cross_site_task
    from lightning_modules.site import build_site_round
    from lightning_modules.state_store import ClientStateStore, default_state_root

    flare.init()
    site = flare.get_site_name()
    tracker = SummaryWriter()
    num_classes = dataset_num_classes(args.dataset)
    # Real sites read their own data (site env var or local/ config); only the simulator derives shards from the job.
    data = site_training_data(site, args, num_classes)
    print(f"{site}: training data from {data.source}")
    # The round itself is lightning_modules/site.py's, shared with the in-process runner (same bits, tested): the
    # built-in classifier with the client algorithm's callback (and a malicious site's attack, for robustness
    # experiments). State that must outlive a round lives on disk in the site workspace, per federated run.
    store = ClientStateStore(default_state_root(), site, per_run=True)  # <root>/<run id>/<site>/: survives resume
    index = seed_index(site, args.num_sites)
    site_round = build_site_round(args, site, index, data.x, data.y, num_classes, store)
    counts = np.bincount(data.y, minlength=num_classes).tolist()
    print(f"{site}: {len(data.y)} training samples, label counts {counts}")
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        if is_cross_site_task(flare_api.get_task_name()):  # after the last round (cross_site_eval)
            cross_site_reply(flare_api.get_task_name(), received, site, store, site_round)
            continue
        round_num = received.current_round or 0
        # restore_state=False: FedAvg-family clients start every round with a fresh optimizer (as FedAvg specifies),
        # and in-memory optimizer state would differ between one-process and process-per-round simulations.
        meta = site_round.fit(round_num, lambda trainer: flare.patch(trainer, restore_state=False))
        log_round_metrics(tracker, meta, round_num)
        # Under DP-SGD the loss and accuracy are withheld from the result (docs/privacy.md): printed as "withheld".
        loss, accuracy = (meta.get(key) for key in (meta_keys.TRAIN_LOSS, meta_keys.TRAIN_ACCURACY))
        print(
            f"{site} round {received.current_round}: {meta.get(meta_keys.NUM_STEPS)} steps, "
            f"train loss {'withheld' if loss is None else f'{loss:.4f}'}, "
            f"train acc {'withheld' if accuracy is None else f'{accuracy:.4f}'}",
            flush=True,
        )


def cross_site_reply(
    task: str, received: Any, site: str, store: Any, site_round: Any, send: Any = None
) -> dict[str, Any]:
    """The built-in site's answer to a cross-site task (`lightning_modules.cross_site.respond`): its kept and
    local-only models, or the counts of the other sites' models on its validation split."""
    import torch

    from lightning_modules.cross_site import respond
    from lightning_modules.personal_scores import site_copy
    from lightning_modules.split_scores import classifier_batches

    validation = site_round.validation
    split = None
    if validation is not None:
        split = classifier_batches(torch.utils.data.DataLoader(validation, batch_size=site_round.training.batch_size))
    return respond(task, received, site, store, split, lambda: site_copy(site_round.module), send)


if __name__ == "__main__":
    main()
