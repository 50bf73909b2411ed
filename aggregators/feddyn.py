"""FedDyn, server side: the participants' mean plus the population mean of the clients' dynamic-regulariser state.

Reference: Acar, Zhao, Matas, Mattina, Whatmough, Saligrama, "Federated Learning Based on Dynamic Regularization",
ICLR 2021, arXiv:2111.04263, Algorithm 1 (server lines; docs/algorithms.md, FedDyn). The paper keeps h and updates

    h^t     = h^{t-1} - alpha * (1/m) * sum_{k in P_t} (theta_k^t - theta^{t-1})
    theta^t = (1/|P_t|) * sum_{k in P_t} theta_k^t - (1/alpha) * h^t

with m the size of the WHOLE client population and P_t the participants. In the authors' displacement form every
client k keeps H_k = sum of its (theta_k - theta_server) over the rounds it took part in, h = -alpha * mean_{all m} H_k,
and the server step is

    theta^t = mean_{k in P_t}(theta_k^t) + (1/m) * sum_{all k} H_k

alpha cancels. The server never sees H_k, but it can keep their sum: every client displacement passes through it,
so h_sum += sum_{k in P_t} (theta_k^t - theta^{t-1}) equals sum_{all k} H_k at every round, non-participants'
stale H_k included (verified in the tests against explicit per-client bookkeeping). Hence

    theta^t = mean_{k in P_t}(theta_k^t) + h_sum / m.

Pitfalls this rule avoids (each pinned by a test): dividing h_sum by |P_t| instead of m, dropping the
non-participants' H_k, sample-weighting the model mean (the paper's mean is uniform), and a site's alpha_k below
alpha / m, which with ``alpha_weighting="samples"`` means its population total of samples is smaller than its own
count (the round is refused, naming the site; `population_total_problem`). The identity holds with rejected
results too: a site commits its H_k only once the server confirms the round's result was aggregated
(docs/design.md, decision 17), and a rejected result never enters h_sum.

Scope and precision: h covers exactly the trainable parameters the clients name in ``feddyn.param_keys``; every
other entry (BatchNorm statistics and other buffers) is the uniform mean of the participants, integer buffers
averaged in float and rounded back. h_sum is a dict of float32 arrays (accumulated in float64 each round), so the
rule state checkpoints as plain arrays.

What is broadcast and what the metrics measure: the returned model is the "cloud" model theta^t above. It is what
the clients start from next round and what the controller evaluates on the test set, as in corrected Plato; the
authors instead report the plain mean of the selected clients' models ("sel") and of all clients' latest models
("all"), which this rule does not compute.

The rule broadcasts the global alpha under ``feddyn.alpha`` so every client uses the same value; its own math
does not depend on alpha.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.contracts.hparams import hparam
from aggregators.contracts.wire import FedDynReport
from aggregators.functional import by_site, is_float_array, weighted_average_params, weighted_mean
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)

DEFAULT_ALPHA = 0.01
HSum = dict[str, np.ndarray]


def param_keys_problems(value: Any, global_params: Mapping[str, np.ndarray], h_sum: Mapping[str, Any]) -> list[str]:
    """Why a client's ``feddyn.param_keys`` cannot be used (empty list: it can)."""
    key = meta_keys.FEDDYN_PARAM_KEYS
    if not isinstance(value, list | tuple) or not value or not all(isinstance(k, str) for k in value):
        return [f"'{key}' must be a non-empty list of parameter names, got {type(value).__name__}"]
    if len(set(value)) != len(value):
        return [f"'{key}' lists a parameter more than once"]
    problems = []
    unknown = sorted(set(value) - set(global_params))
    if unknown:
        problems.append(f"'{key}' names entries that are not in the model: {unknown[:5]}")
    integer = sorted(k for k in set(value) & set(global_params) if not is_float_array(global_params[k]))
    if integer:
        problems.append(f"'{key}' names integer buffers {integer[:5]}; FedDyn covers trainable parameters only")
    if h_sum and set(value) != set(h_sum):
        missing, extra = sorted(set(h_sum) - set(value)), sorted(set(value) - set(h_sum))
        problems.append(f"'{key}' differs from earlier rounds: missing {missing[:5]}, unexpected {extra[:5]}")
    return problems


def alpha_k_problems(value: Any) -> list[str]:
    """The alpha_k a client reports must be a finite positive number (the wire contract's check)."""
    report = FedDynReport.from_meta({meta_keys.FEDDYN_ALPHA_K: value, meta_keys.FEDDYN_PARAM_KEYS: ["-"]})
    return report.lines()


#: Rounding slack of the comparison alpha_k >= alpha / m (alpha_k is computed at the site in float64).
ALPHA_K_SLACK = 1e-9


