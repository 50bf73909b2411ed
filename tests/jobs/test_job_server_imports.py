"""The server of a job on the built-in classifier never imports Lightning (about 3 s of CPU at every server start,
in every simulator run and deployment): it holds the global model in `ClassifierWeights`, the sites' `FLClassifier`
network without Lightning, whose state_dict keys and seeded initial weights are the `FLClassifier`'s bit for bit.

A job on the user's own LightningModule (the ``snp_*`` jobs) builds that module on the server and needs Lightning
there; those are left out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_modules.classifier import FLClassifier
from lightning_modules.models import ClassifierWeights

REPO = Path(__file__).resolve().parents[2]
USER_MODEL = "lightning_modules.own_model.seeded_user_module"


def server_component_paths(config: Path) -> list[str]:
    """Every ``path`` a job config names (components, the persistor's model, nested arguments)."""
    found: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("path"), str):
                found.append(node["path"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads(config.read_text()))
    return found


def builtin_model_servers() -> list[Path]:
    configs = sorted(REPO.glob("jobs/*/app/config/config_fed_server.json"))
    return [c for c in configs if USER_MODEL not in server_component_paths(c)]


def test_the_committed_jobs_servers_import_no_lightning() -> None:
    configs = builtin_model_servers()
    assert len(configs) >= 15  # every built-in job but the genotype ones
    modules = sorted({path.rsplit(".", 1)[0] for c in configs for path in server_component_paths(c)})
    assert "lightning_modules.models" in modules and "controllers.fedalg_controller" in modules
    probe = f"import importlib, sys\nfor m in {modules!r}:\n    importlib.import_module(m)\n"
    probe += "print(sorted(m for m in ('pytorch_lightning', 'lightning', 'torchmetrics') if m in sys.modules))\n"
    completed = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert completed.stdout.strip() == "[]", completed.stdout


@pytest.mark.parametrize(
    ("arch", "arch_args", "init_seed"),
    [
        ("lenet5", None, 0),
        ("lenet5", None, None),
        ("mlp", None, 7),
        ("bn_cnn", None, 1),
        ("lenet5", {"projection_dim": 16}, 3),
    ],
)
def test_the_server_model_has_the_sites_keys_and_seeded_weights(arch, arch_args, init_seed) -> None:
    torch.manual_seed(11)
    server = ClassifierWeights(arch, 10, arch_args, init_seed).state_dict()
    after_server = torch.rand(3)
    torch.manual_seed(11)
    site = FLClassifier(arch, 10, arch_args, init_seed=init_seed).state_dict()
    after_site = torch.rand(3)
    assert list(server) == list(site)
    assert all(torch.equal(server[key], site[key]) for key in site)
    assert torch.equal(after_server, after_site)  # both leave the caller's random stream as it was


def test_the_package_still_offers_its_two_names_lazily() -> None:
    import lightning_modules

    assert lightning_modules.FLClassifier is FLClassifier
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        lightning_modules.nope  # noqa: B018


def test_the_allow_list_holds_every_bundle_class_a_job_without_custom_code_names(tmp_path) -> None:
    # A provisioned participant refuses a non-BYOC job naming a class off its allow-list (the server's model class,
    # renamed to ClassifierWeights, failed a loopback deployment until it was added).
    from jobs.build import JobSpec, export_job
    from jobs.provision.loopback import ALLOW_LIST_FILE, installed_script_job

    exported = export_job(JobSpec(name="plain", num_rounds=1), tmp_path / "exported")
    job = installed_script_job(exported, tmp_path / "plain")
    named = {path for config in job.rglob("config_fed_*.json") for path in server_component_paths(config)}
    ours = {path for path in named if not path.startswith("nvflare.")}
    assert "lightning_modules.models.ClassifierWeights" in ours
    assert ours <= set(json.loads(ALLOW_LIST_FILE.read_text())["class_allow_list"])


def test_building_a_job_on_the_built_in_classifier_imports_no_lightning(tmp_path) -> None:
    # The builder asks the model only about its state_dict and layers: ClassifierWeights answers as FLClassifier
    # would (its attack-site resolution lives apart from the attack callback for the same reason).
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['build', '--name', 'probe', '--output-dir', {str(tmp_path)!r}, '--num-rounds', '1']\n"
        "try:\n    runpy.run_module('jobs.build', run_name='__main__')\nexcept SystemExit as exc:\n"
        "    assert not exc.code, exc.code\n"
        "print(sorted(m for m in ('pytorch_lightning', 'lightning', 'torchmetrics') if m in sys.modules))\n"
    )
    completed = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    assert completed.stdout.strip().splitlines()[-1] == "[]", completed.stdout
    assert (tmp_path / "probe" / "meta.json").is_file()
