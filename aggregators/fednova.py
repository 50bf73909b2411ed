"""FedNova: normalized averaging of heterogeneous local updates.

Reference: Wang, Liu, Liang, Joshi, Poor, "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020, arXiv:2007.07481 (docs/server_rules.md, FedNova). A client whose local solver is linear in
its
stochastic gradients moves by x - y_i = eta * G_i a_i; it reports tau_i (optimizer steps) and ||a_i||_1. The server:

    p_i     = n_i / sum_{j in S} n_j                      (data shares, renormalised over the participants)
    tau_eff = sum_i p_i ||a_i||_1                         (``tau_eff="a_norm"``, the paper; ``"steps"``: sum p_i tau_i)
    x_{t+1} = x_t - tau_eff * sum_i p_i d_i / ||a_i||_1   (d_i = x_t - y_i)

Optional server ("slow") momentum ``server_momentum`` = gmf: b <- gmf * b + g, x <- x - b with
g = tau_eff * sum_i p_i d_i / ||a_i||_1 (the authors write b in units of 1/eta and multiply by eta again; with the
same eta every round that cancels). b is float32 state, checkpointed.

Buffers are the p-weighted mean of the clients (integer buffers rounded back); they are neither normalised nor
moved by the momentum.

Client side, `normalizer_l1` computes ||a_i||_1 exactly for torch's SGD (heavy-ball momentum rho,
dampening, first step without dampening as torch does) plus a proximal term mu (w - w_t) that enters the gradient
before the momentum (FedProx's ``correct_gradients``), with per-step learning rates eta_k in units of the round's
first learning rate eta_0. Closed forms it reproduces (constant lr): vanilla ||a||_1 = tau; momentum
[tau - rho (1 - rho^tau)/(1 - rho)]/(1 - rho); proximal [1 - (1 - eta mu)^tau]/(eta mu). Weight decay is part
of the local gradient (as in the authors' code), not of a_i. Any common unit of a_i cancels in the server step,
so sites must only agree on eta_0 (the job's learning rate).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.contracts.hparams import hparam
from aggregators.contracts.wire import FedNovaReport
from aggregators.deltas import average_buffers, split_keys, trainable_keys
from aggregators.functional import by_site, sample_weights, weighted_step, weighted_sum
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)

TauEff = Literal["a_norm", "steps"]


def normalizer_l1(lrs: Sequence[float], momentum: float = 0.0, dampening: float = 0.0, mu: float = 0.0) -> float:
    """||a||_1 of one round's local solver, in units of ``lrs[0]``.

    The solver (one entry of ``lrs`` per optimizer step k, e = y - x, b = momentum buffer):
    d_k = g_k + mu * e_k;  b_{k+1} = rho * b_k + (1 - dampening) * d_k  (b_1 = d_0: torch's first step);
    e_{k+1} = e_k - eta_k * b_{k+1}. Then e_tau = -sum_j eta_0 * a_j * g_j, and a_j is found by running the
    adjoint of that linear recursion backwards (O(tau)); the result is sum_j |a_j|.
    """
    if not lrs:
        raise ValueError("FedNova normaliser: no optimizer step was taken")
    if lrs[0] <= 0:
        raise ValueError(f"FedNova normaliser: the first learning rate must be positive, got {lrs[0]}")
    sens_e, sens_b = 1.0, 0.0  # d e_tau / d e_{k+1}, d e_tau / d b_{k+1}
    total = 0.0
    for k in range(len(lrs) - 1, -1, -1):
        lr = float(lrs[k])
        feed = 1.0 if k == 0 else 1.0 - dampening  # torch copies d_0 into the buffer undamped
        into_b = sens_b - lr * sens_e  # d e_tau / d b_{k+1} including b's effect on e_{k+1}
        total += abs(into_b * feed)  # coefficient of g_k in e_tau is -eta_0 a_k
        sens_e, sens_b = sens_e + into_b * feed * mu, into_b * momentum
    return total / float(lrs[0])


def nova_momentum_step(
    x: np.ndarray, ys: Sequence[np.ndarray], coefficients: np.ndarray, previous: np.ndarray | None, gmf: float
) -> tuple[np.ndarray, np.ndarray]:
    """(x - b, b) with b = gmf * b_prev + g and g = sum_i c_i (x - y_i): the server momentum step of one tensor.

    g is summed from the deltas (not as x minus the moved model), so a round in which no client moved gives g = 0
    exactly and, from b_prev = 0, x back bit for bit however many rounds run. b is float32, the checkpointed state.
    """
    step = weighted_sum(ys, -coefficients, x, minus=x, dtype=np.float32)
    if previous is not None:
        step += gmf * np.asarray(previous, dtype=np.float32)
    return (x - step).astype(x.dtype, copy=False), step


def nova_problems(meta: Mapping[str, Any]) -> list[str]:
    """Why a client's FedNova report cannot be used (empty list: it can): the wire contract's check."""
    return FedNovaReport.from_meta(meta).lines()


@dataclass(frozen=True)
class FedNova(RuleHParams, AggregationRule):
    """FedNova server rule.

    Args:
        tau_eff: ``a_norm`` (sum_i p_i ||a_i||_1, the paper) or ``steps`` (sum_i p_i tau_i, the authors' code with a
            proximal term).
        server_momentum: gmf >= 0 (0 = none).
    """

    tau_eff: TauEff = "a_norm"
    server_momentum: float = hparam(0.0, low=0, high=1, high_open=True, note="gmf; 0 = none")

    name: ClassVar[str] = "fednova"
    secure_sum: ClassVar[str] = (
        "normalises every site's update by its own tau_i and a_i at the server (a sum only if every site "
        "pre-scaled its own update, which is not implemented)"
    )
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    required_meta: ClassVar[tuple[str, ...]] = (meta_keys.FEDNOVA_TAU, meta_keys.FEDNOVA_A_NORM)
    #: Client algorithms whose local update is not eta * G a (a drift that is not a local gradient) cannot compose.
    needs_linear_local_solver: ClassVar[bool] = True

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {"momentum": {}}

    def update_problems(
        self, update: ClientUpdate, global_params: Mapping[str, np.ndarray], state: Mapping[str, Any]
    ) -> list[str]:
        return nova_problems(update.meta)

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        problems = {u.site: nova_problems(u.meta) for u in updates}
        bad = {site: p for site, p in problems.items() if p}
        if bad:
            raise AggregationError(f"fednova: unusable FedNova meta from {bad}")
        p = sample_weights(updates)
        a_norms = np.array([float(u.meta[meta_keys.FEDNOVA_A_NORM]) for u in updates])
        taus = np.array([float(u.meta[meta_keys.FEDNOVA_TAU]) for u in updates])
        tau_eff = float(np.dot(p, a_norms if self.tau_eff == "a_norm" else taus))
        coefficients = tau_eff * p / a_norms
        trainable = trainable_keys(global_params, updates)
        params = average_buffers(global_params, updates, p, split_keys(global_params, trainable))
        momentum = {}
        for key in trainable:
            x, ys = np.asarray(global_params[key]), [u.params[key] for u in updates]
            if not self.server_momentum:
                params[key] = weighted_step(x, ys, coefficients)  # x - sum_i c_i (x - y_i)
                continue
            params[key], momentum[key] = nova_momentum_step(
                x, ys, coefficients, state["momentum"].get(key), self.server_momentum
            )
        ordered = {key: params[key] for key in global_params}
        return AggregationResult(params=ordered, state={"momentum": momentum}, meta={})
