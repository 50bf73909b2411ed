"""Per-step cost of each client algorithm relative to plain SGD, and of NVFlare's built-in Lightning SCAFFOLD/FedProx.

What is measured: the wall time of one training step inside a real ``pl.Trainer.fit`` of
`lightning_modules.FLClassifier`, from ``on_train_batch_start`` to the end of ``on_train_batch_end``: forward,
loss, metrics and logging, backward, the algorithm's hooks, the optimizer step and, for NVFlare's handlers, their
``on_train_batch_end`` work. That is what a user pays per optimizer step. Loading the batch, moving it to the device
and the once-per-round work (snapshots, state files, meta) are outside the timed region.

Variants, all on the same model (same ``init_seed``), the same batch and the same SGD settings:

- ``fedavg`` (ours): FLClassifier with the base client algorithm, i.e. plain local SGD. Every ratio divides by it;
- every other name in `lightning_modules.algorithms.CLIENT_ALGORITHMS` at run time, driven through the hooks
  of the `lightning_modules.federated.FederatedAlgorithm` callback (its round started with a synthetic
  round-0 server meta; variants whose meta keys this file does not know are skipped with a note);
- NVFlare's built-in SCAFFOLD and FedProx: the plain FLClassifier with NVFlare 2.9's
  ``nvflare.app_opt.lightning.algorithm._AlgorithmHandlerManager``, activated by the meta keys ``scaffold_c_global``
  / ``fedprox_mu`` and driven with the hook calls of NVFlare's ``FLCallback`` (``on_train_start`` → ``start_round``,
  ``on_before_optimizer_step`` → ``before_optimizer_step``, ``on_train_batch_end`` → ``after_train_batch``,
  ``on_train_end`` → ``finish_round``); the receive/send plumbing of ``FLCallback`` is left out (not per step);
- a reference row: no client algorithm attached at all (no callback hooks, no loss-term call): what the callback's
  own per-step bookkeeping costs;
- with ``--compare-paths``, the other way each algorithm can apply its correction, timed beside its default
  (`PATH_VARIANTS`): FedProx and FedDyn in the gradient form (``FederatedAlgorithm(fuse_plain_sgd=False)``, what
  they cost when a callback watches the gradient; their default row is the callback's fused plain-SGD step), and
  SCAFFOLD likewise (its default row applies c - c_i after a plain SGD step nobody watches, the gradient form adds
  it to ``.grad``).

Drift (a shared machine, turbo, thermal state) is cancelled by interleaving at the finest grain: in each of
``--rounds`` fits every variant takes one optimizer step per cycle, in a freshly shuffled (seeded) order every cycle
(A C B, B A C, ...), so all variants see the same machine state and none always follows the same neighbour (a
variant that frees large temporaries could otherwise tax its fixed successor). The variants share the module's
weights and optimizer (only the timing matters here, and dense fp32 kernels do not depend on the values); each has
its own algorithm state. The first ``--warmup`` steps of every variant in every fit are dropped. Ratios are medians
of all kept steps of a variant over the baseline's; the bracketed range is the smallest and largest per-fit ratio,
to show the noise.

Run: ``python -m benchmarks.step_overhead --steps 300 --models lenet5 mlp10m --out results.md``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import logging
import math
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from aggregators.contracts import meta_keys
from benchmarks.snp_model import LARGE_SNP_MODEL
from lightning_modules.algorithms import CLIENT_ALGORITHMS, ClientAlgorithm, build_client_algorithm
from lightning_modules.algorithms.base import trainable_parameters
from lightning_modules.classifier import FLClassifier
from lightning_modules.federated import FederatedAlgorithm, attach_algorithm
from lightning_modules.state_store import ClientStateStore

BASELINE = "fedavg"
REFERENCE_ROW = "lightning-default (ref.)"
NUM_CLASSES = 10
SITE = "bench-site"
RUN_ID = "step-overhead-benchmark"

# NVFlare's built-in Lightning algorithms, by the row (our algorithm name) they are compared with.
NVFLARE_BUILTINS = ("scaffold", "fedprox")
#: The precisions NVFlare's built-in handlers accept (no GradScaler: its skipped steps would break step counts).
PRECISIONS = ("32-true", "bf16-mixed")
#: Models timed when ``--models`` is not given (cnn_transformer_large is for a GPU).
DEFAULT_MODELS = ("lenet5", "mlp10m")
#: ``--compare-paths``: row -> (client algorithm, client arguments, FederatedAlgorithm arguments).
PATH_VARIANTS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "fedprox [gradient form]": ("fedprox", {}, {"fuse_plain_sgd": False}),
    "feddyn [gradient form]": ("feddyn", {}, {"fuse_plain_sgd": False}),
    "scaffold [gradient form]": ("scaffold", {}, {"fuse_plain_sgd": False}),
}


@dataclass(frozen=True)
class ModelSpec:
    """One benchmarked network: a name for the CLI, the model's arguments and the input shape.

    ``genotypes``: the genomics consortium's ``SnpClassifier`` (examples/genomics) on genotype states 0..2 with
    ``arch_args`` as its arguments; otherwise the built-in FLClassifier on Gaussian inputs.
    """

    key: str
    label: str
    arch: str
    arch_args: Mapping[str, Any]
    input_shape: tuple[int, ...]
    num_classes: int = NUM_CLASSES
    genotypes: bool = False


MODEL_SPECS: dict[str, ModelSpec] = {
    "lenet5": ModelSpec("lenet5", "LeNet-5", "lenet5", {}, (1, 28, 28)),
    # 784*2048 + 2048*2048*2 + 2048*10 weights plus biases = 10,020,874 parameters.
    "mlp10m": ModelSpec(
        "mlp10m",
        "MLP 784-2048-2048-2048-10",
        "mlp",
        {"in_features": 784, "hidden_sizes": (2048, 2048, 2048)},
        (784,),
    ),
    "cnn_transformer_large": ModelSpec(
        "cnn_transformer_large",
        "cnn_transformer 10,000 SNPs",
        "cnn_transformer",
        {key: value for key, value in LARGE_SNP_MODEL.items() if key not in ("arch", "num_classes")},
        (LARGE_SNP_MODEL["n_snps"],),
        num_classes=LARGE_SNP_MODEL["num_classes"],
        genotypes=True,
    ),
}


def with_snps(spec: ModelSpec, n_snps: int) -> ModelSpec:
    """``spec`` (a genotype model) at ``n_snps`` SNPs; other models unchanged."""
    if not spec.genotypes:
        return spec
    args = {**spec.arch_args, "n_snps": n_snps}
    return replace(spec, label=f"{spec.arch} {n_snps:,} SNPs", arch_args=args, input_shape=(n_snps,))


@dataclass
class Settings:
    steps: int = 300
    rounds: int = 6
    warmup: int = 5
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.0
    mu: float = 0.01
    alpha: float = 0.01
    seed: int = 0
    accelerator: str = "cpu"
    precision: str = "32-true"
    reference: bool = True
    #: Client algorithms to time (the baseline always): ``None`` for every one in CLIENT_ALGORITHMS.
    algorithms: tuple[str, ...] | None = None
    #: Also time the `PATH_VARIANTS` of the selected algorithms.
    compare_paths: bool = False

    def selected(self, name: str) -> bool:
        return name == BASELINE or self.algorithms is None or name in self.algorithms

    @property
    def measured_per_fit(self) -> int:
        return math.ceil(self.steps / self.rounds)

    @property
    def steps_per_fit(self) -> int:
        return self.measured_per_fit + self.warmup


# --------------------------------------------------------------------------------------------------------------------
# Server meta: what the server would send in round 0, built for a given module.
# --------------------------------------------------------------------------------------------------------------------


def _random_controls(module: torch.nn.Module, seed: int) -> dict[str, np.ndarray]:
    """Small non-zero float32 controls keyed like the module's trainable parameters (c of SCAFFOLD)."""
    rng = np.random.default_rng(seed)
    return {
        name: (1e-3 * rng.standard_normal(tuple(p.shape))).astype(np.float32)
        for name, p in trainable_parameters(module).items()
    }


