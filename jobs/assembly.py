"""NVFlare assembly: a validated `jobs.spec.JobSpec` -> an NVFlare ``FedJob`` -> a job folder.

Built with NVFlare's job API (``FedJob``, ``ScriptRunner``, ``PTModel``). The bundle's packages are declared as
app packages, so they are not copied into the job: they must be installed on every site (``pip install .``);
only the client script travels in ``app/custom/``, and it is a thin launcher (`SITE_SCRIPT`) that calls the
installed bundle's client, `jobs.client.main`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from aggregators.contracts.bundle import APP_PACKAGES, inside_directory
from jobs.egress import add_egress_gates
from jobs.job_record import write_job_entry
from jobs.secure_aggregation import add_sum_site_filters, add_sum_workflow
from jobs.settings import dataset_num_classes, is_private
from jobs.spec import JobSpec, client_script_args, companion_rules, model_arch_args, shipped_folders
from jobs.tracking import add_tracking, server_requirements

JOBS_DIR = Path(__file__).resolve().parent
CLIENT_SCRIPT = "client.py"
#: What every exported job carries as its ``app/custom/client.py``: a few lines that call `jobs.client.main`.
SITE_SCRIPT = JOBS_DIR / "site_script" / CLIENT_SCRIPT
#: Written into every exported job's app/custom/: what the sites must have installed.
REQUIREMENTS_FILE = "site_requirements.txt"
#: Seconds a site waits after each task before asking the server for the next one, and between asks while the
#: server has none (NVFlare's ``server.task_request_interval``, sent to the sites with every answer). NVFlare's 2 s
#: default is waited by every site after every round; the exported jobs use `task_request_interval`.
TASK_REQUEST_INTERVAL = 0.25
#: Idle task requests per second the server gets at most from the job's sites (sites / interval): 40/s is what
#: NVFlare's 2 s default gives 80 sites. Larger federations get longer intervals, never longer than NVFlare's.
MAX_IDLE_REQUESTS_PER_S = 40
NVFLARE_TASK_REQUEST_INTERVAL = 2.0


def build_job(spec: JobSpec) -> Any:
    """Assemble the NVFlare ``FedJob`` for ``spec`` (server: persistor, evaluator, controller; clients: script)."""
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import ScriptRunner

    # NVFlare aborts a job once fewer than min_clients sites are alive: a job whose rounds go on with min_responses
    # results keeps running while that many sites are.
    job = FedJob(name=spec.name, min_clients=spec.min_responses or spec.num_sites)
    job.set_app_packages(list(APP_PACKAGES))
    if spec.secure_aggregation != "none":  # NVFlare's ScatterAndGather summing the results (jobs/secure_aggregation.py)
        if spec.model is not None:
            _ship_user_code(job, spec)
        add_sum_workflow(job, spec, user_model_config(spec) if spec.model is not None else builtin_model_config(spec))
    else:
        _add_controller(job, spec)
    job.to_server(ServerSettings({"task_request_interval": task_request_interval(spec.num_sites)}))
    job.to_clients(ScriptRunner(script=CLIENT_SCRIPT, script_args=client_script_args(spec), **launcher(spec)))
    # ScriptRunner copies the script it names (jobs/client.py: NVFlare needs the path "client.py" in the config);
    # the thin launcher of the same name replaces that copy, as NVFlare copies file sources after scripts.
    job.to_clients(ShippedPackage(SITE_SCRIPT))
    if spec.secure_aggregation != "none":
        add_sum_site_filters(job, spec)
    add_tracking(job, spec)
    add_egress_gates(job, spec)  # last: the final filter on every result a site sends
    return job


def _add_controller(job: Any, spec: JobSpec) -> None:
    """The bundle's own server: the initial model (and the test-set evaluator), and the controller with its rule."""
    from controllers.fedalg_controller import ControllerSettings, FedAlgController

    if spec.model is not None:
        _add_user_model(job, spec)
    else:
        _add_builtin_model(job, spec)
    settings = ControllerSettings.of_job(
        spec,
        local_keys=tuple(spec.local_keys.split(",")) if spec.local_keys else (),  # resolved by JobSpec
        companions=companion_rules(spec),
    )
    # A user's model has no server-side evaluator: the sites evaluate it.
    controller = FedAlgController(settings=settings, **({"evaluator_id": ""} if spec.model is not None else {}))
    job.to_server(controller)


def task_request_interval(num_sites: int) -> float:
    """`TASK_REQUEST_INTERVAL`, lengthened for many sites so that the server gets at most
    `MAX_IDLE_REQUESTS_PER_S` idle requests a second (docs/deployment.md, section 9)."""
    return min(NVFLARE_TASK_REQUEST_INTERVAL, max(TASK_REQUEST_INTERVAL, num_sites / MAX_IDLE_REQUESTS_PER_S))


