"""SCAFFOLD, client side: control-variate correction of local steps, for SGD and for adaptive optimizers.

Reference: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020,
arXiv:1910.06378, Algorithm 1 (client lines).

Per local step (paper: y <- y - eta * (g_i(y) - c_i + c)), where c - c_i is applied (``correction``):

- ``"step"``: the optimizer takes its normal step, then y <- y - eta_k * (c - c_i) with eta_k the learning rate that
  step actually used (read from the optimizer's param groups, so schedulers and per-group rates are honoured); as
  NIID-Bench and NVFlare do it;
- ``"grad"``: c - c_i is added to ``.grad`` before the optimizer step, so momentum, weight decay, gradient clipping
  and an adaptive optimizer's moments act on it too;
- ``"auto"`` (default): ``"grad"`` with the ``gradients`` estimator, and for a plain SGD step (``torch.optim.SGD``
  without momentum or weight decay, in a Lightning fit with clipping off: ``plain_sgd_step_lrs`` of kernels.py)
  whose gradient a callback watches, so that callback sees the term; ``"step"`` with the ``displacement`` estimator
  otherwise: under a plain SGD step that nobody watches it is the callback's fused fast path (``fused_step_allowed``;
  the same update, bit for bit what earlier releases trained), under SGD with momentum or weight decay NVFlare's
  update rule, as before.

With vanilla SGD ``"step"`` and ``"grad"`` are the paper's update (equal in real arithmetic; float32 rounds the two
orders differently, in the last bits). With momentum rho they differ: the gradient is amplified by about 1/(1 - rho)
by the momentum buffer while a post-step correction is not ("step"), or the correction is amplified too ("grad");
neither is the paper's algorithm, which assumes plain SGD.

End of round (K = optimizer steps actually taken, eta_k = the learning rate step k applied, g_k = the raw stochastic
gradient of step k, before c - c_i is added), Option II, with the estimate of c_i+ picked by ``estimator``:

- ``"displacement"`` (the paper's Option II): c_i+ = c_i - c + (x - y_i) / sum_k eta_k;
- ``"gradients"``: c_i+ = sum_k eta_k g_k / sum_k eta_k, the learning-rate-weighted mean of the round's raw
  stochastic gradients, accumulated in float32 at every step;
- ``"auto"`` (default): ``"displacement"`` when the optimizer is ``torch.optim.SGD`` (or a subclass), ``"gradients"``
  for any other optimizer (Adam, AdamW, Adagrad, RMSprop, ...). Resolved at the round's first optimizer step.

Why two estimators. What the paper wants from c_i is the site's mean gradient (Option I is its exact form at x). For
plain SGD without momentum or weight decay the two estimates are the same number: every step moves
y by -eta_k (g_k + c - c_i), so (x - y_i) / sum eta_k = sum eta_k g_k / sum eta_k + (c - c_i), and Option II's
c_i - c + (x - y_i) / sum eta_k is exactly the lr-weighted mean of the g_k (tested to 1e-6 with a schedule). For any
other update rule the displacement measures the optimizer's steps, not the gradients: a fresh Adam(W) moves each
weight by about eta per step whatever the gradient's size, so (x - y_i) / sum eta_k is about one unit per weight and
c_i grows to about sqrt(#weights) (the issue that led here measured ||c|| of 163 to 614 where Option I gave about 2).
The ``gradients`` estimator keeps c_i in gradient units under any optimizer, at the price of one float32 buffer of
the trainable parameters and one pass per step; with it the correction goes to ``.grad`` (``"grad"``), so an adaptive
optimizer sees y's corrected gradient g_k + c - c_i, an estimate of the global gradient, in both of its moments: the
local steps are those of Adam(W) on the (estimated) global objective, with Adam's per-coordinate scaling of the
corrected gradient. Under SGD with momentum or coupled weight decay the two estimators differ (the displacement also
holds the momentum amplification and lambda * y; the raw gradient holds neither), which is why SGD keeps the
displacement by default (committed SGD jobs keep their controls). AdamW's decoupled weight decay is not part of
any gradient, so neither estimator sees it.

What the literature says, as far as we could check. SCAFFOLD's analysis and experiments are for SGD local steps. The
same first author's Mime (Karimireddy et al., "Mime: Mimicking Centralized Stochastic Algorithms in Federated
Learning", arXiv:2008.03606) states in its abstract that it adapts centralized optimizers such as momentum and Adam to
federated learning by combining control variates with server-level optimizer statistics at every client step. Our
``gradients`` estimator shares its principle (the optimizer acts on a drift-corrected gradient) but not its design:
the sites run their own fresh Adam(W) and its moments are not shared with the server. That Mime's variant with frozen
server statistics is preferable to local moments, and how it compares with this design, is **unverified** here (we
read the abstract only); the measured comparison with FedAvg + AdamW is in benchmarks/results/genomics.md.

Option I:  c_i+ = g_i(x), the full local gradient at the received model x (one extra pass over the data at round
start, batch by batch through `lightning_modules.algorithms.task_gradient.task_gradient`: buffers left as they
were, dropout off, the trainer's precision; the module must define ``task_loss(batch)``); ``estimator`` must then be
``"auto"``.

The client sends delta_c_i = c_i+ - c_i under ``scaffold.ctrl.diff`` and keeps c_i+ in the per-site state store,
so it survives process restarts (``nvflare simulator -n N`` with one thread starts a process per client-round).
Controls and the snapshot of x are float32 copies of the trainable parameters only, even under ``bf16-mixed``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import ControlVariate
from aggregators.scaffold import l2_norm
from lightning_modules.algorithms.base import (
    ClientAlgorithm,
    ClientAlgorithmError,
    load_run_state,
    save_run_state,
    settle_state,
    trainable_parameters,
)
from lightning_modules.algorithms.capabilities import DPSGD, Released
from lightning_modules.algorithms.hparams import HParams
from lightning_modules.algorithms.kernels import add_in_own_dtype_, plain_sgd_step_lrs
from lightning_modules.algorithms.task_gradient import task_gradient

LOG = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]
Option = Literal["I", "II"]
Estimator = Literal["auto", "gradients", "displacement"]
Correction = Literal["auto", "step", "grad"]


@dataclass(frozen=True, kw_only=True)
class ScaffoldHParams(HParams):
    """SCAFFOLD's hyperparameters: how c_i+ is computed (``option``, and Option II's ``estimator``) and where
    c - c_i is applied (``correction``); ``"auto"`` picks by the optimizer (module docstring)."""

    name: ClassVar[str] = "scaffold"

    option: Option = "II"
    estimator: Estimator = "auto"
    correction: Correction = "auto"

    def check_together(self) -> None:
        if self.option == "I" and self.estimator != "auto":
            self.refuse(
                "estimator", "'auto' with option='I'", self.estimator, "Option I sends the full gradient at x itself"
            )


def resolve_estimator(estimator: Estimator, optimizer: torch.optim.Optimizer) -> Estimator:
    """``"auto"``: the displacement (the paper's Option II) for SGD, whose steps it measures exactly; the raw
    gradients for every other optimizer, whose steps are no multiple of the gradient (module docstring)."""
    if estimator != "auto":
        return estimator
    return "displacement" if isinstance(optimizer, torch.optim.SGD) else "gradients"


def resolve_correction(correction: Correction, estimator: Estimator, watched_plain_sgd: bool = False) -> Correction:
    """``"auto"``: into ``.grad`` with the gradients estimator (an adaptive optimizer's moments see the corrected
    gradient) and for a plain SGD step whose gradient a callback watches (the same update as after the step, as a
    gradient term it sees); after the step otherwise with the displacement estimator (as before: under plain SGD
    that is the callback's fused fast path, under SGD with momentum or weight decay NVFlare's update rule)."""
    if correction != "auto":
        return correction
    return "grad" if estimator == "gradients" or watched_plain_sgd else "step"


def gradients_control(weighted_gradients: Mapping[str, torch.Tensor], lr_sum: Mapping[str, float]) -> Tensors:
    """c_i+ = sum_k eta_k g_k / sum_k eta_k, per parameter: the lr-weighted mean of the round's raw gradients."""
    return {name: total / lr_sum[name] for name, total in weighted_gradients.items()}


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

    Bit for bit `option_ii_control` (a - b is exactly -(b - a) in IEEE arithmetic and addition commutes), so
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
    """SCAFFOLD client. ``option`` is ``"II"`` (default) or ``"I"``; ``estimator`` is ``"auto"``, ``"gradients"``
    or ``"displacement"``; ``correction`` is ``"auto"``, ``"step"`` or ``"grad"``."""

    name: ClassVar[str] = "scaffold"
    required_server_meta: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_GLOBAL,)
    sent_meta: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_DIFF,)
    local_update: ClassVar[str] = "drift"  # not a local gradient: FedNova cannot normalise it
    hparams_class: ClassVar[type[HParams]] = ScaffoldHParams
    secure_sum: ClassVar[str | None] = "needs the server's control c each round (SCAFFOLD's server state)"
    dp_sgd: ClassVar[DPSGD] = DPSGD(
        True, "Option II: the correction c - c_i and the new control are post-processing (Option I refused)"
    )
    released: ClassVar[tuple[Released, ...]] = (
        Released(
            meta_keys.SCAFFOLD_CTRL_DIFF,
            "SCAFFOLD Option II's control change: from x, y_i and the lrs",
            "post-processing",
        ),
        Released("scaffold.ctrl.*_norm", "norms of SCAFFOLD's controls (Option II)", "post-processing"),
    )
    option: Option
    estimator: Estimator
    correction: Correction

    def init_state(self) -> None:
        self._params: dict[str, nn.Parameter] = {}
        self._round = 0
        self._run_id = ""

    def dp_sgd_problem(self) -> str | None:
        if self.option == "I":
            return (
                "with option I sends a control computed from a full gradient of the site's data, an unprotected "
                "release: use option II (the default), which is post-processing of the DP-trained model"
            )
        return None

    @property
    def needs_task_loss(self) -> bool:  # type: ignore[override]
        return self.option == "I"  # Option I's control is the full local gradient at the global model

    # -- round start ---------------------------------------------------------------------------------------------
    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
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
        # Set at the round's first step, when the optimizer is known (resolve_estimator, resolve_correction).
        self.used_estimator: Estimator | None = None
        self.used_correction: Correction | None = None
        self.accumulates_gradients = False
        self.weighted_gradients: Tensors = {}

    def _resolve(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Fix this round's estimator and correction mode from the optimizer; refuse what cannot be right."""
        self.used_estimator = resolve_estimator(self.estimator, optimizer)
        watched = plain_sgd_step_lrs(module, optimizer) is not None and not self.fused_step_allowed
        self.used_correction = resolve_correction(self.correction, self.used_estimator, watched)
        self.accumulates_gradients = self.option == "II" and self.used_estimator == "gradients"
        if self.used_correction == "grad" and not self.accumulates_gradients and clips_gradients(module):
            raise ClientAlgorithmError(
                f"{self.site}: scaffold with correction='grad' and gradient clipping would clip c - c_i together with "
                "the gradient, and Option II's displacement would then return wrong controls; use "
                "estimator='gradients' (its controls are the unclipped gradients), correction='step', or turn "
                "gradient clipping off"
            )
        if self.estimator == "displacement" and not isinstance(optimizer, torch.optim.SGD):
            LOG.warning(
                "%s: scaffold estimator='displacement' with %s: c_i then measures the optimizer's steps, not the "
                "gradients (about one unit per weight under Adam); estimator='gradients' keeps it a gradient",
                self.site,
                type(optimizer).__name__,
            )
        if self.accumulates_gradients:
            self.weighted_gradients = {
                name: torch.zeros_like(p, dtype=torch.float32) for name, p in self._params.items()
            }

    # -- per step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def correct_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.used_estimator is None:
            self._resolve(module, optimizer)
        if self.accumulates_gradients:
            self._accumulate_raw_gradients(optimizer)  # before c - c_i is added: the raw g_k
        if self.used_correction != "grad":
            return
        pairs = [(p.grad, self.correction_term[name]) for name, p in self._params.items() if p.grad is not None]
        add_in_own_dtype_([grad for grad, _ in pairs], [term for _, term in pairs], alpha=1.0)

    def _accumulate_raw_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """sum_k eta_k g_k += eta_k g_k in float32, with eta_k the lr the coming step of each param group applies."""
        for group in optimizer.param_groups:
            sums, grads = [], []
            for p in group["params"]:
                name = self._names_by_id.get(id(p))
                if name is not None and p.grad is not None:  # no gradient: the step skips it, g_k counts as 0
                    sums.append(self.weighted_gradients[name])
                    grads.append(p.grad)
            add_in_own_dtype_(sums, grads, alpha=float(group["lr"]))

    @torch.no_grad()
    def after_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.used_estimator is None:  # a driver that never calls correct_gradients
            self._resolve(module, optimizer)
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
            if self.used_correction == "step":
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
        elif self.accumulates_gradients:
            c_new = gradients_control(self.weighted_gradients, self.lr_sum)
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
    batch's gradient is taken by `lightning_modules.algorithms.task_gradient.task_gradient`, whose policy
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
