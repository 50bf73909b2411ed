"""One site's round of local training, the same in the NVFlare client script and in process.

``jobs/client.py`` calls `SiteRound.fit` once per received model, connecting the round's Trainer to NVFlare
with ``flare.patch`` (NVFlare's FLCallback loads the global weights and sends the result); the in-process runner
(``benchmarks/in_process.py``) calls `SiteRound.train` with the global state_dict and the server meta, and
gets the result back as numpy arrays + meta. Both go through the same steps, so both give the same bits:

1. seed torch and the shuffling from (job seed, site, round) (`round_seed`), so reruns, one-process and
   process-per-round simulations and the in-process runner shuffle identically (under DP-SGD the Poisson sample and
   the noise are the exception: they come from a secret generator, lightning_modules/privacy/secret.py);
2. the labels of the round (flipped for a label-flipping malicious site), a seeded ``DataLoader``;
3. the round's local epochs (`local_epochs`: constant, or FedNova's seeded heterogeneous draw);
4. a fresh Trainer (`make_trainer`) with the client algorithm's callback
   (`lightning_modules.federated.FederatedAlgorithm`, the one a user's own module gets: it starts the
   algorithm's round once the global weights are in and writes the meta) and the `AttackCallback`, then
   the exchange:
   NVFlare's FLCallback, or `LocalExchange` which does what FLCallback does at the same points of the fit
   (load the global weights at ``on_train_start``, take the module's state_dict on CPU at ``on_train_end``, after
   our callbacks);
5. ``trainer.fit``. The client algorithm keeps the state it must carry between rounds in the site's state store.

With ``site_val_fraction`` > 0 every site holds out that seeded share of its shard (`validation_indices`)
and, before step 5, scores the received global model on it with ``trainer.validate`` (`ValidatedClassifier`),
as a user model's site does: the scores travel as ``eval.val_loss`` / ``eval.val_accuracy`` meta. The site's
personal model, when a method provides one (Ditto's v_i; with ``finetune_epochs`` K > 0 a copy of the received model
fine-tuned K epochs on the training part, lightning_modules/finetune.py), is scored on the same split and sent as
``eval.personal_*`` (lightning_modules/personal_scores.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import TensorDataset

from data_prep import to_tensor_dataset
from data_prep.splits import site_holdout_indices
from lightning_modules.attack_callback import AttackCallback
from lightning_modules.attacks import AttackConfig, attack_config_from_args, site_labels
from lightning_modules.classifier import FLClassifier
from lightning_modules.distributed import check_launch
from lightning_modules.federated import FederatedAlgorithm
from lightning_modules.finetune import BEST_EPOCH, epoch_scorer, finetune_seed, finetuned_copy
from lightning_modules.fl_callback import MetaSource, nvflare_meta_source
from lightning_modules.options import json_arg
from lightning_modules.personal_scores import single_process_trainer, validation_scorer, validation_scores
from lightning_modules.site_choice import SELECT_SPLITS
from lightning_modules.split_scores import classifier_batches
from lightning_modules.state_store import ClientStateStore

__all__ = [
    "LocalExchange",
    "LocalTraining",
    "SiteRound",
    "SiteSplits",
    "ValidatedClassifier",
    "build_site_round",
    "hold_out",
    "local_epochs",
    "make_trainer",
    "round_seed",
    "split_seed",
    "validation_indices",
]


@dataclass(frozen=True)
class LocalTraining:
    """The client script's local-training settings a round needs (field names = the script's options)."""

    seed: int = 0
    epochs: int = 1
    pattern: str = "constant"
    max_local_epochs: int = 10
    batch_size: int = 64
    precision: str = "32-true"
    accelerator: str = "auto"
    devices: int = 1
    finetune_epochs: int = 0

    @classmethod
    def from_namespace(cls, args: Any) -> LocalTraining:
        """From the parsed client options (or any object with these attribute names)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def round_seed(seed: int, site_index: int, round_num: int) -> int:
    """One seed per (job seed, site, round): reruns and single-/multi-process simulations shuffle identically."""
    return int(np.random.SeedSequence([seed, site_index, round_num]).generate_state(1)[0])


def validation_indices(n: int, fraction: float, seed: int, site_index: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) indices of a site's ``n`` samples without a test split
    (`data_prep.splits.site_holdout_indices`): a seeded ``fraction`` held out, the same for every round and
    process of the site. Both keep the shard's order, and at least one sample stays for training."""
    train, val, _ = site_holdout_indices(n, fraction, 0.0, seed, site_index)
    return train, val


