"""FedOpt: server optimizers on the pseudo-gradient — FedAdam, FedAdagrad, FedYogi, and FedAvgM.

Reference: Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan, "Adaptive Federated Optimization",
ICLR 2021, arXiv:2003.00295, Algorithm 2 (docs/server_rules.md, FedOpt). Per round, with Delta_i = y_i - x:

    Delta_t = sum_i p_i Delta_i                                   (p_i: sample weights, or 1/|S| with "uniform")
    m_t     = beta1 * m_{t-1} + (1 - beta1) * Delta_t
    v_t     = v_{t-1} + Delta_t^2                                  FedAdagrad
    v_t     = v_{t-1} - (1 - beta2) * Delta_t^2 * sign(v_{t-1} - Delta_t^2)   FedYogi
    v_t     = beta2 * v_{t-1} + (1 - beta2) * Delta_t^2            FedAdam
    x_{t+1} = x_t + eta * m_t / (sqrt(v_t) + tau)

Exactly as Algorithm 2: no bias correction (``bias_correction=True`` multiplies eta by
sqrt(1 - beta2^t) / (1 - beta1^t), t = 1 in the first round, the Kingma-Ba/Keras form with tau left uncorrected);
tau is added to sqrt(v_t) (not to a bias-corrected sqrt(v_hat)); v starts at ``v0`` (``None`` = tau^2, the
paper's v_{-1} >= tau^2; Flower, Keras and TFF start at 0).

FedAvgM (Hsu et al. 2019, the FedOpt paper's baseline "server SGD with momentum"): m_t = beta1 * m_{t-1} + Delta_t,
x_{t+1} = x_t + eta * m_t (torch SGD momentum on the pseudo-gradient -Delta_t, no dampening). With eta = 1 and
beta1 = 0 it is FedAvg.

Scope and precision: moments cover the trainable parameters only (``train.param_keys``; see aggregators/deltas.py);
buffers (BatchNorm statistics, integer counters) are the weighted mean of the clients, never pushed through the
moments. m and v are float32 arrays; the arithmetic runs in float32, slice by slice of each parameter so that
every client array is read once and the moment updates stay in cache (about the cost of a plain weighted sum,
benchmarks/aggregation.py). The state checkpoints and resumes bit-identically, the step counter t with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from aggregators.contracts.hparams import hparam, interval_text
from aggregators.deltas import average_buffers, split_keys, trainable_keys
from aggregators.functional import Weighting, by_site, sample_weights, weighted_sum
from aggregators.types import (
    SITE_STEP,
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)

CHUNK = 1 << 16  # elements per slice of a parameter: ~16 slices of 256 KiB stay in cache
# Per variant: (server lr eta, beta1). Adam/Yogi/Adagrad follow Flower's and google-research/federated's
# starting points; Adagrad has no momentum in the released code; FedAvgM uses momentum 0.9 at eta = 1.
VARIANT_DEFAULTS = {"adam": (0.01, 0.9), "yogi": (0.01, 0.9), "adagrad": (0.1, 0.0), "avgm": (1.0, 0.9)}
#: Smallest tau of the adaptive variants (Adam, Yogi, Adagrad); `TAU_FLOOR_WHY` says why.
TAU_FLOOR = 1e-12
TAU_FLOOR_WHY = (
    "m and v are float32: v of a coordinate that moved by |d| underflows once d^2 is below float32's smallest "
    "normal (1.2e-38), and then the step is eta * m / tau, which only tau bounds (a move of 1e-24 steps by "
    "eta * 1e-25 / tau: at most 1e-15 at tau = 1e-12 with eta = 0.01, 1e13 at tau = 1e-40; tau = 1e-46 is 0 in float32 "
    "and an unmoved coordinate becomes 0 / 0 = NaN)"
)


def second_moment(variant: str, v_prev: np.ndarray, squared: np.ndarray, beta2: float) -> np.ndarray:
    """v_t (a new array) from v_{t-1} and Delta_t^2, for the adaptive variants; ``squared`` may be overwritten."""
    if variant == "adam":
        v = np.multiply(v_prev, beta2, dtype=np.float32)
        squared *= 1.0 - beta2
        v += squared
        return v
    v = np.array(v_prev, dtype=np.float32, copy=True)
    if variant == "adagrad":
        v += squared
        return v
    # Yogi: v - (1 - beta2) * Delta^2 * sign(v - Delta^2), with one temporary.
    sign = np.sign(v - squared)
    sign *= squared
    sign *= 1.0 - beta2
    v -= sign
    return v


def tau_floor(variant: str) -> tuple[float, str]:
    """The smallest tau of a variant and why: `TAU_FLOOR` for the adaptive ones (`TAU_FLOOR_WHY`), 0 for
    FedAvgM, which does not use it."""
    return (0.0, "fedavgm does not use it") if variant == "avgm" else (TAU_FLOOR, TAU_FLOOR_WHY)


def effective_lr(server_lr: float, beta1: float, beta2: float, step: int, bias_correction: bool) -> float:
    """eta, or eta * sqrt(1 - beta2^t) / (1 - beta1^t) with bias correction (t = 1 in the first round)."""
    if not bias_correction:
        return server_lr
    return server_lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


@dataclass(frozen=True)
class FedOpt(RuleHParams, AggregationRule):
    """Server optimizer rule; use the registered variants ``fedadam``, ``fedadagrad``, ``fedyogi``, ``fedavgm``.

    Args:
        server_lr: eta (``None``: the variant's default, see ``VARIANT_DEFAULTS``).
        beta1: first-moment decay; for FedAvgM the server momentum (``None``: the variant's default).
        beta2: second-moment decay (Adam, Yogi).
        tau: adaptivity, added to sqrt(v_t) (Adam, Yogi, Adagrad): at least ``TAU_FLOOR`` = 1e-12, since m and v
            are float32 and v of a coordinate that moved by less than ~1e-19 underflows, leaving eta * m / tau as its
            step (``TAU_FLOOR_WHY``); FedAvgM ignores it (any tau >= 0).
        bias_correction: Kingma-Ba bias correction of eta (off in Algorithm 2).
        v0: initial second moment (``None``: tau^2); a finite number >= 0.
        weighting: ``samples`` (p_i = n_i / n, docs/design.md decision 6) or ``uniform`` (1/|S|, Algorithm 2's mean).
    """

    server_lr: float | None = hparam(None, low=0, low_open=True, note="eta")
    # beta = 1 would freeze a moment (and divide by zero with bias correction); tau = 0 makes every coordinate
    # that no client moved 0 / 0 = NaN in an adaptive step, and a tiny tau an unbounded one (TAU_FLOOR_WHY).
    beta1: float | None = hparam(None, low=0, high=1, high_open=True, note="first-moment decay")
    beta2: float = hparam(0.99, low=0, high=1, high_open=True, note="second-moment decay")
    tau: float = hparam(1e-3)  # the floor depends on the variant: check_together
    bias_correction: bool = False
    v0: float | None = hparam(None, low=0, note="initial second moment; unset: tau^2")
    weighting: Weighting = "samples"

    name: ClassVar[str] = "fedopt"
    #: A server optimizer steps from x along its moments, not to the clients' common model.
    mean_type: ClassVar[bool] = False
    variant: ClassVar[str] = "adam"

    def __post_init__(self) -> None:
        # Unset server_lr and beta1 take the variant's defaults before the declaration checks them.
        default_lr, default_beta1 = VARIANT_DEFAULTS[self.variant]
        if self.server_lr is None:
            object.__setattr__(self, "server_lr", default_lr)
        if self.beta1 is None:
            object.__setattr__(self, "beta1", default_beta1)
        super().__post_init__()

    def check_together(self) -> None:
        floor, why = tau_floor(self.variant)
        if self.tau < floor:
            self.refuse("tau", interval_text(floor, math.inf), self.tau, why)
        if self.bias_correction and self.variant not in ("adam", "yogi"):
            self.refuse("bias_correction", "false", True, "bias correction applies to fedadam and fedyogi only")

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        # Empty moments mean "not yet created": m = 0 and v = v0 on first use (the trainable keys are known then).
        return {"m": {}, "v": {}, "step": 0}

    def initial_v(self) -> float:
        return self.tau**2 if self.v0 is None else float(self.v0)

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        weights = sample_weights(updates) if self.weighting == "samples" else np.full(len(updates), 1 / len(updates))
        trainable = trainable_keys(global_params, updates)
        params = average_buffers(global_params, updates, weights, split_keys(global_params, trainable))
        step = int(state["step"]) + 1
        lr = effective_lr(self.server_lr, self.beta1, self.beta2, step, self.bias_correction)
        moments_m, moments_v = {}, {}
        adaptive = self.variant != "avgm"
        for key in trainable:
            x = np.asarray(global_params[key])
            ys = [np.asarray(u.params[key]) for u in updates]
            if any(y.shape != x.shape for y in ys):
                raise AggregationError(f"{self.name}: client arrays for '{key}' do not all have shape {x.shape}")
            m_prev = _previous(state["m"], key, x.shape, 0.0).reshape(-1)
            v_prev = _previous(state["v"], key, x.shape, self.initial_v()).reshape(-1) if adaptive else None
            flat_x, flat_ys = x.reshape(-1), [y.reshape(-1) for y in ys]
            moved, m, v = np.empty_like(flat_x), np.empty(x.size, np.float32), np.empty(x.size, np.float32)
            # Chunk by chunk: the clients are read once and the moment arithmetic runs on cache-resident slices, so
            # the rule costs about what the plain weighted sum does (benchmarks/aggregation.py).
            for start in range(0, x.size, CHUNK):
                part = slice(start, start + CHUNK)
                chunk_v = v_prev[part] if adaptive else None
                moved[part], m[part], v[part] = self._step(
                    flat_x[part], [y[part] for y in flat_ys], weights, m_prev[part], chunk_v, lr
                )
            params[key] = moved.reshape(x.shape)
            moments_m[key] = m.reshape(x.shape)
            if adaptive:
                moments_v[key] = v.reshape(x.shape)
        ordered = {key: params[key] for key in global_params}
        return AggregationResult(params=ordered, state={"m": moments_m, "v": moments_v, "step": step})

    def _step(
        self, x: np.ndarray, ys: Sequence[np.ndarray], weights: np.ndarray, m_prev: np.ndarray, v_prev: Any, lr: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | int]:
        """(x_{t+1}, m_t, v_t) on one slice of a parameter; Delta_t's buffer is reused once Delta_t^2 is taken."""
        # sum_i p_i (y_i - x): differences first, so a coordinate no client moved has exactly Delta = 0.
        delta = weighted_sum(ys, weights, x, minus=x, dtype=np.float32)
        m = np.multiply(m_prev, self.beta1, dtype=np.float32)
        if self.variant == "avgm":
            m += delta
            moved = m * lr
            moved += x
            return moved, m, 0
        squared = delta * delta
        delta *= 1.0 - self.beta1
        m += delta
        v = second_moment(self.variant, v_prev, squared, self.beta2)
        moved = np.sqrt(v)
        moved += self.tau
        np.divide(m, moved, out=moved)
        moved *= lr
        moved += x
        return moved, m, v


def _previous(moments: Mapping[str, np.ndarray], key: str, shape: tuple[int, ...], fill: float) -> np.ndarray:
    """The stored moment (read only: the state is never modified), or ``fill`` everywhere when it does not exist
    yet; a wrong shape is an error."""
    if key not in moments:
        return np.full(shape, fill, dtype=np.float32)
    value = np.asarray(moments[key])
    if value.shape != shape:
        raise AggregationError(f"server moment for '{key}' has shape {value.shape}, the parameter has {shape}")
    return value


class FedAdam(FedOpt):
    """FedAdam (Algorithm 2 with Adam's second moment)."""

    name: ClassVar[str] = "fedadam"
    secure_sum: ClassVar[str] = SITE_STEP
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    variant: ClassVar[str] = "adam"


class FedYogi(FedOpt):
    """FedYogi (Algorithm 2 with Yogi's additive, sign-controlled second moment)."""

    name: ClassVar[str] = "fedyogi"
    secure_sum: ClassVar[str] = SITE_STEP
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    variant: ClassVar[str] = "yogi"


class FedAdagrad(FedOpt):
    """FedAdagrad (Algorithm 2 with the accumulated second moment)."""

    name: ClassVar[str] = "fedadagrad"
    secure_sum: ClassVar[str] = SITE_STEP
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    variant: ClassVar[str] = "adagrad"


class FedAvgM(FedOpt):
    """FedAvgM: server SGD with momentum ``beta1`` on the pseudo-gradient."""

    name: ClassVar[str] = "fedavgm"
    secure_sum: ClassVar[str] = SITE_STEP
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    variant: ClassVar[str] = "avgm"


FEDOPT_RULES: tuple[type[FedOpt], ...] = (FedAdam, FedYogi, FedAdagrad, FedAvgM)