def launcher(spec: JobSpec) -> dict[str, Any]:
    """How a site starts the client script: in NVFlare's client process, or for ``devices > 1`` as ``devices``
    processes under torchrun (Lightning DDP; rank 0 talks to NVFlare, the others follow through collectives)."""
    if spec.devices == 1:
        return {}
    command = f"python3 -u -m torch.distributed.run --standalone --nproc_per_node={spec.devices}"
    return {"launch_external_process": True, "command": command}


def _add_builtin_model(job: Any, spec: JobSpec) -> None:
    """The server's initial model and test-set evaluator for the built-in models and datasets."""
    from nvflare.app_opt.pt.job_config.model import PTModel

    from controllers.evaluator import TestSetEvaluator

    num_classes = dataset_num_classes(spec.dataset)
    arch_args = model_arch_args(spec)
    job.to_server(PTModel(builtin_model_config(spec)))
    evaluator = TestSetEvaluator(
        arch=spec.arch,
        num_classes=num_classes,
        arch_args=arch_args or None,
        dataset=spec.dataset,
        max_test_samples=spec.max_test_samples,
    )
    job.to_server(evaluator, id="evaluator")


def builtin_model_config(spec: JobSpec) -> dict[str, Any]:
    """The persistor's model entry for the built-in classifier, seeded with the job's --seed as every site builds it."""
    model_args: dict[str, Any] = {"arch": spec.arch, "num_classes": dataset_num_classes(spec.dataset)}
    model_args["init_seed"] = spec.seed
    arch_args = model_arch_args(spec)
    if arch_args:  # the server's model and evaluator must build what the clients build (MOON's projection head)
        model_args["arch_args"] = arch_args
    # The plain twin of the sites' FLClassifier (same state_dict keys and seeded weights): no Lightning on the server.
    return {"path": "lightning_modules.models.ClassifierWeights", "args": model_args}


def _add_user_model(job: Any, spec: JobSpec) -> None:
    """The user's LightningModule, built by the server from its import path for the initial global model; the
    shipped package folders go to the server and to every site. No server-side evaluator: the sites evaluate the
    global model on their own validation data."""
    from nvflare.app_opt.pt.job_config.model import PTModel

    _ship_user_code(job, spec)
    job.to_server(PTModel(user_model_config(spec)))


def _ship_user_code(job: Any, spec: JobSpec) -> None:
    """The shipped package folders to the server (its persistor builds the user's model) and to every site; a
    ``--script`` to the sites, beside client.py (which runs it)."""
    for folder in shipped_folders(spec):  # absolute: JobSpec resolved them where the job was specified
        job.to_server(ShippedPackage(folder))
        job.to_clients(ShippedPackage(folder))
    if spec.script is not None:
        job.to_clients(ShippedPackage(Path(spec.script)))


#: What the server's persistor calls to build a user model: the user's class seeded with the job's --seed.
SEEDED_USER_MODULE = "lightning_modules.own_model.seeded_user_module"


def user_model_config(spec: JobSpec) -> dict[str, Any]:
    """The persistor's model entry for ``spec``'s user model: built by `SEEDED_USER_MODULE` with the job's
    seed, as every site builds it (NVFlare instantiates the class at ``path`` with ``args``)."""
    args = {"model": spec.model, "model_args": dict(spec.model_args), "seed": spec.seed}
    return {"path": SEEDED_USER_MODULE, "args": args}


class ServerSettings:
    """Entries of the server app's ``"server"`` section of ``config_fed_server.json`` (NVFlare reads
    ``server.task_request_interval`` and ``server.heart_beat_timeout`` there; the job API has no other way to
    write them)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = dict(settings)

    def add_to_fed_job(self, job: Any, ctx: Any) -> None:
        job.add_params({"server": self.settings}, ctx)


class ShippedPackage:
    """A package folder copied into the app's ``custom/<name>/`` (NVFlare's own external-folder option copies the
    folder's files flat, which would break ``package.module`` imports), or a single file into ``custom/``."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)

    def add_to_fed_job(self, job: Any, ctx: Any) -> None:
        job.add_file_source(str(self.folder), self.folder.name if self.folder.is_dir() else None, None, ctx)


