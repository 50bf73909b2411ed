"""Experiment tracking (``--tracking``): which of NVFlare's receivers the server runs for the sites' training curves.

Every site's client script logs its round's ``train_loss`` and ``train_accuracy`` (step = round) through NVFlare's
Client API ``SummaryWriter``; a ``ConvertToFedEvent`` widget at each site forwards those events to the server, where
one receiver writes them. The client never changes with the tracker: NVFlare's receivers convert a TensorBoard-style
record (``SCALAR``) into MLflow's and W&B's ``METRIC`` themselves (``AnalyticsData.from_dxo``).

- ``tensorboard`` (default): ``TBAnalyticsReceiver``, event files in ``<run dir>/tb_events/<site>/``;
- ``mlflow``: ``MLflowReceiver``, one run per site in an experiment, by default in an SQLite file
  ``<run dir>/mlflow.db`` (no tracking server);
- ``wandb``: ``WandBReceiver``, one run per site, offline by default (``<server cwd or $WANDB_DIR>/wandb/``);
- ``none``: no receiver and no forwarding.

The receivers of MLflow and W&B import their package, so the job is built, and run by the server, with it installed
(``pip install 'nvflare-noniid[tracking]'``); the sites never need it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

#: The event the client's writer fires at the site, and its name once forwarded to the server.
SITE_EVENT = "analytix_log_stats"  # nvflare.apis.analytix.ANALYTIC_EVENT_TYPE (the client script must not need it)
FED_PREFIX = "fed."
#: What the server must have installed per tracker, pip requirement lines: the ``tracking`` extra of pyproject.toml
#: is their union (tested). MLflow's default store is SQLite, which mlflow-skinny reads through SQLAlchemy and
#: migrates with Alembic (the full ``mlflow`` package brings both).
SERVER_REQUIREMENTS: dict[str, tuple[str, ...]] = {
    "mlflow": ("mlflow-skinny>=3,<4", "sqlalchemy>=2,<3", "alembic>=1.13,<2"),
    "wandb": ("wandb>=0.19,<1",),
}
#: The module NVFlare's receiver imports, per tracker (checked where the job is built).
RECEIVER_MODULES = {"mlflow": "mlflow", "wandb": "wandb"}
TRACKING_EXTRA = "nvflare-noniid[tracking]"


class TrackingChoice(Protocol):
    """The settings this module reads (a `jobs.spec.JobSpec` has them)."""

    name: str
    client: str
    server: str
    tracking: str
    tracking_uri: str | None
    tracking_project: str
    wandb_mode: str


@dataclass(frozen=True)
class ReceiverComponent:
    """One server component: NVFlare's receiver class by import path, its component id and constructor arguments."""

    path: str
    component_id: str
    args: dict[str, Any]


def receiver_component(spec: TrackingChoice) -> ReceiverComponent | None:
    """The server's receiver for ``spec.tracking`` (``None`` for ``none``). The TensorBoard one is exactly what the
    jobs had before the setting existed, so the committed jobs are unchanged."""
    events = [FED_PREFIX + SITE_EVENT]
    # The job's algorithms, so that runs of different jobs in one experiment or project can be told apart.
    labels = {"job": spec.name, "client": spec.client, "server": spec.server}
    if spec.tracking == "tensorboard":
        return ReceiverComponent(
            "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver", "tb_receiver", {"events": events}
        )
    if spec.tracking == "mlflow":
        # Run names are NVFlare's "<site>-<job id>-<job name>-<run_name>"; empty tag dicts keep it from printing
        # that it found none.
        kw_args = {"experiment_name": spec.tracking_project, "run_name": "train", "experiment_tags": {}}
        kw_args["run_tags"] = labels
        args = {"tracking_uri": spec.tracking_uri, "kw_args": kw_args, "events": events}
        return ReceiverComponent(
            "nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver", "mlflow_receiver", args
        )
    if spec.tracking == "wandb":
        # NVFlare requires name, group and job_type, and rewrites name to "<site>-<job id>-<name>" and group to
        # "<name>-<job id>".
        wandb_args = {
            "project": spec.tracking_project,
            "name": spec.name,
            "group": spec.name,
            "job_type": "train",
            "config": labels,
        }
        args = {"wandb_args": wandb_args, "mode": spec.wandb_mode, "events": events}
        return ReceiverComponent("nvflare.app_opt.tracking.wandb.wandb_receiver.WandBReceiver", "wandb_receiver", args)
    return None


