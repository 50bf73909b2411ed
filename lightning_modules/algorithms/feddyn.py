"""FedDyn, client side: the dynamic regulariser, in the authors' displacement form.

Reference: Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based on Dynamic Regularization",
ICLR 2021, arXiv:2111.04263, Algorithm 1 (docs/algorithms.md, FedDyn). The paper's local problem in round t is

    theta_k^t = argmin_theta  L_k(theta) - <grad L_k(theta_k^{t-1}), theta> + (alpha/2) * ||theta - theta^{t-1}||^2
    grad L_k(theta_k^t) = grad L_k(theta_k^{t-1}) - alpha * (theta_k^t - theta^{t-1})          (state update)

The authors' code keeps instead the displacement sum H_k = sum over the rounds k took part in of
(theta_k - theta_server), with grad L_k(theta_k^{t-1}) = -alpha * H_k, so the gradient of the local objective is

    grad L_k(theta) + alpha_k * (theta - theta_server + H_k)

and after local training H_k += theta_k - theta_server (participants only; a site that sits a round out keeps its
H_k unchanged). theta_server is the model received this round (the server's "cloud" model). The paper's state
update is the same recursion, so the implementation matches the paper for any local solver, exact or not (tested
against an independent numpy reference written in the paper's form).

How the term is applied: ``correct_gradients`` adds alpha_k * ((theta - theta_server) + H_k) to ``.grad`` after
backward, before the optimizer step, in float32. The authors write the same gradient as a loss term
alpha_k * <theta, H_k - theta_server> plus (alpha_k/2)*||theta||^2 folded into the optimizer's weight decay; here the
whole FedDyn term is in the gradient (tested against that explicit loss with autograd), so:

- the optimizer's ``weight_decay`` is NOT where alpha goes. It stays a plain L2 penalty (lambda/2)*||theta||^2 that
  is part of L_k (the authors train with weight decay 1e-3 on top of alpha). Never set weight_decay = alpha to mimic
  the authors' trick: the (alpha/2)*||theta - theta_server||^2 part would then be counted twice;
- with momentum the FedDyn term enters the momentum buffer (the derivation assumes the local problem is solved;
  plain SGD is what the tests pin);
- a trainable parameter with no task gradient in a step still gets the FedDyn gradient (the regulariser depends on
  it), as it would with the explicit loss.

alpha and alpha_k. The global alpha comes from the server rule (meta ``feddyn.alpha``), so every site uses the same
value. The authors scale it per client: alpha_k = alpha / w_k with w_k = n_k * m / sum_j n_j (m = population size,
n_k = the site's training samples), i.e. sites with more data are regularised less. ``alpha_weighting``:

- ``"uniform"`` (default): alpha_k = alpha, the authors' value for balanced data (w_k = 1);
- ``"samples"``: alpha_k = alpha * total_samples / (n_k * population_size), with ``population_size`` (m) and
  ``total_samples`` (sum_j n_j over the whole population) given in the client arguments (the same on every site)
  and n_k the size of the site's training set. ``population_size`` must equal the server rule's m.

The site reports the alpha_k it used (``feddyn.alpha_k``) and the names of the trainable parameters H_k covers
(``feddyn.param_keys``): the server applies its mean of H to those and plainly averages everything else (buffers).

State: H_k is float32 (even under ``bf16-mixed``), covers trainable parameters only, and is written to the site's
state store after every round, so it survives process restarts (``nvflare simulator -n N`` with one thread) and
crashes; state written by another run of a job is ignored with a warning (the site starts again from H_k = 0),
and a corrupt or mismatched file is an error. H_k is saved as pending when the site's round ends and committed at
the start of its next round only if the server's broadcast confirms (``server.last_aggregated``) that the round's
result was aggregated; a rejected, late, failed or replayed round's H_k is discarded, so H_k stays in step with
the server's running sum (docs/design.md, decision 17).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import FedDynReport
from lightning_modules.algorithms.base import (
    ClientAlgorithm,
    ClientAlgorithmError,
    load_run_state,
    save_run_state,
    settle_state,
    trainable_parameters,
)
from lightning_modules.algorithms.capabilities import DPSGD, Released
from lightning_modules.algorithms.hparams import HParams, hparam
from lightning_modules.algorithms.kernels import LinearTerm

AlphaWeighting = Literal["uniform", "samples"]
Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class FedDynHParams(HParams):
    """FedDyn's hyperparameters: how alpha_k is derived from the server's alpha (``alpha_weighting``) and, for
    ``"samples"``, the population's size m and its total training samples sum_j n_j (the same on every site)."""

    name: ClassVar[str] = "feddyn"

    alpha_weighting: AlphaWeighting = "uniform"
    population_size: int | None = hparam(None, low=1, note="m, the sites of the whole population")
    total_samples: int | None = hparam(None, low=1, note="sum_j n_j over the whole population")

    def check_together(self) -> None:
        # alpha_k = alpha * total_samples / (n_k * m) needs both with "samples"; "uniform" uses neither.
        samples = self.alpha_weighting == "samples"
        for field_name in ("population_size", "total_samples"):
            value = getattr(self, field_name)
            if samples and value is None:
                self.refuse(field_name, "a positive integer", value, "alpha_weighting='samples' needs it")
            if not samples and value is not None:
                self.refuse(field_name, "left unset", value, "used only with alpha_weighting='samples'")