def _meta_builders(settings: Settings) -> dict[str, Callable[[torch.nn.Module], Any]]:
    """Builders for the server meta keys this benchmark knows, keyed by the key string (present constants only)."""
    builders: dict[str, Callable[[torch.nn.Module], Any]] = {
        meta_keys.SCAFFOLD_CTRL_GLOBAL: lambda module: _random_controls(module, settings.seed),
    }
    # Keys of algorithms that may not exist yet in this checkout: registered only when their constant is defined.
    scalar_keys = {"FEDPROX_MU": settings.mu, "FEDDYN_ALPHA": settings.alpha}
    for constant, value in scalar_keys.items():
        key = getattr(meta_keys, constant, None)
        if isinstance(key, str):
            builders[key] = lambda module, value=value: value
    return builders


def server_meta_for(
    algorithm_cls: type[ClientAlgorithm], module: torch.nn.Module, settings: Settings
) -> dict[str, Any]:
    """The round-0 server meta for ``algorithm_cls`` (every required key must have a builder)."""
    builders = _meta_builders(settings)
    meta: dict[str, Any] = {meta_keys.ROUND: 0, meta_keys.RUN_ID: RUN_ID}
    meta.update({key: builders[key](module) for key in algorithm_cls.required_server_meta})
    return meta


