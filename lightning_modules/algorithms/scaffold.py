"""SCAFFOLD, client side: control-variate correction of local steps.

Reference: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020,
arXiv:1910.06378, Algorithm 1 (client lines).

Per local step (paper: y <- y - eta * (g_i(y) - c_i + c)):

- ``correction="step"`` (default; as NIID-Bench and NVFlare do it): the optimizer takes its normal step, then
  y <- y - eta_k * (c - c_i) with eta_k the learning rate that step actually used (read from the optimizer's
  param groups, so schedulers and per-group rates are honoured);
- ``correction="grad"``: c - c_i is added to ``.grad`` before the optimizer step, so momentum, weight decay and
  gradient clipping act on it too.

With vanilla SGD both are the paper's update. With momentum rho they differ: the gradient is amplified by about
1/(1 - rho) by the momentum buffer while a post-step correction is not ("step"), or the correction is amplified
too ("grad"); neither is the paper's algorithm, which assumes plain SGD. Weight decay lambda is part of the local
gradient in both modes, so c_i absorbs lambda * y; that is consistent as long as every round uses the same lambda.

End of round (K = optimizer steps actually taken, sum_k eta_k = learning rates actually applied):

- Option II (default): c_i+ = c_i - c + (x - y_i) / sum_k eta_k   (= K * eta_l in the paper's constant-lr notation)
- Option I:            c_i+ = g_i(x), the full local gradient at the received model x (one extra pass over the data
  at round start, batch by batch through :func:`lightning_modules.algorithms.task_gradient.task_gradient`: buffers
  left as they were, dropout off, the trainer's precision; the module must define ``task_loss(batch)``)

The client sends delta_c_i = c_i+ - c_i under ``scaffold.ctrl.diff`` and keeps c_i+ in the per-site state store,
so it survives process restarts (``nvflare simulator -n N`` with one thread starts a process per client-round).
Controls and the snapshot of x are float32 copies of the trainable parameters only, even under ``bf16-mixed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn

from aggregators import meta_keys
from aggregators.scaffold import l2_norm
from aggregators.wire import ControlVariate
from lightning_modules.algorithms.base import (
    ClientAlgorithm,
    ClientAlgorithmError,
    load_run_state,
    save_run_state,
    settle_state,
    trainable_parameters,
)
from lightning_modules.algorithms.hparams import HParams
from lightning_modules.algorithms.kernels import add_in_own_dtype_
from lightning_modules.algorithms.task_gradient import task_gradient

Tensors = dict[str, torch.Tensor]
Option = Literal["I", "II"]
Correction = Literal["step", "grad"]


@dataclass(frozen=True, kw_only=True)
class ScaffoldHParams(HParams):
    """SCAFFOLD's hyperparameters: how c_i+ is computed (``option``) and where c - c_i is applied (``correction``)."""

    name: ClassVar[str] = "scaffold"

    option: Option = "II"
    correction: Correction = "step"


def option_ii_control(
    c_local: Mapping[str, torch.Tensor],
    c_global: Mapping[str, torch.Tensor],
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    lr_sum: Mapping[str, float],
) -> Tensors:
    """c_i+ = c_i - c + (x - y) / sum_k eta_k, per parameter (docs/algorithms.md, SCAFFOLD, Option II)."""
    return {name: c_local[name] - c_global[name] + (x[name] - y[name]) / lr_sum[name] for name in c_local}


def option_ii_from_correction(
    correction: Mapping[str, torch.Tensor],
    x: Mapping[str, torch.Tensor],
    y: Mapping[str, torch.Tensor],
    lr_sum: Mapping[str, float],
) -> Tensors:
    """Option II from the correction c - c_i that the round's steps use: (x - y) / sum_k eta_k - (c - c_i).

    Bit for bit :func:`option_ii_control` (a - b is exactly -(b - a) in IEEE arithmetic and addition commutes), so
    a site need not keep c itself during the round: c_i, x and c - c_i are 3x the trainable parameters, not 4x.
    """
    return {name: (x[name] - y[name]) / lr_sum[name] - correction[name] for name in correction}


