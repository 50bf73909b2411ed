"""Ditto, client side: a personal model per site, pulled towards the global model it received.

Reference: Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through Personalization", ICML 2021,
arXiv:2012.04221, Algorithm 1 (docs/personalization.md, Ditto). Site i keeps a personal model v_i besides the global
model w. In round t, a sampled site

- **global part**: trains the received w^t with the usual local update (E epochs of the module's own optimizer)
  into y_i, which is sent to the server as every client's result is;
- **personal part**: takes local steps on v_i for the personal objective h_i(v; w^t) = F_i(v) + (lam/2)||v - w^t||^2:

      v_i <- v_i - eta_v * (grad F_i(v_i) + lam * (v_i - w^t))

  with w^t the model RECEIVED this round (a detached fp32 snapshot taken when the round starts), never the updated
  y_i. lam = 0 is local-only training of v_i (from the first model the site received); lam -> infinity keeps v_i at
  the global model. The paper sweeps lam in {0.01, 0.1, 1, 2}.

Choices made here (the paper leaves them open):

- **one personal step per training step, on the same batch**: ``on_batch`` keeps the batch, ``after_step`` (right
  after the global model's optimizer step) takes the gradient of the task loss at v_i on it with the project's one
  helper (`lightning_modules.algorithms.task_gradient.task_gradient`: buffers untouched, dropout off, the
  trainer's precision, fp32 gradients) and moves v_i. So s = the round's number of optimizer steps, and a round
  costs about two local trainings;
- **eta_v**: ``personal_lr`` when given, else the lr the optimizer used for that step (each parameter its group's
  lr, a scheduler's value included). The personal step is plain SGD on v_i whatever the global optimizer is (no
  momentum, no weight decay, no Adam moments): with AdamW's small lrs give ``personal_lr``;
- **v_i starts** as the first global model the site receives; a site not sampled keeps v_i unchanged;
- **state**: v_i is fp32 (under ``bf16-mixed`` too), covers the trainable parameters only (the personal model's
  buffers are those of the site's module at the end of the round), and lives in the site's state store under
  ``ditto``, tagged with the run id. It never leaves the site;
- **transactional, as every client state** (docs/design.md, decision 17): the v_i a round writes is pending until
  the server's next broadcast confirms that round's result was aggregated, and is dropped otherwise. v_i is not in
  the server's state, so committing it regardless would be defensible; we keep the project's rule because a
  replayed round (a resumed server, a retried task) must start from the same v_i to give the same bits, and a
  dropped round costs the site only that round's personal steps;
- **missing or unreadable state** never stops the site and is never used: a file that cannot be read, or entries
  missing, mis-shaped or non-finite, restart those entries from the received model with a warning naming the site
  and the keys. A file written by another run of the job is ignored with a warning, as the other algorithms do.

Global part: ``global_client`` ``fedavg`` (plain local training, the paper's choice) or ``fedprox`` (adds
mu * (w - w^t) to the global model's gradients; FedProx's own code). Other client algorithms are refused when the
job is built: SCAFFOLD, FedDyn and FedMoS exchange state of their own with their server rule and MOON adds a loss
term, so each would need a second algorithm in the one callback that drives the hooks; Ditto's global part is
their local update only when nothing else travels with it.

**One personal model per strength** (``lam_grid``, optional; default: ``lam`` alone, today's Ditto bit for bit): a
site trains one v_i per lam of the grid, each with the personal step above on the same batch (a grid of G lams
costs G personal steps per training step: about G + 1 local trainings; ``ditto.personal_steps`` counts all G, so the
local-only model's matched compute does too), keeps all of them in its state store (one entry per lam and
parameter, under ``ditto``; a grid of one stores exactly today's entries), and after the round scores each on its
validation split and keeps the one its validation prefers (`lightning_modules.personalization.strength`): that one is
the site's personal model of the round (``eval.personal_*``, the ``personal`` candidate of ``--keep best``), and its
lam is reported as ``eval.ditto_best_lam`` (an ``eval.*`` score). Since keep best takes the best of its challengers
on the same validation loss, choosing among the grid first and offering the winner equals offering every v_i. The
grid needs lams > 0, distinct, and ``lam`` among them (the job's nominal strength, sent as ``ditto.lam``; ties on
validation go to the earlier lam of the grid). Under DP Ditto is refused, grid or not.

Meta sent: ``ditto.lam``, ``ditto.personal_steps`` (for the logs); the server needs nothing from Ditto (any rule
that takes FedAvg's clients takes Ditto's, FedNova included: the global part is plain or proximal SGD). The
personal model is scored on the site's validation split after the round (``eval.personal_*``,
`lightning_modules.personal_scores`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from aggregators.contracts import meta_keys
from aggregators.contracts.hparams import CHECKED_TOGETHER
from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError, settle_state, trainable_parameters
from lightning_modules.algorithms.capabilities import DPSGD, PER_SITE_STATE, PersonalModel, Released
from lightning_modules.algorithms.fedprox import FedProx
from lightning_modules.algorithms.hparams import HParams, hparam
from lightning_modules.algorithms.kernels import LinearTerm
from lightning_modules.algorithms.task_gradient import task_gradient
from lightning_modules.personalization.personal_state import load_personal, save_personal

DEFAULT_LAM = 0.1
LAM_KEY = meta_keys.DITTO_LAM
PERSONAL_STEPS_KEY = meta_keys.DITTO_PERSONAL_STEPS
#: The site's chosen strength of a grid, an ``eval.*`` score (module docstring).
BEST_LAM_KEY = meta_keys.eval_key("ditto_best_lam")
#: The global parts Ditto composes with, and why the others are refused (module docstring).
GLOBAL_CLIENTS = ("fedavg", "fedprox")
REFUSED_GLOBAL_CLIENTS = {
    "scaffold": "SCAFFOLD exchanges control variates with its own server rule",
    "feddyn": "FedDyn keeps a dynamic regulariser H_k tied to its own server rule",
    "fedmos": "FedMoS replaces the optimizer step with its own momentum update",
    "moon": "MOON adds a contrastive loss term with its own model history",
}

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class DittoHParams(HParams):
    """Ditto's hyperparameters: the pull ``lam`` of v_i towards the received global model, the personal step size
    (``None``: the optimizer's lr) and the global part (``fedavg`` or ``fedprox`` with its ``mu``)."""

    name: ClassVar[str] = "ditto"

    lam: float = hparam(DEFAULT_LAM, low=0, note="the pull of the personal model towards the received global model")
    personal_lr: float | None = hparam(None, low=0, low_open=True, note="eta_v; none = the optimizer's lr")
    global_client: str = "fedavg"
    mu: float = hparam(0.0, low=0, note="FedProx's mu of the global part (global_client 'fedprox')")
    lam_grid: tuple[float, ...] | None = field(default=None, metadata=CHECKED_TOGETHER)

    def check_together(self) -> None:
        if self.lam_grid is not None:
            grid = self.lam_grid
            numbers = isinstance(grid, list | tuple) and all(
                isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in grid
            )
            if not numbers or not grid or len(set(grid)) != len(grid):
                self.refuse(
                    "lam_grid",
                    "a non-empty list of distinct finite numbers > 0",
                    grid,
                    "one personal model per lam, each a personal training every step",
                )
            object.__setattr__(self, "lam_grid", tuple(float(v) for v in grid))
            if self.lam not in self.lam_grid:
                self.refuse("lam", f"one of lam_grid {list(self.lam_grid)}", self.lam, "the job's nominal strength")
        if self.global_client not in GLOBAL_CLIENTS:
            reason = REFUSED_GLOBAL_CLIENTS.get(self.global_client, "not a client algorithm Ditto's global part knows")
            self.refuse(
                "global_client",
                f"one of {list(GLOBAL_CLIENTS)}",
                self.global_client,
                f"{reason}; composing it with Ditto's personal model would need two algorithms in one callback",
            )
        if self.global_client != "fedprox" and self.mu != 0:
            self.refuse("mu", "0", self.mu, "mu belongs to global_client 'fedprox'")


def ditto_step_(
    personal: Mapping[str, torch.Tensor],
    grads: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    lrs: Mapping[str, float],
    lam: float,
) -> None:
    """One personal step in place: v <- v - eta * (g + lam * (v - w)) for every entry (fp32).

    The entries of one step size move together with ``torch._foreach_*`` ops (one call per operation instead of
    one per entry and operation), in the order of the formula: d = v - w, d *= lam, d += g, v -= eta * d, so every
    element sees the same float operations as the per-entry form."""
    by_lr: dict[float, list[str]] = {}
    for name in personal:
        by_lr.setdefault(lrs[name], []).append(name)
    for eta, names in by_lr.items():
        v = [personal[name] for name in names]
        step = torch._foreach_sub(v, [received[name] for name in names])
        torch._foreach_mul_(step, lam)
        torch._foreach_add_(step, [grads[name] for name in names])
        torch._foreach_sub_(v, step, alpha=eta)


def step_sizes(optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter]) -> dict[str, float]:
    """The lr each parameter's group used in the optimizer's last step, by parameter name."""
    by_id = {id(p): float(group["lr"]) for group in optimizer.param_groups for p in group["params"]}
    missing = [name for name, p in params.items() if id(p) not in by_id]
    if missing:
        raise ClientAlgorithmError(
            f"ditto takes the personal step size from the optimizer, which does not train {missing[:5]}; give "
            "client_args personal_lr"
        )
    return {name: by_id[id(p)] for name, p in params.items()}


