"""FedMoS, client side: STORM-type momentum with a proximal pull towards the round's global model.

Reference: Wang, Xu, Hu, Xu, Shen, Xu, "FedMoS: Taming Client Drift in Federated Learning with Double Momentum and
Adaptive Selection", IEEE INFOCOM 2023 (docs/fedmos_moon.md, FedMoS; the paper text itself was not available, the
equations
are those of the authors' code and of the STORM estimator the method is named after). Per local step t:

    d_t     = g(w_t; xi_t) + (1 - a) * (d_{t-1} - g(w_{t-1}; xi_t)),     d_1 = g(w_1; xi_1)       (STORM)
    w_{t+1} = (1 - mu) * w_t - eta * d_t + mu * x                                              (proximal pull)

g(w; xi) is the gradient of the task loss on batch xi; g(w_{t-1}; xi_t) is the *previous iterate's* gradient on the
*current* batch (a second forward/backward per step, at a float32 copy of w_{t-1}, by
`lightning_modules.algorithms.task_gradient.task_gradient` through the module's ``task_loss(batch, params=...)``;
nothing is registered on the module). The batch is the one the callback hands to `FedMoS.on_batch` before the
step's ``training_step``, so the module's ``training_step`` need not call ``algorithm_loss`` (FedMoS adds no loss
term). A "previous step's own gradient" instead would make d_t - g_t = (1 - a)(d_{t-1} - g_{t-1}) = 0, i.e. plain SGD
(tested). x is the global model received this round,
a float32 snapshot; eta is the learning rate the optimizer applies in that step (read from its param group).

How the update is applied inside Lightning's automatic optimization: after backward, ``correct_gradients`` replaces
``.grad`` by d_t + (mu / eta) * (w_t - x); the optimizer's plain SGD step w <- w - eta * grad is then exactly the
update above. So the optimizer must be plain SGD: momentum, Nesterov, weight decay or ``maximize`` would change the
update (FedMoS carries its own momentum d) and are refused, as are gradient clipping (it would clip d_t plus the
pull) and gradient accumulation (the current batch would be only the last micro-batch).

``estimator="authors"`` reproduces the authors' released optimizer instead (the quirk of docs/fedmos_moon.md, FedMoS):
the
stored "previous gradient" is 0 in step 2 and the previous step's own gradient afterwards, which makes
d_t = g_t + (1 - a)^{t-1} * g_1 (only the first gradient is remembered) and needs no second pass. Not the default.

State: d, the previous iterate and x are float32 copies of the trainable parameters (buffers are never touched), and
all of it is per round: a new round starts from d_1 = g_1 again (the authors recreate the optimizer every round).
Nothing persists across rounds, so no state file is written. The second pass follows the policy of
`lightning_modules.algorithms.task_gradient`: BatchNorm statistics are updated by the first pass only (the
second runs on copies of the buffers), dropout is off in it (the bundled models have no dropout), and it runs in the
trainer's precision context like the first.

Hyperparameters: ``a`` in (0, 1] ("1 - momentum": a = 1 is SGD with the proximal pull, a -> 0 remembers more),
``mu`` in [0, 1) (the share of the way back to x taken every step). Defaults a = 0.1, mu = 0.001: the authors'
``run.sh`` (their option defaults are a = 0.2, mu = 1e-4). The learning rate eta is the job's ``lr``. The server
side (server momentum, client selection) is `aggregators.fedmos`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError, trainable_parameters
from lightning_modules.algorithms.capabilities import DPSGD, Released
from lightning_modules.algorithms.hparams import HParams, hparam
from lightning_modules.algorithms.task_gradient import task_gradient

DEFAULT_A = 0.1
DEFAULT_MU = 0.001
Estimator = Literal["storm", "authors"]
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class FedMoSHParams(HParams):
    """FedMoS's hyperparameters: the STORM weight ``a``, the proximal share ``mu`` and the ``estimator``."""

    name: ClassVar[str] = "fedmos"

    a: float = hparam(DEFAULT_A, low=0, high=1, low_open=True, note="a = 1 - momentum; 1 = SGD")
    mu: float = hparam(
        DEFAULT_MU, low=0, high=1, high_open=True, note="the share of the way back to the global model taken every step"
    )
    estimator: Estimator = "storm"


def storm_update_(d: list[torch.Tensor], grad: list[torch.Tensor], grad_prev: list[torch.Tensor], a: float) -> None:
    """In place: d <- grad + (1 - a) * (d - grad_prev), per tensor (the STORM recursion)."""
    torch._foreach_sub_(d, grad_prev)
    torch._foreach_mul_(d, 1.0 - a)
    torch._foreach_add_(d, grad)