def hparams_for(algorithm_cls: type[ClientAlgorithm], settings: Settings) -> dict[str, Any]:
    """Constructor hyperparameters: ``mu``/``alpha`` from the CLI where the constructor takes them, else defaults."""
    try:
        parameters = inspect.signature(algorithm_cls.__init__).parameters
    except (TypeError, ValueError):
        return {}
    values = {"mu": settings.mu, "alpha": settings.alpha}
    # Only where the term is on by default (FedProx's mu, FedDyn's alpha): a zero default is a term the algorithm
    # leaves off unless told (Ditto's mu belongs to its optional FedProx global part, refused without it).
    return {
        name: value
        for name, value in values.items()
        if name in parameters and parameters[name].default not in (0, 0.0, inspect.Parameter.empty)
    }


# --------------------------------------------------------------------------------------------------------------------
# Variants: one thing to time each. All of them share one fit and take turns, one optimizer step each.
# --------------------------------------------------------------------------------------------------------------------


class _Skip(Exception):
    """A variant cannot be built here (e.g. its server meta is unknown); the reason is printed, nothing fails."""


class Variant:
    """Base: ``row`` is the table row (algorithm name), ``impl`` is ``ours``, ``nvflare`` or ``reference``.

    ``start``/``finish`` run once per fit (untimed); ``activate`` runs in ``on_train_batch_start`` before the timer
    starts; ``before_optimizer_step``/``after_train_batch`` are the per-step hooks of NVFlare's ``FLCallback``.
    """

    impl = "reference"

    def __init__(self, row: str, settings: Settings) -> None:
        self.row = row
        self.settings = settings
        self.steps = 0
        self.plain = ClientAlgorithm()

    @property
    def key(self) -> str:
        return f"{self.impl}:{self.row}"

    def start(self, trainer: pl.Trainer, module: pl.LightningModule, state_root: Path) -> None:
        pass

    def activate(self, module: pl.LightningModule, batch: Any) -> None:
        attach_algorithm(module, self.plain)

    def before_optimizer_step(self, optimizer: Any) -> None:
        pass

    def after_train_batch(self, module: pl.LightningModule) -> None:
        pass

    def finish(self, module: pl.LightningModule) -> None:
        pass


class LightningDefault(Variant):
    """Reference: no client algorithm attached (no callback hooks, no loss-term call)."""

    def activate(self, module: pl.LightningModule, batch: Any) -> None:
        attach_algorithm(module, None)