def site_requirements(spec: JobSpec) -> str:
    """What every site (and the server) must have installed for the job, in pip's requirements format: this bundle
    and the dependencies it declares, plus where the user's model and data come from (shipped or installed)."""
    import tomllib

    pyproject = tomllib.loads((JOBS_DIR.parent / "pyproject.toml").read_text())
    project = pyproject["project"]
    lines = [
        "# What every site (and the server) must have installed to run this job.",
        f"# {project['name']} is this bundle (not on PyPI): pip install <its repository> installs it and the rest.",
        f"{project['name']}=={project['version']}",
        *project["dependencies"],
        *server_requirements(spec),
    ]
    if is_private(spec):
        # DP-SGD runs at the sites with Opacus, an optional extra of the bundle (docs/privacy.md).
        lines += [
            "# DP-SGD (--dp-*): every site needs the bundle's privacy extra.",
            *project["optional-dependencies"]["privacy"],
        ]
    if spec.secure_aggregation == "he":
        # NVFlare's HE components import TenSEAL, an optional extra of the bundle (docs/deployment.md).
        lines += [
            "# Secure aggregation (--secure-aggregation he): the server and every site need the bundle's he extra.",
            *project["optional-dependencies"]["he"],
        ]
    if spec.secure_aggregation == "secagg":
        # SecAgg+ (aggregators/secagg.py) runs on flwr's primitives, an optional extra of the bundle.
        lines += [
            "# Secure aggregation (--secure-aggregation secagg): the server and every site need the secagg extra.",
            *project["optional-dependencies"]["secagg"],
        ]
    if spec.devices > 1:
        lines.append("# --devices: the sites start the client with torch.distributed.run (part of torch).")
    shipped = [folder.name for folder in shipped_folders(spec)] if spec.model is not None else []
    if shipped:
        lines.append(f"# Shipped with the job in app/custom/ (nothing to install): {', '.join(shipped)}")
    user_modules = sorted({path.partition(":")[0] for path in (spec.model, spec.data) if path})
    unshipped = [m for m in user_modules if m.split(".")[0] not in shipped]
    bundled = [m for m in unshipped if installed_with_bundle(m, pyproject)]
    if bundled:
        lines.append(f"# Installed with {project['name']} above (nothing to ship or install): {', '.join(bundled)}")
    others = [m for m in unshipped if m not in bundled]
    if others:
        lines.append(f"# Must be importable on every site (install the package): {', '.join(others)}")
    return "\n".join(lines) + "\n"


def installed_with_bundle(module: str, pyproject: dict[str, Any]) -> bool:
    """Whether ``module``'s top-level package is one the bundle installs (pyproject's package patterns: the
    genomics examples are, so a job that uses them carries no copy)."""
    import fnmatch

    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    return any(fnmatch.fnmatchcase(module.split(".")[0], pattern) for pattern in patterns)


def write_site_requirements(job_folder: Path, spec: JobSpec) -> None:
    """Put `site_requirements` into an exported job's ``app/custom/``."""
    (job_folder / "app" / "custom" / REQUIREMENTS_FILE).write_text(site_requirements(spec))


FILTER_KEYS = ("task_data_filters", "task_result_filters")


def sort_filter_tasks(job_dir: Path) -> None:
    """Sort the task names of every filter entry in the job's configs. NVFlare's job API keeps a filter's tasks as a
    set and writes them in the set's order, which varies with the interpreter's hash seed: without this, an export
    of the same job (e.g. an HE job's decryptor on ``train`` and ``validate``) differs from run to run and the
    committed jobs' regeneration check fails at random. NVFlare matches tasks by name, so the order means nothing."""
    for config in sorted(job_dir.glob("*/config/config_fed_*.json")):
        content = json.loads(config.read_text())
        for key in FILTER_KEYS:
            for entry in content.get(key, []):
                if isinstance(entry.get("tasks"), list):
                    entry["tasks"] = sorted(entry["tasks"])
        config.write_text(json.dumps(content, indent=4))


def export_job(spec: JobSpec, output_dir: Path, resource_spec: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write ``output_dir/<spec.name>/`` (replacing an older export of the same name) and return its path;
    ``resource_spec``: what each site must grant the job, into meta.json (`jobs.provision.resources`).

    The job is written to a scratch folder beside the target first and moved into place only when complete, so
    a job that fails to assemble or export leaves ``output_dir`` as it was.
    """
    from jobs.provision.resources import add_resource_spec

    output_dir = Path(output_dir).resolve()
    target = output_dir / spec.name
    with inside_directory(JOBS_DIR):
        job = build_job(spec)
    add_resource_spec(job, resource_spec or {})
    output_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=output_dir, prefix=f".{spec.name}.") as scratch:
        with inside_directory(JOBS_DIR):
            job.export_job(scratch)
        sort_filter_tasks(Path(scratch) / spec.name)
        write_site_requirements(Path(scratch) / spec.name, spec)
        write_job_entry(Path(scratch) / spec.name, spec)  # job_spec.json + job.py: the recipe path (jobs.job_entry)
        if target.exists():
            shutil.rmtree(target)
        os.replace(Path(scratch) / spec.name, target)
    return target
