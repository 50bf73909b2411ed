"""FedAtt: layer-wise attentive aggregation.

Reference: Ji, Pan, Long, Li, Jiang, Huang, "Learning Private Neural Language Modeling with Attentive Aggregation",
IJCNN 2019, arXiv:1812.07108 (docs/server_rules.md, FedAtt). Per trainable layer l and client k:

    s_k^l   = ||x^l - y_k^l||_F                      (Frobenius / flattened L2; the authors' scipy call gives the
                                                       spectral norm for matrices, which the paper does not intend)
    alpha^l = softmax_k(s_k^l)                        (no negation: farther clients get more weight)
    x^l    <- x^l + epsilon * sum_k alpha_k^l (y_k^l - x^l) + beta * N(0, I)

Sample counts are not used. The Gaussian noise goes on trainable float parameters only (never on BatchNorm
statistics or integer counters); buffers are the uniform mean of the clients. The noise is drawn from a generator
seeded by (``seed``, round), so a rerun or a resumed job draws the same noise. epsilon > 1 steps past the attended
clients (the authors' default 1.2); the softmax runs on raw norms, so large layers saturate towards the farthest
client (a property of the method, kept).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from aggregators.contracts.hparams import hparam
from aggregators.deltas import average_buffers, delta_sq_norms, split_keys, trainable_keys
from aggregators.functional import by_site, weighted_step
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)


def softmax(scores: np.ndarray) -> np.ndarray:
    """Numerically stable softmax of a 1-D float64 vector."""
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()


def layer_distances(x: np.ndarray, layers: Sequence[np.ndarray]) -> np.ndarray:
    """||x - y_k||_F for every client k (accumulated in float64, streamed)."""
    return np.sqrt(delta_sq_norms(x, layers))


@dataclass(frozen=True)
class FedAtt(RuleHParams, AggregationRule):
    """FedAtt server rule.

    Args:
        epsilon: step size epsilon (authors' default 1.2).
        noise: beta, standard deviation of the Gaussian noise on trainable parameters (authors' default 0.001;
            0 disables it).
        seed: seeds the noise generator together with the round index.
    """

    epsilon: float = hparam(1.2, low=0, low_open=True, note="the step towards the clients; 0 never moves the model")
    noise: float = hparam(0.001, low=0, note="the standard deviation of the Gaussian noise; 0 disables it")
    seed: int = hparam(0, low=0, note="seeds the noise together with the round index")

    name: ClassVar[str] = "fedatt"
    secure_sum: ClassVar[str] = "weights every site by the distance of its own model to the global one, layer by layer"
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    #: x + epsilon * sum_i alpha_i (y_i - x): a step of size epsilon towards the clients, plus noise.
    mean_type: ClassVar[bool] = False

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        if not updates:
            raise AggregationError("fedatt: no client update to aggregate")
        uniform = np.full(len(updates), 1.0 / len(updates))
        trainable = trainable_keys(global_params, updates)
        params = average_buffers(global_params, updates, uniform, split_keys(global_params, trainable))
        rng = np.random.default_rng([self.seed, context.round_num])
        for key in trainable:
            x = np.asarray(global_params[key])
            layers = [u.params[key] for u in updates]
            alpha = softmax(layer_distances(x, layers))
            moved = weighted_step(x, layers, self.epsilon * alpha)  # x + eps * sum_k alpha_k (y_k - x)
            if self.noise:
                noise = rng.standard_normal(x.shape, dtype=np.float32)
                noise *= self.noise
                moved += noise
            params[key] = moved.astype(x.dtype, copy=False)
        ordered = {key: params[key] for key in global_params}
        return AggregationResult(params=ordered, state={})
