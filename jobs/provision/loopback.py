"""A real NVFlare deployment on this machine: provision, start server and sites as processes, submit, wait, stop.

    python -m jobs.provision.loopback jobs/scaffold --workspace /tmp/fedalg-loopback
    python -m jobs.provision.loopback jobs/fedavg --workspace /tmp/fl --sites 3 --keep   # leave it running
    python -m jobs.provision.loopback --stop /tmp/fl                                     # stop a kept deployment

Everything a provisioned deployment does happens here, on loopback: ``nvflare provision`` with
``jobs/provision/project.yml`` (server ``localhost`` on a port that is free now), mutual-TLS startup kits, each
participant started from its own kit (``startup/sub_start.sh --once``) as a separate process group, the job
submitted as the project admin through ``nvflare.fuel.flare_api``. Each site gets

- the bundle's classes added to the class allow-list of its ``local/resources.json``;
- its own training data: ``<site>/data/train.npz`` (written from the simulation shard, as a stand-in for the
  site's real data) named by ``local/fedalg_site_data.json`` (see `data_prep.site_config`). The shard is the one the
  job's own record (``job_spec.json``) derives in simulation, so the deployed job trains as ``nvflare simulator``
  does (`site_data_settings`; ``--max-train-samples`` overrides the record's count, 3,000 when it names none);
- with ``--genotypes`` (``{site}`` replaced by each site's name), ``--snp-table`` and ``--labels``: its genotype
  files, named in the same ``local/fedalg_site_data.json`` (``"genotypes"``, ``"snp_table"``, ``"labels"``; see
  `data_prep.genotypes.site_files`), as a real site writes them in its own kit. The caller's ``FEDALG_SITE_*`` /
  ``FEDALG_SNP_TABLE`` variables are not passed to the sites: each reads only what its kit names.

A job that uses secure aggregation under HE (NVFlare's HE components, or a federated QC job exported with
``--secure-aggregation he``) gets kits with HEBuilder's contexts by itself; a federated QC job succeeds when it ends
``FINISHED:COMPLETED`` with the server's ``qc_report.json`` (it has no rounds).

The run ends with the global model's final test accuracy and the report command for the downloaded result. A
deployment left running with ``--keep`` is stopped from any shell with ``--stop WORKSPACE`` (`stop_workspace`: the
admin's ``shutdown all``, then every process whose command line names that workspace).

The package must be importable by every participant's Python (here: the same ``.venv``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jobs.log_streaming import ALLOW_LOG_STREAMING
from jobs.secure_aggregation import CLIENT_CONTEXT, SERVER_CONTEXT, is_he_job

PROVISION_DIR = Path(__file__).resolve().parent
PROJECT_TEMPLATE = PROVISION_DIR / "project.yml"
ALLOW_LIST_FILE = PROVISION_DIR / "class_allow_list.json"
ADMIN = "admin@fedalg.org"


class DeploymentError(RuntimeError):
    """The loopback deployment could not be provisioned, started, or did not finish the job."""


@dataclass
class Deployment:
    """Paths and processes of one provisioned deployment."""

    workspace: Path
    server: Path
    sites: dict[str, Path]
    admin: Path
    port: int
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)


def free_port() -> int:
    """A TCP port free at this moment (the OS picks it), so runs never depend on a fixed port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: NVFlare's builder that writes the TenSEAL CKKS contexts into the kits (server: no secret key; sites: with it).
HE_BUILDER = "nvflare.lighter.impl.he.HEBuilder"


def write_project(path: Path, port: int, site_names: Sequence[str], he: bool = False) -> Path:
    """The project template with the server's port and the site list replaced; ``he`` adds NVFlare's HEBuilder
    before the signature builder, so the contexts are signed with the rest of each startup kit."""
    project = yaml.safe_load(PROJECT_TEMPLATE.read_text())
    if he:
        builders = project["builders"]
        signing = next(i for i, b in enumerate(builders) if b["path"].endswith("SignatureBuilder"))
        builders.insert(signing, {"path": HE_BUILDER})
    others = [p for p in project["participants"] if p["type"] != "client"]
    for participant in others:
        if participant["type"] == "server":
            participant["fed_learn_port"] = port
    # No site streams its logs to the server (NVFlare's default would, error_log.txt for every job).
    clients = [{"name": name, "type": "client", "org": "fedalg", ALLOW_LOG_STREAMING: False} for name in site_names]
    project["participants"] = others[:1] + clients + others[1:]
    path.write_text(yaml.safe_dump(project, sort_keys=False))
    return path


