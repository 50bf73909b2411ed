"""The one job builder of the bundle: a client algorithm × a server rule → an NVFlare job folder.

    python -m jobs.build --client fedavg --server fedavg --name my_job --output-dir /tmp/jobs
    python -m jobs.build --presets                # re-export every committed jobs/<name>/ folder
    python -m jobs.build --presets --check        # fail if a committed folder differs from what is generated

Built with NVFlare's job API (``FedJob``, ``ScriptRunner``, ``PTModel``). The bundle's packages are declared as
app packages, so they are not copied into the job: they must be installed on every site (``pip install .``);
only the client script travels in ``app/custom/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import filecmp
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JOBS_DIR = Path(__file__).resolve().parent
CLIENT_SCRIPT = "client.py"
APP_PACKAGES = ("aggregators", "controllers", "data_prep", "jobs", "lightning_modules")


class JobBuildError(ValueError):
    """The requested job cannot be built (unknown names, a meaningless combination, bad settings)."""


@dataclass(frozen=True)
class JobSpec:
    """Everything that defines an exported job. Field names match ``jobs/client.py`` options where shared."""

    name: str
    client: str = "fedavg"
    client_args: dict[str, Any] = field(default_factory=dict)
    server: str = "fedavg"
    server_args: dict[str, Any] = field(default_factory=dict)
    num_rounds: int = 10
    num_sites: int = 3
    clients_per_round: int | float | None = None
    dataset: str = "fashion_mnist"
    scheme: str = "dirichlet"
    alpha: float = 0.5
    classes_per_site: int = 2
    max_train_samples: int | None = None
    max_test_samples: int | None = None
    seed: int = 0
    arch: str = "lenet5"
    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    precision: str = "32-true"
    save_client_updates: bool = False

    def __post_init__(self) -> None:
        validate_spec(self)


FIELD_HELP = {
    "num_rounds": "federated rounds",
    "num_sites": "number of sites the data is split into (= clients the job needs)",
    "clients_per_round": "sites per round: none = all, an int count, or a fraction such as 0.5",
    "dataset": "fashion_mnist, mnist or digits",
    "scheme": "label split: iid, dirichlet, shards or quantity",
    "alpha": "Dirichlet concentration for dirichlet/quantity (smaller = more skewed)",
    "classes_per_site": "labels per site for the shards scheme (#C=k)",
    "max_train_samples": "use a seeded subset of the training set (quick runs)",
    "max_test_samples": "evaluate the global model on the first n test samples",
    "seed": "seeds the split, the initial model, the shuffling and the site sampling",
    "arch": "model: lenet5, simple_cnn (28x28 images) or mlp (digits)",
    "epochs": "local epochs per round",
    "batch_size": "local batch size",
    "lr": "local SGD learning rate",
    "momentum": "local SGD momentum (0 = vanilla SGD, what SCAFFOLD's analysis assumes)",
    "weight_decay": "local SGD weight decay",
    "precision": "Lightning precision: 32-true or bf16-mixed",
    "save_client_updates": "also save every accepted client model per round (audits, tests)",
}


def validate_spec(spec: JobSpec) -> None:
    """Reject unknown names and settings at build time, with the valid choices in the message."""
    from aggregators import RULES
    from data_prep import DATASETS, SCHEMES
    from lightning_modules.algorithms import CLIENT_ALGORITHMS
    from lightning_modules.models import MODELS

    choices = {
        "client": (spec.client, CLIENT_ALGORITHMS),
        "server": (spec.server, RULES),
        "dataset": (spec.dataset, DATASETS),
        "scheme": (spec.scheme, SCHEMES),
        "arch": (spec.arch, MODELS),
        "precision": (spec.precision, ("32-true", "bf16-mixed")),
    }
    for what, (value, valid) in choices.items():
        if value not in valid:
            raise JobBuildError(f"unknown {what} '{value}'; choose one of {sorted(valid)}")
    _check_composition(CLIENT_ALGORITHMS[spec.client], RULES[spec.server])
    if (spec.dataset == "digits") != (spec.arch == "mlp"):
        raise JobBuildError(f"arch '{spec.arch}' does not fit dataset '{spec.dataset}': use mlp for digits only")
    for name in ("num_rounds", "num_sites", "epochs", "batch_size"):
        if getattr(spec, name) < 1:
            raise JobBuildError(f"{name} must be at least 1, got {getattr(spec, name)}")


def _check_composition(client_cls: type, rule_cls: type) -> None:
    """A client algorithm and a server rule compose only when each sends what the other needs."""
    missing_down = [k for k in client_cls.required_server_meta if k not in rule_cls.broadcast_keys]
    if missing_down:
        raise JobBuildError(
            f"client algorithm '{client_cls.name}' needs {missing_down} from the server, which rule "
            f"'{rule_cls.name}' does not send; use a server rule that maintains it (e.g. '{client_cls.name}')"
        )
    missing_up = [k for k in rule_cls.required_meta if k not in client_cls.sent_meta]
    if missing_up:
        raise JobBuildError(
            f"server rule '{rule_cls.name}' needs {missing_up} from every client, which client algorithm "
            f"'{client_cls.name}' does not send; use a client algorithm that reports it (e.g. '{rule_cls.name}')"
        )


def dataset_num_classes(dataset: str) -> int:
    # All datasets shipped here have ten classes; kept in one place for when that changes.
    return 10


def compact_json(value: dict[str, Any]) -> str:
    """JSON without whitespace: NVFlare splits ``task_script_args`` on whitespace and does not honour quotes."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    if any(ch.isspace() for ch in text):
        raise JobBuildError(
            f"client hyperparameters must not contain whitespace (NVFlare splits arguments on it): {text}"
        )
    return text


