"""Containers and clusters: the runtime kits `jobs.provision.deploy` prepares with `nvflare deploy prepare` for a
freshly provisioned project (docker, k8s, slurm), its refusals, and the per-site resources a job asks for
(`jobs.provision.resources`, ``--site-resources``), read back with NVFlare's own resolvers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobs.provision import deploy
from jobs.provision.loopback import ALLOW_LIST_FILE, PROJECT_TEMPLATE
from jobs.provision.resources import ResourceSpecError, parse_site_resources

SITES = ("site-1", "site-2", "site-3")


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`nvflare provision` of the bundle's project.yml (offline, about 2 s)."""
    workspace = tmp_path_factory.mktemp("provision")
    nvflare = Path(sys.executable).with_name("nvflare")
    command = [str(nvflare), "provision", "-p", str(PROJECT_TEMPLATE), "-w", str(workspace)]
    subprocess.run(command, check=True, capture_output=True, cwd=workspace, timeout=120)
    return workspace


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = deploy.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _study_runtime(kit: Path, mode: str):
    from nvflare.app_opt.job_launcher.study_runtime import load_study_runtime_file, resolve_study_runtime

    path = str(kit / "local" / "study_runtime.yaml")
    return resolve_study_runtime(load_study_runtime_file(path, launcher_mode=mode), "default", path)


def _launcher(kit: Path) -> dict:
    resources = json.loads((kit / "local" / "resources.json").read_text())
    allowed = set(resources["class_allow_list"])
    assert set(json.loads(ALLOW_LIST_FILE.read_text())["class_allow_list"]) <= allowed  # the bundle's classes
    return {c["id"]: c for c in resources["components"]}