def provision(workspace: Path, num_sites: int = 3, env: dict[str, str] | None = None, he: bool = False) -> Deployment:
    """Run ``nvflare provision`` into ``workspace/provision`` and return the kit locations; ``he``: with the
    homomorphic-encryption contexts (``startup/server_context.tenseal``, ``startup/client_context.tenseal``)."""
    workspace.mkdir(parents=True, exist_ok=True)
    port = free_port()
    sites = [f"site-{i}" for i in range(1, num_sites + 1)]
    project = write_project(workspace / "project.yml", port, sites, he=he)
    nvflare = Path(sys.executable).with_name("nvflare")
    command = [str(nvflare), "provision", "-p", str(project), "-w", str(workspace / "provision")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=workspace, timeout=120)
    kits = sorted((workspace / "provision").glob("*/prod_*"))
    if done.returncode != 0 or not kits:
        raise DeploymentError(f"nvflare provision failed ({done.returncode}): {done.stdout}\n{done.stderr}")
    kit = kits[-1]
    return Deployment(workspace, kit / "localhost", {s: kit / s for s in sites}, kit / ADMIN, port)


def deployment_in(workspace: Path) -> Deployment:
    """The deployment `provision` wrote into ``workspace`` (read back from its kits and ``project.yml``), without
    processes: what `stop_workspace` needs to shut it down from another process."""
    workspace = Path(workspace).resolve()
    kits = sorted((workspace / "provision").glob("*/prod_*"))
    project_file = workspace / "project.yml"
    if not kits or not project_file.is_file():
        raise DeploymentError(
            f"--stop {workspace}: no loopback deployment there (expected {project_file} and the kits in "
            f"{workspace / 'provision'}/<project>/prod_NN/); pass the --workspace the deployment was started with"
        )
    kit = kits[-1]
    participants = yaml.safe_load(project_file.read_text())["participants"]
    port = next(p["fed_learn_port"] for p in participants if p["type"] == "server")
    sites = [p["name"] for p in participants if p["type"] == "client"]
    return Deployment(workspace, kit / "localhost", {s: kit / s for s in sites}, kit / ADMIN, port)


def allow_bundle_classes(participant: Path) -> Path:
    """Write ``local/resources.json``: the provisioned defaults plus this bundle's classes in the allow-list."""
    local = participant / "local"
    resources = json.loads((local / "resources.json.default").read_text())
    extra = json.loads(ALLOW_LIST_FILE.read_text())["class_allow_list"]
    allowed = resources.setdefault("class_allow_list", [])
    allowed.extend(name for name in extra if name not in allowed)
    target = local / "resources.json"
    target.write_text(json.dumps(resources, indent=2))
    return target


def keep_server_storage_inside(server: Path, scheduler: dict[str, float] | None = None) -> Path:
    """Point the server's job store and snapshot store (``/tmp/nvflare/...`` in provisioned kits) into its own
    workspace, so deployments never share or leave state outside their folder; ``scheduler`` overrides the job
    scheduler's retry settings (``max_schedule_count``, ``min_schedule_interval``)."""
    target = server / "local" / "resources.json"
    resources = json.loads(target.read_text())
    storage = server / "storage"
    resources["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"] = str(storage / "snapshot-storage")
    for component in resources["components"]:
        if component.get("id") == "job_manager":
            component["args"]["uri_root"] = str(storage / "jobs-storage")
        if component.get("id") == "job_scheduler" and scheduler:
            component.setdefault("args", {}).update(scheduler)
    target.write_text(json.dumps(resources, indent=2))
    return target


