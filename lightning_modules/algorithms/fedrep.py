"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized Federated
Learning", ICML 2021, Algorithm 1): a shared body phi, a personal head h_i per site.

Round t at site i, with f_i the site's local loss:

    phi <- phi^t                                                    (the received body)
    h_i <- tau_h local epochs of SGD on  h -> f_i(h, phi^t)      with phi frozen      (head phase)
    phi_i <- tau_phi local epochs of SGD on  phi -> f_i(h_i, phi)   with h_i frozen     (body phase)
    send phi_i;     server: phi^{t+1} = sum_i p_i phi_i               (any rule, on the body only)

The head never leaves the site and persists there across rounds: it is the job's ``--local-keys`` (or, without
them, the head the module declares with ``fl_head_keys()``; `lightning_modules.personalization.local_keys`), so
it travels the partial-sharing path of `lightning_modules.federated.FederatedAlgorithm` (kept in the site's
state store, excluded from what is sent, from ``train.param_keys`` and from every server rule). tau_h is
``head_epochs`` (the paper's default is 10, chosen on its datasets; not verified for every dataset here), tau_phi is
the job's ``--epochs``.

How the two phases run inside one Lightning fit: the callback raises the fit's ``max_epochs`` by ``head_epochs``
(`FedRep.extra_epochs`), the first ``head_epochs`` epochs of the round are the head phase and the rest the
body phase. Freezing is done on the gradients: before every optimizer step the frozen part's ``.grad`` is set to
``None``, and every torch optimizer (SGD with momentum or weight decay, Adam, AdamW) skips a parameter without a
gradient entirely, so it moves by exactly zero. Optimizer state therefore does not carry between the phases: the
bundle builds a fresh Trainer, hence a fresh optimizer, every round, and a parameter's state (momentum buffer, Adam's
moments and step count) is created at its first step, which is in the one phase where it trains. That is what a
fresh optimizer per phase (the paper's code) gives, bit for bit; an epoch-driven learning-rate schedule is the one
thing shared by the phases (it counts the head epochs too). BatchNorm running statistics are buffers: the forward
passes of both phases update them, as in the paper's code, which trains in ``train()`` mode throughout.

FedNova is refused (``local_update = "drift"``): its normaliser a_i describes steps that all move the sent model,
while FedRep's head-phase steps move nothing that is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from lightning_modules.algorithms.base import ClientAlgorithm, local_keys_of
from lightning_modules.algorithms.capabilities import DPSGD, PersonalModel, Released
from lightning_modules.algorithms.hparams import HParams, hparam

DEFAULT_HEAD_EPOCHS = 10


@dataclass(frozen=True, kw_only=True)
class FedRepHParams(HParams):
    """FedRep's hyperparameter: the head phase's local epochs tau_h (the body phase's are the job's ``--epochs``)."""

    name: ClassVar[str] = "fedrep"

    head_epochs: int = hparam(DEFAULT_HEAD_EPOCHS, low=1, note="local epochs that train the head, body frozen")


def phase_of(epoch_in_round: int, head_epochs: int) -> str:
    """``head`` for the round's first ``head_epochs`` epochs, then ``body``."""
    return "head" if epoch_in_round < head_epochs else "body"


def frozen_names(phase: str, parameter_names: list[str], head: frozenset[str]) -> list[str]:
    """The parameters a phase leaves untouched: the body during the head phase, the head during the body phase."""
    if phase == "head":
        return [name for name in parameter_names if name not in head]
    return [name for name in parameter_names if name in head]


class FedRep(ClientAlgorithm):
    """FedRep client (module docstring): head phase, then body phase, each with the other part's gradients dropped."""

    name: ClassVar[str] = "fedrep"
    local_update: ClassVar[str] = "drift"
    hparams_class: ClassVar[type[HParams]] = FedRepHParams
    secure_sum: ClassVar[str | None] = (
        "keeps its head at the site (partial sharing), which the sum workflow does not handle"
    )
    dp_sgd: ClassVar[DPSGD] = DPSGD(
        False,
        "FedRep's head phase freezes the body, and per-sample clipping over frozen parts is not accounted here",
    )
    released: ClassVar[tuple[Released, ...]] = ()  # it sends no meta of its own
    personal_model: ClassVar[PersonalModel | None] = PersonalModel(
        "module", "FedRep's trained module with the site's own head"
    )
    #: The head is the site's local entries; without --local-keys the module must declare one (fl_head_keys).
    needs_head: ClassVar[bool] = True
    head_epochs: int

    def init_state(self) -> None:
        self._head: frozenset[str] = frozenset()
        self._first_epoch = 0

    def extra_epochs(self) -> int:
        """Epochs the fit runs on top of the job's ``--epochs``: the head phase."""
        return self.head_epochs

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        self._head = local_keys_of(module)
        self._first_epoch = _current_epoch(module)

    def phase(self, module: nn.Module) -> str:
        return phase_of(_current_epoch(module) - self._first_epoch, self.head_epochs)

    @torch.no_grad()
    def correct_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        params = dict(module.named_parameters())
        for name in frozen_names(self.phase(module), list(params), self._head):
            params[name].grad = None


def _current_epoch(module: nn.Module) -> int:
    """The fit's epoch (a LightningModule attached to a Trainer), 0 for a bare module."""
    try:
        return int(module.current_epoch)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return 0
