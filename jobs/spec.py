"""The spec of a job (every setting of `jobs.settings` in one flat, validated object) and the client command
line derived from it.

A `JobSpec` that exists is buildable: its constructor checks each value against its declaration, then the
combinations (dataset and model, sampling and the number of sites, the client algorithm and the server rule), and
constructs the model, the client algorithm and the server rule with the given arguments, so their own checks refuse
bad hyperparameters when the job is built rather than when it runs. Every refusal is a `JobBuildError` with
one line naming the setting, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs.secure_aggregation import secagg_entries_problem, secure_aggregation_problem
from jobs.settings import (
    ATTACK_FIELDS,
    CLIENT,
    JSON_FIELDS,
    AttackSettings,
    ClientAlgorithmSettings,
    DataSettings,
    JobBuildError,
    LocalTrainingSettings,
    ModelSettings,
    PrecisionSettings,
    PrivacySettings,
    RoundSettings,
    SecureAggregationSettings,
    TrackingSettings,
    UserCodeSettings,
    check_settings,
    compact_json,
    dataset_num_classes,
    flag,
    registries,
    setting_fields,
)
from jobs.shipping import importable, shipped_folders  # re-exported: jobs.assembly imports them from here

if TYPE_CHECKING:
    from lightning_modules.algorithms import ClientAlgorithm


# Base classes are listed last-to-first: a dataclass orders inherited fields from the end of its MRO.
@dataclass(frozen=True, kw_only=True)
class JobSpec(
    SecureAggregationSettings,
    PrivacySettings,
    TrackingSettings,
    AttackSettings,
    RoundSettings,
    ClientAlgorithmSettings,
    PrecisionSettings,
    LocalTrainingSettings,
    UserCodeSettings,
    ModelSettings,
    DataSettings,
):
    """Everything that defines an exported job: a name plus every field of the settings groups."""

    name: str

    def __post_init__(self) -> None:
        # Whole numbers given for float settings (lr=1) are floats, so the recipe and the CLI export the same text.
        for spec_field, kind in setting_fields():
            value = getattr(self, spec_field.name)
            if kind.base is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, spec_field.name, float(value))
        validate_spec(self)
        # Resolved once, here, against the job's model: the sites and the server get the same explicit names.
        object.__setattr__(self, "local_keys", ",".join(job_local_keys(self)))
        _check_personal_validation(self)  # after the keys resolved: a pattern matching nothing is named first
        _check_candidates(self)
        # Shipped folders are named relative to where the job is specified; the export runs elsewhere.
        object.__setattr__(self, "ship", ",".join(str(p.resolve()) for p in shipped_folders(self)))
        if self.script is not None:
            object.__setattr__(self, "script", str(Path(self.script).resolve()))


def validate_spec(spec: JobSpec) -> None:
    """Reject bad values, unknown names and impossible combinations at build time (one line each)."""
    if not isinstance(spec.name, str) or not spec.name or "/" in spec.name or spec.name in (".", ".."):
        raise JobBuildError(f"name must be a folder name (no '/'), got {spec.name!r}")
    check_settings(spec, registries=registries())
    problem = secure_aggregation_problem(spec)  # first: the sum workflow never runs what the later checks check
    if problem:
        raise JobBuildError(problem)
    _check_composition_of(spec)
    if spec.pattern == "uniform_random" and spec.max_local_epochs < 2:
        raise JobBuildError(f"max_local_epochs must be at least 2 for uniform_random, got {spec.max_local_epochs}")
    _check_sampling(spec)
    if spec.data_site_arg is not None and spec.data is None:
        raise JobBuildError(
            f"data_site_arg {spec.data_site_arg!r} names a constructor parameter of your data module: it needs --data"
        )
    if spec.model is not None or spec.data is not None or spec.script is not None:
        _check_user_code(spec)
    if spec.devices > 1:
        _check_distributed_site(spec)
    _check_stopping(spec)
    _check_cross_site(spec)
    if spec.final_site_eval and (spec.model is None or spec.script is not None):
        raise JobBuildError(
            "final_site_eval needs a user model and data module (--model, --data) whose sites hold a validation "
            "split, run by the bundle's client (not --script); the built-in models are scored on the server's test set"
        )
    else:
        if (spec.dataset == "digits") != (spec.arch == "mlp"):
            raise JobBuildError(f"arch '{spec.arch}' does not fit dataset '{spec.dataset}': use mlp for digits only")
        _check_arch_args(spec)
    _check_client_algorithm(spec)
    _check_privacy(spec)
    if spec.finetune_epochs:
        _check_finetune(spec)
    _check_site_splits(spec)
    _check_server_rule(spec)
    _check_client_level_dp(spec)
    job_attack_args(spec)  # unknown attack, no malicious site, bad share: refused at build time
    _check_tracking(spec)
    if spec.secure_aggregation == "secagg":  # its model is known to build by now
        problem = secagg_entries_problem(job_model(spec))
        if problem:
            raise JobBuildError(problem)


def job_model(spec: JobSpec) -> Any:
    """The module every side of the job builds (the built-in classifier or the user's module), for build-time
    questions about its state_dict."""
    if spec.model is not None:
        from lightning_modules.own_model import build_user_module

        with importable(shipped_folders(spec)):
            return build_user_module(spec.model, spec.model_args, seed=spec.seed)
    # The built-in classifier's network without Lightning (the same state_dict and layers), as the server holds it:
    # building a job then never imports Lightning.
    from lightning_modules.models import ClassifierWeights

    return ClassifierWeights(spec.arch, dataset_num_classes(spec.dataset), model_arch_args(spec))


def job_local_keys(spec: JobSpec) -> tuple[str, ...]:
    """The job's local entries as explicit state_dict names (docs/personalization.md, "Partial sharing"): the
    ``local_keys`` patterns resolved against the job's model, or for a client algorithm that needs a head (FedRep)
    without them, the head the model declares. Refused in one line: a pattern that matches nothing, patterns that
    cover everything, a head that cannot be found, a combination whose math does not hold."""
    from lightning_modules.algorithms import CLIENT_ALGORITHMS
    from lightning_modules.personalization.local_keys import LocalKeysError, declared_head_keys, resolve_local_keys

    needs_head = CLIENT_ALGORITHMS[spec.client].needs_head
    if not spec.local_keys and not needs_head:
        return ()
    _check_partial_sharing(spec)
    model = job_model(spec)
    try:
        keys = resolve_local_keys(spec.local_keys, model) if spec.local_keys else declared_head_keys(model)
    except LocalKeysError as exc:
        raise JobBuildError(str(exc)) from None
    if not keys:
        raise JobBuildError(
            f"client '{spec.client}' needs a head that stays at the site: give --local-keys (globs over the model's "
            f"state_dict names, e.g. {list(model.state_dict())[-2:]}) or define fl_head_keys() on the model"
        )
    if needs_head and not any(name in keys for name, _ in model.named_parameters()):
        raise JobBuildError(
            f"client '{spec.client}': local_keys {list(keys)[:5]} hold no trainable parameter to use as a head"
        )
    if len(keys) == len(model.state_dict()):
        raise JobBuildError(f"local_keys: the head {list(keys)[:5]} is the whole model: nothing would be shared")
    return keys


def _check_partial_sharing(spec: JobSpec) -> None:
    """Combinations where keeping entries at the sites does not hold."""
    refused = _rule_declares(spec, "partial_sharing_refused")
    if refused:
        raise JobBuildError(f"local_keys with server '{spec.server}': {refused}")
    if spec.script is not None:
        raise JobBuildError(
            "local_keys (or a client that keeps a head) with --script: your own training script builds its own "
            "callback, which the bundle cannot give the local entries; use --model and --data"
        )


def _rule_declares(spec: JobSpec, capability: str) -> Any:
    """The job's rule's own declaration of ``capability`` (aggregators/types.py::declared): undeclared, refused."""
    from aggregators.registry import RULES
    from aggregators.types import UndeclaredCapability, declared

    try:
        return declared(RULES[spec.server], capability)
    except UndeclaredCapability as exc:
        raise JobBuildError(str(exc)) from None


def client_level_dp(spec: JobSpec) -> str | None:
    """The name of the job's rule's client-level DP mechanism (``"DP-FedAvg"``), ``None``: its result is no such
    release; the rule's own declaration (``client_level_dp``), never its name."""
    return _rule_declares(spec, "client_level_dp")


def _check_privacy(spec: JobSpec) -> None:
    """DP-SGD at the sites (lightning_modules/privacy/job_checks.py): settings, what cannot be accounted, the model."""
    from lightning_modules.privacy.job_checks import privacy_problem

    problem = privacy_problem(spec, _client_algorithm(spec), lambda: job_model(spec))
    if problem:
        raise JobBuildError(problem)


def _check_tracking(spec: JobSpec) -> None:
    """The tracker's options fit it, and its package is here: NVFlare's receiver is constructed when the job is
    built (jobs/tracking.py)."""
    from jobs.tracking import tracking_problem

    problem = tracking_problem(spec)
    if problem:
        raise JobBuildError(problem)


def advisories(spec: JobSpec) -> list[str]:
    """Notes about a valid job (printed by the builder, never refused): measured pitfalls, and what the server must
    install for the job's tracker."""
    from data_prep.partition import LABEL_COUNT_SCHEMES  # build time only: the spec module stays import-light
    from jobs.tracking import tracking_note

    notes = [note] if (note := tracking_note(spec)) else []
    strong_skew = (spec.scheme == "dirichlet" and spec.alpha <= 0.1) or (
        spec.scheme in LABEL_COUNT_SCHEMES and spec.classes_per_site <= 2
    )
    # Momentum rho scales SGD's steady step by 1/(1 - rho): lr 0.01 with momentum 0.9 steps like plain lr 0.1.
    effective_lr = spec.lr / (1 - spec.momentum)
    above_limit = effective_lr > 0.02 * (1 + 1e-9)  # 0.002 / (1 - 0.9) is 0.020000000000000004 in binary
    if spec.client == "scaffold" and spec.model is None and strong_skew and above_limit:
        notes.append(
            f"SCAFFOLD with lr {spec.lr:g} and momentum {spec.momentum:g} (effective lr {effective_lr:g}) under strong "
            f"label skew ({spec.scheme}) fell below FedAvg or collapsed to chance in our measurements (plain SGD at lr "
            "0.05: benchmarks/results/scaffold_label_skew.md; lr 0.01 with momentum 0.9 on NIID-Bench's split: "
            "benchmarks/results/niid_bench.md); consider FedAvg/FedProx or an effective lr <= 0.02"
        )
    elif spec.client == "scaffold" and spec.model is not None:  # the builder cannot see the sites' own data
        notes.append(
            "SCAFFOLD can diverge under strong label skew when the local lr is large "
            "(benchmarks/results/scaffold_label_skew.md); python -m controllers.report warns when a site's "
            "control ||c_i|| runs away"
        )
    return notes


def sampled_sites(spec: JobSpec) -> int:
    """Sites trained per round (the controller's own resolution of ``clients_per_round``)."""
    from aggregators.contracts.sampling import clients_per_round_count

    return clients_per_round_count(spec.clients_per_round, spec.num_sites)


def _check_distributed_site(spec: JobSpec) -> None:
    """``devices > 1``: Lightning DDP at every site, which the bundle's client runs for a user model only, and
    which the algorithms that take extra gradient passes on a rank's own batch cannot follow."""
    if spec.model is None or spec.script is not None:
        raise JobBuildError(
            f"devices {spec.devices} (Lightning DDP at every site) needs --model and --data run by the bundle's "
            "client (not --script, not the built-in models)"
        )
    from lightning_modules.federated import distributed_refusal

    reason = distributed_refusal(_client_algorithm(spec))
    if reason:
        raise JobBuildError(f"devices {spec.devices}: {reason}")


def _check_sampling(spec: JobSpec) -> None:
    value, sites = spec.clients_per_round, spec.num_sites
    if isinstance(value, float) and not 0 < value <= 1:
        raise JobBuildError(f"clients_per_round {value!r} is a fraction outside (0, 1]; use a fraction or a count")
    if isinstance(value, int) and not 1 <= value <= sites:
        raise JobBuildError(f"clients_per_round must be a count in [1, num_sites={sites}] or a fraction, got {value}")
    sampled = sampled_sites(spec)
    if spec.min_responses is not None and spec.min_responses > sampled:
        raise JobBuildError(
            f"min_responses must be at most the {sampled} site(s) sampled per round, got {spec.min_responses}"
        )
    enough = sampled if spec.min_responses is None else spec.min_responses
    if spec.min_accepted > enough:
        raise JobBuildError(
            f"min_accepted must be at most the {enough} result(s) a round waits for (clients_per_round, "
            f"min_responses), got {spec.min_accepted}: the global model would never change"
        )


def job_attack_args(spec: JobSpec) -> list[str]:
    """The client options of the job's simulated attack (robustness experiments; empty without one)."""
    from lightning_modules.attacks import attack_script_args, resolve_malicious_sites

    try:
        sites = resolve_malicious_sites(spec.num_sites, spec.malicious_fraction, spec.malicious_sites, spec.seed)
        return attack_script_args(spec.attack, spec.attack_strength, spec.attack_start_round, sites, spec.num_sites)
    except ValueError as exc:
        raise JobBuildError(str(exc)) from None


def model_arch_args(spec: JobSpec) -> dict[str, Any]:
    """The model arguments every side builds with: the client algorithm's needs (MOON's projection head) + the job's."""
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    return {**CLIENT_ALGORITHMS[spec.client].default_arch_args, **spec.arch_args}


def _check_user_code(spec: JobSpec) -> None:
    """The user's model and data classes import, are a LightningModule and a LightningDataModule, and the model
    builds with its arguments (the server builds the initial global model from it)."""
    from jobs.user_checks import check_user_job
    from lightning_modules.own_model import UserCodeError, build_user_module, user_class

    if spec.site_val_fraction:  # a user's sites validate on their data module's val_dataloader
        raise JobBuildError(
            f"site_val_fraction {spec.site_val_fraction:g}: applies to the built-in models only; with --model the "
            "sites evaluate on the data module's val_dataloader"
        )
    if spec.site_test_fraction:  # ... and report on its test_dataloader
        raise JobBuildError(
            f"site_test_fraction {spec.site_test_fraction:g}: applies to the built-in models only; with --model the "
            "sites' test split is the data module's test_dataloader (scored by the model's test_step)"
        )
    if spec.script is not None:
        script = Path(spec.script)
        if script.suffix != ".py" or not script.is_file():
            raise JobBuildError(f"script: {spec.script!r} is not a Python file (from {Path.cwd()})")
        if spec.model is None:
            raise JobBuildError("script: give --model too: the server builds the initial global model from it")
    elif spec.model is None or spec.data is None:
        raise JobBuildError("model and data go together: give both --model and --data (import paths)")
    compact_json(spec.model_args, "--model-args")
    compact_json(spec.data_args, "--data-args")
    import pytorch_lightning as pl

    with importable(shipped_folders(spec)):
        try:
            module = build_user_module(spec.model, spec.model_args, seed=spec.seed)
            if spec.data is not None:
                user_class(spec.data, pl.LightningDataModule, "data")
            check_user_job(spec, module)  # jobs/user_checks.py: what the client and the rule need from the user code
        except UserCodeError as exc:
            raise JobBuildError(str(exc)) from None


def _check_arch_args(spec: JobSpec) -> None:
    from lightning_modules.models import build_model

    try:
        build_model(spec.arch, num_classes=dataset_num_classes(spec.dataset), **model_arch_args(spec))
    except (TypeError, ValueError) as exc:
        raise JobBuildError(
            f"arch '{spec.arch}' cannot be built with arch_args {model_arch_args(spec)}: {exc}"
        ) from None


def _check_finetune(spec: JobSpec) -> None:
    """Local fine-tuning (lightning_modules/finetune.py) scores the fine-tuned copy on the site's validation split,
    trains it in one process, beside the bundle's site loop, and is the site's one personal model."""
    why = f"finetune_epochs {spec.finetune_epochs}"
    if spec.script is not None:
        raise JobBuildError(f"{why}: the bundle's site loop fine-tunes; a --script runs its own loop instead")
    if spec.devices > 1:
        raise JobBuildError(f"{why}: the fine-tuned copy trains in one process; use devices 1")
    collision = personal_collision(spec)
    if collision:
        raise JobBuildError(collision)
    if spec.model is None and not spec.site_val_fraction:
        raise JobBuildError(f"{why} needs a validation split to score the fine-tuned copy on: set site_val_fraction")
    if spec.model is not None:
        problem = _user_validation_problem(spec)
        if problem:
            raise JobBuildError(f"{why} needs a validation split to score the fine-tuned copy on: {problem}")


#: The fewest test samples a site may hold (``site_test_fraction``): below it one sample moves its test accuracy by
#: more than 10 points, and the paired kept-vs-local interval says nothing.
MIN_TEST_SAMPLES = 10


def _check_site_splits(spec: JobSpec) -> None:
    """Every site of a built-in dataset keeps at least `MIN_TEST_SAMPLES` test samples (the partition is
    computed here, as the sites will compute it); a stratified hold-out needs a hold-out to stratify."""
    if spec.model is None and spec.site_holdout != "random" and not spec.site_val_fraction + spec.site_test_fraction:
        raise JobBuildError(
            f"site_holdout {spec.site_holdout!r} stratifies the sites' validation and test splits, and this job holds "
            "out none: set site_val_fraction and/or site_test_fraction, or leave site_holdout random"
        )
    if spec.model is None and spec.site_test_fraction > 0:
        from lightning_modules.site import builtin_split_sizes

        for site, (n_train, n_val, n_test) in builtin_split_sizes(spec).items():
            if n_test < MIN_TEST_SAMPLES:
                raise JobBuildError(
                    f"site_test_fraction {spec.site_test_fraction:g} leaves {site} {n_test} test samples (of "
                    f"{n_train + n_val + n_test}); every site needs at least {MIN_TEST_SAMPLES}: raise "
                    "site_test_fraction, or give the sites more data (max_train_samples, num_sites, scheme)"
                )


def _check_personal_validation(spec: JobSpec) -> None:
    """Every personal method needs a validation split (a fine-tuned copy is refused earlier with its own message):
    without one the site builds its personal model every round (Ditto's v_i; FedPer/FedBN/FedRep's trained module
    with its own entries) and can never report it against the global model, which is what the method is for."""
    method = personal_method(spec)
    if method and spec.script is None and not has_validation_split(spec):
        raise JobBuildError(
            f"{method} makes a personal model at every site, which can only be scored against the global model on a "
            f"validation split: {_validation_hint(spec)}"
        )


#: What ``keep_metric`` may name with the built-in classifier (its validation_step logs these).
BUILTIN_VAL_METRICS = ("val_loss", "val_accuracy")


def _check_candidates(spec: JobSpec) -> None:
    """``--local-baseline`` and ``--keep best`` (lightning_modules/local_baseline.py, keep_best.py): the splits they
    score on, something to choose between, and the bundle's single-process site loop."""
    _check_pooled_choice(spec)
    wanted = [name for name, on in (("local_baseline", spec.local_baseline), ("keep best", spec.keep == "best")) if on]
    if spec.keep == "last" and spec.keep_metric != "val_loss":
        raise JobBuildError(f"keep_metric {spec.keep_metric!r} selects for --keep best only; this job keeps 'last'")
    if not wanted:
        return
    if spec.script is not None or spec.devices > 1:
        raise JobBuildError(
            f"{wanted[0]}: the bundle's site loop trains and scores the candidates in one process; not with --script "
            "or devices > 1"
        )
    validation, test = has_validation_split(spec), has_test_split(spec)
    if spec.local_baseline and not (validation or test):
        raise JobBuildError(
            f"local_baseline needs a split to score the local-only model on: {_validation_hint(spec)} and/or "
            f"{_validation_hint(spec, 'test')}"
        )
    if spec.keep != "best":
        return
    if not validation or not test:
        missing = "validation" if not validation else "test"
        raise JobBuildError(
            f"keep best selects on a validation split and reports on a test split; the sites hold no {missing} split: "
            f"{_validation_hint(spec, missing)}"
        )
    if not spec.local_baseline and personal_method(spec) is None:
        raise JobBuildError(
            "keep best with the global model as the only candidate: add --local-baseline or a personal method "
            f"(finetune_epochs, client {' or '.join(_personal_clients())}, local_keys)"
        )
    if spec.model is None and spec.keep_metric not in BUILTIN_VAL_METRICS:
        raise JobBuildError(f"keep_metric {spec.keep_metric!r}: the built-in model logs {list(BUILTIN_VAL_METRICS)}")


def _check_pooled_choice(spec: JobSpec) -> None:
    """``keep_view pooled`` (lightning_modules/site_choice.py): the own and the kept model are both chosen on a pooled
    validation split, which must exist and never overlap the pooled test view."""
    pooled, count = spec.keep_view == "pooled", spec.site_pooled_val
    if count and not pooled:
        raise JobBuildError(
            f"site_pooled_val {count} is the split keep_view 'pooled' chooses on; this job chooses on the sites' own "
            "validation splits: set keep_view pooled, or leave site_pooled_val 0"
        )
    if not pooled:
        return
    if spec.keep != "best" or not spec.local_baseline:
        raise JobBuildError(
            "keep_view 'pooled' needs keep best and local_baseline: it chooses both the site's own early-stopped "
            "model and the kept model on the pooled validation split; set both, or keep_view own"
        )
    if spec.keep_metric != "val_loss":
        raise JobBuildError(
            f"keep_view 'pooled' chooses on the validation loss per sample, not keep_metric {spec.keep_metric!r}: "
            "leave keep_metric val_loss"
        )
    if spec.model is not None:
        _check_pooled_val_hook(spec)
        return
    if not count:
        raise JobBuildError(
            "keep_view 'pooled' with the built-in data needs site_pooled_val n > 0: the n published test images "
            "after site_pooled_test's that the sites choose on (e.g. site_pooled_val 1000)"
        )
    if not spec.site_pooled_test:
        raise JobBuildError(
            f"site_pooled_val needs site_pooled_test > 0: the pooled view the choice is reported on (its images come "
            f"first, the {count} pooled validation images after them)"
        )
    published = _published_test_size(spec)
    if spec.site_pooled_test + count > published:
        raise JobBuildError(
            f"site_pooled_test {spec.site_pooled_test} + site_pooled_val {count} = {spec.site_pooled_test + count} "
            f"published test images, but {spec.dataset} has {published}: lower them so that the two do not overlap"
        )


def _published_test_size(spec: JobSpec) -> int:
    from data_prep import SiteDataConfig
    from data_prep.sites import test_split

    return len(test_split(SiteDataConfig.from_namespace(spec))[1])


def _check_pooled_val_hook(spec: JobSpec) -> None:
    """A user's data module offers the pooled validation split through ``pooled_val_dataloader()``."""
    import pytorch_lightning as pl

    from lightning_modules.own_model import user_class

    with importable(shipped_folders(spec)):
        data_cls = user_class(spec.data, pl.LightningDataModule, "data")
    if not callable(getattr(data_cls, "pooled_val_dataloader", None)):
        raise JobBuildError(
            f"keep_view 'pooled': data {spec.data!r} defines no pooled_val_dataloader(), the pooled validation split "
            "the sites choose on: add it (docs/personalization.md), or keep_view own"
        )


def _active_personal_methods(spec: JobSpec) -> list[Any]:
    """The personalization methods the job turns on, asked of their declarations
    (lightning_modules/personalization/methods.py), never of their names."""
    from lightning_modules.algorithms import CLIENT_ALGORITHMS
    from lightning_modules.personalization.methods import active_methods

    return active_methods(CLIENT_ALGORITHMS[spec.client], spec.finetune_epochs, bool(spec.local_keys))


def personal_collision(spec: JobSpec) -> str | None:
    """Why the job's personal methods cannot run together (two personal models, one set of personal_* scores)."""
    from lightning_modules.personalization.methods import collision

    return collision(_active_personal_methods(spec))


def personal_method(spec: JobSpec) -> str | None:
    """The setting that gives the job's sites a personal model (``None``: none): a client algorithm that declares
    one (Ditto, APFL, FedRep's head), local fine-tuning, or partial sharing (FedPer/FedBN's local_keys), whose
    personal model is the trained module with the site's own entries."""
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    if CLIENT_ALGORITHMS[spec.client].personal_model is not None:
        return f"client '{spec.client}'"
    if spec.finetune_epochs:
        return f"finetune_epochs {spec.finetune_epochs}"
    # By now local_keys holds the resolved names, which can be many: the count names the setting in one short line.
    return f"local_keys ({len(spec.local_keys.split(','))} entries kept at the site)" if spec.local_keys else None


def _personal_clients() -> list[str]:
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    return [name for name, cls in CLIENT_ALGORITHMS.items() if cls.personal_model is not None]


def has_validation_split(spec: JobSpec) -> bool:
    """Whether the sites hold a validation split: ``site_val_fraction`` for the built-in data, a ``validation_step``
    and a ``val_dataloader()`` for a user's model and data module."""
    if spec.model is None:
        return spec.site_val_fraction > 0
    return spec.data is not None and _user_validation_problem(spec) is None


def has_test_split(spec: JobSpec) -> bool:
    """Whether the sites hold a test split: ``site_test_fraction`` for the built-in data, a ``test_step`` and a
    ``test_dataloader()`` for a user's model and data module."""
    if spec.model is None:
        return spec.site_test_fraction > 0
    return spec.data is not None and _user_validation_problem(spec, stage="test") is None


def _validation_hint(spec: JobSpec, stage: str = "validation") -> str:
    if spec.model is None:
        option = "site_val_fraction" if stage == "validation" else "site_test_fraction"
        return f"set {option} (e.g. 0.1)"
    return _user_validation_problem(spec, stage="test" if stage == "test" else "validation") or ""


def _user_validation_problem(spec: JobSpec, stage: str = "validation") -> str | None:
    """What the user's model or data module lacks to score a model at the site on its validation (or, with
    ``stage="test"``, its test) split, or ``None``."""
    import pytorch_lightning as pl
    from pytorch_lightning.utilities.model_helpers import is_overridden

    from lightning_modules.own_model import user_class

    with importable(shipped_folders(spec)):
        model_cls = user_class(spec.model, pl.LightningModule, "model")
        data_cls = user_class(spec.data, pl.LightningDataModule, "data") if spec.data else None
    step, loader = ("test_step", "test_dataloader") if stage == "test" else ("validation_step", "val_dataloader")
    if not is_overridden(step, model_cls, pl.LightningModule):
        return f"model {spec.model!r} defines no {step}"
    if data_cls is None or not is_overridden(loader, data_cls, pl.LightningDataModule):
        return f"data {spec.data!r} defines no {loader}()"
    return None


def _check_client_algorithm(spec: JobSpec) -> None:
    """The client algorithm, constructed with ``client_args`` exactly as every site will construct it."""
    compact_json(spec.client_args, "--client-args")  # whitespace would break NVFlare's split of the line
    _client_algorithm(spec)
    _client_declares(spec, "released")  # what its sites send: the egress gate and DP's release read it


def _client_declares(spec: JobSpec, capability: str) -> Any:
    """The job's client algorithm's own declaration of ``capability`` (aggregators/types.py::declared): undeclared,
    refused."""
    from aggregators.types import UndeclaredCapability, declared
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    try:
        return declared(CLIENT_ALGORITHMS[spec.client], capability)
    except UndeclaredCapability as exc:
        raise JobBuildError(str(exc)) from None


def _client_algorithm(spec: JobSpec) -> ClientAlgorithm:
    """The job's client algorithm: keys it does not declare, then values its hyperparameter dataclass refuses, are
    one line each, named by the option that carries them."""
    from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm, client_args_problem

    problem = client_args_problem(spec.client, spec.client_args)
    if problem:
        raise JobBuildError(f"--client-args: {problem}")
    try:
        return build_client_algorithm(spec.client, **spec.client_args)
    except (ClientAlgorithmError, TypeError, ValueError) as exc:
        raise JobBuildError(f"--client-args: {exc}") from None


def _check_server_rule(spec: JobSpec) -> None:
    """The server rule and its companions, constructed with ``server_args`` as the controller will."""
    from aggregators.compose import compose
    from aggregators.registry import build_rule, rule_args_problem

    problem = rule_args_problem(spec.server, spec.server_args)
    if problem:
        raise JobBuildError(f"--server-args: {problem}")
    try:
        compose(build_rule(spec.server, **spec.server_args), companion_rules(spec))
    except (TypeError, ValueError) as exc:
        raise JobBuildError(f"--server-args: {exc}") from None


def _check_client_level_dp(spec: JobSpec) -> None:
    """A rule whose result is a client-level DP release (``client_level_dp``: DP-FedAvg, aggregators/dp_fedavg.py)
    protects what its noised sum releases: a companion's state built from the sites' individual results, or float
    buffers averaged beside it, would escape the noise."""
    mechanism = client_level_dp(spec)
    if mechanism is None:
        return
    from aggregators.dp_fedavg import FLOAT_BUFFER_ADVICE

    companions = companion_rules(spec)
    if companions:
        raise JobBuildError(
            f"server {spec.server} with client '{spec.client}': its server state ({', '.join(companions)}) is built "
            f"from every site's own result, which {mechanism}'s clipping and noise do not cover; use a client "
            "algorithm without server state (fedavg, fedprox, moon, ...)"
        )
    model, local = job_model(spec), set(job_local_keys(spec))
    trainable = {name for name, _ in model.named_parameters()}
    buffers = [k for k, v in model.state_dict().items() if v.is_floating_point() and k not in trainable | local]
    if buffers:
        raise JobBuildError(f"server {spec.server}: the model's float buffers {buffers[:3]}: {FLOAT_BUFFER_ADVICE}")


def _check_composition(client_cls: type, rule_cls: type) -> tuple[str, ...]:
    """A client algorithm and a server rule compose when each gets what it needs, possibly through companion rules
    that keep the client algorithm's server state (SCAFFOLD's c beside FedYogi); returns their names, or raises
    with the reason the pair is meaningless (aggregators/compose.py)."""
    from aggregators.compose import CompositionError, plan_composition

    try:
        return plan_composition(client_cls, rule_cls)
    except CompositionError as exc:
        raise JobBuildError(str(exc)) from None


def _check_composition_of(spec: JobSpec) -> tuple[str, ...]:
    from aggregators.registry import RULES
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    return _check_composition(CLIENT_ALGORITHMS[spec.client], RULES[spec.server])


def companion_rules(spec: JobSpec) -> dict[str, dict[str, Any]] | None:
    """The companion rules the job's controller runs beside its rule (``None``: none)."""
    return {name: {} for name in _check_composition_of(spec)} or None


def client_script_args(spec: JobSpec) -> str:
    """The command line every site's client script receives (deterministic order: the export is diffed).

    Every client-side setting in declaration order (``None`` and options whose ``exported_when`` says no are left
    out), then the attack options, then the JSON ones, compact: NVFlare splits the line on whitespace.
    """
    parts = []
    for spec_field, _ in setting_fields():
        name = spec_field.name
        if spec_field.metadata["side"] != CLIENT or name in ATTACK_FIELDS or name in JSON_FIELDS:
            continue
        exported_when = spec_field.metadata["exported_when"]
        value = getattr(spec, name)
        if value is None or (exported_when is not None and not exported_when(spec)):
            continue
        if name == "script":  # the sites run the copy in the job's custom/: its file name is all they need
            value = Path(value).name
        if isinstance(value, bool):  # a store_true flag: present when on
            parts += [flag(name)] if value else []
            continue
        parts.append(f"{flag(name)} {value}")
    parts += job_attack_args(spec)
    if model_arch_args(spec):
        parts.append(f"--arch-args {compact_json(model_arch_args(spec), '--arch-args')}")
    if spec.client_args:
        parts.append(f"--client-args {compact_json(spec.client_args, '--client-args')}")
    for name in ("model_args", "data_args"):
        if getattr(spec, name):
            parts.append(f"{flag(name)} {compact_json(getattr(spec, name), flag(name))}")
    return " ".join(parts)


def spec_from_values(name: str, values: Mapping[str, Any]) -> JobSpec:
    """A spec from a mapping of setting names, the one way the builder and the recipe make one: an unknown name is
    refused in one line with the known ones, as the registries refuse unknown hyperparameters."""
    from aggregators.registry import unknown_setting_problem

    known = [f.name for f in dataclasses.fields(JobSpec) if f.name != "name"]
    problem = unknown_setting_problem("a job", values, known)
    if problem:
        raise JobBuildError(problem)
    return JobSpec(name=name, **values)


def _check_stopping(spec: JobSpec) -> None:
    """The stopping rule reads the sites' validation scores at the server (controllers/stopping.py)."""
    if spec.stop_patience is None:
        return
    if spec.model is None and spec.site_val_fraction == 0:
        raise JobBuildError(
            "stop_patience stops at a plateau of the sites' validation loss: the built-in sites need a validation "
            "split (--site-val-fraction, e.g. 0.2)"
        )
    if (spec.dp_noise_multiplier is not None or spec.dp_target_epsilon is not None) and not (
        spec.dp_release_site_scores
    ):
        raise JobBuildError(
            "stop_patience reads the sites' validation scores, which DP-SGD keeps at the sites: add "
            "--dp-release-site-scores (an unaccounted release) or leave stop_patience unset"
        )


def _check_cross_site(spec: JobSpec) -> None:
    """``cross_site_eval`` (aggregators/contracts/cross_site.py) sends each site's kept and local-only models to the
    other sites: never under DP (nothing accounts for that release), only where those models and the splits that score
    them exist (docs/privacy.md, docs/personalization.md)."""
    if not spec.cross_site_eval:
        return
    from lightning_modules.privacy.job_checks import is_private

    what = "cross_site_eval sends each site's kept and local-only models to the other sites"
    mechanism = client_level_dp(spec)
    if is_private(spec) or mechanism is not None:
        dp = f"the {mechanism} rule ({spec.server})"
        if is_private(spec):
            dp = "DP-SGD (dp_noise_multiplier/dp_target_epsilon)"
        raise JobBuildError(f"{what}, a release no DP accounting covers: not with {dp}")
    if spec.script is not None:
        raise JobBuildError(f"{what}: the bundle's site loop only, not --script (your script keeps no such models)")
    if spec.keep != "best" or not spec.local_baseline:
        raise JobBuildError(f"{what}: the sites keep them with --keep best and --local-baseline; add both")
    if not has_validation_split(spec):
        raise JobBuildError(
            f"{what}, which score them on their validation splits: the sites hold none: {_validation_hint(spec)}"
        )
    if spec.keep_metric != "val_loss":
        raise JobBuildError(
            f"{what}: the kept model it sends is the one chosen on validation loss; keep_metric {spec.keep_metric!r} "
            "keeps another (leave keep_metric at val_loss)"
        )