def configure_site_data(site_dir: Path, site: str, data_settings: dict[str, Any]) -> Path:
    """Give a site its own data file and the local config that names it (stand-in for the site's real data)."""
    from data_prep import SiteDataConfig, site_split
    from data_prep.site_config import LOCAL_CONFIG, write_site_file

    x, y = site_split(SiteDataConfig(**data_settings), site)
    data_file = write_site_file(site_dir / "data" / "train.npz", x, y)
    config = site_dir / LOCAL_CONFIG
    config.write_text(json.dumps({"train": str(data_file)}))
    return config


#: The federated QC job's server workflow (``python -m data_prep.genotypes qc-job``), by which its folder is known.
QC_CONTROLLER = "data_prep.genotypes.federated_qc.GenotypeQcController"
#: The site data variables a caller may have set for the simulator; a deployed site reads its kit's local/ instead.
SITE_VARIABLES = ("FEDALG_SITE_GENOTYPES", "FEDALG_SNP_TABLE", "FEDALG_SITE_LABELS", "FEDALG_SITE_DATA")


def qc_settings(job_dir: Path) -> dict[str, Any] | None:
    """The QC controller's arguments when ``job_dir`` is a federated QC job, else ``None``."""
    for config in Path(job_dir).glob("app*/config/config_fed_server.json"):
        for workflow in json.loads(config.read_text()).get("workflows", []):
            if workflow.get("path") == QC_CONTROLLER:
                return dict(workflow.get("args") or {})
    return None


def needs_he_contexts(job_dir: Path) -> bool:
    """Whether the job needs kits provisioned with HEBuilder: NVFlare's HE components, or a QC job under HE (its
    own TenSEAL code reads the same contexts)."""
    qc = qc_settings(job_dir)
    return is_he_job(job_dir) or (qc is not None and qc.get("secure_aggregation") == "he")


def he_contexts_problem(deployment: Deployment, job_dir: Path) -> str | None:
    """Why ``job_dir`` cannot run on ``deployment`` for want of HE contexts (one line), or ``None``."""
    if not needs_he_contexts(job_dir):
        return None
    wanted = [deployment.server / "startup" / SERVER_CONTEXT]
    wanted += [kit / "startup" / CLIENT_CONTEXT for kit in deployment.sites.values()]
    missing = [path for path in wanted if not path.is_file()]
    if not missing:
        return None
    return (
        f"{Path(job_dir).name}: secure_aggregation 'he' needs the HE contexts of NVFlare's HEBuilder, but "
        f"{missing[0]} does not exist ({len(missing)} of {len(wanted)} kits lack theirs); provision with "
        "HEBuilder (python -m jobs.provision.loopback does for such a job; provision(..., he=True)); nothing submitted"
    )


def configure_site_genotypes(
    site_dir: Path, site: str, genotypes: str, snp_table: str | None, labels: str | None
) -> Path:
    """Name the site's genotype files in its kit's ``local/fedalg_site_data.json`` (kept: what it holds already),
    as absolute paths with ``{site}`` replaced; a file that does not exist is refused here, before anything starts."""
    from data_prep.site_config import LOCAL_CONFIG

    config = site_dir / LOCAL_CONFIG
    content = json.loads(config.read_text()) if config.is_file() else {}
    for key, option, pattern in (
        ("genotypes", "--genotypes", genotypes),
        ("snp_table", "--snp-table", snp_table),
        ("labels", "--labels", labels),
    ):
        if pattern is None:
            continue
        path = Path(pattern.replace("{site}", site)).expanduser().absolute()
        if not path.is_file():
            raise DeploymentError(f"{option} {pattern}: {site}'s file {path} does not exist")
        content[key] = str(path)
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(content, indent=2))
    return config


