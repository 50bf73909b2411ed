"""DP-SGD inside a Lightning fit, driven by the client-algorithm callback (``FederatedAlgorithm(privacy=...)``).

Opacus has no supported Lightning integration, so the wiring is ours; the DP math is Opacus's:

- **per-sample gradients**: Opacus's ``GradSampleModule`` hooks on the LightningModule's own layers (the module
  Lightning trains is not replaced; the hooks fill ``p.grad_sample`` during Lightning's backward);
- **Poisson sampling**: the site's training loader is Opacus's ``DPDataLoader`` (the built-in site and the user
  model's site build it with `poisson_loader`; the callback refuses a round whose loader is not one, or whose
  sampler does not draw from a secret generator);
- **clip and noise**: Opacus's ``DPOptimizer`` steps (clip every per-sample gradient to C over all trainable
  parameters together, add N(0, sigma^2 C^2) drawn from a secret generator, divide by the expected batch size
  floor(n q), as Opacus's ``make_private`` sets it) run in Lightning's
  ``on_before_optimizer_step``, **before** the client algorithm's correction (SCAFFOLD's c - c_i, FedProx's and
  FedDyn's terms are post-processing of the noisy gradient) and before the module's own optimizer steps, whatever
  optimizer the module configured (SGD, AdamW: post-processing too);
- **accounting**: Opacus's accountant would restart at zero with every new process (``nvflare simulator -t 1``
  starts one per client round), so the site keeps its own ledger of (q, sigma, steps) in its state store
  (`lightning_modules.privacy.ledger`) and epsilon is computed from the whole ledger every round.

Every random draw of the mechanism (the Poisson sample, the noise) comes from a generator seeded from the operating
system's entropy, never from the job's seed (`lightning_modules.privacy.secret` says why). What the site may
not use under DP is refused at build time (`dp_problem`) and again when the fit starts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import ClientAlgorithm
from lightning_modules.algorithms.capabilities import declared_dp_sgd
from lightning_modules.algorithms.errors import ClientAlgorithmError
from lightning_modules.algorithms.registry import CLIENT_ALGORITHMS
from lightning_modules.privacy.accountant import AccountantUnavailable, noise_for_budget
from lightning_modules.privacy.config import PRIVACY_EXTRA, PrivacyConfig
from lightning_modules.privacy.ledger import Ledger, privacy_meta, read_ledger, segments_text, write_ledger
from lightning_modules.privacy.release import SITE_SCORES, release, unaccounted_keys
from lightning_modules.privacy.secret import SECURE_NOISE, is_secret, secret_generator
from lightning_modules.privacy.site_scores import log_line, withheld_scores, write_site_scores
from lightning_modules.state_store import ClientStateStore, is_writer

#: Client algorithms whose extra terms are post-processing of the DP-SGD output or inside the per-sample loss
#: (docs/privacy.md, "Composition"), and why the others cannot be accounted (yet): derived from each algorithm's own
#: ``dp_sgd`` declaration (lightning_modules/algorithms/capabilities.py).
COMPOSES = {name: declared_dp_sgd(cls).why for name, cls in CLIENT_ALGORITHMS.items() if declared_dp_sgd(cls).composes}
REFUSED = {name: declared_dp_sgd(cls).why for name, cls in CLIENT_ALGORITHMS.items() if name not in COMPOSES}
PRECISIONS = ("32-true", "32", "bf16-mixed")


class PrivacyBudgetExhausted(ClientAlgorithmError):
    """The site's next round would take its epsilon past the job's ``dp_target_epsilon``: the site stops."""


def algorithm_problem(algorithm: ClientAlgorithm) -> str | None:
    """Why ``algorithm``'s outputs cannot be accounted under sample-level DP-SGD, or ``None``: its class's ``dp_sgd``,
    or a refusal of one of its settings (`ClientAlgorithm.dp_sgd_problem`)."""
    problem = algorithm.dp_sgd_problem()
    if problem is None:
        return None
    if declared_dp_sgd(type(algorithm)).composes:  # the class composes; one of its settings does not
        return f"client '{algorithm.name}' {problem}"
    return f"client '{algorithm.name}' cannot run under DP-SGD: {problem}; use one of {sorted(COMPOSES)}"


def _owner_problem(module: nn.Module, is_root: bool) -> str | None:
    """Opacus computes per-sample gradients of a module it has no rule for with functorch, over that module's whole
    forward; dropout inside it fails ("vmap: called random operation"), and a LightningModule's own forward may not
    run in ``training_step`` at all."""
    from opacus.grad_sample import GradSampleModule

    own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
    if not own or type(module) in GradSampleModule.GRAD_SAMPLERS:
        return None
    where = f"parameters {own} of {{where}} ({type(module).__name__})"
    if is_root:
        return f"{where}: move them into a small nn.Module (one that holds only them) so that Opacus can hook it"
    if any(isinstance(child, nn.Dropout) for child in module.modules()):
        return (
            f"{where}: Opacus would differentiate that module's whole forward per sample, which has dropout; keep "
            "the parameters in a leaf nn.Module that holds only them"
        )
    return None


def model_problem(module: nn.Module) -> str | None:
    """Why Opacus cannot give per-sample gradients of ``module``, with what to change, or ``None``. Every problem
    found is named, once per kind with the modules that have it, so that one build tells all there is to change."""
    try:
        from opacus.validators import ModuleValidator
    except ImportError:
        return f"DP-SGD needs Opacus, which is not installed: pip install '{PRIVACY_EXTRA}'"
    problems: dict[str, list[str]] = {}  # each kind of problem, with the modules that have it
    for name, child in module.named_modules():
        problem = _module_problem(child, child is module)
        if problem:
            problems.setdefault(problem, []).append(name or "the module itself")
    if not problems:
        errors = ModuleValidator.validate(module, strict=False)
        return f"Opacus refuses the model: {str(errors[0]).split('. ')[0]}" if errors else None
    return "; ".join(problem.format(where=_where(names)) for problem, names in problems.items())


def _where(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown if len(names) <= 3 else f"{shown} and {len(names) - 3} more"


#: The class attribute a module declares its constant buffers with (names local to the module): buffers computed
#: from public values only (positional tables, fixed masks), never updated from the data.
DATA_INDEPENDENT_BUFFERS = "data_independent_buffers"


def undeclared_buffers(module: nn.Module) -> list[str]:
    """``module``'s own buffers (float or integer, persistent or not) that its class does not declare
    data-independent (`DATA_INDEPENDENT_BUFFERS`)."""
    declared = set(getattr(type(module), DATA_INDEPENDENT_BUFFERS, ()))
    return [name for name, buffer in module.named_buffers(recurse=False) if buffer is not None and name not in declared]


def _buffer_problem(child: nn.Module) -> str | None:
    """A buffer updated from the data (running statistics, a running-mean standardiser, a sample counter) leaves the
    site in the state_dict with no noise (the mean of the site's inputs, the size of its secret Poisson sample), and,
    read in the forward, makes one sample's gradient depend on the samples of earlier steps, which per-sample
    clipping does not bound. Nothing tells a constant buffer from such a statistic, so each must be declared."""
    names = undeclared_buffers(child)
    if not names:
        return None
    fix = (
        "construct it with track_running_stats=False"
        if isinstance(child, nn.modules.instancenorm._InstanceNorm)
        else f"if a buffer never depends on the data, declare it on the class: {DATA_INDEPENDENT_BUFFERS} = "
        f"{tuple(names)!r}; else compute it from public values or remove it"
    )
    return (
        f"buffers {names} of {{where}} ({type(child).__name__}) are released with no noise and may depend on the "
        f"data under DP-SGD: {fix}"
    )


def _module_problem(child: nn.Module, is_root: bool) -> str | None:
    """The kind of problem ``child`` has, as a message with ``{where}`` for the modules that have it."""
    if isinstance(child, nn.modules.batchnorm._BatchNorm):
        return f"{type(child).__name__} mixes the samples of a batch ({{where}}): use GroupNorm or LayerNorm"
    if isinstance(child, nn.MultiheadAttention):
        return (
            "nn.MultiheadAttention has no per-sample gradient in Opacus ({where}): build the attention from "
            "nn.Linear layers (or opacus.layers.DPMultiheadAttention)"
        )
    return _buffer_problem(child) or _owner_problem(child, is_root)


def dp_problem(algorithm: ClientAlgorithm, module: nn.Module | None, precision: str, devices: int) -> str | None:
    """Everything the builder can check before a DP job is written (the site checks it again)."""
    if precision not in PRECISIONS:
        return f"precision '{precision}' under DP-SGD: use one of {list(PRECISIONS)}"
    if devices > 1:
        return (
            f"devices {devices}: DP-SGD under DDP is not implemented (each rank would clip and noise its own share "
            "and the accountant would count them apart); use devices 1"
        )
    problem = algorithm_problem(algorithm)
    if problem is None and module is not None:
        problem = model_problem(module)
    return problem


def poisson_loader(loader: torch.utils.data.DataLoader) -> Any:
    """Opacus's Poisson-sampling loader over ``loader``'s dataset: every record joins each batch independently with
    probability q = 1 / len(loader), for len(loader) batches an epoch, drawn from a secret generator
    (`lightning_modules.privacy.secret`): never from ``loader``'s own generator or torch's global one, which
    the job's seed determines."""
    from opacus.data_loader import DPDataLoader

    return DPDataLoader.from_data_loader(loader, generator=secret_generator())


def poisson_data_module(datamodule: pl.LightningDataModule) -> pl.LightningDataModule:
    """``datamodule`` with its training loader under `poisson_loader` (validation and test unchanged).
    Opacus's own ``DPLightningDataModule`` is not used: it ignores the generator it is given and samples from the
    user's loader's generator or torch's global one, both of which the job's seed determines."""
    from opacus.lightning import DPLightningDataModule

    class PoissonDataModule(DPLightningDataModule):
        def train_dataloader(self) -> Any:
            return poisson_loader(self.datamodule.train_dataloader())

    return PoissonDataModule(datamodule)


def planned_epochs(training: Any) -> int:
    """Local epochs a round may take at most: ``epochs``, or ``max_local_epochs`` for the uniform_random pattern."""
    if getattr(training, "pattern", "constant") == "constant":
        return int(getattr(training, "epochs", 1))
    return int(training.max_local_epochs)


def _poisson_sampler(trainer: pl.Trainer) -> Any:
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    loader = trainer.train_dataloader
    sampler = getattr(loader, "batch_sampler", None)
    return sampler if isinstance(sampler, UniformWithReplacementSampler) else None


def _sampler_problem(sampler: Any) -> str | None:
    """Why the round's training loader cannot be DP-SGD's, or ``None``."""
    if sampler is None:
        return (
            "DP-SGD needs Poisson sampling: train on lightning_modules.privacy.dp_sgd.poisson_loader(your_loader) "
            "(Opacus's DPDataLoader)"
        )
    if not is_secret(sampler.generator):
        source = "torch's global generator" if sampler.generator is None else "a generator it was given"
        return (
            f"the Poisson sampler draws from {source}, which the job's seed can reproduce: anyone who knows the job "
            "could replay the sample; build the loader with lightning_modules.privacy.dp_sgd.poisson_loader("
            "your_loader), which draws from a secret generator"
        )
    return None


class DPSGD:
    """One site's DP-SGD: started at every round's start, run before every optimizer step, closed at round end."""

    def __init__(
        self, config: PrivacyConfig, site: str, state_store: ClientStateStore | None, planned_epochs: int = 1
    ) -> None:
        self.config = config
        self.site = site
        self.state_store = state_store
        self.planned_epochs = planned_epochs
        self._ledger: Ledger | None = None
        self._optimizer: Any = None
        self._hooks: Any = None
        self._rate = math.nan
        self._sigma = math.nan
        self._steps = 0
        self._steps_per_epoch = 0

    # -- set-up -------------------------------------------------------------------------------------------------
    def check_setup(self, trainer: pl.Trainer, module: nn.Module, algorithm: ClientAlgorithm) -> None:
        problem = dp_problem(algorithm, module, str(trainer.precision), trainer.world_size)
        if problem is None and trainer.accumulate_grad_batches != 1:
            problem = "gradient accumulation under DP-SGD is not accounted here: use accumulate_grad_batches=1"
        if problem:
            raise ClientAlgorithmError(f"{self.site}: {problem}")

    def start_round(self, trainer: pl.Trainer, module: nn.Module, meta: Mapping[str, Any]) -> None:
        """Read the ledger, fix sigma, refuse a round that would exceed the budget, hook the module."""
        from opacus.grad_sample import GradSampleModule
        from opacus.optimizers import DPOptimizer

        sampler = _poisson_sampler(trainer)
        problem = _sampler_problem(sampler)
        if problem:
            raise ClientAlgorithmError(f"{self.site}: {problem}")
        ledger = read_ledger(self.state_store, self.site, meta, self.config.delta)
        self._rate, round_steps = float(sampler.sample_rate), len(sampler) * int(trainer.max_epochs or 1)
        self._sigma = self._noise_multiplier(meta, len(sampler))
        self._check_budget(ledger, round_steps)
        self._ledger, self._steps, self._steps_per_epoch = ledger, 0, len(sampler)
        self._hooks = GradSampleModule(module, batch_first=True, loss_reduction="mean")
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._optimizer = DPOptimizer(
            trainer.optimizers[0],
            noise_multiplier=self._sigma,
            max_grad_norm=self.config.max_grad_norm,
            expected_batch_size=int(sampler.num_samples * self._rate),  # as Opacus's make_private sets it
            generator=secret_generator(device),  # not torch's global generator: the job's seed sets that one
            secure_mode=SECURE_NOISE,
        )

    def _noise_multiplier(self, meta: Mapping[str, Any], steps_per_epoch: int) -> float:
        """sigma as set, or calibrated once for the whole plan: every round, the most epochs, this site's q."""
        if self.config.noise_multiplier is not None:
            return float(self.config.noise_multiplier)
        rounds = int(meta.get(meta_keys.NUM_ROUNDS) or 1)
        planned = rounds * self.planned_epochs * steps_per_epoch
        try:
            return noise_for_budget(self.config.target_epsilon, self.config.delta, self._rate, planned)
        except (ValueError, AccountantUnavailable) as exc:
            raise ClientAlgorithmError(f"{self.site}: dp_target_epsilon: {exc}") from None

    def _check_budget(self, ledger: Ledger, round_steps: int) -> None:
        target = self.config.target_epsilon
        if target is None:
            return
        after = ledger.spend(self._rate, self._sigma, round_steps)
        if after.epsilon() > target * (1 + 1e-9):
            raise PrivacyBudgetExhausted(
                f"{self.site}: privacy budget: this round's {round_steps} DP-SGD steps would take epsilon from "
                f"{ledger.epsilon():.4g} to {after.epsilon():.4g} > dp_target_epsilon {target:g} (delta "
                f"{self.config.delta:g}; spent: {segments_text(ledger.segments) or 'nothing'}); this site stops "
                "training"
            )

    # -- per step -----------------------------------------------------------------------------------------------
    def privatize(self) -> None:
        """Replace every trainable parameter's ``.grad`` by the clipped, noised mean of the per-sample gradients."""
        if self._optimizer is None:
            return
        self._optimizer.pre_step()
        for p in self._optimizer.params:  # the next backward starts afresh (Lightning zeroes .grad only)
            p.grad_sample = None
            p.summed_grad = None
        self._steps += 1

    # -- round end ----------------------------------------------------------------------------------------------
    def end_round(self, meta: Mapping[str, Any], round_num: Any) -> dict[str, Any]:
        """Write the ledger (before the result leaves the site), then the meta a DP site sends: the protected and
        public items, ``privacy.*``, and the names of what was withheld."""
        self.close()
        if self._ledger is None:
            raise ClientAlgorithmError(f"{self.site}: the DP-SGD round ended without starting")
        ledger = self._ledger.spend(self._rate, self._sigma, self._steps)
        write_ledger(self.state_store, ledger, int(round_num or 0))
        self._ledger = None
        kept, withheld = release(meta, [SITE_SCORES] if self.config.release_site_scores else [])
        self.keep_site_scores(meta, withheld, int(round_num or 0))
        unaccounted = unaccounted_keys(kept)
        kept.update(privacy_meta(ledger, self.config.max_grad_norm))
        kept.update(self.budget_meta(ledger))
        kept[meta_keys.PRIVACY_WITHHELD] = withheld
        if unaccounted:
            kept[meta_keys.PRIVACY_UNACCOUNTED] = unaccounted
        return kept

    def keep_site_scores(self, meta: Mapping[str, Any], withheld: list[str], round_num: int) -> None:
        """The withheld ``eval.*`` scores stay at the site: one line in its log and one record in its own file
        (lightning_modules/privacy/site_scores.py), never in the result."""
        scores = withheld_scores(meta, withheld)
        if not scores or not is_writer():  # DDP: rank 0 alone writes and logs
            return
        store = self.state_store
        run_id = store.root.name if store is not None and store.per_run and store.root != store.base_root else ""
        path = write_site_scores(store, round_num, run_id, scores)
        print(log_line(self.site, round_num, scores, path), flush=True)

    def budget_meta(self, ledger: Ledger) -> dict[str, float]:
        """The budget and the epsilon the next round (the most epochs it may take) would reach, so that the server
        sends no round this site cannot afford (controllers/budget.py); nothing without a budget."""
        if self.config.target_epsilon is None:
            return {}
        after = ledger.spend(self._rate, self._sigma, self.planned_epochs * self._steps_per_epoch)
        return {
            meta_keys.PRIVACY_TARGET_EPSILON: float(self.config.target_epsilon),
            meta_keys.PRIVACY_NEXT_EPSILON: after.epsilon(),
        }

    def close(self) -> None:
        """Remove Opacus's hooks and attributes from the module (the next round, or a validation, runs without)."""
        if self._hooks is not None:
            self._hooks.cleanup()
            self._hooks = None
        self._optimizer = None
