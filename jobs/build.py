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
    min_responses: int | None = None
    train_timeout: int = 0
    dataset: str = "fashion_mnist"
    scheme: str = "dirichlet"
    alpha: float = 0.5
    classes_per_site: int = 2
    max_train_samples: int | None = None
    max_test_samples: int | None = None
    seed: int = 0
    arch: str = "lenet5"
    arch_args: dict[str, Any] = field(default_factory=dict)
    epochs: int = 1
    pattern: str = "constant"
    max_local_epochs: int = 10
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    precision: str = "32-true"
    attack: str = "none"
    attack_strength: float | None = None
    attack_start_round: int = 0
    malicious_fraction: float = 0.0
    malicious_sites: str = ""
    save_client_updates: bool = False
    resume_from: str | None = None

    def __post_init__(self) -> None:
        validate_spec(self)


EPOCH_PATTERNS = ("constant", "uniform_random")
FIELD_HELP = {
    "pattern": "local epochs per site and round: constant (= --epochs) or uniform_random (seeded draw from "
    "[2, --max-local-epochs] per site and round, FedNova's heterogeneous-work setting)",
    "max_local_epochs": "upper bound (inclusive) of the uniform_random pattern",
    "resume_from": "continue a stopped job: a previous run's server app folder holding server_state.pt and the "
    "global model (e.g. <workspace>/server/simulate_job/app_server)",
    "num_rounds": "federated rounds",
    "num_sites": "number of sites the data is split into (= clients the job needs)",
    "clients_per_round": "sites per round: none = all, an int count, or a fraction such as 0.5",
    "min_responses": "results a round waits for: none = every sampled site; fewer ends the round as soon as that "
    "many arrived (later ones are dropped), so a site that drops out cannot stall the job",
    "train_timeout": "seconds a round waits for results (0 = forever); at the timeout the round aggregates what "
    "arrived",
    "dataset": "fashion_mnist, mnist or digits",
    "scheme": "label split: iid, dirichlet, shards or quantity",
    "alpha": "Dirichlet concentration for dirichlet/quantity (smaller = more skewed)",
    "classes_per_site": "labels per site for the shards scheme (#C=k)",
    "max_train_samples": "use a seeded subset of the training set (quick runs)",
    "max_test_samples": "evaluate the global model on the first n test samples",
    "seed": "seeds the split, the initial model, the shuffling and the site sampling",
    "arch": "model: lenet5, simple_cnn (28x28 images) or mlp (digits)",
    "arch_args": 'model constructor arguments, a JSON object (e.g. {"projection_dim":256} for MOON\'s head)',
    "epochs": "local epochs per round",
    "batch_size": "local batch size",
    "lr": "local SGD learning rate",
    "momentum": "local SGD momentum (0 = vanilla SGD, what SCAFFOLD's analysis assumes)",
    "weight_decay": "local SGD weight decay",
    "precision": "Lightning precision: 32-true or bf16-mixed",
    "save_client_updates": "also save every accepted client model per round (audits, tests)",
    "attack": "simulated attack of the malicious sites: none, sign_flip, scale, gaussian, label_flip (experiments)",
    "attack_strength": "attack strength (none = the attack's default; docs/robustness.md)",
    "attack_start_round": "first round (0-based) the malicious sites attack",
    "malicious_fraction": "share of sites that attack, drawn with the seed (ignored if malicious_sites is set)",
    "malicious_sites": "comma-separated malicious site names, e.g. site-2,site-5",
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
    if spec.pattern not in EPOCH_PATTERNS:
        raise JobBuildError(f"unknown pattern '{spec.pattern}'; choose one of {list(EPOCH_PATTERNS)}")
    if spec.pattern == "uniform_random" and spec.max_local_epochs < 2:
        raise JobBuildError(f"max_local_epochs must be at least 2 for uniform_random, got {spec.max_local_epochs}")
    if (spec.dataset == "digits") != (spec.arch == "mlp"):
        raise JobBuildError(f"arch '{spec.arch}' does not fit dataset '{spec.dataset}': use mlp for digits only")
    for name in ("num_rounds", "num_sites", "epochs", "batch_size"):
        if getattr(spec, name) < 1:
            raise JobBuildError(f"{name} must be at least 1, got {getattr(spec, name)}")
    _check_arch_args(spec)
    job_attack_args(spec)  # unknown attack, no malicious site, bad share: refused at build time


def job_attack_args(spec: JobSpec) -> list[str]:
    """The client options of the job's simulated attack (robustness experiments; empty without one)."""
    from lightning_modules.attacks import attack_script_args, resolve_malicious_sites

    try:
        if not 0 <= spec.malicious_fraction <= 1:
            raise ValueError(f"malicious_fraction must be in [0, 1], got {spec.malicious_fraction}")
        sites = resolve_malicious_sites(spec.num_sites, spec.malicious_fraction, spec.malicious_sites, spec.seed)
        return attack_script_args(spec.attack, spec.attack_strength, spec.attack_start_round, sites, spec.num_sites)
    except ValueError as exc:
        raise JobBuildError(str(exc)) from None


def model_arch_args(spec: JobSpec) -> dict[str, Any]:
    """The model arguments every side builds with: the client algorithm's needs (MOON's projection head) + the job's."""
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    return {**CLIENT_ALGORITHMS[spec.client].default_arch_args, **spec.arch_args}


def _check_arch_args(spec: JobSpec) -> None:
    from lightning_modules.models import build_model

    if not isinstance(spec.arch_args, dict):
        raise JobBuildError(f"arch_args must be a JSON object, got {spec.arch_args!r}")
    try:
        build_model(spec.arch, num_classes=dataset_num_classes(spec.dataset), **model_arch_args(spec))
    except (TypeError, ValueError) as exc:
        raise JobBuildError(
            f"arch '{spec.arch}' cannot be built with arch_args {model_arch_args(spec)}: {exc}"
        ) from None


def _check_composition(client_cls: type, rule_cls: type) -> tuple[str, ...]:
    """A client algorithm and a server rule compose when each gets what it needs, possibly through companion rules
    that keep the client algorithm's server state (SCAFFOLD's c beside FedYogi); returns their names, or raises
    with the reason the pair is meaningless (aggregators/compose.py)."""
    from aggregators.compose import CompositionError, plan_composition

    try:
        return plan_composition(client_cls, rule_cls)
    except CompositionError as exc:
        raise JobBuildError(str(exc)) from None


def companion_rules(spec: JobSpec) -> dict[str, dict[str, Any]] | None:
    """The companion rules the job's controller runs beside its rule (``None``: none)."""
    from aggregators import RULES
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    names = _check_composition(CLIENT_ALGORITHMS[spec.client], RULES[spec.server])
    return {name: {} for name in names} or None


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
        "pattern": spec.pattern if spec.pattern != "constant" else None,
        "max-local-epochs": spec.max_local_epochs if spec.pattern != "constant" else None,
        "batch-size": spec.batch_size,
        "lr": spec.lr,
        "momentum": spec.momentum,
        "weight-decay": spec.weight_decay,
        "precision": spec.precision,
        "client": spec.client,
    }
    parts = [f"--{key} {value}" for key, value in args.items() if value is not None]
    parts += job_attack_args(spec)
    if model_arch_args(spec):
        parts.append(f"--arch-args {compact_json(model_arch_args(spec))}")
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
    arch_args = model_arch_args(spec)
    model_args: dict[str, Any] = {"arch": spec.arch, "num_classes": num_classes, "init_seed": spec.seed}
    if arch_args:  # the server's model and evaluator must build what the clients build (MOON's projection head)
        model_args["arch_args"] = arch_args
    job.to_server(PTModel({"path": "lightning_modules.classifier.FLClassifier", "args": model_args}))
    evaluator = TestSetEvaluator(
        arch=spec.arch,
        num_classes=num_classes,
        arch_args=arch_args or None,
        dataset=spec.dataset,
        max_test_samples=spec.max_test_samples,
    )
    job.to_server(evaluator, id="evaluator")
    controller = FedAlgController(
        num_rounds=spec.num_rounds,
        rule=spec.server,
        rule_args=dict(spec.server_args) or None,
        clients_per_round=spec.clients_per_round,
        min_responses=spec.min_responses,
        train_timeout=spec.train_timeout,
        seed=spec.seed,
        save_client_updates=spec.save_client_updates,
        companions=companion_rules(spec),
        resume_from=spec.resume_from,
    )
    job.to_server(controller)
    job.to_clients(ScriptRunner(script=CLIENT_SCRIPT, script_args=client_script_args(spec)))
    add_tracking(job)
    return job


