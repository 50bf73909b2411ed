"""Runtime kits for containers and clusters: NVFlare's ``nvflare deploy prepare`` for every participant of a
provisioned project, plus what this bundle's participants need on top.

    nvflare provision -p jobs/provision/project.yml -w /tmp/fedalg-provision
    python -m jobs.provision.deploy --runtime docker --kits /tmp/fedalg-provision --out /tmp/fedalg-docker
    python -m jobs.provision.deploy --runtime k8s --kits /tmp/fedalg-provision --out /tmp/fedalg-k8s \\
        --site-data 'fedalg-data-{site}'
    python -m jobs.provision.deploy --config my-slurm.yaml --kits /tmp/fedalg-provision --out /shared/fedalg-kits

``--kits`` is the provisioned folder of kits (``<workspace>/<project>/prod_NN``) or the provision workspace (its
newest ``prod_NN``). Every server and site kit in it (admin kits stay as they are: the admin runs no runtime) is
prepared by NVFlare with the runtime config (``--config``, default ``jobs/provision/runtimes/<runtime>.yaml``) into
``--out/<participant>/``; then each prepared kit gets

- the bundle's classes in the class allow-list of ``local/resources.json`` (as the loopback deployment does);
- docker and k8s: ``local/study_runtime.yaml`` naming the runtime's image as the site's default job image (the jobs
  this bundle exports name none), and with ``--site-data`` the site's data as a read-only mount;
- with ``--site-data``: ``local/fedalg_site_data.json`` pointing the bundle's client at that data.

Bad input (an unknown runtime, a config naming one, a config NVFlare refuses, a folder without kits, an ``--out`` that
already holds files) exits with code 2 and one line naming the setting and what is allowed; nothing is written. The
kits are prepared in a scratch folder beside ``--out`` and moved there only when all of them are ready.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

RUNTIMES = ("docker", "k8s", "slurm")
RUNTIMES_DIR = Path(__file__).resolve().parent / "runtimes"
#: NVFlare's launchers mount a study's datasets at /data/<study>/<dataset>; jobs submitted without a study run in
#: the study named "default".
STUDY, DATASET = "default", "fedalg"
DATA_MOUNT = f"/data/{STUDY}/{DATASET}"
SITE_DATA_FILE = "train.npz"
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class DeployError(ValueError):
    """The runtime kits cannot be prepared; the message is one line naming the setting and what is allowed."""


@dataclass(frozen=True)
class Kit:
    """A server or site startup kit: its folder, role (``server`` or ``client``) and participant name."""

    path: Path
    role: str
    name: str


# --------------------------------------------------------------------------------------------------------------------
# Reading and checking the input
# --------------------------------------------------------------------------------------------------------------------
def runtime_problem(runtime: Any, where: str) -> str | None:
    """One line when ``runtime`` is not one NVFlare's ``deploy prepare`` knows."""
    if runtime in RUNTIMES:
        return None
    return f"{where}: runtime {runtime!r} is not one of {', '.join(RUNTIMES)}"