def parse_global_control(value: Any, params: Mapping[str, nn.Parameter], site: str) -> Tensors:
    """The server's c as float32 tensors on the parameters' devices; an empty dict means c = 0 (first round).

    Checked by the wire contract (the server checks the diffs with the same code): the trainable parameters' names
    and shapes, float arrays, finite values. A NaN or Inf in c is refused here, before it can reach c_i.
    """
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    key = meta_keys.SCAFFOLD_CTRL_GLOBAL
    parsed = ControlVariate.from_meta({key: value}, key, shapes, allow_empty=True)
    if not parsed.ok:
        raise ClientAlgorithmError(f"{site}: {'; '.join(parsed.lines())}; is the server running the same model?")
    if not parsed.value.arrays:
        return {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    return {
        name: torch.as_tensor(parsed.value.arrays[name], dtype=torch.float32).to(p.device) for name, p in params.items()
    }


class Scaffold(ClientAlgorithm):
    """SCAFFOLD client. ``option`` is ``"II"`` (default) or ``"I"``; ``correction`` is ``"step"`` or ``"grad"``."""

    name: ClassVar[str] = "scaffold"
    required_server_meta: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_GLOBAL,)
    sent_meta: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_DIFF,)
    local_update: ClassVar[str] = "drift"  # not a local gradient: FedNova cannot normalise it
    hparams_class: ClassVar[type[HParams]] = ScaffoldHParams
    option: Option
    correction: Correction

    def __init__(
        self, option: Option = ScaffoldHParams.option, correction: Correction = ScaffoldHParams.correction
    ) -> None:
        self.use_hparams(ScaffoldHParams(option=option, correction=correction))
        self._params: dict[str, nn.Parameter] = {}
        self._round = 0
        self._run_id = ""

    @property
    def needs_task_loss(self) -> bool:  # type: ignore[override]
        return self.option == "I"  # Option I's control is the full local gradient at the global model

    # -- round start ---------------------------------------------------------------------------------------------
    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        if self.correction == "grad" and clips_gradients(module):
            raise ClientAlgorithmError(
                f"{self.site}: scaffold with correction='grad' and gradient clipping would clip c - c_i together with "
                "the gradient, and Option II would then return wrong controls; use correction='step' (the default) "
                "or turn gradient clipping off"
            )
        settle_state(self, meta)
        self._params = trainable_parameters(module)
        self._round = int(meta.get(meta_keys.ROUND, 0))
        self._run_id = str(meta.get(meta_keys.RUN_ID, ""))
        c_global = parse_global_control(meta[meta_keys.SCAFFOLD_CTRL_GLOBAL], self._params, self.site)
        self.c_local = load_run_state(self, self._params, self._run_id, "SCAFFOLD control c_i")
        self.x = {name: p.detach().to(torch.float32).clone() for name, p in self._params.items()}
        self.lr_sum = dict.fromkeys(self._params, 0.0)
        self.steps = 0
        # c - c_i, kept in float32 and applied in the parameter's dtype; c itself is not kept (Option II needs only
        # c - c_i: option_ii_from_correction).
        self.correction_term = {name: c_global[name] - self.c_local[name] for name in self._params}
        del c_global
        self._names_by_id = {id(p): name for name, p in self._params.items()}
        self.gradient_at_x = full_local_gradient(module, self._params) if self.option == "I" else None

    # -- per step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def correct_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.correction != "grad":
            return
        pairs = [(p.grad, self.correction_term[name]) for name, p in self._params.items() if p.grad is not None]
        add_in_own_dtype_([grad for grad, _ in pairs], [term for _, term in pairs], alpha=1.0)

    @torch.no_grad()
    def after_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.steps += 1
        for group in optimizer.param_groups:
            lr = float(group["lr"])
            moved, terms = [], []
            for p in group["params"]:
                name = self._names_by_id.get(id(p))
                if name is None:
                    continue
                self.lr_sum[name] += lr
                moved.append(p)
                terms.append(self.correction_term[name])
            if self.correction == "step":
                # y <- y - lr * (c - c_i): one foreach pass per param group (the least a post-step correction costs).
                add_in_own_dtype_(moved, terms, alpha=-lr)

    # -- round end -----------------------------------------------------------------------------------------------
    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        if self.steps == 0 or any(total <= 0 for total in self.lr_sum.values()):
            raise ClientAlgorithmError(
                f"{self.site}: SCAFFOLD took {self.steps} optimizer steps with learning-rate sum "
                f"{min(self.lr_sum.values(), default=0.0)}; Option II needs at least one step with a positive lr"
            )
        if self.option == "I":
            c_new = self.gradient_at_x
        else:
            y = {name: p.detach().to(torch.float32) for name, p in self._params.items()}
            c_new = option_ii_from_correction(self.correction_term, self.x, y, self.lr_sum)
        diff = {name: (c_new[name] - self.c_local[name]).cpu().numpy().astype(np.float32) for name in self._params}
        save_run_state(self, c_new, self._run_id, self._round)
        return {
            **ControlVariate(meta_keys.SCAFFOLD_CTRL_DIFF, diff).to_meta(),
            # What a user watches to see the control variates working (the server logs ||c||).
            meta_keys.SCAFFOLD_CTRL_DIFF_NORM: l2_norm(diff),
            meta_keys.SCAFFOLD_CTRL_LOCAL_NORM: l2_norm({k: v.cpu().numpy() for k, v in c_new.items()}),
        }


def clips_gradients(module: nn.Module) -> bool:
    """True when a Lightning trainer drives ``module`` with gradient clipping on."""
    try:
        trainer = module.trainer  # a LightningModule not attached to a trainer raises RuntimeError
    except (AttributeError, RuntimeError):
        return False
    return bool(getattr(trainer, "gradient_clip_val", None))


def full_local_gradient(module: nn.Module, params: Mapping[str, nn.Parameter]) -> Tensors:
    """g_i(x): the gradient of the local empirical loss at the current weights, over the whole local dataset.

    Uses an unshuffled loader over the same dataset so that the training order of the round is not disturbed. Each
    batch's gradient is taken by :func:`lightning_modules.algorithms.task_gradient.task_gradient`, whose policy
    leaves the round untouched: buffers (BatchNorm running statistics) restored, dropout off, the trainer's precision.
    """
    loader = module.trainer.train_dataloader
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        raise ClientAlgorithmError("scaffold option I needs a map-style training dataset to compute g_i(x)")
    unshuffled = torch.utils.data.DataLoader(dataset, batch_size=getattr(loader, "batch_size", None) or 256)
    totals = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    seen = 0
    for batch in unshuffled:
        batch = [t.to(module.device) for t in batch]
        _, grads = task_gradient(module, batch, names=list(params))
        size = len(batch[0])
        for name, grad in grads.items():
            totals[name] += grad * size
        seen += size
    return {name: total / seen for name, total in totals.items()}