def client_script_args(spec: JobSpec) -> str:
    """The command line every site's client script receives (deterministic order: the export is diffed)."""
    args: dict[str, Any] = {
        "dataset": spec.dataset,
        "scheme": spec.scheme,
        "alpha": spec.alpha,
        "classes-per-site": spec.classes_per_site,
        "num-sites": spec.num_sites,
        "max-train-samples": spec.max_train_samples,
        "seed": spec.seed,
        "arch": spec.arch,
        "epochs": spec.epochs,
        "batch-size": spec.batch_size,
        "lr": spec.lr,
        "momentum": spec.momentum,
        "weight-decay": spec.weight_decay,
        "precision": spec.precision,
        "client": spec.client,
    }
    parts = [f"--{key} {value}" for key, value in args.items() if value is not None]
    if spec.client_args:
        parts.append(f"--client-args {compact_json(spec.client_args)}")
    return " ".join(parts)


@contextlib.contextmanager
def inside_directory(directory: Path) -> Iterator[None]:
    # NVFlare writes the script path as given into the job config, so it must be relative to the job's custom/.
    previous = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)


def build_job(spec: JobSpec) -> Any:
    """Assemble the NVFlare ``FedJob`` for ``spec`` (server: persistor, evaluator, controller; clients: script)."""
    from nvflare.app_opt.pt.job_config.model import PTModel
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import ScriptRunner

    from controllers.evaluator import TestSetEvaluator
    from controllers.fedalg_controller import FedAlgController

    num_classes = dataset_num_classes(spec.dataset)
    job = FedJob(name=spec.name, min_clients=spec.num_sites)
    job.set_app_packages(list(APP_PACKAGES))
    model_config = {
        "path": "lightning_modules.classifier.FLClassifier",
        "args": {"arch": spec.arch, "num_classes": num_classes, "init_seed": spec.seed},
    }
    job.to_server(PTModel(model_config))
    evaluator = TestSetEvaluator(
        arch=spec.arch, num_classes=num_classes, dataset=spec.dataset, max_test_samples=spec.max_test_samples
    )
    job.to_server(evaluator, id="evaluator")
    controller = FedAlgController(
        num_rounds=spec.num_rounds,
        rule=spec.server,
        rule_args=dict(spec.server_args) or None,
        clients_per_round=spec.clients_per_round,
        seed=spec.seed,
        save_client_updates=spec.save_client_updates,
    )
    job.to_server(controller)
    job.to_clients(ScriptRunner(script=CLIENT_SCRIPT, script_args=client_script_args(spec)))
    return job


