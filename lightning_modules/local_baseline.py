"""The local-only counterfactual inside a real job (``--local-baseline``): what the site would have had alone.

Every site trains, beside the federation, its own **local-only model**:

- initialised as the federation's initial model (the same class and arguments, seeded with the job's ``--seed``:
  the bits the server's persistor starts from), whatever round the site first takes part in;
- trained with the module's own ``configure_optimizers`` (the same optimizer and settings as the federation's
  local training, fresh every round as theirs is) on the site's training split only, plain local training (no
  client algorithm, no DP-SGD: the model never leaves the site, so it is what the site would train on its own);
- **compute-matched** per round: it takes exactly as many optimizer steps as the site's own training took that
  round (`matched_steps`): the federated fit's optimizer steps (``train.num_steps``, FedRep's head phase
  included), plus the personal steps of Ditto or APFL (``ditto.personal_steps``, ``apfl.personal_steps``: the
  ``steps_key`` of their declared personal model), plus the local fine-tuning's steps. So a site
  running Ditto or FedRep, which do about twice FedAvg's gradient work, gives its local-only model twice the steps
  too. Matched are optimizer steps, i.e. batches of the same batch size: a Ditto personal step costs a second
  backward pass on the same batch, counted as one step;
- kept in the site's private state store (``local_baseline``), never sent: a restarted site (``nvflare simulator
  -t 1``, a crash) continues from the last round it completed; a round trained again (re-delivered) starts from the
  state before it (the state is written pending and committed when the next round starts, whatever the server did
  with the site's federated result: the local model does not depend on it);
- its shuffling seeded from (job seed, site, round) on a stream of its own, so reruns repeat it and the round's
  own draws are untouched.

It is scored each round on the validation split (``eval.local_<metric>``) and the test split
(``eval.local_test_*``) after its training; ``--keep best`` counts it as a candidate (lightning_modules/keep_best.py).
Under DP-SGD its scores are site-evaluation scores: withheld unless the job releases them
(``--dp-release-site-scores``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.model_helpers import is_overridden

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.registry import CLIENT_ALGORITHMS
from lightning_modules.personal_scores import own_random_stream, single_process_trainer
from lightning_modules.state_store import ClientStateStore

STORE_NAME = "local_baseline"
RUN_ID_KEY = "__run_id__"


def local_seed(seed: int, site_index: int, round_num: int) -> int:
    """The seed of a site's local-only training in a round: a stream apart from the round's and fine-tuning's."""
    return int(np.random.SeedSequence([seed, site_index, round_num, 4]).generate_state(1)[0])


#: Where a client algorithm reports its personal training's steps (its ``personal_model.steps_key``: Ditto, APFL).
PERSONAL_STEPS_KEYS = tuple(
    cls.personal_model.steps_key
    for cls in CLIENT_ALGORITHMS.values()
    if cls.personal_model and cls.personal_model.steps_key
)


def matched_steps(meta: Mapping[str, Any], extra_steps: int = 0) -> int:
    """Optimizer steps the site's own training took this round: the federated fit's, the personal steps of an
    algorithm that declares them (Ditto's, APFL's), and ``extra_steps`` (local fine-tuning's)."""
    personal = sum(int(meta.get(key, 0) or 0) for key in PERSONAL_STEPS_KEYS)
    return int(meta.get(meta_keys.NUM_STEPS, 0) or 0) + personal + int(extra_steps)


class LocalBaseline:
    """One site's local-only model (module docstring).

    Args:
        site: the site's name (errors name it).
        store: the site's private state store.
        make_module: builds the federation's initial model (a fresh module, the job's seed).
        fit: ``fit(trainer, module)`` trains ``module`` on the site's training split with ``trainer``.
        precision, accelerator: the job's.
    """

    def __init__(
        self,
        site: str,
        store: ClientStateStore | None,
        make_module: Callable[[], pl.LightningModule],
        fit: Callable[[pl.Trainer, pl.LightningModule], Any],
        precision: Any = "32-true",
        accelerator: str = "auto",
        plain_loader: Callable[[], Iterable[Any]] | None = None,
    ) -> None:
        if store is None:
            raise ValueError(f"{site}: --local-baseline needs the site's state store (the model must outlive a round)")
        self.site, self.store, self.make_module, self.fit = site, store, make_module, fit
        self.precision, self.accelerator = precision, accelerator
        self.plain_loader = plain_loader

    def start(self, round_num: int, run_id: str) -> pl.LightningModule:
        """The local-only model as the site left it before ``round_num`` (the initial model the first time, or when
        the stored one belongs to another run)."""
        self.store.settle(STORE_NAME, round_num, None)  # committed whatever the server did: nothing of it is shared
        module = self.make_module()
        stored = self.store.load(STORE_NAME)
        if stored is not None and stored.state.get(RUN_ID_KEY) == run_id:
            weights = {key: value for key, value in stored.state.items() if key != RUN_ID_KEY}
            module.load_state_dict(weights, strict=True)
        return module

    def train(self, round_num: int, run_id: str, steps: int, seed: int) -> pl.LightningModule:
        """Train the local-only model ``steps`` optimizer steps (round ``round_num``), keep it, return it."""
        module = self.start(round_num, run_id)
        if steps > 0:
            with own_random_stream(seed):
                if self.plain_loader is not None and plain_training_fits(module, self.precision, self.accelerator):
                    plain_fit(module, self.plain_loader(), steps)
                else:
                    # No validation loop after each epoch: the site scores the model once per round, and the
                    # loop's draws from the generator would make this path differ from plain_fit's (tested).
                    trainer = single_process_trainer(
                        self.precision, self.accelerator, epochs=-1, steps=steps, validate=False
                    )
                    self.fit(trainer, module)
        state: dict[str, Any] = {key: value.detach().cpu() for key, value in module.state_dict().items()}
        state[RUN_ID_KEY] = run_id
        self.store.save(STORE_NAME, state, round_num=round_num, pending=True)
        return module


