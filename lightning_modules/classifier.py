"""The one LightningModule of the bundle: an image/vector classifier that drives a client algorithm.

Hook placement (docs/design.md, decision 2 and the NVFlare facts there):

- ``training_step`` adds the algorithm's extra loss terms (MOON, FedProx-as-a-loss);
- ``optimizer_step`` wraps Lightning's closure: the closure runs ``training_step`` + backward, so gradients
  exist only after it returns. ``correct_gradients`` runs there, before Lightning's own
  ``on_before_optimizer_step`` and gradient clipping, and before the optimizer moves the weights;
  ``after_step`` runs once the step is taken. fp16 GradScaler precisions are refused, so the gradients seen in the
  closure are never loss-scaled.
- ``start_round`` / ``end_round`` are called by :class:`lightning_modules.fl_callback.FederatedRoundCallback`
  once the global weights are loaded and before NVFlare sends the result.

The network sits under the attribute ``net``; the server builds the same class from its import path, so the
state_dict keys (``net.conv1.weight``, ...) agree on both sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from aggregators import meta_keys
from aggregators.fednova import normalizer_l1
from aggregators.wire import FedNovaReport
from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError, check_server_meta
from lightning_modules.models import build_model


class FLClassifier(pl.LightningModule):
    """Classifier with SGD whose local training is shaped by a pluggable :class:`ClientAlgorithm`.

    Args:
        arch: model name from :data:`lightning_modules.models.MODELS` (``lenet5``, ``simple_cnn``, ``mlp``).
        num_classes: number of output classes.
        arch_args: extra keyword arguments for the model constructor.
        lr, momentum, weight_decay: local SGD settings. FedAvg semantics: a fresh optimizer every round.
        init_seed: seeds the initial weights (``None``: torch's global generator, as usual).
    """

    def __init__(
        self,
        arch: str = "lenet5",
        num_classes: int = 10,
        arch_args: Mapping[str, Any] | None = None,
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        init_seed: int | None = None,
    ) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            # A seeded initial model makes the whole federated run reproducible (the server builds it).
            if init_seed is not None:
                torch.manual_seed(init_seed)
            self.net = build_model(arch, num_classes=num_classes, **dict(arch_args or {}))
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.train_loss = MeanMetric()
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        # A plain object, not a submodule: the algorithm's tensors must never enter the state_dict.
        self.algorithm: ClientAlgorithm = ClientAlgorithm()
        self.round_steps = 0
        # (lr, momentum, dampening) of every optimizer step this round, None for a step FedNova cannot describe.
        self.solver_steps: list[tuple[float, float, float] | None] = []

    def set_algorithm(self, algorithm: ClientAlgorithm) -> None:
        if isinstance(algorithm, torch.nn.Module):
            raise ClientAlgorithmError("a client algorithm must not be an nn.Module: it would enter the state_dict")
        self.algorithm = algorithm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.net.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )

    def setup(self, stage: str) -> None:
        # Before Lightning casts the module for the precision plugin: a refused bf16-true fit must leave the
        # fp32 weights untouched.
        if stage == "fit":
            check_trainer_supports(self.algorithm, self.trainer, self.automatic_optimization, check_optimizers=False)

    def on_fit_start(self) -> None:
        # Optimizers exist only now.
        check_trainer_supports(self.algorithm, self.trainer, self.automatic_optimization)

    def task_loss(
        self, batch: tuple[torch.Tensor, torch.Tensor], params: Mapping[str, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy of a batch and the logits (algorithms that need extra gradient passes call this).

        ``params`` (keyed like this module's ``state_dict``, e.g. ``net.fc1.weight``) evaluates the loss at other
        weights without touching the module's own (FedMoS: the previous iterate on the current batch).
        """
        x, y = batch
        logits = self.net(x) if params is None else torch.func.functional_call(self, dict(params), (x,))
        return F.cross_entropy(logits, y), logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        _, y = batch
        loss, logits = self.task_loss(batch)
        self.train_loss.update(loss.detach())
        self.train_acc.update(logits.detach(), y)
        self.log("train_loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        extra = self.algorithm.loss_terms(self, batch, logits)
        return loss if extra is None else loss + extra

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        raw_optimizer = getattr(optimizer, "optimizer", optimizer)

        def closure_then_correct() -> Any:
            loss = optimizer_closure()
            self.algorithm.correct_gradients(self, raw_optimizer)
            return loss

        optimizer.step(closure=closure_then_correct)
        self.round_steps += 1
        self.solver_steps.append(sgd_step_settings(raw_optimizer))
        self.algorithm.after_step(self, raw_optimizer)

    def start_round(self, meta: Mapping[str, Any], site: str = "local") -> None:
        """Begin a federated round: the global weights are already loaded into ``self``."""
        check_server_meta(self.algorithm, meta, site)
        self.round_steps = 0
        self.solver_steps = []
        self.train_loss.reset()
        self.train_acc.reset()
        self.algorithm.on_round_start(self, meta)

    def end_round(self) -> dict[str, Any]:
        """Meta describing this round's local training, merged with the algorithm's own meta."""
        meta: dict[str, Any] = {
            meta_keys.NUM_STEPS: self.round_steps,
            meta_keys.TRAIN_LOSS: float(self.train_loss.compute()) if self.round_steps else float("nan"),
            meta_keys.TRAIN_ACCURACY: float(self.train_acc.compute()) if self.round_steps else float("nan"),
            meta_keys.CLIENT_ALGORITHM: self.algorithm.name,
            meta_keys.PARAM_KEYS: [name for name, p in self.named_parameters() if p.requires_grad],
            **fednova_meta(self.algorithm, self.solver_steps),
        }
        algorithm_meta = self.algorithm.on_round_end(self)
        bad_keys = [k for k in algorithm_meta if not meta_keys.is_namespaced(k) or k in meta_keys.NVFLARE_RESERVED]
        if bad_keys:
            raise ClientAlgorithmError(
                f"client algorithm '{self.algorithm.name}' returned meta keys {bad_keys} that are not namespaced "
                "'<algorithm>.<name>' keys or are reserved by NVFlare's built-in handlers"
            )
        meta.update(algorithm_meta)
        return meta


def sgd_step_settings(optimizer: Any) -> tuple[float, float, float] | None:
    """(lr, momentum, dampening) of a plain or heavy-ball ``torch.optim.SGD`` step with one lr for every group;
    ``None`` for anything FedNova's normaliser does not model (other optimizers, Nesterov, maximize, unequal lrs)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return None
    groups = optimizer.param_groups
    settings = {(float(g["lr"]), float(g["momentum"]), float(g["dampening"])) for g in groups}
    if len(settings) != 1 or any(g.get("nesterov") or g.get("maximize") for g in groups):
        return None
    return settings.pop()


def fednova_meta(algorithm: ClientAlgorithm, steps: list[tuple[float, float, float] | None]) -> dict[str, Any]:
    """``fednova.tau`` and ``fednova.a_norm`` (docs/server_rules.md, FedNova) when this round's local update is eta * G
    a.

    Empty when it is not (a ``drift`` algorithm, an optimizer the normaliser does not model, momentum settings that
    changed within the round, no positive first lr): a FedNova server then rejects the result by name.
    """
    if algorithm.local_update == "drift" or not steps or any(step is None for step in steps):
        return {}
    if len({step[1:] for step in steps}) != 1 or steps[0][0] <= 0:
        return {}
    momentum, dampening = steps[0][1], steps[0][2]
    mu = algorithm.proximal_coefficient() if algorithm.local_update == "proximal" else 0.0
    a_norm = normalizer_l1([step[0] for step in steps], momentum=momentum, dampening=dampening, mu=mu)
    return FedNovaReport(len(steps), a_norm).to_meta()


def check_trainer_supports(
    algorithm: ClientAlgorithm, trainer: pl.Trainer, automatic_optimization: bool, check_optimizers: bool = True
) -> None:
    """Refuse set-ups under which client algorithms silently go wrong, with a message that says how to fix it."""
    who = f"{algorithm.site}: client algorithm '{algorithm.name}'"
    precision = str(trainer.precision)
    if precision not in algorithm.supported_precisions:
        raise ClientAlgorithmError(
            f"{who} does not support precision '{precision}'; use one of {list(algorithm.supported_precisions)} "
            "(fp16 GradScaler skips optimizer steps; bf16-true keeps no fp32 master weights)"
        )
    if not automatic_optimization:
        raise ClientAlgorithmError(
            f"{who} needs Lightning's automatic optimization; manual optimization bypasses optimizer_step, "
            "so corrections would never be applied"
        )
    if check_optimizers and len(trainer.optimizers) != 1:
        raise ClientAlgorithmError(f"{who} needs exactly one optimizer, got {len(trainer.optimizers)}")
