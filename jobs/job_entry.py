"""``python jobs/<name>/job.py``: a job folder run with NVFlare's recipe API (NVFlare 2.9's ``python job.py``).

    python jobs/scaffold/job.py                                   # SimEnv: the simulator, one process per site
    python jobs/scaffold/job.py --env poc                         # PocEnv: a POC deployment on this machine
    python jobs/scaffold/job.py --env prod --startup-kit KIT      # ProdEnv: submit as the admin of a provisioned kit
    python jobs/scaffold/job.py --export --export-dir /tmp/jobs   # NVFlare's own option: write the job folder

The folder's own record of its settings (`jobs.job_record`) builds `jobs.recipe.FedAlgRecipe`, so
``nvflare simulator <job>`` and ``python <job>/job.py`` run one definition: the recipe's job is the folder's job,
file for file (tested). Bad input (an unknown ``--env``, ``--env prod`` without a kit, a folder that is not an admin
startup kit or is one of another project) is refused in one line before anything starts. A run ends with where its
result is and the report command for it; the exit code is 1 when not every round ran. In SimEnv it prints what
``make demo`` prints, the per-round lines, and keeps NVFlare's whole output in ``WORKSPACE/<job name>.log``
(`jobs.run_output`; ``--verbose``: all of it here).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from jobs.job_record import JOB_SCRIPT, recorded_spec
from jobs.run_output import quiet_output
from jobs.settings import JobBuildError, OneLineErrorParser
from jobs.spec import JobSpec

#: The project the bundle provisions (``jobs/provision/project.yml``): the default a startup kit must belong to.
PROJECT_FILE = Path(__file__).resolve().parent / "provision" / "project.yml"
#: Where an admin startup kit names its project and user (NVFlare's provisioning writes it).
ADMIN_CONFIG = Path("startup") / "fed_admin.json"
ENVS = ("sim", "poc", "prod")


def build_parser(spec: JobSpec, folder: str) -> OneLineErrorParser:
    """``job.py``'s options (``folder``: the job folder's name, for the usage line)."""
    parser = OneLineErrorParser(
        prog=f"python {folder}/{JOB_SCRIPT}",
        description=f"Run the job {spec.name!r} ({spec.client} clients, {spec.server} server, {spec.num_sites} sites, "
        f"{spec.num_rounds} rounds) with NVFlare's recipe API. The number of sites is the job's: its data are "
        "split for that many. NVFlare's own --export [--export-dir DIR] writes the job folder instead of running it.",
    )
    parser.add_argument(
        "--env",
        choices=ENVS,
        default="sim",
        help="sim: NVFlare's simulator in this process tree (SimEnv; like nvflare simulator); poc: a POC deployment "
        "on this machine (PocEnv: prepares, starts, submits, waits, stops); prod: submit to a provisioned "
        "deployment as the admin of --startup-kit (ProdEnv) and wait for the result (default: sim)",
    )
    parser.add_argument(
        "--workspace",
        type=Path,
        default=Path("/tmp/nvflare/simulation"),
        help="sim: the workspace root; the run lands in WORKSPACE/<job name> (default: SimEnv's %(default)s)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="sim: processes running the sites (default: one per site, so every site keeps its process; "
        "nvflare simulator's -t)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="sim: print NVFlare's whole output here (default: keep it in WORKSPACE/<job name>.log and print the "
        "per-round lines, as make demo does)",
    )
    parser.add_argument(
        "--startup-kit",
        type=Path,
        help="prod: the admin's startup kit folder, the one holding startup/fed_admin.json "
        "(<provision workspace>/<project>/prod_NN/<admin e-mail>)",
    )
    parser.add_argument(
        "--project",
        default=None,
        help="prod: the project the startup kit must belong to (default: jobs/provision/project.yml's name)",
    )
    return parser


def bundle_project() -> str:
    """The project name of the bundle's provisioning file."""
    import yaml

    return str(yaml.safe_load(PROJECT_FILE.read_text())["name"])