def export_job(spec: JobSpec, output_dir: Path) -> Path:
    """Write ``output_dir/<spec.name>/`` (replacing an older export of the same name) and return its path."""
    output_dir = Path(output_dir).resolve()
    target = output_dir / spec.name
    if target.exists():
        shutil.rmtree(target)
    with inside_directory(JOBS_DIR):
        build_job(spec).export_job(str(output_dir))
    return target


PRESETS: dict[str, JobSpec] = {
    "fedavg": JobSpec(name="fedavg"),
    "scaffold": JobSpec(name="scaffold", client="scaffold", server="scaffold"),
    "fedprox": JobSpec(name="fedprox", client="fedprox", client_args={"mu": 0.01}, server="fedavg"),
    "feddyn": JobSpec(name="feddyn", client="feddyn", server="feddyn", server_args={"alpha": 0.01}),
}


def check_presets(jobs_dir: Path = JOBS_DIR) -> list[str]:
    """Differences between the committed ``jobs/<name>/`` folders and freshly generated ones (empty = in sync)."""
    differences: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in PRESETS.values():
            fresh = export_job(spec, Path(tmp))
            differences.extend(_diff_trees(fresh, jobs_dir / spec.name, spec.name))
    return differences


def _diff_trees(fresh: Path, committed: Path, label: str) -> list[str]:
    if not committed.is_dir():
        return [f"{label}: committed folder {committed} is missing"]
    fresh_files = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()}
    committed_files = {
        p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    problems = [f"{label}: missing {p}" for p in sorted(fresh_files - committed_files)]
    problems += [f"{label}: unexpected {p}" for p in sorted(committed_files - fresh_files)]
    problems += [
        f"{label}: {p} differs"
        for p in sorted(fresh_files & committed_files)
        if not filecmp.cmp(fresh / p, committed / p, shallow=False)
    ]
    return problems


def _parse_json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jobs.build", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", action="store_true", help="export every preset into jobs/ (the committed jobs)")
    parser.add_argument("--check", action="store_true", help="with --presets: only report differences, exit 1 on any")
    parser.add_argument("--output-dir", type=Path, default=JOBS_DIR, help="where job folders are written")
    parser.add_argument("--name", help="job folder name (default: <client>_<server>)")
    parser.add_argument(
        "--client-args", type=_parse_json_object, default={}, help="client algorithm hyperparameters, a JSON object"
    )
    parser.add_argument(
        "--server-args", type=_parse_json_object, default={}, help="server rule hyperparameters, a JSON object"
    )
    from aggregators import RULES
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    choices_help = {
        "client": "client algorithm: " + ", ".join(sorted(CLIENT_ALGORITHMS)),
        "server": "server aggregation rule: " + ", ".join(sorted(RULES)),
    }
    defaults = JobSpec(name="defaults")
    for spec_field in dataclasses.fields(JobSpec):
        if spec_field.name in {"name", "client_args", "server_args"}:
            continue
        default = getattr(defaults, spec_field.name)
        flag = "--" + spec_field.name.replace("_", "-")
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true", help=FIELD_HELP.get(spec_field.name))
            continue
        kind = {int: int, float: float, str: str}.get(type(default), _number_or_none)
        description = choices_help.get(spec_field.name) or FIELD_HELP.get(spec_field.name, "")
        help_text = f"{description} (default: {default})".strip()
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    return parser


def _number_or_none(text: str) -> int | float | None:
    if text.lower() == "none":
        return None
    return float(text) if "." in text else int(text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.presets:
            return _run_presets(args.check, args.output_dir)
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(JobSpec) if f.name != "name"}
        spec = JobSpec(name=args.name or f"{args.client}_{args.server}", **values)
        print(f"exported {export_job(spec, args.output_dir)}")
    except (JobBuildError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_presets(check: bool, output_dir: Path) -> int:
    if check:
        differences = check_presets(output_dir)
        for line in differences:
            print(line)
        return 1 if differences else 0
    for spec in PRESETS.values():
        print(f"exported {export_job(spec, output_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
