"""Every job-level setting, declared once: type, default, help text, allowed values and ranges.

Each group of settings is a frozen dataclass whose fields carry their own metadata (help, interval, where the
setting is used), declared and checked with the one declaration of `aggregators.contracts.hparams` that the server rules
and the client algorithms use too. Everything else is derived from these declarations:

- `jobs.spec.JobSpec` (the flat spec of a job, used by ``python -m jobs.build`` and the recipe) inherits
  every group, so a setting is a field of the spec without being written again;
- the options of ``python -m jobs.build`` and of the client script ``jobs/client.py`` (`jobs.settings.add_arguments`);
- the command line the builder hands every site's client script (`jobs.spec.client_script_args`);
- the per-value checks (`setting_problem`, `check_settings`) the builder and the server's controller run.

It lives in the bottom layer (``aggregators.contracts``, below the rules' math) so that the builder (``jobs``) and the
server runtime (``controllers``) both read it without importing each other. Only the standard library and
`aggregators.contracts.hparams`: the client script uses it on a site before (and without) importing torch, Lightning or
NVFlare's job API.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from aggregators.contracts.hparams import Kind, allowed_text, declared_fields, field_bounds, fits, interval

#: Where a setting is used. ``client``: part of the job and of every site's client command line; ``server``: part
#: of the job, used by the server components only; ``site``: chosen on the site, never by the job (client script).
CLIENT, SERVER, SITE = "client", "server", "site"


class JobBuildError(ValueError):
    """The requested job cannot be built (unknown names, a meaningless combination, bad settings)."""


def setting(
    default: Any,
    help: str,
    *,
    side: str = CLIENT,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    registry: str | None = None,
    exported_when: Callable[[Any], bool] | None = None,
) -> Any:
    """A job setting: its default, ``help`` (the option's help text), the ``side`` it is used on and the `interval`
    a number must lie in, as `aggregators.contracts.hparams.hparam` declares one. ``registry`` names, by a
    name (``"models"``, ``"client_algorithms"``, ``"rules"``), the registry whose keys are the allowed values: the
    layer that owns the registries hands them to `check_settings` when it validates a job (they import torch, and
    live above this layer, which names no module above it); ``exported_when`` drops the option from the client command
    line when it returns False for the spec (keeps committed jobs unchanged for settings added later)."""
    metadata = {
        **interval(low, high, low_open, high_open),
        "help": help,
        "side": side,
        "registry": registry,
        "exported_when": exported_when,
    }
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def _secagg(spec: Any) -> bool:
    return spec.secure_aggregation == "secagg"


def _site_validation(spec: Any) -> bool:
    return spec.site_val_fraction > 0


def _site_test(spec: Any) -> bool:
    return spec.site_test_fraction > 0


def _stratified_holdout(spec: Any) -> bool:
    return spec.site_holdout != "random" and (spec.site_val_fraction > 0 or spec.site_test_fraction > 0)


def _cross_site(spec: Any) -> bool:
    return bool(spec.cross_site_eval)


# --------------------------------------------------------------------------------------------------------------------
# The groups. Field order is the order of the client command line (kept stable: committed jobs are diffed).
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class DataSettings:
    """Data and its split. In simulation every site derives its shard from these; provisioned sites use their own
    data, configured on the site (docs/deployment.md)."""

    title: ClassVar[str] = "data"

    dataset: Literal["fashion_mnist", "mnist", "digits"] = setting("fashion_mnist", "dataset")
    scheme: Literal["iid", "dirichlet", "shards", "quantity", "label_quantity", "small_sites"] = setting(
        "dirichlet",
        "how labels are split across sites (label_quantity: #C=k dealt as NIID-Bench deals it; small_sites: IID "
        "labels, the first round(alpha x sites) sites hold 50..150 samples each, the others share the rest)",
    )
    alpha: float = setting(
        0.5,
        "Dirichlet concentration for dirichlet/quantity (smaller = more skewed); for small_sites the share of "
        "small sites, in (0, 1)",
        low=0,
        low_open=True,
    )
    classes_per_site: int = setting(2, "labels per site for the shards and label_quantity schemes (#C=k)", low=1)
    num_sites: int = setting(3, "number of sites the data is split into (= clients the job needs)", low=1)
    max_train_samples: int | None = setting(None, "use a seeded subset of the training set (quick runs)", low=1)
    max_test_samples: int | None = setting(
        None, "evaluate the global model on the first n test samples", side=SERVER, low=1
    )
    seed: int = setting(0, "seeds the split, the initial model, the shuffling and the site sampling", low=0)
    site_val_fraction: float = setting(
        0.0,
        "share of every built-in site's training shard held out (seeded per site) to score the received global "
        "model before each round's training, sent as eval.* meta (site_eval in round_metrics.jsonl); 0 = none. "
        "Built-in datasets only: with --model your data module's val_dataloader is the split",
        low=0,
        high=0.5,
        high_open=True,
        exported_when=_site_validation,
    )
    site_test_fraction: float = setting(
        0.0,
        "share of every built-in site's training shard held out (seeded per site, disjoint from the validation "
        "split) as the site's TEST split: reporting only, never trained or selected on (eval.global_test_*, "
        "eval.personal_test_*, eval.local_test_*, eval.kept_test_*); the training part is what is left; each site "
        "needs at least 10 test samples; 0 = none. Built-in datasets only: with --model your data module's "
        "test_dataloader (and your module's test_step) is the split",
        low=0,
        high=0.5,
        high_open=True,
        exported_when=_site_test,
    )
    site_holdout: Literal["random", "stratified"] = setting(
        "random",
        "how a built-in site draws its validation and test splits: random (one seeded permutation, blind to the "
        "labels) or stratified (every label of the site's shard in the same share in both splits, so the split that "
        "selects holds the label mix of the split that reports; the same split sizes; data_prep/splits.py)",
        exported_when=_stratified_holdout,
    )
    partition_seed: int | None = setting(
        None,
        "seeds the site data alone: the partition over the sites, the max_train_samples subset and every site's "
        "validation and test hold-outs (none = --seed); fix it and vary --seed to vary training over fixed site data",
        low=0,
    )


@dataclass(frozen=True, kw_only=True)
class ModelSettings:
    """The bundle's built-in model for the built-in datasets (replaced by --model, docs/own_model.md)."""

    title: ClassVar[str] = "built-in model"

    arch: str = setting("lenet5", "model: lenet5, simple_cnn (28x28 images) or mlp (digits)", registry="models")
    arch_args: dict[str, Any] = setting(
        {}, 'model constructor arguments, a JSON object (e.g. {"projection_dim":256} for MOON\'s head)'
    )


def _own_model(spec: Any) -> bool:
    return spec.model is not None


def _own_script(spec: Any) -> bool:
    return spec.script is not None


@dataclass(frozen=True, kw_only=True)
class UserCodeSettings:
    """Your own LightningModule and LightningDataModule by import path, instead of the built-in models and
    datasets (docs/own_model.md)."""

    title: ClassVar[str] = "your own model and data"

    model: str | None = setting(
        None,
        "your LightningModule, 'package.module:Class' (replaces --arch and the built-in datasets; needs --data)",
        exported_when=_own_model,
    )
    model_args: dict[str, Any] = setting({}, "your model's constructor arguments, a JSON object")
    data: str | None = setting(
        None,
        "your LightningDataModule, 'package.module:Class' (train_dataloader; val_dataloader for site evaluation)",
        exported_when=_own_model,
    )
    data_args: dict[str, Any] = setting({}, "your data module's constructor arguments, a JSON object")
    data_site_arg: str | None = setting(
        None,
        "the constructor parameter of your data module that names the site whose data it loads, when it is not "
        "called 'site' (e.g. site_name): each site passes its own name (site-1, ...) to it. A constant for such a "
        "parameter in --data-args is refused: every site would load the same site's data",
    )
    script: str | None = setting(
        None,
        "your own Lightning training script (a .py file), copied into the job and run at every site instead of the "
        "bundle's site loop; it attaches lightning_modules.federated.job_algorithm() (docs/own_model.md). Needs "
        "--model (the server builds the initial global model from it); --data becomes optional",
        exported_when=_own_script,
    )
    ship: str = setting(
        "",
        "comma-separated package folders copied into the job's custom/ so that the server and the sites can import "
        "your classes without installing them (NVFlare's bring-your-own-code); each needs an __init__.py, and every "
        "package of yours that a shipped one imports must be shipped too",
        side=SERVER,
    )


def _not_constant(spec: Any) -> bool:
    return spec.pattern != "constant"


def _has_local_keys(spec: Any) -> bool:
    return bool(spec.local_keys)


def _finetunes(spec: Any) -> bool:
    return spec.finetune_epochs > 0


def _keeps_best(spec: Any) -> bool:
    return spec.keep != "last"


def _stops_early(spec: Any) -> bool:
    return spec.stop_patience is not None


def _pools_test(spec: Any) -> bool:
    return spec.site_pooled_test > 0


def _chooses_on_pooled(spec: Any) -> bool:
    return spec.keep_view != "own"


def _pools_val(spec: Any) -> bool:
    return spec.site_pooled_val > 0


@dataclass(frozen=True, kw_only=True)
class LocalTrainingSettings:
    """The local optimizer (SGD) and how long each site trains per round."""

    title: ClassVar[str] = "local training"

    epochs: int = setting(1, "local epochs per round (pattern constant)", low=1)
    pattern: Literal["constant", "uniform_random"] = setting(
        "constant",
        "local epochs per site and round: constant (= --epochs) or uniform_random (seeded draw from "
        "[2, --max-local-epochs] per site and round, FedNova's heterogeneous-work setting)",
        exported_when=_not_constant,
    )
    max_local_epochs: int = setting(
        10, "upper bound (inclusive) of the uniform_random pattern", low=1, exported_when=_not_constant
    )
    batch_size: int = setting(64, "local batch size", low=1)
    lr: float = setting(0.05, "local SGD learning rate", low=0, low_open=True)
    momentum: float = setting(
        0.0, "local SGD momentum (0 = vanilla SGD, what SCAFFOLD's analysis assumes)", low=0, high=1, high_open=True
    )
    weight_decay: float = setting(0.0, "local SGD weight decay", low=0)
    finetune_epochs: int = setting(
        0,
        "local fine-tuning (docs/personalization.md): every round each site trains a copy of the received global "
        "model this many epochs on its training split and scores it on its validation split (eval.personal_*); the "
        "copy never leaves the site. 0 = off. Needs a validation split (--site-val-fraction, or your data module's "
        "val_dataloader)",
        low=0,
        exported_when=_finetunes,
    )
    local_baseline: bool = setting(
        False,
        "every site also trains a local-only model (lightning_modules/local_baseline.py): the federation's initial "
        "model and optimizer, trained on the site's training split alone, each round as many optimizer steps as the "
        "site's own training took (federated fit + Ditto's personal steps + fine-tuning), kept in the site's "
        "private state store, never sent; scored as eval.local_* on the validation and test splits. Needs a "
        "validation or a test split (--site-val-fraction/--site-test-fraction, or your module's "
        "validation_step/test_step with val_dataloader/test_dataloader)",
    )
    keep: Literal["last", "best"] = setting(
        "last",
        "last: sites keep nothing of their own (as before); best: every round each site keeps the candidate "
        "(0 global received, 1 personal/fine-tuned, 2 local-only) with the best validation --keep-metric (ties to "
        "the earlier one) in its private state store and reports all candidates on its TEST split "
        "(eval.{global,personal,local,kept}_test_*, eval.kept_candidate, eval.kept_minus_local_test_accuracy[_se]; "
        "lightning_modules/keep_best.py). Needs a validation and a test split, and a personal method or "
        "--local-baseline",
        exported_when=_keeps_best,
    )
    keep_metric: str = setting(
        "val_loss",
        "with --keep best: the validation metric that selects (a name the sites' validation logs; lower is better "
        "when it contains loss or error, higher otherwise)",
        exported_when=_keeps_best,
    )
    keep_margin: float = setting(
        1.0,
        "with --keep best and --local-baseline: a federated candidate replaces the site's own early-stopped model "
        "only when its validation loss is lower by more than this many standard errors of the per-sample paired "
        "difference (1.0, the default, chosen on tuning settings: benchmarks/results/site_gain.md; 1.645: a "
        "one-sided test at the 5 percent level, fewer losses and less gain; 0: any lower mean). Classifier sites "
        "only (lightning_modules/site_choice.py)",
        low=0,
        exported_when=_keeps_best,
    )
    site_pooled_test: int = setting(
        0,
        "the 'next patient' view: every built-in site also scores its candidates on the first n images of the "
        "dataset's published test set, all labels (eval.{kept,local,global,personal}_pooled_test_*); 0 = off. "
        "Simulation and benchmarks with built-in data only (a real site has no pooled test set)",
        low=0,
        exported_when=_pools_test,
    )
    keep_view: Literal["own", "pooled"] = setting(
        "own",
        "with --keep best and --local-baseline: the validation split BOTH the site's own early-stopped model and the "
        "kept model are chosen on: own (the site's own validation split) or pooled (a pooled validation split of "
        "the population the site serves, the 'next patient': --site-pooled-val with built-in data, your data "
        "module's pooled_val_dataloader() otherwise; docs/personalization.md). Reports stay on the test views. "
        "Classifier sites only",
        exported_when=_chooses_on_pooled,
    )
    site_pooled_val: int = setting(
        0,
        "with --keep-view pooled and built-in data: the pooled validation split, the next n images of the "
        "published test set after --site-pooled-test's (disjoint from the pooled view; all labels); 0 = off",
        low=0,
        exported_when=_pools_val,
    )


def _several_devices(spec: Any) -> bool:
    return spec.devices > 1


@dataclass(frozen=True, kw_only=True)
class PrecisionSettings:
    """Numerics and devices of each site's training."""

    title: ClassVar[str] = "precision and devices"

    precision: Literal["32-true", "bf16-mixed"] = setting(
        "32-true", "Lightning precision (fp16 GradScaler and bf16-true are refused: docs/deployment.md)"
    )
    devices: int = setting(
        1,
        "processes per site: more than 1 trains every site with Lightning DDP (one process per GPU, or CPU "
        "processes), launched by NVFlare with torchrun; jobs with --model only (docs/own_model.md)",
        low=1,
        exported_when=_several_devices,
    )


@dataclass(frozen=True, kw_only=True)
class ClientAlgorithmSettings:
    """What every site runs on top of local SGD (lightning_modules/algorithms/) and which model entries stay on the
    site."""

    title: ClassVar[str] = "client algorithm"

    client: str = setting("fedavg", "client algorithm", registry="client_algorithms")
    client_args: dict[str, Any] = setting({}, 'client algorithm hyperparameters, a JSON object (e.g. {"mu":0.01})')
    local_keys: str = setting(
        "",
        "state_dict entries that never leave the site (partial sharing, docs/personalization.md): comma-separated "
        "globs over the model's state_dict names (e.g. 'net.classifier.*': FedPer), the word batchnorm (every "
        "BatchNorm entry: FedBN) or the word head (the head the model declares in fl_head_keys, e.g. the genomics "
        "model's net.head.*); with --client fedrep, the head. The builder resolves them against the job's model "
        "and writes the explicit names into the job. Like every personal method (ditto, fedrep, fine-tuning), needs "
        "a validation split (--site-val-fraction, or your data module's val_dataloader)",
        exported_when=_has_local_keys,
    )


@dataclass(frozen=True, kw_only=True)
class RoundSettings:
    """The server: its rule, the rounds and which sites take part in each."""

    title: ClassVar[str] = "server and rounds"

    server: str = setting("fedavg", "server aggregation rule", side=SERVER, registry="rules")
    server_args: dict[str, Any] = setting(
        {},
        'server rule hyperparameters, a JSON object (e.g. {"alpha":0.01}: FedDyn\'s alpha is a server argument, sent '
        "to the sites every round, never in --client-args)",
        side=SERVER,
    )
    num_rounds: int = setting(10, "federated rounds", side=SERVER, low=1)
    clients_per_round: int | float | None = setting(
        None,
        "sites per round: none = all, an integer count in [1, num_sites], or a fraction in (0, 1] written with a "
        "dot (0.5, 1.0)",
        side=SERVER,
        low=0,
        low_open=True,
    )
    min_responses: int | None = setting(
        None,
        "results a round waits for: none = every sampled site; fewer ends the round as soon as that many arrived "
        "(later ones are dropped), so a site that drops out cannot stall the job",
        side=SERVER,
        low=1,
    )
    min_accepted: int = setting(
        1,
        "valid results a round needs to update the global model (fewer: the model stays unchanged that round)",
        side=SERVER,
        low=1,
    )
    train_timeout: int = setting(
        0,
        "seconds a round waits for results (0 = forever); at the timeout the round aggregates what arrived",
        side=SERVER,
        low=0,
    )
    save_client_updates: bool = setting(
        False, "also save every accepted client model per round (audits, tests)", side=SERVER
    )
    resume_from: str | None = setting(
        None,
        "continue a stopped job: a previous run's server app folder holding server_state.pt and the global model "
        "(e.g. <workspace>/server/simulate_job/app_server)",
        side=SERVER,
    )
    final_site_eval: bool = setting(
        False,
        "after the last round every site scores the final global model on its own validation split "
        "(<run dir>/metrics/final_site_scores.json, a site x metric table; jobs with --model only)",
        side=SERVER,
    )
    cross_site_eval: bool = setting(
        False,
        "after the last round every site sends the model it keeps (--keep best) and its early-stopped local-only "
        "model (--local-baseline) to the other sites, which score them on their validation splits: per site "
        "eval.kept_cross_site_accuracy, eval.local_cross_site_accuracy and their paired difference in "
        "<run dir>/metrics/cross_site_scores.json (aggregators/contracts/cross_site.py). A release of the site "
        "models to the other sites (docs/privacy.md): refused under DP and secure aggregation and for --script",
        side=SERVER,
        exported_when=_cross_site,
    )
    stop_patience: int | None = setting(
        None,
        "stop before --num-rounds at a validation plateau: when the sites' mean validation loss (of the model each "
        "keeps with --keep best, else of the personal model, else of the received global model) has not improved "
        "for this many rounds (controllers/stopping.py); none = run every round. Needs the sites' validation "
        "scores at the server (a validation split; under DP-SGD --dp-release-site-scores)",
        side=SERVER,
        low=1,
        exported_when=_stops_early,
    )


@dataclass(frozen=True, kw_only=True)
class AttackSettings:
    """Simulated attacks of malicious sites (robustness experiments; default: none)."""

    title: ClassVar[str] = "simulated attacks"

    attack: Literal["none", "sign_flip", "scale", "gaussian", "label_flip"] = setting(
        "none", "what the malicious sites do"
    )
    attack_strength: float | None = setting(None, "attack strength (none = the attack's default)")
    attack_start_round: int = setting(0, "first round (0-based) the malicious sites attack", low=0)
    malicious_fraction: float = setting(
        0.0,
        "share of sites that attack, drawn with the seed (ignored if malicious_sites is set)",
        side=SERVER,
        low=0,
        high=1,
    )
    malicious_sites: str = setting("", "comma-separated malicious site names, e.g. site-2,site-5")


@dataclass(frozen=True, kw_only=True)
class TrackingSettings:
    """Where the server writes the sites' training curves (train_loss, train_accuracy per round) with NVFlare's
    receivers (jobs/tracking.py; docs/deployment.md, "Experiment tracking")."""

    title: ClassVar[str] = "experiment tracking"

    tracking: Literal["tensorboard", "mlflow", "wandb", "none"] = setting(
        "tensorboard",
        "experiment tracker on the server: tensorboard (event files in <run dir>/tb_events/), mlflow, wandb (the "
        "server installs the 'tracking' extra) or none",
        side=SERVER,
    )
    tracking_uri: str | None = setting(
        None,
        "with --tracking mlflow: the MLflow tracking URI (none = an SQLite file <run dir>/mlflow.db on the server, "
        "no tracking server)",
        side=SERVER,
    )
    tracking_project: str = setting(
        "nvflare-noniid", "with --tracking mlflow or wandb: the MLflow experiment or W&B project", side=SERVER
    )
    wandb_mode: Literal["offline", "online"] = setting(
        "offline", "with --tracking wandb: offline writes run files on the server, no account needed", side=SERVER
    )


def is_private(spec: Any) -> bool:
    """Whether the job runs DP-SGD at its sites (a noise multiplier or a target epsilon is set)."""
    return spec.dp_noise_multiplier is not None or spec.dp_target_epsilon is not None


@dataclass(frozen=True, kw_only=True)
class PrivacySettings:
    """Sample-level DP-SGD at every site (docs/privacy.md): on when dp_noise_multiplier or dp_target_epsilon is set;
    needs the 'privacy' extra (Opacus) at the sites and the builder."""

    title: ClassVar[str] = "differential privacy (DP-SGD)"

    dp_noise_multiplier: float | None = setting(
        None,
        "DP-SGD noise multiplier sigma: Gaussian noise of std sigma * C on every step's sum of clipped per-sample "
        "gradients (none: calibrated to --dp-target-epsilon)",
        low=0,
        exported_when=is_private,
    )
    dp_max_grad_norm: float | None = setting(
        None,
        "DP-SGD clipping norm C of every per-sample gradient (all trainable parameters together)",
        low=0,
        low_open=True,
        exported_when=is_private,
    )
    dp_delta: float = setting(
        1e-5,
        "DP-SGD delta of the reported (epsilon, delta)",
        low=0,
        low_open=True,
        high=1,
        high_open=True,
        exported_when=is_private,
    )
    dp_target_epsilon: float | None = setting(
        None,
        "each site's privacy budget: without --dp-noise-multiplier, sigma is calibrated so that the planned rounds "
        "spend it; a site whose next round would exceed it stops training",
        low=0,
        low_open=True,
        exported_when=is_private,
    )
    dp_release_site_scores: bool = setting(
        False,
        "UNACCOUNTED RELEASE under DP-SGD: send each site's validation scores (eval.*, and the final model's scores "
        "of --final-site-eval) to the server; they are computed on the site's data outside DP-SGD and no epsilon "
        "covers them (default: they stay at the site, in its log)",
        exported_when=is_private,
    )


@dataclass(frozen=True, kw_only=True)
class SecureAggregationSettings:
    """Secure aggregation with NVFlare's homomorphic-encryption components (docs/deployment.md, "Secure aggregation
    (HE)"): the sites encrypt their weighted results with the provisioned TenSEAL CKKS context, the server only adds
    ciphertexts, the sites decrypt the sum; or SecAgg+ masking (aggregators/secagg.py). Sum-type work only; the checks
    are in jobs/secure_aggregation.py."""

    title: ClassVar[str] = "secure aggregation"

    secure_aggregation: Literal["none", "he", "plain", "secagg"] = setting(
        "none",
        "none: the bundle's controller and rules on plaintext updates; he: NVFlare's ScatterAndGather with its HE "
        "encryptor, accumulating aggregator and decryptor (FedAvg, or FedOpt with its step taken at the sites; "
        "provisioned kits with HEBuilder, not the simulator); plain: the same NVFlare workflow without encryption "
        "(the baseline HE's cost is measured against; runs in the simulator); secagg: SecAgg+ masking (pairwise and "
        "self masks, Shamir-shared seeds): the server sees only the sum, even together with fewer than "
        "--secagg-threshold sites; at least 3 sites; runs in the simulator",
        side=SERVER,
    )
    secagg_threshold: int | None = setting(
        None,
        "secagg: how many sites' shares rebuild a site's secret; a majority of the sites, at most all of them "
        "(default: the smallest majority); the sites that may drop in a round: the sites less this",
        side=SERVER,
        low=1,
        exported_when=_secagg,
    )


@dataclass(frozen=True, kw_only=True)
class SiteSettings:
    """Chosen by each site for itself, never written into a job (client script only)."""

    title: ClassVar[str] = "this site"

    data_dir: str | None = setting(None, "directory with the dataset files (default: where installed)", side=SITE)
    accelerator: str = setting("auto", "Lightning accelerator: auto, cpu, gpu", side=SITE)


#: The groups that make up a job, in client command-line order.
JOB_GROUPS: tuple[type, ...] = (
    DataSettings,
    ModelSettings,
    UserCodeSettings,
    LocalTrainingSettings,
    PrecisionSettings,
    ClientAlgorithmSettings,
    RoundSettings,
    AttackSettings,
    TrackingSettings,
    PrivacySettings,
    SecureAggregationSettings,
)
#: Options the builder renders in its own way at the end of the client command line (resolved sites, JSON).
ATTACK_FIELDS = frozenset(f.name for f in dataclasses.fields(AttackSettings))
JSON_FIELDS = frozenset({"arch_args", "client_args", "server_args", "model_args", "data_args"})

# All datasets shipped here have ten classes (data_prep/datasets.py).
NUM_CLASSES = {"fashion_mnist": 10, "mnist": 10, "digits": 10}


def dataset_num_classes(dataset: str) -> int:
    """Number of classes of a dataset, known without loading it (the server builds its model before any data)."""
    try:
        return NUM_CLASSES[dataset]
    except KeyError:
        raise JobBuildError(f"unknown dataset '{dataset}'; choose one of {sorted(NUM_CLASSES)}") from None


# --------------------------------------------------------------------------------------------------------------------
# Reading the declarations
# --------------------------------------------------------------------------------------------------------------------
def setting_fields(groups: Sequence[type] = JOB_GROUPS) -> Iterator[tuple[dataclasses.Field, Kind]]:
    """Every field of ``groups`` with its kind, in declaration order."""
    for group in groups:
        yield from declared_fields(group)


def setting_problem(spec_field: dataclasses.Field, kind: Kind, value: Any) -> str | None:
    """One line naming the setting, the value and what is allowed, or ``None`` when the value is fine."""
    if fits(kind, field_bounds(spec_field), value):
        return None
    if kind.choices is not None and value is not None:
        return f"unknown {spec_field.name} {value!r}; choose one of {list(kind.choices)}"
    return f"{spec_field.name} must be {allowed_text(kind, field_bounds(spec_field))}, got {value!r}"


def registry_problem(
    spec_field: dataclasses.Field, value: Any, registries: Mapping[str, Collection[str]]
) -> str | None:
    """Names outside a registry (client algorithms, rules, models), with the valid ones. ``registries`` maps each
    registry's name (a setting's ``registry``) to the registry; one a setting names that is not given is an error of
    the caller (`LookupError`), never a setting that passes unchecked."""
    where = spec_field.metadata.get("registry")
    if where is None:
        return None
    if where not in registries:
        raise LookupError(f"{spec_field.name} takes a name from the registry {where!r}, not among {sorted(registries)}")
    valid = registries[where]
    return None if value in valid else f"unknown {spec_field.name} {value!r}; choose one of {sorted(valid)}"


def check_settings(
    values: Any, groups: Sequence[type] = JOB_GROUPS, *, registries: Mapping[str, Collection[str]] | None
) -> None:
    """Raise `JobBuildError` for the first field of ``values`` (an object with the fields as attributes)
    that its declaration refuses; with ``registries`` (registry name -> registry, `registry_problem`), also names
    outside their registry; ``None`` leaves those to a later check."""
    for spec_field, kind in setting_fields(groups):
        if not hasattr(values, spec_field.name):
            continue
        value = getattr(values, spec_field.name)
        problem = setting_problem(spec_field, kind, value)
        if problem is None and registries is not None:
            problem = registry_problem(spec_field, value, registries)
        if problem:
            raise JobBuildError(problem)