class Ditto(ClientAlgorithm):
    """Ditto client (module docstring): the global part's local update, plus personal SGD steps on v_i."""

    name: ClassVar[str] = "ditto"
    sent_meta: ClassVar[tuple[str, ...]] = (LAM_KEY, PERSONAL_STEPS_KEY)
    hparams_class: ClassVar[type[HParams]] = DittoHParams
    needs_task_loss: ClassVar[bool] = True
    personal_model: ClassVar[PersonalModel | None] = PersonalModel(
        "weights", "Ditto's v_i", steps_key=meta_keys.DITTO_PERSONAL_STEPS
    )
    #: An instance takes its global part's (`init_state`: fedavg's ``gradient``, fedprox's ``proximal``), never drift.
    local_update: ClassVar[str] = "gradient"
    secure_sum: ClassVar[str | None] = PER_SITE_STATE
    dp_sgd: ClassVar[DPSGD] = DPSGD(
        False, "Ditto trains the personal model v_i on the data outside DP-SGD, and its scores leave the site"
    )
    released: ClassVar[tuple[Released, ...]] = (
        Released("ditto.*", "Ditto's settings (Ditto itself is refused under DP)", "public"),
    )
    lam: float
    personal_lr: float | None
    global_client: str
    mu: float
    lam_grid: tuple[float, ...] | None

    def init_state(self) -> None:
        self.global_part: ClientAlgorithm = (
            FedProx(mu=self.mu) if self.global_client == "fedprox" else ClientAlgorithm()
        )
        self.local_update = self.global_part.local_update  # what FedNova normalises: the global part's update
        self._params: dict[str, nn.Parameter] = {}
        self.received: Tensors = {}
        self.personal: Tensors | None = None  # the site's personal model: lam's v_i, or the grid's chosen one
        self.personals: dict[float, Tensors] = {}  # every lam's v_i
        self._batch: Any = None
        self._steps = 0
        self._round = 0
        self._run_id = ""

    def bind(self, site: str, state_store: Any) -> None:
        super().bind(site, state_store)
        self.global_part.bind(site, None)

    def proximal_coefficient(self) -> float:
        return self.global_part.proximal_coefficient()

    # -- round start ---------------------------------------------------------------------------------------------
    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and getattr(trainer, "accumulate_grad_batches", 1) != 1:
            raise ClientAlgorithmError(
                f"{self.site}: ditto needs accumulate_grad_batches=1 (each personal step is taken on the batch of "
                f"the global step), got {trainer.accumulate_grad_batches}"
            )
        settle_state(self, meta)
        self.global_part.on_round_start(module, meta)
        self._params = trainable_parameters(module)
        self._round = int(meta.get(meta_keys.ROUND, 0))
        self._run_id = str(meta.get(meta_keys.RUN_ID, ""))
        # w^t: the received global model, fp32, never a view of the live weights.
        self.received = {name: p.detach().to(torch.float32).clone() for name, p in self._params.items()}
        self.personals = self._load_personal()
        self.personal = self.personals[self.lam]
        self._batch, self._steps = None, 0

    @property
    def lams(self) -> tuple[float, ...]:
        """The strengths trained, one personal model each: the grid, or ``lam`` alone."""
        return self.lam_grid if self.lam_grid is not None else (self.lam,)

    def _stored_names(self) -> dict[tuple[float, str], str]:
        """Each lam's entry names in the state store: the parameter's name alone for one lam (today's file)."""
        one = len(self.lams) == 1
        return {(lam, name): name if one else f"lam={lam!r}/{name}" for lam in self.lams for name in self.received}

    def _load_personal(self) -> dict[float, Tensors]:
        """Every lam's v_i as this site left it, or the received model for the entries it cannot trust (with a
        warning)."""
        names = self._stored_names()
        reference = {stored: self.received[name] for (_, name), stored in names.items()}
        loaded = load_personal(self, reference, self._run_id, "ditto personal model")
        return {lam: {name: loaded[names[lam, name]] for name in self.received} for lam in self.lams}

    # -- per step ------------------------------------------------------------------------------------------------
    def on_batch(self, module: nn.Module, batch: Any) -> None:
        self._batch = batch
        self.global_part.on_batch(module, batch)

    def linear_term(self) -> LinearTerm | None:
        return self.global_part.linear_term()  # the global part's (FedProx's mu * (w - w^t)); v_i moves in after_step

    @torch.no_grad()
    def after_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.global_part.after_step(module, optimizer)
        if self.personal is None or self._batch is None:
            raise ClientAlgorithmError(f"{self.site}: ditto took an optimizer step before its round started")
        if self.personal_lr is not None:
            lrs = dict.fromkeys(self.personal, self.personal_lr)
        else:
            lrs = step_sizes(optimizer, self._params)
        for lam, personal in self.personals.items():
            _, grads = task_gradient(module, self._batch, params=personal)
            ditto_step_(personal, grads, self.received, lrs, lam)
            self._steps += 1

    # -- round end -----------------------------------------------------------------------------------------------
    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        meta = self.global_part.on_round_end(module)
        if self.personals:
            state = {stored: self.personals[lam][name] for (lam, name), stored in self._stored_names().items()}
            save_personal(self, state, self._run_id, self._round)
        return {**meta, LAM_KEY: self.lam, PERSONAL_STEPS_KEY: self._steps}

    def personal_weights(self, module: nn.Module) -> Tensors | None:
        """v_i, the site's personal model (trainable parameters, fp32), once a round has started."""
        return self.personal

    def personal_options(self, module: nn.Module) -> dict[float, Tensors] | None:
        """With a grid of two or more lams, every lam's v_i (the site keeps the one its validation prefers)."""
        return dict(self.personals) if len(self.personals) > 1 else None

    def choose_personal(self, option: float) -> dict[str, float]:
        self.personal = self.personals[option]
        return {BEST_LAM_KEY: float(option)}