def plain_training_fits(module: pl.LightningModule, precision: Any, accelerator: str) -> bool:
    """Whether the local-only model may train in `plain_fit`: a module that declares its ``training_step`` and
    ``configure_optimizers`` need nothing of a Trainer (``fl_plain_training = True``: the built-in classifier, the
    genomics example's model; a user's module may declare it too), fp32, on the CPU."""
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return bool(getattr(module, "fl_plain_training", False)) and str(precision) in ("32-true", "32") and on_cpu


def plain_fit(module: pl.LightningModule, loader: Iterable[Any], steps: int) -> int:
    """``steps`` optimizer steps of ``module``'s own ``training_step`` and ``configure_optimizers`` over ``loader``
    (epoch after epoch), without a Trainer: what ``Trainer(max_steps=steps, max_epochs=-1).fit`` does for such a
    module (the same weights, tested), without its per-fit set-up, which cost more than the training on small
    sites. ``self.log`` calls without a Trainer are skipped by Lightning."""
    optimizer = module.configure_optimizers()
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"plain_fit needs configure_optimizers to return one optimizer, got {type(optimizer).__name__}")
    module.train()
    taken = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*self.log.*")
        while taken < steps:
            for index, batch in enumerate(loader):
                loss = module.training_step(batch, index)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                taken += 1
                if taken == steps:
                    break
            if taken == 0:  # an empty loader would loop forever
                break
    return taken


#: Lightning's batch hooks, called on every training batch between the loader and ``training_step``.
BATCH_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


class DataModuleBatches:
    """A user data module's training batches as ``Trainer.fit(module, datamodule=data)`` hands them to
    ``training_step`` on the CPU: ``data.train_dataloader()`` read once, iterated again every epoch, each batch
    through `batch_transform` (the data module's ``on_before_batch_transfer`` and ``on_after_batch_transfer`` where
    it overrides them; `datamodule_batches` refuses modules that override any)."""

    def __init__(self, data: pl.LightningDataModule) -> None:
        self.data = data
        self.loader: Iterable[Any] | None = None

    def __iter__(self):
        if self.loader is None:
            self.loader = self.data.train_dataloader()
        transform = batch_transform(self.data)
        for batch in self.loader:
            yield batch if transform is None else transform(batch)


def batch_transform(
    data: pl.LightningDataModule, module: pl.LightningModule | None = None
) -> Callable[[Any], Any] | None:
    """What Lightning does to a batch between the loader and a ``*_step`` on the CPU: ``on_before_batch_transfer``
    then ``on_after_batch_transfer``, each the data module's where it overrides the hook, else the module's where it
    does (Lightning's rule, its data-hook selector), or ``None`` where neither overrides either."""
    hooks = []
    for name in ("on_before_batch_transfer", "on_after_batch_transfer"):
        if is_overridden(name, data, pl.LightningDataModule):
            hooks.append(getattr(data, name))
        elif module is not None and is_overridden(name, module, pl.LightningModule):
            hooks.append(getattr(module, name))
    if not hooks:
        return None

    def transform(batch: Any) -> Any:
        for hook in hooks:
            batch = hook(batch, 0)
        return batch

    return transform


def datamodule_batches(
    data: pl.LightningDataModule, module_class: type[pl.LightningModule]
) -> Callable[[], Iterable[Any]] | None:
    """What `LocalBaseline` trains on without a Trainer for a user's data module (`DataModuleBatches`, fresh every
    round as a fit reads it), or ``None`` (a Trainer, as before) when a batch hook could differ from Lightning's:
    the module overrides one of `BATCH_HOOKS`, or the data module overrides ``transfer_batch_to_device``."""
    if any(is_overridden(name, module_class, pl.LightningModule) for name in BATCH_HOOKS):
        return None
    if is_overridden("transfer_batch_to_device", data, pl.LightningDataModule):
        return None
    return lambda: DataModuleBatches(data)


def taken_steps(trainer: pl.Trainer) -> int:
    """Optimizer steps a finished fit took (one optimizer: Lightning's global step)."""
    return int(trainer.global_step)


__all__ = [
    "DataModuleBatches",
    "LocalBaseline",
    "batch_transform",
    "datamodule_batches",
    "local_seed",
    "matched_steps",
    "plain_fit",
    "plain_training_fits",
    "taken_steps",
]