def tracking_problem(
    spec: TrackingChoice, find_module: Callable[[str], object | None] = importlib.util.find_spec
) -> str | None:
    """One line saying why the tracking settings cannot be built here, or ``None``."""
    if spec.tracking_uri is not None and spec.tracking != "mlflow":
        return f"tracking_uri {spec.tracking_uri!r} applies to --tracking mlflow only, got tracking {spec.tracking!r}"
    if spec.wandb_mode != "offline" and spec.tracking != "wandb":
        return f"wandb_mode {spec.wandb_mode!r} applies to --tracking wandb only, got tracking {spec.tracking!r}"
    if spec.tracking in ("mlflow", "wandb") and not spec.tracking_project.strip():
        return f"tracking_project must name the MLflow experiment or W&B project for tracking {spec.tracking!r}"
    module = RECEIVER_MODULES.get(spec.tracking)
    if module is not None and find_module(module) is None:
        return (
            f"tracking {spec.tracking!r} needs the {module} package where the job is built (NVFlare's receiver is "
            f"constructed here) and on the server (it runs the receiver): pip install '{TRACKING_EXTRA}' "
            f"({', '.join(SERVER_REQUIREMENTS[spec.tracking])})"
        )
    return None


def server_requirements(spec: TrackingChoice) -> list[str]:
    """Lines for the job's ``site_requirements.txt``: what the server must add for the tracker (none for TensorBoard,
    a dependency of the bundle), as comments since the sites need none of it."""
    packages = SERVER_REQUIREMENTS.get(spec.tracking)
    if not packages:
        return []
    needs = ", ".join(packages)
    return [f"# --tracking {spec.tracking}: the server (only) also needs {needs} (pip install '{TRACKING_EXTRA}')"]


def tracking_note(spec: TrackingChoice) -> str | None:
    """What the builder tells whoever runs the server about the tracker's package and where the curves land."""
    if spec.tracking not in SERVER_REQUIREMENTS:
        return None
    where = {
        "mlflow": f"MLflow experiment {spec.tracking_project!r} at "
        + (spec.tracking_uri or "sqlite:///<server run dir>/mlflow.db"),
        "wandb": f"W&B project {spec.tracking_project!r} ({spec.wandb_mode}; files under $WANDB_DIR or the server's "
        "working directory, wandb/)",
    }[spec.tracking]
    return (
        f"tracking {spec.tracking}: the server must have {', '.join(SERVER_REQUIREMENTS[spec.tracking])} installed "
        f"(pip install '{TRACKING_EXTRA}'); the sites' train_loss/train_accuracy per round go to {where}"
    )


@contextlib.contextmanager
def _environment_kept(name: str) -> Iterator[None]:
    """Restore environment variable ``name`` (or its absence) after the block: building a job must not change the
    builder's own environment."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def add_tracking(job: Any, spec: TrackingChoice) -> None:
    """Add the server's receiver and every site's forwarding of tracking events to an NVFlare ``FedJob``."""
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent

    component = receiver_component(spec)
    if component is None:  # the client's writer still fires its events; nothing forwards or records them
        return
    module, _, class_name = component.path.rpartition(".")
    receiver_class = getattr(importlib.import_module(module), class_name)
    with _environment_kept("WANDB_MODE"):  # WandBReceiver's constructor sets it for the process that runs it
        receiver = receiver_class(**component.args)
    job.to_server(receiver, id=component.component_id)
    job.to_clients(ConvertToFedEvent(events_to_convert=[SITE_EVENT], fed_event_prefix=FED_PREFIX), id="to_fed")