def test_every_runtime_prepares_every_participant(
    provisioned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sources = {"docker": "/srv/fedalg/{site}", "k8s": "fedalg-data-{site}", "slurm": "/shared/data/{site}"}
    for runtime, source in sources.items():
        out = tmp_path / runtime
        code, stdout, err = _run(
            capsys, "--runtime", runtime, "--kits", str(provisioned), "--out", str(out), "--site-data", source
        )
        assert code == 0, err
        assert sorted(p.name for p in out.iterdir()) == ["localhost", *SITES]  # the admin kit is not prepared
        assert len(stdout.splitlines()) == 4
        for name in ("localhost", *SITES):
            components = _launcher(out / name)
            assert f"{runtime}_launcher" in components
        site = out / "site-2"
        site_data = json.loads((site / "local" / "fedalg_site_data.json").read_text())
        if runtime == "slurm":
            assert site_data == {"train": "/shared/data/site-2/train.npz"}
            assert (site / "startup" / "parent.slurm").is_file()
            assert not (out / "localhost" / "startup" / "parent.slurm").exists()  # server: no parent job
            continue
        image = "fedalg:cpu" if runtime == "docker" else "registry.example.org/fedalg:cpu"
        study = _study_runtime(site, runtime)
        assert study.container_image == image
        [mount] = study.datasets
        assert (mount.source, mount.read_only) == (source.replace("{site}", "site-2"), True)
        assert site_data == {"train": f"{mount.mount_path}/train.npz"}  # where the job container sees it
        assert _study_runtime(out / "localhost", runtime).container_image == image  # the server's jobs too
    values = yaml.safe_load((tmp_path / "k8s" / "site-1" / "helm_chart" / "values.yaml").read_text())
    assert values["image"] == {"repository": "registry.example.org/fedalg", "tag": "cpu", "pullPolicy": "Always"}
    start = (tmp_path / "docker" / "localhost" / "startup" / "start_docker.sh").read_text()
    assert '"fedalg:cpu"' in start


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ("runtime: nomad\n", "runtime 'nomad' is not one of docker, k8s, slurm"),
        ("parent: {docker_image: x}\n", "runtime None is not one of docker, k8s, slurm"),
        ("runtime: docker\nparent: {docker_image: x, gpus: 1}\n", "Unknown keys in parent: ['gpus']"),
        ("runtime: slurm\njob_launcher: {sandbox: podman, python_path: /x}\n", "sandbox must be one of"),
        ("- runtime: docker\n", "a YAML mapping"),
    ],
)
def test_a_bad_runtime_config_writes_nothing(
    provisioned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str, expected: str
) -> None:
    path = tmp_path / "runtime.yaml"
    path.write_text(config)
    code, stdout, err = _run(capsys, "--config", str(path), "--kits", str(provisioned), "--out", str(tmp_path / "o"))
    assert (code, stdout) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"error: --config {path}: ") and expected in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runtime.yaml"]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--runtime", "nomad"], "error: --runtime: runtime 'nomad' is not one of docker, k8s, slurm"),
        (["--runtime", "k8s", "--config", str(deploy.RUNTIMES_DIR / "docker.yaml")], "disagrees with --runtime k8s"),
        (["--runtime", "k8s", "--site-data", "/srv/{site}"], "a PersistentVolumeClaim name"),
        (["--runtime", "docker", "--site-data", "/srv/fedalg"], "must contain {site}"),
        (["--runtime", "docker", "--site-data", "data/{site}"], "an absolute host path"),
        ([], "--runtime or --config is required"),
    ],
)
def test_bad_arguments_write_nothing(
    provisioned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    code, _, err = _run(capsys, *argv, "--kits", str(provisioned), "--out", str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and expected in err
    assert not any(tmp_path.iterdir())


def test_no_kits_or_a_used_out_folder_is_refused(
    provisioned: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run(capsys, "--runtime", "docker", "--kits", str(tmp_path), "--out", str(tmp_path / "o"))
    assert code == 2 and "no startup kits" in err and not (tmp_path / "o").exists()
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    code, _, err = _run(capsys, "--runtime", "docker", "--kits", str(provisioned), "--out", str(used))
    assert code == 2 and "exists and is not an empty folder" in err
    assert [p.name for p in used.iterdir()] == ["keep.txt"]


def test_the_bundle_configs_are_the_runtimes_they_are_named_after() -> None:
    for runtime in deploy.RUNTIMES:
        assert deploy.load_runtime_config(None, deploy.RUNTIMES_DIR / f"{runtime}.yaml")[0] == runtime
        deploy.check_config(runtime, deploy.load_runtime_config(runtime, None)[1], runtime)  # NVFlare accepts it


# --------------------------------------------------------------------------------------------------------------------
# --site-resources: NVFlare's resource_spec in meta.json
# --------------------------------------------------------------------------------------------------------------------
def test_site_resources_are_what_nvflare_launchers_resolve() -> None:
    from nvflare.utils.job_launcher_utils import (
        get_portable_resource_spec,
        portable_memory_to_mib,
        validate_portable_resource_spec,
    )

    spec = parse_site_resources("gpus=1,mem_gb=16 ; site-3:gpus=0,mem_gb=8,cpus=2")
    assert spec == {
        "@default": {"num_of_gpus": 1, "memory": "16Gi"},
        "site-3": {"num_of_gpus": 0, "memory": "8Gi", "num_of_cpus": 2},
    }
    validate_portable_resource_spec(spec)
    meta = {"resource_spec": spec}
    assert get_portable_resource_spec(meta, "site-1") == {"num_of_gpus": 1, "memory": "16Gi"}
    assert get_portable_resource_spec(meta, "site-3") == {"num_of_gpus": 0, "num_of_cpus": 2, "memory": "8Gi"}
    assert portable_memory_to_mib(get_portable_resource_spec(meta, "site-1")["memory"]) == 16 * 1024
    assert parse_site_resources("") == {} and parse_site_resources("site-1:cpus=4") == {"site-1": {"num_of_cpus": 4}}


@pytest.mark.parametrize(
    "text",
    [
        "gpu=1",  # not a key
        "gpus=-1",
        "gpus=1.5",
        "mem_gb=0",
        "cpus=0",
        "mem_gb=16Gi",
        "gpus",
        "gpus=1,gpus=2",
        "gpus=1;gpus=2",
        "site-1:gpus=1;site-1:mem_gb=2",
        "gpus=1;",
        "bad site:gpus=1",
        "site-1:",
    ],
)
def test_bad_site_resources_are_refused(text: str) -> None:
    with pytest.raises(ResourceSpecError):
        parse_site_resources(text)


@pytest.mark.slow  # builds a job in process (imports torch, Lightning, NVFlare's job API): 5-16 s here
def test_the_builder_writes_site_resources_into_meta_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from jobs import build

    base = ["--client", "fedavg", "--server", "fedavg", "--name", "gpu_job", "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as refused:
        build.main([*base, "--site-resources", "gpus=one"])
    assert refused.value.code == 2 and "--site-resources" in capsys.readouterr().err and not any(tmp_path.iterdir())
    assert build.main(["--presets", "--check", "--site-resources", "gpus=1"]) == 2  # not silently ignored
    assert "--site-resources applies to one job" in capsys.readouterr().err
    assert build.main([*base, "--site-resources", "gpus=1,mem_gb=16"]) == 0
    meta = json.loads((tmp_path / "gpu_job" / "meta.json").read_text())
    assert meta["resource_spec"] == {"@default": {"num_of_gpus": 1, "memory": "16Gi"}}
    # Without the option meta.json is as before: `python -m jobs.build --presets --check` (committed jobs).