def parse_alpha(value: Any, site: str) -> float:
    """The server's alpha as a float; anything but a finite positive number is an error naming the site and key."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClientAlgorithmError(f"{site}: '{meta_keys.FEDDYN_ALPHA}' must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ClientAlgorithmError(f"{site}: '{meta_keys.FEDDYN_ALPHA}' must be finite and > 0, got {value!r}")
    return float(value)


def client_alpha(alpha: float, num_samples: int, population_size: int, total_samples: int) -> float:
    """alpha_k = alpha / w_k with w_k = n_k * m / sum_j n_j (the authors' per-client scaling)."""
    return alpha * total_samples / (num_samples * population_size)


def local_num_samples(module: nn.Module, site: str) -> int:
    """n_k: the size of the dataset the module is being trained on this round."""
    try:
        dataset = module.trainer.train_dataloader.dataset
        return len(dataset)
    except (AttributeError, RuntimeError, TypeError):
        raise ClientAlgorithmError(
            f"{site}: feddyn alpha_weighting='samples' needs the size of the training set, and the module has no "
            "trainer with a sized training dataset"
        ) from None


class FedDyn(ClientAlgorithm):
    """FedDyn client.

    Args:
        alpha_weighting: ``"uniform"`` (alpha_k = alpha) or ``"samples"`` (alpha_k = alpha / w_k).
        population_size: m, for ``"samples"`` only.
        total_samples: sum_j n_j over the whole population, for ``"samples"`` only.
    """

    name: ClassVar[str] = "feddyn"
    required_server_meta: ClassVar[tuple[str, ...]] = (meta_keys.FEDDYN_ALPHA,)
    sent_meta: ClassVar[tuple[str, ...]] = (meta_keys.FEDDYN_ALPHA_K, meta_keys.FEDDYN_PARAM_KEYS)
    local_update: ClassVar[str] = "drift"  # not a local gradient: FedNova cannot normalise it
    hparams_class: ClassVar[type[HParams]] = FedDynHParams
    secure_sum: ClassVar[str | None] = "needs the server's alpha and h each round (FedDyn's server state)"
    dp_sgd: ClassVar[DPSGD] = DPSGD(
        True, "its linear and quadratic terms are added to the noisy gradient: post-processing"
    )
    released: ClassVar[tuple[Released, ...]] = (
        Released("feddyn.*", "FedDyn's alpha_k (settings and n_i) and its parameter names", "public"),
    )
    alpha_weighting: AlphaWeighting
    population_size: int | None
    total_samples: int | None

    def init_state(self) -> None:
        self._params: dict[str, nn.Parameter] = {}
        self._round = 0
        self._run_id = ""
        self.alpha_k = 0.0

    # -- round start ---------------------------------------------------------------------------------------------
    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        settle_state(self, meta)
        self._params = trainable_parameters(module)
        self._round = int(meta.get(meta_keys.ROUND, 0))
        self._run_id = str(meta.get(meta_keys.RUN_ID, ""))
        alpha = parse_alpha(meta[meta_keys.FEDDYN_ALPHA], self.site)
        if self.alpha_weighting == "samples":
            assert self.population_size is not None and self.total_samples is not None
            num_samples = local_num_samples(module, self.site)
            if num_samples < 1:
                raise ClientAlgorithmError(f"{self.site}: feddyn alpha_weighting='samples' with an empty training set")
            if self.total_samples < num_samples:
                # sum_j n_j includes this site's n_k: a smaller total is a wrong setting, and alpha_k would fall below
                # alpha / m (the server refuses the round on that too, without knowing which setting is wrong).
                raise ClientAlgorithmError(
                    f"{self.site}: feddyn hyperparameter 'total_samples' ({self.total_samples}) must be at least this "
                    f"site's own training samples ({num_samples}): it is sum_j n_j over the whole population"
                )
            self.alpha_k = client_alpha(alpha, num_samples, self.population_size, self.total_samples)
        else:
            self.alpha_k = alpha
        self.h_local = load_run_state(self, self._params, self._run_id, "FedDyn state H_k")
        # The gradient term alpha_k * (theta - (theta_server - H_k)) only ever needs theta_server - H_k: keep that one
        # fp32 tensor per parameter, the point the term pulls theta towards (two passes on .grad; one when the
        # callback folds the term into a plain SGD step, kernels.py).
        self.pull_target = {name: p.detach().to(torch.float32) - self.h_local[name] for name, p in self._params.items()}

    # -- per step ------------------------------------------------------------------------------------------------
    @property
    def offset(self) -> Tensors:
        """H_k - theta_server per parameter (a fresh copy; the algorithm keeps its negation, ``pull_target``)."""
        return {name: -target for name, target in self.pull_target.items()}

    def linear_term(self) -> LinearTerm:
        # alpha_k * (theta - (theta_server - H_k)), added to .grad by the base correct_gradients; also to a
        # parameter with no task gradient in this step (the regulariser depends on it).
        return LinearTerm(self._params, self.pull_target, self.alpha_k, every_parameter=True)

    # -- round end -----------------------------------------------------------------------------------------------
    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        # H_k + (theta_k - theta_server) = theta_k - pull_target
        h_new = {name: p.detach().to(torch.float32) - self.pull_target[name] for name, p in self._params.items()}
        save_run_state(self, h_new, self._run_id, self._round)
        self.h_local = h_new
        return FedDynReport(self.alpha_k, tuple(self._params)).to_meta()