def load_runtime_config(runtime: str | None, config: Path | None) -> tuple[str, dict[str, Any]]:
    """The runtime and its config: ``config`` (whose ``runtime`` must agree with ``runtime`` when both are given)
    or the bundle's config for ``runtime``."""
    if runtime is not None and (problem := runtime_problem(runtime, "--runtime")):
        raise DeployError(problem)
    if config is None:
        if runtime is None:
            raise DeployError(f"--runtime or --config is required: --runtime is one of {', '.join(RUNTIMES)}")
        config = RUNTIMES_DIR / f"{runtime}.yaml"
    try:
        content = yaml.safe_load(Path(config).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DeployError(f"--config {config}: not a readable YAML file ({' '.join(str(exc).split())})") from None
    if not isinstance(content, dict):
        raise DeployError(f"--config {config}: a YAML mapping with 'runtime: {'|'.join(RUNTIMES)}' is expected")
    if problem := runtime_problem(content.get("runtime"), f"--config {config}"):
        raise DeployError(problem)
    if runtime is not None and content["runtime"] != runtime:
        raise DeployError(f"--config {config}: runtime {content['runtime']!r} disagrees with --runtime {runtime}")
    return content["runtime"], content


def kits_folder(kits: Path) -> Path:
    """``kits`` itself when it holds startup kits, else the newest ``<project>/prod_NN`` of a provision workspace."""
    if any((child / "startup").is_dir() for child in _children(kits)):
        return kits
    provisioned = sorted(kits.glob("*/prod_*"), key=lambda path: (path.parent.name, _prod_number(path)))
    projects = {path.parent.name for path in provisioned}
    if len(projects) > 1:
        raise DeployError(f"--kits {kits}: holds several projects {sorted(projects)}; name one's prod_NN folder")
    if not provisioned:
        raise DeployError(f"--kits {kits}: no startup kits (<participant>/startup/) and no <project>/prod_NN in it")
    return provisioned[-1]


def _children(folder: Path) -> list[Path]:
    return sorted(child for child in folder.iterdir() if child.is_dir()) if folder.is_dir() else []


def _prod_number(path: Path) -> int:
    suffix = path.name.removeprefix("prod_")
    return int(suffix) if suffix.isdigit() else -1


def find_kits(kits: Path) -> list[Kit]:
    """The server and site kits under ``kits`` (NVFlare's own kit checks: role file, certificates, resources)."""
    from nvflare.tool.deploy.deploy_common import ROLE_ADMIN, validate_kit

    found = []
    for child in _children(kits_folder(kits)):
        if not (child / "startup").is_dir():
            continue
        with nvflare_errors(f"--kits {child}"):
            info = validate_kit(child.resolve())
        if info.role != ROLE_ADMIN:
            found.append(Kit(child.resolve(), info.role, info.name))
    if not found:
        raise DeployError(f"--kits {kits}: no server or site startup kit in it (admin kits are not prepared)")
    return found


def role_config(config: dict[str, Any], runtime: str, role: str) -> dict[str, Any]:
    """The config NVFlare gets for a kit of ``role``: for Slurm the server takes no ``parent`` section (NVFlare
    refuses one: the server runs on a stable host, not as a batch job)."""
    if runtime == "slurm" and role == "server":
        return {key: value for key, value in config.items() if key != "parent"}
    return dict(config)


def check_config(runtime: str, config: dict[str, Any], source: str) -> None:
    """NVFlare's own validation of the runtime config, for both roles, its refusal as one line."""
    from nvflare.tool.deploy import docker_deploy, k8s_deploy, slurm_deploy

    backend = {"docker": docker_deploy, "k8s": k8s_deploy, "slurm": slurm_deploy}[runtime]
    for role in ("server", "client"):
        with nvflare_errors(source):
            backend.validate_config(role_config(config, runtime, role))


def site_data_problem(runtime: str, template: str) -> str | None:
    """One line when ``--site-data`` cannot name a site's data for ``runtime``: Docker and Slurm read a host path
    (absolute), Kubernetes mounts a PersistentVolumeClaim (a DNS-1123 name); ``{site}`` stands for the site."""
    example = template.replace("{site}", "site-1")
    if "{site}" not in template:
        return f"--site-data {template!r}: must contain {{site}} (each site mounts its own data)"
    if runtime == "k8s" and not (_K8S_NAME.fullmatch(example) and len(example) <= 63):
        return f"--site-data {template!r}: with runtime k8s a PersistentVolumeClaim name (lowercase, digits, '-')"
    if runtime != "k8s" and not example.startswith("/"):
        return f"--site-data {template!r}: with runtime {runtime} an absolute host path (e.g. /srv/fedalg/{{site}})"
    return None


@contextlib.contextmanager
def nvflare_errors(where: str) -> Iterator[None]:
    """NVFlare's deploy tooling prints its refusals (message, hint, code) and exits: one line naming ``where``."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            yield
    except SystemExit:
        lines = [line.strip() for line in stderr.getvalue().splitlines() if line.strip()]
        message = "; ".join(line for line in lines if not line.startswith("Code:")) or "refused by NVFlare"
        raise DeployError(f"{where}: {message}") from None


# --------------------------------------------------------------------------------------------------------------------
# Writing the prepared kits
# --------------------------------------------------------------------------------------------------------------------
def study_runtime(image: str, data_source: str | None) -> dict[str, Any]:
    """``local/study_runtime.yaml`` (NVFlare's format 2) for the default study: the job image, and the site's data."""
    study: dict[str, Any] = {"container": {"image": image}}
    if data_source is not None:
        study["datasets"] = {DATASET: {"source": data_source, "mode": "ro"}}
    return {"format_version": 2, "studies": {STUDY: study}}


def site_data_config(runtime: str, data_source: str) -> dict[str, str]:
    """``local/fedalg_site_data.json``: where the bundle's client finds the site's training file, as the job sees
    it (inside the job container for docker and k8s, on the shared filesystem for Slurm)."""
    folder = data_source if runtime == "slurm" else DATA_MOUNT
    return {"train": f"{folder}/{SITE_DATA_FILE}"}


def finish_kit(kit: Path, runtime: str, config: dict[str, Any], role: str, data_source: str | None) -> None:
    """What a prepared kit of this bundle needs beyond NVFlare's preparation (see the module docstring)."""
    # Imported here: the loopback module imports the bundle's training code (torch), which checking input never needs.
    from data_prep.site_config import LOCAL_CONFIG
    from jobs.provision.loopback import allow_bundle_classes

    allow_bundle_classes(kit)
    if runtime in ("docker", "k8s"):
        image = config["parent"]["docker_image"]
        content = study_runtime(image, data_source if role == "client" else None)
        (kit / "local" / "study_runtime.yaml").write_text(yaml.safe_dump(content, sort_keys=False))
    if role == "client" and data_source is not None:
        (kit / LOCAL_CONFIG).write_text(json.dumps(site_data_config(runtime, data_source), indent=2) + "\n")


def prepare_kit(kit: Kit, target: Path, runtime: str, config: dict[str, Any], site_data: str | None) -> None:
    """``nvflare deploy prepare`` of one kit into ``target`` (in process), then `finish_kit`."""
    from nvflare.tool.deploy.deploy_commands import prepare_deployment

    config_file = target.parent / f".{kit.name}.{runtime}.yaml"
    config_file.write_text(yaml.safe_dump(role_config(config, runtime, kit.role), sort_keys=False))
    arguments = argparse.Namespace(kit=str(kit.path), kit_flag=None, output=str(target), config=str(config_file))
    with nvflare_errors(f"kit {kit.path}"):
        prepare_deployment(arguments)
    config_file.unlink()
    data_source = site_data.replace("{site}", kit.name) if site_data is not None else None
    finish_kit(target, runtime, config, kit.role, data_source)


def start_command(runtime: str, config: dict[str, Any], kit: Kit, prepared: Path) -> str:
    """How the participant starts its prepared kit (NVFlare's generated scripts and chart)."""
    if runtime == "docker":
        return f"cd {prepared} && ./startup/start_docker.sh"
    if runtime == "k8s":
        namespace = config.get("namespace", "default")
        return f"helm upgrade --install {kit.name} {prepared}/helm_chart --namespace {namespace}"
    if kit.role == "client" and config.get("parent") is not None:
        return f"sbatch {prepared}/startup/parent.slurm   # or: cd {prepared} && ./startup/start_slurm.sh"
    return f"cd {prepared} && ./startup/start_slurm.sh"


def prepare_all(
    runtime: str, config: dict[str, Any], kits: Sequence[Kit], out: Path, site_data: str | None = None
) -> dict[str, Path]:
    """Prepare every kit into ``out/<participant>/`` (scratch folder first, moved into place when all are done)."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for kit in kits:
            prepare_kit(kit, scratch / kit.name, runtime, config, site_data)
        if out.exists():
            out.rmdir()  # empty: checked before anything was written
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {kit.name: out / kit.name for kit in kits}


def check_out(out: Path, kits: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DeployError(f"--out {out}: exists and is not an empty folder; name a new one")
    if out.resolve().is_relative_to(kits.resolve()):
        raise DeployError(f"--out {out}: inside --kits {kits}; the prepared kits go beside the provisioned ones")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runtime, config = load_runtime_config(args.runtime, args.config)
        check_config(runtime, config, f"--config {args.config or RUNTIMES_DIR / f'{runtime}.yaml'}")
        if args.site_data is not None and (problem := site_data_problem(runtime, args.site_data)):
            raise DeployError(problem)
        kits = find_kits(args.kits)
        check_out(args.out, args.kits)
        prepared = prepare_all(runtime, config, kits, args.out, args.site_data)
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for kit in kits:
        print(f"{kit.name} ({kit.role}): {start_command(runtime, config, kit, prepared[kit.name])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from jobs.settings import OneLineErrorParser

    parser = OneLineErrorParser(prog="python -m jobs.provision.deploy", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", help=f"one of {', '.join(RUNTIMES)} (default: the runtime --config names)")
    parser.add_argument(
        "--config", type=Path, help="an `nvflare deploy prepare` runtime config (default: jobs/provision/runtimes/)"
    )
    parser.add_argument("--kits", type=Path, required=True, help="provisioned kits (prod_NN) or provision workspace")
    parser.add_argument("--out", type=Path, required=True, help="new folder for the prepared kits, one per participant")
    parser.add_argument(
        "--site-data",
        help="each site's data, {site} for its name: a host folder (docker, slurm) or a PersistentVolumeClaim "
        f"(k8s) holding {SITE_DATA_FILE}; without it each site writes local/fedalg_site_data.json itself",
    )
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