class Ours(Variant):
    """One of our client algorithms, driven through the hooks of its `FederatedAlgorithm` callback."""

    impl = "ours"
    #: FederatedAlgorithm arguments (a `PATH_VARIANTS` row sets them; subclasses that skip __init__ keep none).
    callback_args: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, row: str, settings: Settings) -> None:
        super().__init__(row, settings)
        self.name, self.client_args, self.callback_args = PATH_VARIANTS.get(row, (row, {}, {}))
        self.algorithm_cls = CLIENT_ALGORITHMS[self.name]
        missing = [key for key in self.algorithm_cls.required_server_meta if key not in _meta_builders(settings)]
        if missing:
            raise _Skip(f"the benchmark does not know how to build server meta {missing}")
        if self.algorithm_cls.default_arch_args:  # MOON: a projection head the shared benchmark model lacks
            raise _Skip(
                f"needs model arguments {dict(self.algorithm_cls.default_arch_args)}; "
                "see python -m benchmarks.client_algorithms"
            )

    def start(self, trainer: pl.Trainer, module: pl.LightningModule, state_root: Path) -> None:
        args = {**hparams_for(self.algorithm_cls, self.settings), **self.client_args}
        algorithm = build_client_algorithm(self.name, **args)
        algorithm.bind(SITE, ClientStateStore(state_root / re.sub(r"\W+", "_", self.row), SITE))
        self.start_callback(trainer, module, algorithm, server_meta_for(self.algorithm_cls, module, self.settings))

    def start_callback(
        self, trainer: pl.Trainer, module: pl.LightningModule, algorithm: ClientAlgorithm, meta: Mapping[str, Any]
    ) -> None:
        """The callback's round start (server meta checked, ``on_round_start``), with the live optimizer."""
        self.algorithm, self.module, self.trainer = algorithm, module, trainer
        self.callback = FederatedAlgorithm(
            algorithm, num_samples=1, meta_source=lambda: dict(meta), **self.callback_args
        )
        self.optimizer = trainer.optimizers[0]
        self.callback.on_train_epoch_start(trainer, module)

    def activate(self, module: pl.LightningModule, batch: Any) -> None:
        attach_algorithm(module, self.algorithm)
        self.algorithm.on_batch(module, batch)  # as the callback's on_train_batch_start does (FedMoS, Ditto keep it)

    def before_optimizer_step(self, optimizer: Any) -> None:
        self.callback.on_before_optimizer_step(self.trainer, self.module, optimizer)

    def after_train_batch(self, module: pl.LightningModule) -> None:
        self.callback.after_optimizer_step(module, self.optimizer)

    def finish(self, module: pl.LightningModule) -> None:
        self.algorithm.on_round_end(module)  # raises if, e.g., SCAFFOLD saw no step
        counted = getattr(self.algorithm, "steps", None)
        if isinstance(counted, int) and counted != self.steps:
            raise RuntimeError(f"{self.key}: the algorithm counted {counted} steps, the benchmark ran {self.steps}")


class NVFlareBuiltin(Variant):
    """NVFlare's built-in handler, driven with the hook calls of ``nvflare.app_opt.lightning.api.FLCallback``."""

    impl = "nvflare"

    def start(self, trainer: pl.Trainer, module: pl.LightningModule, state_root: Path) -> None:
        from nvflare.app_common.abstract.fl_model import FLModel
        from nvflare.app_common.app_constant import AlgorithmConstants
        from nvflare.app_opt.lightning.algorithm import _AlgorithmHandlerManager

        if self.row == "scaffold":
            meta = {AlgorithmConstants.SCAFFOLD_CTRL_GLOBAL: _random_controls(module, self.settings.seed)}
        else:
            meta = {AlgorithmConstants.FEDPROX_MU: self.settings.mu}
        self.manager = _AlgorithmHandlerManager()
        self.manager.start_round(trainer=trainer, pl_module=module, input_model=FLModel(meta=meta))

    def before_optimizer_step(self, optimizer: Any) -> None:
        self.manager.before_optimizer_step(optimizer)

    def after_train_batch(self, module: pl.LightningModule) -> None:
        self.manager.after_train_batch(module)

    def finish(self, module: pl.LightningModule) -> None:
        result = self.manager.finish_round(module)
        if result.num_steps != self.steps:
            raise RuntimeError(f"{self.key}: NVFlare's handler counted {result.num_steps} steps, ran {self.steps}")