def split_seed(args: Any) -> int:
    """The seed of the site data: the partition, its subset and every site's hold-outs (``partition_seed``, or the
    job's ``seed`` when none is given), so that a study can vary the training seed over fixed site data."""
    partition_seed = getattr(args, "partition_seed", None)
    return args.seed if partition_seed is None else partition_seed


def local_epochs(training: Any, site_index: int, round_num: int) -> int:
    """This site's local epochs this round: ``epochs``, or for ``uniform_random`` a draw from
    [2, ``max_local_epochs``] (both inclusive) seeded by (job seed, site, round), so reruns repeat it."""
    if training.pattern == "constant":
        return training.epochs
    rng = np.random.default_rng([training.seed, site_index, round_num, 1])  # 1: a stream apart from round_seed's
    return int(rng.integers(2, training.max_local_epochs, endpoint=True))


def make_trainer(
    training: Any, round_callback: pl.Callback, epochs: int | None = None, extra_callbacks: Sequence = ()
) -> pl.Trainer:
    """A fresh Trainer for every round: a Trainer reused across fits carries loop state that changes the batch
    order of later rounds, so a site that keeps its process (``-t N``) would train differently from one that is
    restarted every round (``-t 1``). Fresh trainers make both bit-identical (tested end to end). With
    ``devices > 1`` the site trains with Lightning DDP, in processes started by torchrun."""
    devices = getattr(training, "devices", 1)
    check_launch(devices)
    return pl.Trainer(
        max_epochs=epochs or training.epochs,
        accelerator=training.accelerator,
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        precision=training.precision,
        callbacks=[round_callback, *extra_callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


class LocalExchange(pl.Callback):
    """In-process stand-in for NVFlare's FLCallback, at the same points of the fit (it must come last).

    ``on_train_start`` loads the global state_dict strictly, as FLCallback does once the round's callbacks have
    run; ``on_train_end`` moves the module to CPU, as FLCallback does before sending, and keeps its state_dict as
    numpy arrays in `result`.
    """

    def __init__(self, global_params: Mapping[str, Any]) -> None:
        self.global_params = global_params
        self.result: dict[str, np.ndarray] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = {key: torch.as_tensor(np.array(value, copy=True)) for key, value in self.global_params.items()}
        pl_module.load_state_dict(state, strict=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = pl_module.cpu().state_dict()
        self.result = {key: value.detach().numpy().copy() for key, value in state.items()}


class ValidatedClassifier(FLClassifier):
    """The built-in classifier with a ``validation_step``, for sites that score the received global model."""

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self.task_loss(batch)
        size = len(batch[1])  # Lightning weights the epoch means by batch size: exact over the whole split
        self.log("val_loss", loss, on_epoch=True, batch_size=size)
        self.log("val_accuracy", (logits.argmax(dim=1) == batch[1]).float().mean(), on_epoch=True, batch_size=size)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss, logits = self.task_loss(batch)
        size = len(batch[1])
        self.log("test_loss", loss, on_epoch=True, batch_size=size)
        self.log("test_accuracy", (logits.argmax(dim=1) == batch[1]).float().mean(), on_epoch=True, batch_size=size)


@dataclass
class SiteRound:
    """Everything a site keeps between rounds: its module, data and callbacks (the client algorithm's first)."""

    site: str
    site_index: int
    module: pl.LightningModule
    x: np.ndarray
    y: np.ndarray
    training: LocalTraining
    round_callback: FederatedAlgorithm
    attack_callback: AttackCallback
    dataset: TensorDataset | None = None  # ``to_tensor_dataset(x, y)``, built here unless the caller has it already
    validation: TensorDataset | None = None  # held-out split scoring the received model (needs a validation_step)
    test: TensorDataset | None = None  # held-out split the site reports on only (needs a test_step)
    _finetune_val: Any = field(default=None, init=False, repr=False)  # fine-tuning's validation batches (or False)

    def __post_init__(self) -> None:
        if self.dataset is None:
            self.dataset = to_tensor_dataset(self.x, self.y)
        if self.validation is not None:  # the personal model an algorithm provides (Ditto) is scored on the split
            self.round_callback.personal_scorer = validation_scorer(
                self.training.precision, self.training.accelerator, dataloaders=self.validation_loader()
            )

    @property
    def attack(self) -> AttackConfig:
        return self.attack_callback.config

    def fit(self, round_num: int, connect: Callable[[pl.Trainer], None]) -> dict[str, Any]:
        """Train one round; ``connect(trainer)`` attaches the exchange (``flare.patch`` or `LocalExchange`)
        after our callbacks. Returns the meta the site sends (``pl_module.__fl_meta__``)."""
        seed = round_seed(self.training.seed, self.site_index, round_num)
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        self.attack_callback.round_num = round_num
        labels = site_labels(self.y, self.attack, self.site, round_num)
        round_data = self.dataset if labels is self.y else to_tensor_dataset(self.x, labels)
        loader = torch.utils.data.DataLoader(
            round_data, batch_size=self.training.batch_size, shuffle=True, generator=generator
        )
        if self.round_callback.privacy is not None:  # DP-SGD samples every batch by Poisson sampling, in secret
            from lightning_modules.privacy.dp_sgd import poisson_loader

            loader = poisson_loader(loader)
        epochs = local_epochs(self.training, self.site_index, round_num)
        trainer = make_trainer(self.training, self.round_callback, epochs, [self.attack_callback])
        connect(trainer)
        if self.validation is not None:
            self.score_received(trainer)
            if self.training.finetune_epochs:
                self.finetune(round_num, round_data)
        trainer.fit(self.module, train_dataloaders=loader)
        return self.round_callback.last_meta

    def validation_loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.validation, batch_size=self.training.batch_size)

    def finetune(self, round_num: int, data: TensorDataset) -> pl.LightningModule:
        """Local fine-tuning (lightning_modules/finetune.py): a copy of the received model (in the module after
        `score_received`) trained ``finetune_epochs`` on ``data``, scored on the validation split; the
        scores go out as ``eval.personal_*``. The module and the round's random draws are untouched."""
        seed = finetune_seed(self.training.seed, self.site_index, round_num)

        def fit(trainer: pl.Trainer, copy: pl.LightningModule) -> None:
            generator = torch.Generator().manual_seed(seed)
            loader = torch.utils.data.DataLoader(
                data, batch_size=self.training.batch_size, shuffle=True, generator=generator
            )
            trainer.fit(copy, train_dataloaders=loader)

        precision, accelerator = self.training.precision, self.training.accelerator

        def validate(copy: pl.LightningModule) -> dict[str, float]:
            trainer = single_process_trainer(precision, accelerator)
            return validation_scores(copy, trainer, dataloaders=self.validation_loader())

        if self._finetune_val is None and self.training.finetune_epochs >= 2:  # read once: the per-epoch scores
            self._finetune_val = classifier_batches(self.validation_loader()) or False
        score = epoch_scorer(self._finetune_val or None, validate)
        tuned = finetuned_copy(self.module, self.training.finetune_epochs, seed, fit, precision, accelerator, score)
        self.round_callback.add_personal_scores(validate(tuned))
        self.round_callback.add_site_scores({BEST_EPOCH: tuned.__fl_best_epoch__})
        if self.round_callback.candidates is not None:
            self.round_callback.candidates.hand_over(tuned)
        return tuned

    def score_received(self, trainer: pl.Trainer) -> None:
        """Score the received global model on the validation split before training (eval mode, no gradients);
        the algorithm callback sends the scores as ``eval.*`` meta with the round's result."""
        loader = self.validation_loader()
        # Iterating a loader draws a base seed from torch's global generator: fork it so that training shuffles
        # and initialises exactly as it would after torch.manual_seed alone (evaluation uses no CUDA randomness).
        with torch.random.fork_rng(devices=[]):
            trainer.validate(self.module, dataloaders=loader, verbose=False)

    def train(
        self, round_num: int, global_params: Mapping[str, Any], server_meta: Mapping[str, Any]
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """One round in process: the global model and server meta in, the site's model (numpy) and meta out."""
        exchange = LocalExchange(global_params)

        def connect(trainer: pl.Trainer) -> None:
            if self.validation is not None:  # FLCallback loads the received weights before validate; so do we
                exchange.on_train_start(trainer, self.module)
            trainer.callbacks.append(exchange)

        previous_source = self.round_callback.meta_source
        self.round_callback.meta_source = lambda: dict(server_meta)
        try:
            meta = self.fit(round_num, connect)
        finally:
            self.round_callback.meta_source = previous_source
        assert exchange.result is not None, "the fit ended without reaching on_train_end"
        return exchange.result, dict(meta)


@dataclass(frozen=True)
class SiteSplits:
    """A site's shard in its three parts: training (``x``, ``y``), validation (selection and the received model's
    scores only) and test (reporting only); ``None`` where the job holds out nothing."""

    x: np.ndarray
    y: np.ndarray
    validation: TensorDataset | None
    test: TensorDataset | None


def hold_out(args: Any, x: np.ndarray, y: np.ndarray, site_index: int) -> SiteSplits:
    """The site's training part and its validation and test splits (``site_val_fraction``,
    ``site_test_fraction``), seeded by `split_seed` and the site: FedAvg weighs the site by the training part
    only, and nothing held out is ever trained on. ``site_holdout`` stratified: both splits hold the shard's
    label mix (`data_prep.splits.stratified_roles`)."""
    val_fraction = getattr(args, "site_val_fraction", 0.0) or 0.0
    test_fraction = getattr(args, "site_test_fraction", 0.0) or 0.0
    if not val_fraction and not test_fraction:
        return SiteSplits(x, y, None, None)
    labels = y if getattr(args, "site_holdout", "random") == "stratified" else None
    train, val, test = site_holdout_indices(len(y), val_fraction, test_fraction, split_seed(args), site_index, labels)
    validation = to_tensor_dataset(x[val], y[val]) if len(val) else None
    return SiteSplits(x[train], y[train], validation, to_tensor_dataset(x[test], y[test]) if len(test) else None)


def builtin_split_sizes(spec: Any) -> dict[str, tuple[int, int, int]]:
    """(training, validation, test) sample counts of every simulated site of a built-in dataset, as the sites will
    split their shards (the build-time checks: the test split's minimum, DP-SGD's first round)."""
    from data_prep import SiteDataConfig
    from data_prep.sites import partition_sites

    _, parts = partition_sites(SiteDataConfig.from_namespace(spec))
    val_fraction, test_fraction = spec.site_val_fraction, getattr(spec, "site_test_fraction", 0.0)
    sizes = {}
    for index, part in enumerate(parts):
        split = site_holdout_indices(len(part), val_fraction, test_fraction, split_seed(spec), index)
        sizes[f"site-{index + 1}"] = tuple(len(indices) for indices in split)
    return sizes


def builtin_candidates(args: Any, site: str, site_index: int, splits: SiteSplits, num_classes: int, store: Any) -> Any:
    """The site's `lightning_modules.keep_best.SiteCandidates` for the built-in classifier (``None`` when
    the job has no test split, no local-only model and keeps the last model, as before)."""
    keep, local = getattr(args, "keep", "last"), getattr(args, "local_baseline", False)
    if splits.test is None and not local and keep == "last" and not getattr(args, "site_pooled_test", 0):
        return None
    from lightning_modules.keep_best import SiteCandidates, module_scorer, sample_correct
    from lightning_modules.local_baseline import LocalBaseline

    def make_module() -> pl.LightningModule:  # the federation's initial model: what the server's persistor builds
        kwargs = {"arch_args": json_arg(args.arch_args), "lr": args.lr, "momentum": args.momentum}
        kwargs["weight_decay"] = args.weight_decay
        return ValidatedClassifier(arch=args.arch, num_classes=num_classes, init_seed=args.seed, **kwargs)

    def training_loader() -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(to_tensor_dataset(splits.x, splits.y), args.batch_size, shuffle=True)

    def fit(trainer: pl.Trainer, module: pl.LightningModule) -> None:
        trainer.fit(module, train_dataloaders=training_loader())

    precision, accelerator = args.precision, args.accelerator
    candidates = SiteCandidates(
        site, site_index, args.seed, keep, getattr(args, "keep_metric", "val_loss"), store=store
    )
    if splits.validation is not None:
        loader = torch.utils.data.DataLoader(splits.validation, batch_size=args.batch_size)
        candidates.score_val = module_scorer(precision, accelerator, "validate", dataloaders=loader)
    if splits.test is not None:
        test_loader = torch.utils.data.DataLoader(splits.test, batch_size=args.batch_size)
        candidates.score_test = module_scorer(precision, accelerator, "test", dataloaders=test_loader)
        candidates.correct = lambda module: sample_correct(module, test_loader)
    if local:
        candidates.local = LocalBaseline(site, store, make_module, fit, precision, accelerator, training_loader)
    candidates.margin = float(getattr(args, "keep_margin", candidates.margin))
    candidates.select = SELECT_SPLITS[getattr(args, "keep_view", "own")]
    candidates.split_source = lambda: classifier_splits(
        splits.validation, splits.test, pooled_test_set(args), pooled_val_set(args), batch_size=args.batch_size
    )
    return candidates


def classifier_splits(*datasets: TensorDataset | None, batch_size: int = 256) -> dict[str, Any]:
    """The built-in site's validation, test, pooled test and pooled validation sets read once for the classifier path
    (lightning_modules/split_scores.py); a missing one is left out."""
    from lightning_modules.split_scores import classifier_batches

    loaders = {
        name: torch.utils.data.DataLoader(dataset, batch_size=batch_size)
        for name, dataset in zip(("val", "test", "pooled", "pooled_val"), datasets, strict=True)
        if dataset is not None
    }
    return {name: classifier_batches(loader) for name, loader in loaders.items()}


def pooled_test_set(args: Any) -> TensorDataset | None:
    """With ``--site-pooled-test n``: the "next patient" view, the first n images of the built-in dataset's
    published test set (all labels; the order the server scores the global model in), else ``None``."""
    limit = int(getattr(args, "site_pooled_test", 0) or 0)
    return published_test_images(args, 0, limit) if limit else None


def pooled_val_set(args: Any) -> TensorDataset | None:
    """With ``--site-pooled-val m``: the pooled validation split ``keep_view pooled`` chooses on, the m published test
    images after the pooled test view's n (images n .. n + m - 1: never one the pooled view reports on), else
    ``None``."""
    start, count = int(getattr(args, "site_pooled_test", 0) or 0), int(getattr(args, "site_pooled_val", 0) or 0)
    return published_test_images(args, start, start + count) if count else None


def published_test_images(args: Any, start: int, stop: int) -> TensorDataset:
    """Images ``start .. stop - 1`` of the built-in dataset's published test set, with their labels."""
    from data_prep import SiteDataConfig
    from data_prep.sites import test_split

    x, y = test_split(SiteDataConfig.from_namespace(args))
    return to_tensor_dataset(np.asarray(x[start:stop]), np.asarray(y[start:stop]))


def build_site_round(
    args: argparse.Namespace,
    site: str,
    site_index: int,
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    state_store: ClientStateStore | None,
    meta_source: MetaSource = nvflare_meta_source,
) -> SiteRound:
    """A site as the client script sets it up, from its parsed options (``jobs/client.py --help``) and its data."""
    from lightning_modules.algorithms import build_client_algorithm

    splits = hold_out(args, x, y, site_index)
    x, y, validation = splits.x, splits.y, splits.validation
    module = (ValidatedClassifier if validation is not None or splits.test is not None else FLClassifier)(
        arch=args.arch,
        num_classes=num_classes,
        arch_args=json_arg(args.arch_args),
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
    )
    algorithm = build_client_algorithm(args.client, **json_arg(args.client_args))
    callback = FederatedAlgorithm(
        algorithm,
        site=site,
        state_store=state_store,
        num_samples=len(y),
        meta_source=meta_source,
        local_keys=getattr(args, "local_keys", None),
        privacy=site_privacy(args, site, state_store),
    )
    callback.candidates = builtin_candidates(args, site, site_index, splits, num_classes, state_store)
    attack = attack_config_from_args(args, num_classes)
    return SiteRound(
        site=site,
        site_index=site_index,
        module=module,
        x=x,
        y=y,
        training=LocalTraining.from_namespace(args),
        round_callback=callback,
        attack_callback=AttackCallback(attack, site, site_index),
        validation=validation,
        test=splits.test,
    )


def site_privacy(args: Any, site: str, state_store: ClientStateStore | None) -> Any:
    """The site's DP-SGD (lightning_modules/privacy/dp_sgd.py) when the job turns it on, else ``None``."""
    from lightning_modules.privacy import PrivacyConfig

    config = PrivacyConfig.from_namespace(args)
    if config is None:
        return None
    from lightning_modules.privacy.dp_sgd import DPSGD, planned_epochs

    return DPSGD(config, site, state_store, planned_epochs(args))
