"""FedAvg: sample-weighted model averaging.

Reference: McMahan et al., "Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017, arXiv:1602.05629 (Algorithm 1, the server step).

    x_{t+1} = sum_{i in S} p_i * y_i,        p_i = n_i / sum_{j in S} n_j

With a server learning rate eta_g != 1 the step is x + eta_g * sum_i p_i (y_i - x) (eta_g = 1 is vanilla
FedAvg). Weights are the clients' training-sample counts (docs/design.md, decision 6), not NVFlare's default
step counts. Buffers are averaged with the same weights; integer buffers (``num_batches_tracked``) are averaged
in float and rounded back, and are never moved by the server learning rate.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from aggregators.contracts.hparams import hparam
from aggregators.functional import by_site, is_float_array, sample_weights, weighted_average_params
from aggregators.types import SECURE_SUM, AggregationRule, ClientUpdate, Params, RoundContext, RuleHParams


def fedavg_params(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], server_lr: float = 1.0
) -> dict[str, np.ndarray]:
    """The FedAvg step as a pure function (sample weights); inputs are never modified."""
    updates = by_site(updates)
    return weighted_model_step(global_params, updates, sample_weights(updates), server_lr)


def weighted_model_step(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], weights: np.ndarray, server_lr: float
) -> dict[str, np.ndarray]:
    """x + eta_g * sum_i w_i (y_i - x) for float parameters; integer buffers take the weighted mean directly.

    With ``server_lr == 1`` the result is computed as sum_i w_i y_i, exactly the weighted mean of the clients.
    """
    averaged = weighted_average_params(updates, weights, global_params)
    if server_lr == 1.0:
        return averaged
    return {key: _server_step(global_params[key], averaged[key], server_lr) for key in global_params}


def _server_step(current: np.ndarray, averaged: np.ndarray, server_lr: float) -> np.ndarray:
    if not is_float_array(current):
        return averaged
    step = np.asarray(averaged, dtype=np.float64) - np.asarray(current, dtype=np.float64)
    return (np.asarray(current, dtype=np.float64) + server_lr * step).astype(current.dtype)


@dataclass(frozen=True)
class FedAvg(RuleHParams, AggregationRule):
    """FedAvg as an aggregation rule (stateless). ``server_lr`` is eta_g; 1.0 is the paper's FedAvg."""

    server_lr: float = hparam(1.0, low=0, low_open=True, note="eta_g; 1 is the paper's FedAvg")

    name: ClassVar[str] = "fedavg"
    secure_sum: ClassVar[str] = SECURE_SUM
    translation_equivariant: ClassVar[str | None] = "server_lr = 1"  # x + sum_i p_i (y_i - x) = sum_i p_i y_i
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None

    def aggregate_params(
        self, global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], context: RoundContext
    ) -> Params:
        return fedavg_params(global_params, updates, self.server_lr)