def admin_kit(kit: Path, project: str) -> str:
    """The admin user of the startup kit ``kit``, checked to be an admin kit of ``project``; one line otherwise."""
    config_path = kit / ADMIN_CONFIG
    try:
        admin = json.loads(config_path.read_text())["admin"]
        kit_project, username = admin["project_name"], admin["username"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JobBuildError(
            f"--startup-kit {kit}: not an admin startup kit (expected {config_path} with admin.project_name and "
            f"admin.username, as nvflare provision writes for an admin: <workspace>/<project>/prod_NN/<admin>): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if kit_project != project:
        raise JobBuildError(
            f"--startup-kit {kit}: a kit of project {kit_project!r}, expected project {project!r} "
            f"(--project; default: {PROJECT_FILE.name}'s name): use that project's admin kit"
        )
    return str(username)


def check_args(args: Any, spec: JobSpec) -> None:
    """Refuse settings that do not fit ``--env`` before anything starts (one line each)."""
    if args.env == "prod" and args.startup_kit is None:
        raise JobBuildError(
            "--startup-kit: --env prod needs the admin's startup kit folder (holding startup/fed_admin.json)"
        )
    if args.env != "prod" and (args.startup_kit is not None or args.project is not None):
        raise JobBuildError(f"--startup-kit/--project: only for --env prod, got --env {args.env}")
    if args.env != "sim" and args.threads is not None:
        raise JobBuildError(f"--threads: only for --env sim, got --env {args.env}")
    if args.env != "sim" and args.verbose:
        raise JobBuildError(
            f"--verbose: only for --env sim (poc and prod print their output as it is), got --env {args.env}"
        )
    if args.threads is not None and args.threads < 1:
        raise JobBuildError(f"--threads must be at least 1, got {args.threads}")
    if args.env == "sim" and spec.secure_aggregation == "he":
        raise JobBuildError(
            "--env sim: this job aggregates under homomorphic encryption, which needs kits provisioned with NVFlare's "
            "HEBuilder: use --env poc (provisions them) or --env prod with such a kit"
        )
    if spec.secure_aggregation == "secagg" and args.threads is not None and args.threads < spec.num_sites:
        raise JobBuildError(
            f"--threads {args.threads}: under secagg every site keeps its round's keys and shares in its own process; "
            f"use --threads {spec.num_sites} or leave it out"
        )


def make_env(args: Any, spec: JobSpec) -> Any:
    """NVFlare's execution environment for ``args.env``."""
    from nvflare.recipe import PocEnv, ProdEnv, SimEnv

    if args.env == "sim":
        return SimEnv(num_clients=spec.num_sites, num_threads=args.threads, workspace_root=str(args.workspace))
    if args.env == "poc":
        poc_site_environment(os.environ)  # the POC's processes inherit this process's environment
        return PocEnv(num_clients=spec.num_sites, use_he=spec.secure_aggregation == "he")
    username = admin_kit(args.startup_kit, args.project or bundle_project())
    return ProdEnv(startup_kit_location=str(args.startup_kit.resolve()), username=username)


def poc_site_environment(environ: MutableMapping[str, str]) -> None:
    """What every POC process needs from its environment: ``python3`` (the kits' start scripts run it from PATH)
    must be this interpreter, which has the bundle; and, unless ``$FEDALG_SITE_DATA`` names the sites' data already,
    each site trains on its shard derived from the job's data settings, as in the simulator (a POC site is
    provisioned, so `data_prep.site_config` would otherwise refuse to derive data it does not own)."""
    from data_prep.site_config import SITE_DATA_ENV

    environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environ.get('PATH', '')}"
    if not environ.get(SITE_DATA_ENV, "").strip():
        config = Path(tempfile.mkdtemp(prefix="fedalg_poc_")) / "derive_site_data.json"
        config.write_text(json.dumps({"derive": True}))
        environ[SITE_DATA_ENV] = str(config)


def main(job_folder: Path, argv: Sequence[str] | None = None) -> int:
    """Run the job recorded in ``job_folder`` in the environment the command line names; 0 when its rounds all ran."""
    exporting = "--export" in sys.argv[1:]  # NVFlare's option, gone from sys.argv once nvflare.recipe is imported
    from jobs.recipe import FedAlgRecipe  # imports nvflare.recipe, which takes --export/--export-dir off sys.argv

    try:
        spec = recorded_spec(Path(job_folder))
    except JobBuildError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    args = build_parser(spec, Path(job_folder).name).parse_args(argv)
    try:
        check_args(args, spec)
        env = make_env(args, spec)
        recipe = FedAlgRecipe.from_spec(spec)
    except (JobBuildError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    log = None if exporting else output_log(args, spec)
    failure = None
    with run_output(log, spec, args.workspace):
        try:
            run = recipe.execute(env)
        except RuntimeError as exc:  # SimEnv: the simulator exited non-zero; ProdEnv: the submission failed
            failure = exc
        else:
            # PocEnv would delete its workspace, and the downloaded result in it, when it stops: keep it.
            result = run.get_result(clean_up=False) if args.env == "poc" else run.get_result()
    if failure is not None:
        seen = f" (the run's whole output: {log})" if log else ""
        print(f"error: {' '.join(str(failure).split())}{seen}", file=sys.stderr)
        return report_result(env.get_job_result(spec.name)) if args.env == "sim" else 1
    return report_result(result)


def output_log(args: Any, spec: JobSpec) -> Path | None:
    """Where the run's whole output goes (`jobs.run_output`): beside the SimEnv run folder, ``WORKSPACE/<job
    name>.log``; ``None`` (printed as it comes) with ``--verbose`` or outside SimEnv."""
    return None if args.verbose or args.env != "sim" else Path(args.workspace) / f"{spec.name}.log"


@contextlib.contextmanager
def run_output(log: Path | None, spec: JobSpec, workspace: Path) -> Iterator[None]:
    """The run's output kept in ``log`` with its per-round lines shown (`jobs.run_output.quiet_output`), or all of
    it as it comes (``log`` None)."""
    if log is None:
        yield
        return
    run = Path(workspace) / spec.name
    print(f"SimEnv: {spec.num_rounds} rounds, {spec.num_sites} sites in {run} (full log: {log}; --verbose prints it)")
    with quiet_output(log):
        yield


def report_result(result: str | None) -> int:
    """Print where the run's result is and whether every round ran (the simulator exits 0 on some aborts)."""
    from aggregators.contracts.run_records import finished_records

    if result is None:
        print("error: no result: the job did not finish (see the environment's logs)", file=sys.stderr)
        return 1
    try:
        finished_records(Path(result))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"result: {result}\nsummary: python -m controllers.report {result}")
    return 0