def add_tracking(job: Any) -> None:
    """Stream each site's training curves to the server: the client script logs through NVFlare's tracking API,
    each site converts those events into federated events, and the server writes TensorBoard event files under
    ``<run dir>/tb_events/<site>/`` (``tensorboard --logdir <run dir>/tb_events``)."""
    from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE
    from nvflare.app_common.widgets.convert_to_fed_event import ConvertToFedEvent
    from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver

    job.to_server(TBAnalyticsReceiver(events=["fed." + ANALYTIC_EVENT_TYPE]), id="tb_receiver")
    job.to_clients(ConvertToFedEvent(events_to_convert=[ANALYTIC_EVENT_TYPE], fed_event_prefix="fed."), id="to_fed")


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
    "fedmos": JobSpec(
        name="fedmos",
        client="fedmos",
        client_args={"a": 0.1, "mu": 0.001},
        server="fedmos",
        server_args={"beta": 0.8, "selection": "uniform"},
    ),
    # MOON's authors train with SGD momentum 0.9 and weight decay 1e-5; with vanilla SGD the projection-head model
    # sits at chance for several rounds (docs/fedmos_moon.md).
    "moon": JobSpec(
        name="moon",
        client="moon",
        client_args={"mu": 5.0, "temperature": 0.5, "history_size": 1},
        momentum=0.9,
        weight_decay=1e-5,
    ),
    # Server rules of issue 5 (docs/server_rules.md): plain local SGD clients, the same data and model as above;
    # server settings picked by short measured runs (docs/server_rules.md, "Presets").
    "fedadam": JobSpec(name="fedadam", server="fedadam", server_args={"server_lr": 0.03, "tau": 0.001}),
    "fedadagrad": JobSpec(name="fedadagrad", server="fedadagrad", server_args={"server_lr": 0.02, "tau": 0.01}),
    "fedyogi": JobSpec(name="fedyogi", server="fedyogi", server_args={"server_lr": 0.03, "tau": 0.001}),
    "fednova": JobSpec(name="fednova", server="fednova", pattern="uniform_random", max_local_epochs=3),
    "fedatt": JobSpec(name="fedatt", server="fedatt", server_args={"epsilon": 1.0, "noise": 0.0001}),
    "fedadp": JobSpec(name="fedadp", server="fedadp", server_args={"alpha": 5.0}),
    # Attack-adaptive aggregation (docs/robustness.md): the shipped LeNet-5 attention checkpoint, 10 sites.
    "attack_adaptive": JobSpec(
        name="attack_adaptive",
        server="attack_adaptive",
        server_args={"attention_model_path": "checkpoints/attention_lenet5.pt"},
        num_sites=10,
    ),
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
    parser.add_argument("--arch-args", type=_parse_json_object, default={}, help=FIELD_HELP["arch_args"])
    parser.add_argument("--resume-from", default=None, help=FIELD_HELP["resume_from"])
    from aggregators import RULES
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    choices_help = {
        "client": "client algorithm: " + ", ".join(sorted(CLIENT_ALGORITHMS)),
        "server": "server aggregation rule: " + ", ".join(sorted(RULES)),
    }
    defaults = JobSpec(name="defaults")
    for spec_field in dataclasses.fields(JobSpec):
        if spec_field.name in {"name", "client_args", "server_args", "arch_args", "resume_from"}:
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