def population_total_problem(update: ClientUpdate, alpha: float, population: int) -> str | None:
    """Why a site's alpha_k shows a population total of samples smaller than its own count (``None``: it does not).

    With ``alpha_weighting="samples"`` a site uses alpha_k = alpha * total_samples / (n_k * m), which is at least
    alpha / m exactly when total_samples >= n_k (``"uniform"``: alpha_k = alpha, always). The server never sees
    total_samples, but an alpha_k below alpha / m can only come from a total below the site's own n_k (or from a
    client population_size above the server's m): FedDyn would then regularise that site less than one that holds
    every sample of the federation.
    """
    alpha_k = float(update.meta[meta_keys.FEDDYN_ALPHA_K])
    if alpha_k * population >= alpha * (1.0 - ALPHA_K_SLACK):
        return None
    implied = alpha_k * update.num_samples * population / alpha
    return (
        f"site '{update.site}' reports '{meta_keys.FEDDYN_ALPHA_K}' = {alpha_k:.6g}, below alpha / m = {alpha:.6g} / "
        f"{population}: its client setting 'total_samples' (alpha_k = alpha * total_samples / (n_k * m)) works out at "
        f"{implied:.6g}, smaller than its own {update.num_samples} training samples; total_samples must be the "
        f"training samples of the whole population, at least every site's own count, and the client's "
        f"population_size must equal the server's m = {population}"
    )


def accumulate_displacements(
    h_sum: Mapping[str, np.ndarray],
    global_params: Mapping[str, np.ndarray],
    updates: Sequence[ClientUpdate],
    keys: Sequence[str],
) -> HSum:
    """h_sum + sum_i (theta_i - theta_prev) over ``keys``, in float64, stored as float32. Empty ``h_sum`` = zeros."""
    new_sum = {}
    for key in sorted(keys):
        previous = np.asarray(global_params[key], dtype=np.float64)
        total = np.asarray(h_sum[key], dtype=np.float64) if key in h_sum else np.zeros(previous.shape)
        for update in updates:
            total = total + (np.asarray(update.params[key], dtype=np.float64) - previous)
        new_sum[key] = total.astype(np.float32)
    return new_sum


def feddyn_params(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], h_sum: Mapping[str, np.ndarray], m: int
) -> dict[str, np.ndarray]:
    """theta = uniform mean of the participants + h_sum / m on the keys of ``h_sum``; other entries: the mean."""
    updates = by_site(updates)
    weights = np.full(len(updates), 1.0 / len(updates))
    others = weighted_average_params(updates, weights, {k: v for k, v in global_params.items() if k not in h_sum})
    params = {}
    for key, value in global_params.items():
        if key not in h_sum:
            params[key] = others[key]
            continue
        like = np.asarray(value)
        mean = weighted_mean([u.params[key] for u in updates], weights, like.astype(np.float64))
        params[key] = (mean + np.asarray(h_sum[key], dtype=np.float64) / m).astype(like.dtype)
    return params


@dataclass(frozen=True)
class FedDyn(RuleHParams, AggregationRule):
    """FedDyn server rule.

    Args:
        alpha: the dynamic-regulariser coefficient, broadcast to the clients (authors' CIFAR example: 1e-2).
        population_size: m; ``None`` uses every site connected when the job started.
    """

    alpha: float = hparam(DEFAULT_ALPHA, low=0, low_open=True, note="the dynamic-regulariser coefficient")
    population_size: int | None = hparam(None, low=1, note="m; unset: every site connected when the job started")

    name: ClassVar[str] = "feddyn"
    secure_sum: ClassVar[str] = (
        "keeps h from every round's updates and sends alpha to the sites; NVFlare's HE workflow keeps no server state"
    )
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    #: x = mean(y) - h / alpha: the correction h moves it off the clients' common model.
    mean_type: ClassVar[bool] = False
    required_meta: ClassVar[tuple[str, ...]] = (meta_keys.FEDDYN_ALPHA_K, meta_keys.FEDDYN_PARAM_KEYS)
    broadcast_keys: ClassVar[tuple[str, ...]] = (meta_keys.FEDDYN_ALPHA,)

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {"h_sum": {}}

    def broadcast_meta(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {meta_keys.FEDDYN_ALPHA: float(self.alpha)}

    def update_problems(
        self, update: ClientUpdate, global_params: Mapping[str, np.ndarray], state: Mapping[str, Any]
    ) -> list[str]:
        return param_keys_problems(
            update.meta.get(meta_keys.FEDDYN_PARAM_KEYS), global_params, state["h_sum"]
        ) + alpha_k_problems(update.meta.get(meta_keys.FEDDYN_ALPHA_K))

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        if not updates:
            raise AggregationError("feddyn: no client update to aggregate")
        population = self.population_size or len(context.population)
        if population < len(updates):
            raise AggregationError(f"feddyn: {len(updates)} participants but a population of only {population}")
        totals = [problem for u in updates if (problem := population_total_problem(u, self.alpha, population))]
        if totals:
            raise AggregationError("feddyn: " + "; ".join(totals))
        key_sets = {u.site: frozenset(u.meta[meta_keys.FEDDYN_PARAM_KEYS]) for u in updates}
        keys = key_sets[updates[0].site]
        if any(k != keys for k in key_sets.values()):
            raise AggregationError(
                f"feddyn: the sites name different trainable parameters in '{meta_keys.FEDDYN_PARAM_KEYS}'"
            )
        lacking = [u.site for u in updates if not keys <= set(u.params)]
        if lacking:
            raise AggregationError(f"feddyn: results from {lacking} lack parameters named in their param keys")
        h_sum = state["h_sum"]
        if h_sum and set(h_sum) != keys:
            raise AggregationError(
                f"feddyn: '{meta_keys.FEDDYN_PARAM_KEYS}' differs from the parameters of the server's running sum"
            )
        new_sum = accumulate_displacements(h_sum, global_params, updates, sorted(keys))
        params = feddyn_params(global_params, updates, new_sum, population)
        return AggregationResult(params=params, state={"h_sum": new_sum})