def check_plain_sgd(optimizer: torch.optim.Optimizer, site: str) -> None:
    """FedMoS's update is applied as one plain SGD step; anything else would silently change it."""
    if not isinstance(optimizer, torch.optim.SGD):
        raise ClientAlgorithmError(f"{site}: fedmos needs torch.optim.SGD, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        extras = {k: group.get(k) for k in ("momentum", "weight_decay", "nesterov", "maximize") if group.get(k)}
        if extras:
            raise ClientAlgorithmError(
                f"{site}: fedmos applies w <- (1 - mu) w - lr d + mu x as a plain SGD step and carries its own "
                f"momentum d, so the optimizer must have momentum=0 and weight_decay=0; got {extras}"
            )
        if float(group["lr"]) <= 0:
            raise ClientAlgorithmError(f"{site}: fedmos needs a positive learning rate, got {group['lr']}")


def check_trainer(module: nn.Module, site: str) -> None:
    """Refuse Lightning settings under which the step is no longer w <- w - lr * (d + (mu/lr)(w - x))."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        return
    if getattr(trainer, "accumulate_grad_batches", 1) != 1:
        raise ClientAlgorithmError(
            f"{site}: fedmos needs accumulate_grad_batches=1 (the previous iterate's gradient is taken on the "
            f"current batch), got {trainer.accumulate_grad_batches}"
        )
    if getattr(trainer, "gradient_clip_val", None):
        raise ClientAlgorithmError(
            f"{site}: fedmos does not support gradient clipping (it would clip the momentum plus the proximal pull); "
            f"got gradient_clip_val={trainer.gradient_clip_val}"
        )


class FedMoS(ClientAlgorithm):
    """FedMoS client: STORM momentum d and the proximal pull, applied through ``.grad`` before a plain SGD step."""

    name: ClassVar[str] = "fedmos"
    needs_task_loss: ClassVar[bool] = True  # the STORM estimator: the loss at the previous iterate
    needs_plain_sgd: ClassVar[bool] = True  # the proximal pull is exact only through one plain SGD step
    sent_meta: ClassVar[tuple[str, ...]] = (meta_keys.FEDMOS_A, meta_keys.FEDMOS_MU)
    local_update: ClassVar[str] = "drift"  # not a local gradient: FedNova cannot normalise it
    hparams_class: ClassVar[type[HParams]] = FedMoSHParams
    secure_sum: ClassVar[str | None] = "needs the bundle's FedMoS server (momentum, selection by data share)"
    dp_sgd: ClassVar[DPSGD] = DPSGD(
        False, "FedMoS takes a second gradient of the data at the previous iterate, outside DP-SGD's clipping and noise"
    )
    released: ClassVar[tuple[Released, ...]] = (
        Released("fedmos.*", "FedMoS's settings (FedMoS itself is refused under DP)", "public"),
    )
    a: float
    mu: float
    estimator: Estimator

    def init_state(self) -> None:
        self._params: dict[str, nn.Parameter] = {}
        self._batch: Any = None
        self.steps = 0

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        check_trainer(module, self.site)
        self._params = trainable_parameters(module)
        # x: the received global model, float32, never a view of the live weights.
        self.x = {name: p.detach().to(torch.float32).clone() for name, p in self._params.items()}
        self.d: Tensors | None = None  # momentum: per round, starts again from d_1 = g_1
        self.prev: Tensors = {}  # STORM: w_{t-1}; authors: the stored "previous gradient"
        self.steps = 0
        self._checked_optimizer = False

    def on_batch(self, module: nn.Module, batch: Any) -> None:
        # The batch whose gradient will be in .grad is needed again for g(w_{t-1}; xi_t).
        self._batch = batch

    @torch.no_grad()
    def correct_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not self._checked_optimizer:
            check_plain_sgd(optimizer, self.site)
            self._checked_optimizer = True
        names = list(self._params)
        weights = [self._params[n].detach().to(torch.float32) for n in names]
        grads = [self._current_grad(self._params[n]) for n in names]
        if self.d is None:  # first step of the round: d_1 = g_1
            self.d = {n: g.clone() for n, g in zip(names, grads, strict=True)}
            if self.estimator == "storm":
                self.prev = {n: w.clone() for n, w in zip(names, weights, strict=True)}
            else:  # the authors' optimizer stores 0 as the "previous gradient" in step 1 and does not update it
                self.prev = {n: torch.zeros_like(g) for n, g in zip(names, grads, strict=True)}
        else:
            if self.estimator == "storm":
                grads_prev = self._gradient_at_previous_iterate(module, names)
                for n, w in zip(names, weights, strict=True):
                    self.prev[n].copy_(w)  # w_t becomes the previous iterate of the next step
            else:
                grads_prev = [self.prev[n] for n in names]
            storm_update_([self.d[n] for n in names], grads, grads_prev, self.a)
            if self.estimator == "authors":
                for n, g in zip(names, grads, strict=True):
                    self.prev[n].copy_(g)
        self._write_step_gradients(optimizer, names, weights)

    def _current_grad(self, p: nn.Parameter) -> torch.Tensor:
        # A parameter outside this batch's graph has gradient 0 (SGD would skip it, FedMoS still moves it).
        return torch.zeros_like(p, dtype=torch.float32) if p.grad is None else p.grad.to(torch.float32)

    def _gradient_at_previous_iterate(self, module: nn.Module, names: list[str]) -> list[torch.Tensor]:
        """g(w_{t-1}; xi_t): the task loss of the current batch at the stored previous iterate, differentiated."""
        if self._batch is None:
            raise ClientAlgorithmError(
                f"{self.site}: fedmos was handed no training batch before this step (on_batch; the "
                "FederatedAlgorithm callback hands it over)"
            )
        _, grads = task_gradient(module, self._batch, self.prev, names=names)
        self._batch = None
        return [grads[n] for n in names]

    def _write_step_gradients(self, optimizer: torch.optim.Optimizer, names: list[str], weights: list) -> None:
        """.grad <- d + (mu / lr) * (w - x): the SGD step then gives w <- (1 - mu) w - lr d + mu x."""
        assert self.d is not None
        lr_by_param = {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}
        for n, w in zip(names, weights, strict=True):
            p = self._params[n]
            lr = lr_by_param.get(id(p))
            if lr is None:
                raise ClientAlgorithmError(f"{self.site}: fedmos: parameter {n} is not in the optimizer")
            step_grad = self.d[n].clone()
            if self.mu:
                step_grad.add_(w - self.x[n], alpha=self.mu / lr)
            p.grad = step_grad.to(p.dtype)

    def after_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.steps += 1

    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        return {meta_keys.FEDMOS_A: self.a, meta_keys.FEDMOS_MU: self.mu}
