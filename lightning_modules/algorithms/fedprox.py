"""FedProx, client side: a proximal term that keeps local training near the received global model.

Reference: Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, "Federated Optimization in Heterogeneous Networks",
MLSys 2020, arXiv:1812.06127, Algorithm 2, local objective h_k:

    h_k(w; w_t) = F_k(w) + (mu / 2) * ||w - w_t||^2          (SQUARED Euclidean norm, docs/algorithms.md, FedProx)

w_t is the global model the site received this round: a detached float32 snapshot of the trainable parameters
taken in ``on_round_start`` (after the global weights were loaded, before the first step). Buffers (BatchNorm
running statistics, ``num_batches_tracked``) are never part of the term and are never touched.

How the term is applied. Instead of adding (mu/2)||w - w_t||^2 to the loss, ``correct_gradients`` adds its exact
gradient mu * (w - w_t) to ``.grad`` after backward and before the optimizer step, which is what the authors'
``PerturbedGradientDescent`` does (grad + mu * (w - w_star)). The two are the same gradient (tested against an
explicit loss with autograd), but the gradient form needs no extra graph, and since no square root is ever taken
there is no NaN at w = w_t (the pitfall of the non-squared ``sqrt(sum of squares)`` form). Consequences worth
knowing, identical to the explicit-loss form:

- with momentum, the prox gradient enters the momentum buffer together with the task gradient;
- gradient clipping (Lightning's, which runs after ``correct_gradients``) clips the sum;
- with gradient accumulation the term is added once per optimizer step, as the explicit term would be after
  Lightning's division of each micro-batch loss by the number of accumulated batches;
- optimizer weight decay is a separate L2 penalty towards 0, independent of mu (mu pulls towards w_t).

With ``mu = 0`` nothing is added, so training is bit-for-bit FedAvg's local training (tested with a
real Lightning fit). The server side is unchanged FedAvg: FedProx sends no payload besides the model; the mu the
site trained with is reported under ``fedprox.mu`` so the server logs show it.

Hyperparameter: ``mu`` >= 0 (default 0.01, as NVFlare's ``PTFedProxLoss``; the authors' README: no single value
works for every task, they search {0.001, 0.01, 0.1, 0.5, 1}).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import ClientAlgorithm, trainable_parameters
from lightning_modules.algorithms.capabilities import DPSGD, Released
from lightning_modules.algorithms.hparams import HParams, hparam
from lightning_modules.algorithms.kernels import LinearTerm

DEFAULT_MU = 0.01


@dataclass(frozen=True, kw_only=True)
class FedProxHParams(HParams):
    """FedProx's hyperparameter: the proximal coefficient ``mu`` (0 is FedAvg's local training)."""

    name: ClassVar[str] = "fedprox"

    mu: float = hparam(DEFAULT_MU, low=0)


class FedProx(ClientAlgorithm):
    """FedProx client: adds mu * (w - w_t) to the gradient of every trainable parameter before each step."""

    name: ClassVar[str] = "fedprox"
    sent_meta: ClassVar[tuple[str, ...]] = (meta_keys.FEDPROX_MU,)
    local_update: ClassVar[str] = "proximal"
    hparams_class: ClassVar[type[HParams]] = FedProxHParams
    secure_sum: ClassVar[str | None] = None
    dp_sgd: ClassVar[DPSGD] = DPSGD(True, "mu (w - w_t) is added to the noisy gradient: post-processing")
    released: ClassVar[tuple[Released, ...]] = (Released(meta_keys.FEDPROX_MU, "FedProx's mu (a setting)", "public"),)
    mu: float

    def init_state(self) -> None:
        self._params: dict[str, nn.Parameter] = {}
        self.anchor: dict[str, torch.Tensor] = {}

    def proximal_coefficient(self) -> float:
        return self.mu

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        self._params = trainable_parameters(module)
        # w_t: detached float32 copies (never views of the live weights, never buffers).
        self.anchor = {name: p.detach().to(torch.float32).clone() for name, p in self._params.items()}

    def linear_term(self) -> LinearTerm | None:
        # mu * (w - w_t), added to .grad by the base correct_gradients. A parameter outside this step's graph (no
        # grad) does not move, so its w - w_t stays 0: only parameters with a gradient get the term.
        if self.mu == 0:
            return None  # bit for bit FedAvg's local training
        return LinearTerm(self._params, self.anchor, self.mu, every_parameter=False)

    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        return {meta_keys.FEDPROX_MU: self.mu}
