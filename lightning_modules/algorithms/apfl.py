"""APFL, client side: a personal model per site, mixed with the global model by a weight each site learns.

Reference: Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461, 2020, Algorithm 1
(docs/personalization.md, APFL). Site i keeps a personal model v_i and a mixing weight alpha_i in [0, 1] besides the
model w it trains for the federation. Its personalized model is the mixture

    v_bar = alpha v + (1 - alpha) w.

At every local step k, on the step's batch xi, with w_k the weights before the step:

    w_{k+1}   = w_k - eta grad f(w_k; xi)                         (the global part: the module's own optimizer step)
    g         = grad f(v_bar_k; xi),     v_bar_k = alpha_k v_k + (1 - alpha_k) w_k
    v_{k+1}   = v_k - eta alpha_k g                               (the chain rule: d v_bar / d v = alpha)
    alpha_{k+1} = clip(alpha_k - eta_alpha <v_k - w_k, g>, 0, 1)  (d v_bar / d alpha = v - w; adaptive only)

Both gradients are taken at iterate k, as in the paper. alpha = 0 held fixed makes v_bar the trained w: the site
sends what a FedAvg site sends, bit for bit, and its personal model is that same model.

Choices made here (the paper leaves them open):

- **eta** is ``personal_lr`` when given, else the lr of the optimizer step just taken (one lr for every parameter
  group, else refused); **eta_alpha** is ``alpha_lr`` when given, else eta. The personal step is plain SGD;
- **when**: g and <v - w, g> are taken in ``on_batch`` (the module holds w_k there) with the project's one helper
  for a task gradient at other weights (`task_gradient`: buffers untouched, dropout off, the trainer's precision,
  fp32), and applied in ``after_step`` with the step's lr. So a round costs about two local trainings;
- **state**: v_i (fp32, trainable parameters) and alpha_i start as the first received model and ``alpha``, and
  live in the site's state store under ``apfl`` (`lightning_modules.personalization.personal_state`: pending until
  the server confirms the round, restart-safe, never sent). A stored alpha outside [0, 1] is clipped into it;
- **the personal model** scored after the round (``eval.personal_*``) is v_bar with w the trained module's weights:
  the paper's v_bar after the round's last step.

Meta sent: ``apfl.alpha`` (learned from the site's data: withheld under DP, where APFL is refused anyway) and
``apfl.personal_steps``. The server needs nothing from APFL: its global part is plain local SGD.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError, settle_state, trainable_parameters
from lightning_modules.algorithms.capabilities import DPSGD, PER_SITE_STATE, PersonalModel, Released
from lightning_modules.algorithms.hparams import HParams, hparam
from lightning_modules.algorithms.task_gradient import task_gradient
from lightning_modules.personalization.personal_state import load_personal, save_personal

#: The state-store entry of alpha beside v's entries (angle brackets: never a parameter name).
ALPHA_ENTRY = "<alpha>"
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class APFLHParams(HParams):
    """APFL's hyperparameters: alpha's start value, whether it adapts, and the step sizes of v and alpha."""

    name: ClassVar[str] = "apfl"

    alpha: float = hparam(0.25, low=0, high=1, note="the personal model's share of the mixture at the start")
    adaptive: bool = True
    personal_lr: float | None = hparam(None, low=0, low_open=True, note="eta of v; none = the optimizer's lr")
    alpha_lr: float | None = hparam(None, low=0, low_open=True, note="eta of alpha; none = eta of v")

    def check_together(self) -> None:
        if not self.adaptive and self.alpha_lr is not None:
            self.refuse("alpha_lr", "none", self.alpha_lr, "alpha is held fixed (adaptive false)")


def mixed_model(personal: Mapping[str, torch.Tensor], shared: Mapping[str, torch.Tensor], alpha: float) -> Tensors:
    """v_bar = alpha v + (1 - alpha) w, entry by entry (fp32)."""
    return {name: alpha * personal[name] + (1.0 - alpha) * shared[name] for name in personal}


def alpha_gradient(
    personal: Mapping[str, torch.Tensor], shared: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor]
) -> float:
    """d f(v_bar) / d alpha = <v - w, grad f(v_bar)>, summed over every entry."""
    return float(sum(((personal[name] - shared[name]) * grads[name]).sum() for name in personal))


def personal_step_(personal: Mapping[str, torch.Tensor], grads: Mapping[str, torch.Tensor], alpha: float, eta: float):
    """v <- v - eta alpha grad f(v_bar), in place."""
    for name, value in personal.items():
        value.sub_(grads[name], alpha=eta * alpha)


def next_alpha(alpha: float, gradient: float, eta_alpha: float) -> float:
    """alpha - eta_alpha * gradient, clipped into [0, 1]."""
    return min(1.0, max(0.0, alpha - eta_alpha * gradient))


def single_lr(optimizer: torch.optim.Optimizer, site: str) -> float:
    """The one lr of the optimizer's parameter groups (a scheduler's current value included)."""
    lrs = sorted({float(group["lr"]) for group in optimizer.param_groups})
    if len(lrs) != 1:
        raise ClientAlgorithmError(
            f"{site}: apfl steps v and alpha with one lr, and the optimizer's groups use {lrs}; give client_args "
            "personal_lr"
        )
    return lrs[0]


class APFL(ClientAlgorithm):
    """APFL client (module docstring): plain local SGD on w, and SGD on v and alpha through the mixture."""

    name: ClassVar[str] = "apfl"
    hparams_class: ClassVar[type[HParams]] = APFLHParams
    sent_meta: ClassVar[tuple[str, ...]] = (meta_keys.APFL_ALPHA, meta_keys.APFL_PERSONAL_STEPS)
    needs_task_loss: ClassVar[bool] = True
    personal_model: ClassVar[PersonalModel | None] = PersonalModel(
        "weights", "APFL's mixture alpha v_i + (1-alpha) w", steps_key=meta_keys.APFL_PERSONAL_STEPS
    )
    local_update: ClassVar[str] = "gradient"  # w, the model it sends, takes plain local SGD steps
    secure_sum: ClassVar[str | None] = PER_SITE_STATE
    dp_sgd: ClassVar[DPSGD] = DPSGD(
        False, "APFL trains v_i and alpha on the data outside DP-SGD, and alpha and the personal scores leave the site"
    )
    released: ClassVar[tuple[Released, ...]] = (
        Released(
            meta_keys.APFL_ALPHA, "APFL's mixing weight after the round: learned from the site's data", "withheld"
        ),
        Released("apfl.*", "APFL's personal step count: the round's step count", "public"),
    )
    alpha: float
    adaptive: bool
    personal_lr: float | None
    alpha_lr: float | None

    def init_state(self) -> None:
        self.site_alpha = self.alpha  # alpha_i: the site's own, learned, persisted
        self.personal: Tensors | None = None
        self._params: dict[str, nn.Parameter] = {}
        self._pending: tuple[Tensors, float] | None = None  # g and <v - w, g> of the current batch
        self._steps, self._round, self._run_id = 0, 0, ""

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        accumulation = getattr(getattr(module, "_trainer", None), "accumulate_grad_batches", 1)
        if accumulation != 1:
            raise ClientAlgorithmError(
                f"{self.site}: apfl steps v on every optimizer step's batch; accumulate_grad_batches {accumulation} "
                "would step it on the last micro-batch only: use 1"
            )
        settle_state(self, meta)
        self._params = trainable_parameters(module)
        self._round, self._run_id = int(meta.get(meta_keys.ROUND, 0)), str(meta.get(meta_keys.RUN_ID, ""))
        start = {name: p.detach() for name, p in self._params.items()}
        start[ALPHA_ENTRY] = torch.tensor(self.alpha, dtype=torch.float32)
        state = load_personal(self, start, self._run_id, "apfl personal model")
        self.site_alpha = next_alpha(float(state.pop(ALPHA_ENTRY)), 0.0, 0.0)  # a stored value clipped into [0, 1]
        self.personal, self._pending, self._steps = state, None, 0

    @torch.no_grad()
    def on_batch(self, module: nn.Module, batch: Any) -> None:
        if self.personal is None:
            raise ClientAlgorithmError(f"{self.site}: apfl received a batch before its round started")
        shared = {name: p.detach().to(torch.float32) for name, p in self._params.items()}
        with torch.enable_grad():
            _, grads = task_gradient(module, batch, params=mixed_model(self.personal, shared, self.site_alpha))
        self._pending = grads, alpha_gradient(self.personal, shared, grads)

    @torch.no_grad()
    def after_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if self.personal is None or self._pending is None:
            raise ClientAlgorithmError(f"{self.site}: apfl took an optimizer step without its batch's gradient")
        grads, alpha_grad = self._pending
        eta = self.personal_lr if self.personal_lr is not None else single_lr(optimizer, self.site)
        personal_step_(self.personal, grads, self.site_alpha, eta)
        if self.adaptive:
            self.site_alpha = next_alpha(self.site_alpha, alpha_grad, self.alpha_lr or eta)
        self._pending, self._steps = None, self._steps + 1

    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        if self.personal is not None:
            state = {**self.personal, ALPHA_ENTRY: torch.tensor(self.site_alpha, dtype=torch.float32)}
            save_personal(self, state, self._run_id, self._round)
        return {meta_keys.APFL_ALPHA: self.site_alpha, meta_keys.APFL_PERSONAL_STEPS: self._steps}

    def personal_weights(self, module: nn.Module) -> Tensors | None:
        """v_bar = alpha v + (1 - alpha) w with w the module's weights now (after the round: the trained model)."""
        if self.personal is None:
            return None
        shared = {name: p.detach().to(torch.float32) for name, p in self._params.items()}
        return mixed_model(self.personal, shared, self.site_alpha)