def without_site_variables(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` less `SITE_VARIABLES`: a deployed site is pointed at its files by its kit, not by its caller."""
    return {name: value for name, value in environ.items() if name not in SITE_VARIABLES}


def participant_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every participant starts with: this interpreter's ``bin`` first (``python3`` in the kits'
    start scripts must be the one that has the bundle installed)."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def start(deployment: Deployment, env: dict[str, str]) -> None:
    """Start the server, wait until it listens, then start every site; each in its own process group."""
    _start_one(deployment, "server", deployment.server, env)
    _wait_for_port(deployment.port, timeout=60.0, deployment=deployment)
    for site, site_dir in deployment.sites.items():
        _start_one(deployment, site, site_dir, env)


def restart(deployment: Deployment, name: str, env: dict[str, str]) -> None:
    """Start one participant again from its kit (after it crashed or was stopped); the server is waited for until
    it listens. A restarted site reconnects by itself and gets the jobs submitted from then on: NVFlare deploys a
    job to the sites connected when it starts, so a running job does not take a site back (resume it instead,
    docs/deployment.md)."""
    kit = deployment.server if name == "server" else deployment.sites[name]
    _start_one(deployment, name, kit, env)
    if name == "server":
        _wait_for_port(deployment.port, timeout=60.0, deployment=deployment)


def _start_one(deployment: Deployment, name: str, kit: Path, env: dict[str, str]) -> None:
    log = (deployment.workspace / f"{name}.out").open("a")
    deployment.processes[name] = subprocess.Popen(
        ["bash", str(kit / "startup" / "sub_start.sh"), "--once"],
        cwd=kit,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_for_port(port: int, timeout: float, deployment: Deployment) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(deployment)
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return
        time.sleep(0.5)
    raise DeploymentError(f"server did not listen on port {port} within {timeout:.0f} s")


def _check_alive(deployment: Deployment) -> None:
    for name, process in deployment.processes.items():
        if process.poll() is not None:
            log = deployment.workspace / f"{name}.out"
            tail = log.read_text()[-2000:] if log.is_file() else ""
            raise DeploymentError(f"{name} exited with {process.returncode}:\n{tail}")


@contextlib.contextmanager
def admin_session(deployment: Deployment, timeout: float = 60.0) -> Iterator[Any]:
    """A logged-in admin session (the project admin's startup kit)."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    session = new_secure_session(ADMIN, str(deployment.admin), timeout=timeout)
    try:
        yield session
    finally:
        with contextlib.suppress(Exception):
            session.close()


def wait_for_sites(
    session: Any,
    deployment: Deployment,
    timeout: float = 120.0,
    sites: Sequence[str] | None = None,
    registered_after: Mapping[str, float] | None = None,
) -> None:
    """Block until the server lists every site (or every one of ``sites``), and each site that
    ``registered_after`` names with a registration at or after that time (``time.time()``; the server's
    ``last_connect_time``). NVFlare keeps listing a killed site until it has sent no heartbeat for 600 s, so after
    restarting one, being listed proves nothing: pass the restart's time for it."""
    wanted = set(deployment.sites if sites is None else sites) | set(registered_after or {})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(deployment)
        connected = {
            client.name
            for client in session.get_system_info().client_info
            if (client.last_connect_time or 0.0) >= (registered_after or {}).get(client.name, 0.0)
        }
        if wanted <= connected:
            return
        time.sleep(1.0)
    raise DeploymentError(f"sites {sorted(wanted - connected)} did not connect within {timeout:.0f} s")


def installed_script_job(job_dir: Path, target: Path) -> Path:
    """A copy of ``job_dir`` without ``custom/``: the sites run the client script of the installed package instead.

    NVFlare then treats the job as non-BYOC, so the submitter needs no ``byoc`` right, and every component class must
    be on each participant's class allow-list (see `allow_bundle_classes`)."""
    import jobs
    from jobs.job_record import JOB_SCRIPT, SPEC_FILE

    installed = Path(jobs.__file__).resolve().parent / "client.py"
    # job.py and its record describe the exported job with its shipped copies, which this variant drops.
    shutil.copytree(job_dir, target, ignore=shutil.ignore_patterns("__pycache__", JOB_SCRIPT, SPEC_FILE))
    for app in target.glob("app*"):
        shutil.rmtree(app / "custom", ignore_errors=True)
        config_file = app / "config" / "config_fed_client.json"
        if not config_file.is_file():
            continue
        config = json.loads(config_file.read_text())
        for entry in config.get("executors", []):
            args = entry.get("executor", {}).get("args", {})
            if args.get("task_script_path") == "client.py":
                args["task_script_path"] = str(installed)
        config_file.write_text(json.dumps(config, indent=4))
    return target


def submit(session: Any, deployment: Deployment, job_dir: Path) -> str:
    """Submit a copy of ``job_dir`` (submitting signs the folder in place, which must not touch jobs/)."""
    copy = deployment.workspace / "submitted" / f"{job_dir.name}-{time.monotonic_ns()}"
    shutil.copytree(job_dir, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return session.submit_job(str(copy))


def run_job(session: Any, deployment: Deployment, job_dir: Path, timeout: float) -> tuple[str, dict]:
    """Submit a job folder and wait for it to finish; returns (job id, final job meta). A job that needs HE contexts
    the deployment lacks is refused first (`he_contexts_problem`): it would fail at every site after the upload."""
    problem = he_contexts_problem(deployment, job_dir)
    if problem:
        raise DeploymentError(problem)
    job_id = submit(session, deployment, job_dir)
    meta = session.wait_for_job(job_id, timeout=timeout, poll_interval=1.0)
    return job_id, meta


def download_result(session: Any, job_id: str) -> Path:
    """The server's run folder of a finished job (NVFlare moves it into the job store when the job ends), downloaded
    into the admin kit's ``transfer/``: ``app_server/FL_global_model.pt``, ``metrics/``, ``tb_events/``."""
    return Path(session.download_job_result(job_id)) / "workspace"


def stop(deployment: Deployment, grace: float = 15.0) -> None:
    """Shut every participant down: admin shutdown, then SIGTERM/SIGKILL to every process this deployment started
    (their job processes run in sessions of their own, so they are found by their workspace path)."""
    import psutil

    with contextlib.suppress(Exception), admin_session(deployment, timeout=5.0) as session:
        session.shutdown("all", wait=False)
    ours = _deployment_processes(deployment)
    for process in ours:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(ours, timeout=grace)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5.0)
    for process in deployment.processes.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5.0)


def _deployment_processes(deployment: Deployment) -> list[Any]:
    """The processes this deployment started and everything below them, plus any process (of this user) whose
    command line names this deployment's workspace (job processes detach into sessions of their own)."""
    import psutil

    found: dict[int, Any] = {}
    for popen in deployment.processes.values():
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(popen.pid)
            for process in [root, *root.children(recursive=True)]:
                found[process.pid] = process
    for process in psutil.process_iter(["pid", "uids", "cmdline"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if process.info["uids"].real == os.getuid() and names_workspace(
                process.info["cmdline"], deployment.workspace
            ):
                found.setdefault(process.pid, process)
    # Never this process or what started it (make, a shell), whose command lines may name the workspace too.
    for process in [psutil.Process(), *psutil.Process().parents()]:
        found.pop(process.pid, None)
    return list(found.values())


def names_workspace(cmdline: Sequence[str], workspace: Path) -> bool:
    """Whether a command line names ``workspace`` or a path inside it; ``/tmp/fl`` is not named by ``/tmp/fl2/...``
    (another deployment beside it)."""
    inside = re.compile(re.escape(str(workspace)) + r"(?![^/\s])")
    return any(inside.search(arg) for arg in cmdline)


def stop_workspace(workspace: Path, grace: float = 15.0) -> list[int]:
    """Stop the deployment in ``workspace`` from any process (one kept with ``--keep``), as `stop` does; the process
    ids still running afterwards (empty: stopped)."""
    deployment = deployment_in(workspace)
    stop(deployment, grace)
    return leftover_processes(deployment)


def leftover_processes(deployment: Deployment) -> list[int]:
    """Process ids still running that belong to this deployment (empty after a clean `stop`)."""
    return sorted(p.pid for p in _deployment_processes(deployment) if p.is_running() and p.status() != "zombie")


def job_problems(meta: Mapping[str, Any], result: Path, qc: bool = False) -> list[str]:
    """Why a finished job did not do its work (empty: it did): NVFlare's status, then the server's metrics in the
    downloaded ``result``, whose round records must reach the planned rounds with one that aggregated
    (`aggregators.contracts.run_records.completion_problems`, the check ``controllers.report`` makes of simulator runs):
    a controller that stops early still ends in ``FINISHED:COMPLETED``. A federated QC job (``qc``) has no rounds:
    the server's ``qc_report.json`` is its result."""
    from aggregators.contracts.run_records import completion_problems

    status = str(meta.get("status", ""))
    problems = [] if status.startswith("FINISHED:COMPLETED") else [f"job status is {status or 'unknown'}"]
    if qc:
        report = result / "qc_report.json"
        return problems if report.is_file() else [*problems, f"no QC report at {report}"]
    metrics = result / "metrics" / "round_metrics.jsonl"
    if not metrics.is_file():
        return [*problems, f"no metrics file at {metrics}"]
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return problems + completion_problems(records)


#: Training samples split across the sites when neither the command line nor the job's record names a number.
DEFAULT_TRAIN_SAMPLES = 3000
#: The data settings of a job's record that decide each site's shard (`data_prep.SiteDataConfig`).
SHARD_SETTINGS = ("dataset", "scheme", "alpha", "classes_per_site", "seed", "partition_seed")


def site_data_settings(job_dir: Path, num_sites: int, max_train_samples: int | None) -> dict[str, Any]:
    """What `configure_site_data` derives each site's file from: the job's own data settings when its folder records
    them (``job_spec.json``, read as written: nothing of the job is imported; a built-in dataset), so the deployed
    sites hold the shards the job's simulation does; Fashion-MNIST with Dirichlet label skew otherwise.
    ``max_train_samples`` (the command line's) wins over the record's; ``DEFAULT_TRAIN_SAMPLES`` when neither names
    one."""
    from jobs.job_record import SPEC_FILE

    settings: dict[str, Any] = {"dataset": "fashion_mnist", "scheme": "dirichlet"}
    record_file = Path(job_dir) / SPEC_FILE
    recorded = json.loads(record_file.read_text()).get("settings", {}) if record_file.is_file() else {}
    if recorded.get("data") is None and recorded.get("dataset") is not None:
        settings = {name: recorded[name] for name in SHARD_SETTINGS if name in recorded}
        partition_seed = settings.pop("partition_seed", None)
        if partition_seed is not None:
            settings["seed"] = partition_seed
        if max_train_samples is None:
            max_train_samples = recorded.get("max_train_samples")
    return {**settings, "num_sites": num_sites, "max_train_samples": max_train_samples or DEFAULT_TRAIN_SAMPLES}


def result_summary(result: Path) -> str:
    """The global model's final test accuracy in the downloaded ``result`` and the report command for it."""
    from aggregators.contracts.run_records import load_records

    scored = [r for r in load_records(result) if r.get("test_accuracy") is not None]
    accuracy = f"{scored[-1]['test_accuracy']:.4f}" if scored else "not scored"
    return f"final global test accuracy: {accuracy}\nsummary: python -m controllers.report {result.parent}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.provision.loopback", description=__doc__.splitlines()[0])
    parser.add_argument("job", type=Path, nargs="?", help="an exported job folder, e.g. jobs/scaffold")
    parser.add_argument("--workspace", type=Path, help="where kits and workspaces go (must not exist)")
    parser.add_argument("--sites", type=int, default=3, help="number of sites (default: 3)")
    parser.add_argument(
        "--max-train-samples",
        type=int,
        default=None,
        help="training samples split across sites (default: the job's own, as its job_spec.json records it; "
        f"{DEFAULT_TRAIN_SAMPLES} when it records none)",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for the job (default: 1800)")
    parser.add_argument(
        "--keep", action="store_true", help="leave the deployment running after the job (stop it with --stop)"
    )
    parser.add_argument(
        "--stop",
        type=Path,
        metavar="WORKSPACE",
        default=None,
        help="stop the deployment kept running in WORKSPACE (--keep) instead of starting one: the admin's shutdown "
        "all, then every process that names WORKSPACE; exit 1 if any is left",
    )
    parser.add_argument(
        "--he",
        action="store_true",
        help="provision with NVFlare's HEBuilder (TenSEAL contexts in every kit); on by itself for a job that uses "
        "NVFlare's HE components (--secure-aggregation he)",
    )
    parser.add_argument(
        "--genotypes",
        default=None,
        help="each site's genotype file ({site} = its name: a harmonised .npz or a VCF/BCF/PLINK file), named in its "
        "kit's local/fedalg_site_data.json",
    )
    parser.add_argument("--snp-table", default=None, help="the consortium's SNP table, named in every site's kit")
    parser.add_argument("--labels", default=None, help="each site's labels CSV ({site} = its name), if not in the .npz")
    return parser


def qc_input_problem(job: Path, args: argparse.Namespace) -> str | None:
    """Why a federated QC job cannot run with these options (one line), or ``None``."""
    if qc_settings(job) is None or (args.genotypes and args.snp_table):
        return None
    return (
        f"{job.name} is a federated QC job: every site needs its genotype file and the consortium's SNP table; pass "
        "--genotypes PATH (with {site}) and --snp-table PATH (docs/deployment.md)"
    )


def usage_problem(args: argparse.Namespace) -> str | None:
    """Why the command line asks for neither or both of a run and ``--stop`` (one line), or ``None``."""
    if args.stop is not None:
        if args.job is not None or args.workspace is not None:
            return "--stop WORKSPACE stops a kept deployment and takes no job or --workspace; run them separately"
        return None
    if args.job is None or args.workspace is None:
        return "pass a job folder and --workspace DIR to run it, or --stop WORKSPACE to stop a kept deployment"
    return None


def stop_main(workspace: Path) -> int:
    """``--stop WORKSPACE``: stop a kept deployment; 0 when nothing of it is left running."""
    try:
        left = stop_workspace(workspace)
    except DeploymentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if left:
        print(f"error: {workspace}: processes still running after the shutdown: {left}", file=sys.stderr)
        return 1
    print(f"stopped: no process of the deployment in {Path(workspace).resolve()} is running")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = usage_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.stop is not None:
        return stop_main(args.stop)
    if args.workspace.exists():
        print(f"error: {args.workspace} exists; pass a new folder", file=sys.stderr)
        return 2
    problem = qc_input_problem(args.job, args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    workspace = args.workspace.resolve()
    env = participant_env(without_site_variables(os.environ))
    deployment = provision(workspace, args.sites, env, he=args.he or needs_he_contexts(args.job))
    data = site_data_settings(args.job, args.sites, args.max_train_samples)
    for participant in [deployment.server, *deployment.sites.values()]:
        allow_bundle_classes(participant)
    keep_server_storage_inside(deployment.server)
    try:
        for site, site_dir in deployment.sites.items():
            configure_site_data(site_dir, site, data)
            if args.genotypes:
                configure_site_genotypes(site_dir, site, args.genotypes, args.snp_table, args.labels)
    except DeploymentError as exc:  # nothing started yet
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        start(deployment, env)
        with admin_session(deployment) as session:
            wait_for_sites(session, deployment)
            job_id, meta = run_job(session, deployment, args.job.resolve(), args.timeout)
            result = download_result(session, job_id)
        print(f"job {job_id}: {meta.get('status')} after {time.monotonic() - started:.0f} s")
        print(f"server results (model, metrics/round_metrics.jsonl, tb_events/): {result}")
    finally:
        if not args.keep:
            stop(deployment)
    qc = qc_settings(args.job) is not None
    problems = job_problems(meta, result, qc=qc)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if not problems and not qc:
        print(result_summary(result))
    if args.keep:
        print(f"kept running: stop it with python -m jobs.provision.loopback --stop {workspace}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