class Interleaver(pl.Callback):
    """Runs every variant in one fit, one optimizer step at a time in the order of ``schedule``, timing every step.

    Per step: ``on_train_batch_start`` picks the variant and activates it, then starts the clock (so the switch is
    not timed); the variant's NVFlare hooks run from ``on_before_optimizer_step`` / ``on_train_batch_end`` as
    NVFlare's ``FLCallback`` would run them; the clock stops at the end of ``on_train_batch_end``.

    It reads no gradient itself (``observes_gradients``), so a variant's callback may take the fused plain-SGD
    step as it would in a job (lightning_modules/algorithms/kernels.py, ``gradient_observers``).
    """

    observes_gradients = False

    def __init__(
        self, variants: Sequence[Variant], schedule: Sequence[int], state_root: Path, synchronize: bool
    ) -> None:
        self.variants = list(variants)
        self.schedule = list(schedule)
        self.state_root = state_root
        self.synchronize = synchronize
        self.times_ns: dict[str, list[int]] = {v.key: [] for v in self.variants}
        self.current = self.variants[0]
        self._start = 0

    def _sync(self) -> None:
        if self.synchronize:
            torch.cuda.synchronize()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for variant in self.variants:
            variant.start(trainer, pl_module, self.state_root)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self.current = self.variants[self.schedule[batch_idx]]
        self.current.activate(pl_module, batch)
        self._sync()
        self._start = time.perf_counter_ns()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.current.before_optimizer_step(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.current.after_train_batch(pl_module)
        self._sync()
        self.times_ns[self.current.key].append(time.perf_counter_ns() - self._start)
        self.current.steps += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for variant in self.variants:
            variant.finish(pl_module)


def build_variants(settings: Settings, skipped: dict[str, str]) -> list[Variant]:
    """Fresh variants for one fit; those that cannot be built are recorded in ``skipped`` (key -> reason)."""
    variants: list[Variant] = []
    for name in filter(settings.selected, CLIENT_ALGORITHMS):
        for row in [name, *(row for row, spec in PATH_VARIANTS.items() if settings.compare_paths and spec[0] == name)]:
            try:
                variants.append(Ours(row, settings))
            except _Skip as skip:
                skipped[f"ours:{row}"] = str(skip)
    variants += [NVFlareBuiltin(name, settings) for name in NVFLARE_BUILTINS if settings.selected(name)]
    if settings.reference:
        variants.append(LightningDefault(REFERENCE_ROW, settings))
    return variants


# --------------------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-Trainer banners and the few-workers warning during the fits."""
    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*does not have many workers.*")
            warnings.filterwarnings("ignore", message=".*number of training batches.*")
            warnings.filterwarnings("ignore", message=".*LeafSpec.*")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


class SameBatch(Dataset):
    """``length`` times the same ready-made batch (use with ``DataLoader(batch_size=None)``)."""

    def __init__(self, batch: tuple[torch.Tensor, torch.Tensor], length: int) -> None:
        self.batch = batch
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        return self.batch


def make_loader(spec: ModelSpec, settings: Settings, num_steps: int) -> DataLoader:
    """The same fixed random batch for every step of every variant."""
    generator = torch.Generator().manual_seed(settings.seed)
    shape = (settings.batch_size, *spec.input_shape)
    # Genotype models take dosages 0/1/2 (indices of an embedding; the time does not depend on which).
    x = torch.randint(0, 3, shape, generator=generator) if spec.genotypes else torch.randn(shape, generator=generator)
    y = torch.randint(0, spec.num_classes, (settings.batch_size,), generator=generator)
    return DataLoader(SameBatch((x, y), num_steps), batch_size=None, shuffle=False)


def new_module(spec: ModelSpec, settings: Settings) -> pl.LightningModule:
    """A fresh module of ``spec``; the genotype model with plain SGD (``optimizer="sgd"``), as the built-in one."""
    if spec.genotypes:
        from benchmarks.snp_model import examples_importable

        examples_importable()
        from genomics.model import SnpClassifier

        return SnpClassifier(
            arch=spec.arch,
            num_classes=spec.num_classes,
            optimizer="sgd",
            lr=settings.lr,
            seed=settings.seed,
            **spec.arch_args,
        )
    return FLClassifier(
        arch=spec.arch,
        num_classes=NUM_CLASSES,
        arch_args=dict(spec.arch_args),
        lr=settings.lr,
        momentum=settings.momentum,
        init_seed=settings.seed,
    )


def shuffled_cycles(num_variants: int, cycles: int, seed: int) -> list[int]:
    """``cycles`` cycles, each a fresh permutation of the variant indices: every variant once per cycle."""
    rng = random.Random(seed)
    schedule: list[int] = []
    for _ in range(cycles):
        cycle = list(range(num_variants))
        rng.shuffle(cycle)
        schedule += cycle
    return schedule


def run_fit(
    variants: Sequence[Variant], spec: ModelSpec, settings: Settings, round_index: int
) -> dict[str, list[float]]:
    """One fit in which ``variants`` take turns; returns each variant's kept step times in milliseconds."""
    num_steps = settings.steps_per_fit * len(variants)
    schedule = shuffled_cycles(len(variants), settings.steps_per_fit, seed=settings.seed * 1000 + round_index)
    with tempfile.TemporaryDirectory(prefix="bench-state-") as state_root:
        interleaver = Interleaver(variants, schedule, Path(state_root), synchronize=settings.accelerator == "gpu")
        trainer = pl.Trainer(
            accelerator=settings.accelerator,
            devices=1,
            precision=settings.precision,
            max_epochs=1,
            limit_train_batches=num_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[interleaver],
        )
        gc.collect()
        trainer.fit(new_module(spec, settings), train_dataloaders=make_loader(spec, settings, num_steps))
    kept = {}
    for key, times in interleaver.times_ns.items():
        if len(times) != settings.steps_per_fit:
            raise RuntimeError(f"{key}: timed {len(times)} steps, expected {settings.steps_per_fit}")
        kept[key] = [t / 1e6 for t in times[settings.warmup :]]
    return kept


@dataclass
class Row:
    model: str
    params: int
    algorithm: str
    ours_ms: float | None
    ours_ratio: float | None
    ours_range: tuple[float, float] | None
    nvflare_ms: float | None = None
    nvflare_ratio: float | None = None
    nvflare_range: tuple[float, float] | None = None
    #: Ours divided by the Lightning-default reference row (no algorithm attached): the cost over plain Lightning.
    lightning_ratio: float | None = None
    lightning_range: tuple[float, float] | None = None
    note: str = ""


def _ratio_stats(times: list[list[float]], base: list[list[float]]) -> tuple[float, float, tuple[float, float]]:
    """Median ms over all kept steps, its ratio to the baseline's, and the range of the per-round ratios."""
    median = statistics.median(t for r in times for t in r)
    base_median = statistics.median(t for r in base for t in r)
    per_round = [statistics.median(v) / statistics.median(b) for v, b in zip(times, base, strict=True)]
    return median, median / base_median, (min(per_round), max(per_round))


def benchmark_model(spec: ModelSpec, settings: Settings, progress: Callable[[str], None]) -> list[Row]:
    """Times every variant on ``spec`` (``rounds`` fits, variants interleaved step by step) and returns the rows."""
    params = sum(p.numel() for p in new_module(spec, settings).net.parameters())
    skipped: dict[str, str] = {}
    times: dict[str, list[list[float]]] = {}
    for round_index in range(settings.rounds):
        variants = build_variants(settings, skipped)
        progress(
            f"[{spec.key}] fit {round_index + 1}/{settings.rounds}: {len(variants)} variants x "
            f"{settings.steps_per_fit} steps, interleaved in shuffled cycles"
        )
        for key, kept in run_fit(variants, spec, settings, round_index).items():
            times.setdefault(key, []).append(kept)
    for key, why in skipped.items():
        progress(f"[{spec.key}] skipped {key}: {why}")

    base = times[f"ours:{BASELINE}"]
    rows: list[Row] = []
    row_names = [*CLIENT_ALGORITHMS, *(n for n in NVFLARE_BUILTINS if n not in CLIENT_ALGORITHMS)]
    row_names = list(filter(settings.selected, row_names))
    if settings.compare_paths:  # each path variant right after its algorithm's row
        row_names = [r for name in row_names for r in (name, *(v for v, s in PATH_VARIANTS.items() if s[0] == name))]
    if settings.reference:
        row_names.append(REFERENCE_ROW)
    for name in row_names:
        row = Row(spec.label, params, name, None, None, None)
        notes = []
        for impl in ("ours", "nvflare", "reference"):
            key = f"{impl}:{name}"
            if key in skipped:
                notes.append(f"{impl} skipped: {skipped[key]}")
            if key not in times:
                continue
            median, ratio, spread = _ratio_stats(times[key], base)
            if impl == "nvflare":
                row.nvflare_ms, row.nvflare_ratio, row.nvflare_range = median, ratio, spread
            else:
                row.ours_ms, row.ours_ratio, row.ours_range = median, ratio, spread
                reference = times.get(f"reference:{REFERENCE_ROW}")
                if reference is not None:
                    _, row.lightning_ratio, row.lightning_range = _ratio_stats(times[key], reference)
        if name not in CLIENT_ALGORITHMS and name not in PATH_VARIANTS and name != REFERENCE_ROW:
            notes.append("not in CLIENT_ALGORITHMS yet")
        row.note = "; ".join(notes)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------------------


def machine_info(settings: Settings) -> list[str]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import nvflare

    device = torch.cuda.get_device_name(0) if settings.accelerator == "gpu" else "CPU (no GPU used)"
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    return [
        f"- CPU: {cpu}; os.cpu_count() = {os.cpu_count()}, usable by this process = {usable}",
        f"- device: {device}",
        f"- torch {torch.__version__} (threads {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}),"
        f" pytorch-lightning {pl.__version__}, nvflare {nvflare.__version__}, Python {platform.python_version()},"
        f" {platform.system()} {platform.release()}",
        f"- load average (1/5/15 min) at report time: {load}",
        f"- settings: batch {settings.batch_size}, SGD lr {settings.lr} momentum {settings.momentum}, "
        f"FedProx mu {settings.mu}, FedDyn alpha {settings.alpha}, precision {settings.precision}; "
        f"{settings.rounds} fits x "
        f"{settings.measured_per_fit} kept steps per variant (+{settings.warmup} warm-up steps dropped per variant "
        "and fit), variants interleaved step by step in shuffled cycles, the same batch every step",
    ]


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _fmt_ratio(ratio: float | None, spread: tuple[float, float] | None) -> str:
    if ratio is None or spread is None:
        return "—"
    return f"{ratio:.3f} [{spread[0]:.2f}–{spread[1]:.2f}]"


def format_table(rows: Sequence[Row]) -> str:
    header = (
        "| model | params | algorithm | ours ms/step | ours Δ ms | ours ÷ plain [per-fit range] "
        "| NVFlare built-in ms/step | NVFlare ÷ plain [per-fit range] | ours ÷ NVFlare "
        "| ours ÷ Lightning default [per-fit range] | note |"
    )
    lines = [header, "|" + "---|" * 11]
    base_ms = {row.model: row.ours_ms for row in rows if row.algorithm == BASELINE}
    for row in rows:
        delta = None
        if row.ours_ms is not None and base_ms.get(row.model) is not None:
            delta = row.ours_ms - base_ms[row.model]
        vs_nvflare = None
        if row.ours_ms is not None and row.nvflare_ms is not None:
            vs_nvflare = row.ours_ms / row.nvflare_ms
        lines.append(
            f"| {row.model} | {row.params:,} | {row.algorithm} | {_fmt(row.ours_ms, '.2f')} | "
            f"{_fmt(delta, '+.2f')} | {_fmt_ratio(row.ours_ratio, row.ours_range)} | {_fmt(row.nvflare_ms, '.2f')} | "
            f"{_fmt_ratio(row.nvflare_ratio, row.nvflare_range)} | {_fmt(vs_nvflare, '.3f')} | "
            f"{_fmt_ratio(row.lightning_ratio, row.lightning_range)} | {row.note} |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.step_overhead",
        description=(
            "Per-step training time of every client algorithm (and of NVFlare's built-in Lightning SCAFFOLD/FedProx) "
            "divided by plain SGD (our fedavg client) on the same model and batch, measured in real Lightning fits "
            "with the variants interleaved step by step. Prints a markdown table; the target is <= 1.10x plain and "
            "never slower than NVFlare's built-in."
        ),
    )
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODEL_SPECS), default=None, help=f"default: {' '.join(DEFAULT_MODELS)}"
    )
    parser.add_argument(
        "--algorithms",
        nargs="+",
        choices=sorted(CLIENT_ALGORITHMS),
        default=None,
        metavar="NAME",
        help=f"client algorithms to time, from {sorted(CLIENT_ALGORITHMS)} (default: all; {BASELINE} always)",
    )
    parser.add_argument(
        "--snps",
        type=int,
        default=LARGE_SNP_MODEL["n_snps"],
        help=f"SNPs of cnn_transformer_large (default {LARGE_SNP_MODEL['n_snps']:,})",
    )
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="32-true", help="the Trainer's precision (default 32-true)"
    )
    parser.add_argument("--steps", type=int, default=None, help="kept steps per variant and model (default 300)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="fits per model, each with all variants interleaved (default 6)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="steps dropped per variant at the start of every fit (default 5)"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--mu", type=float, default=0.01, help="FedProx mu, ours and NVFlare's (default 0.01)")
    parser.add_argument("--alpha", type=float, default=0.01, help="FedDyn alpha sent as server meta (default 0.01)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: CPUs usable by this process)"
    )
    parser.add_argument(
        "--device", choices=("auto", "cpu", "gpu"), default="auto", help="auto: a CUDA GPU when present, else CPU"
    )
    parser.add_argument("--no-reference", action="store_true", help="leave out the Lightning-default reference row")
    parser.add_argument(
        "--compare-paths",
        action="store_true",
        help="also time the other way each selected algorithm can apply its correction: "
        + "; ".join(f"'{row}'" for row in PATH_VARIANTS)
        + " (FedProx/FedDyn's default rows use the fused plain-SGD step, nobody watching the gradient)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report to this file")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and settings as JSON here")
    parser.add_argument(
        "--quick", action="store_true", help="smoke-test sizes: lenet5 only, 2 fits x 3 kept steps, 1 warm-up step"
    )
    args = parser.parse_args(argv)
    quick = {"models": ["lenet5"], "steps": 6, "rounds": 2, "warmup": 1}
    full = {"models": list(DEFAULT_MODELS), "steps": 300, "rounds": 6, "warmup": 5}
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("steps", "rounds", "batch_size", "snps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.device == "gpu" and not torch.cuda.is_available():
        parser.error("--device gpu: no CUDA GPU is available")
    if args.momentum and any(MODEL_SPECS[key].genotypes for key in args.models):
        parser.error("--momentum: the genotype model's SGD has none; leave it at 0 with cnn_transformer_large")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is None:
        try:
            args.threads = len(os.sched_getaffinity(0))
        except AttributeError:
            args.threads = os.cpu_count() or 1
    torch.set_num_threads(args.threads)
    accelerator = "gpu" if args.device == "gpu" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    settings = Settings(
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        mu=args.mu,
        alpha=args.alpha,
        seed=args.seed,
        accelerator=accelerator,
        precision=args.precision,
        reference=not args.no_reference,
        algorithms=None if args.algorithms is None else tuple(args.algorithms),
        compare_paths=args.compare_paths,
    )

    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    progress(f"client algorithms: {sorted(CLIENT_ALGORITHMS)}; NVFlare built-ins: {list(NVFLARE_BUILTINS)}")
    rows: list[Row] = []
    with _quiet_lightning():
        for key in args.models:
            rows += benchmark_model(with_snps(MODEL_SPECS[key], args.snps), settings, progress)

    command = "python -m benchmarks.step_overhead " + " ".join(sys.argv[1:] if argv is None else argv)
    report = "\n".join(
        [
            "## Step overhead: client algorithms vs plain SGD",
            "",
            f"Command: `{command.strip()}` ({time.perf_counter() - started:.0f} s)",
            "",
            *machine_info(settings),
            "",
            format_table(rows),
            "",
        ]
    )
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"command": command.strip(), "settings": asdict(settings), "rows": [asdict(row) for row in rows]}
        args.json.write_text(json.dumps(record, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
