"""FedMoS, server side: server momentum and client selection by data share.

Reference: Wang, Xu, Hu, Xu, Shen, Xu, "FedMoS: Taming Client Drift in Federated Learning with Double Momentum and
Adaptive Selection", IEEE INFOCOM 2023; the server follows the authors' released ``main_fed.py`` (docs/fedmos_moon.md,
FedMoS;
the paper text was not available). The client side (STORM momentum + proximal pull) is
`lightning_modules.algorithms.fedmos`.

Server momentum. With xt = sum_{i in S} wt_i (y_i - x) the selection-weighted model change of the round, the
authors' code does: first round x <- x + xt (u stays 0); later u <- beta * u - xt / (eta * E), x <- x - eta * E * u.
eta (client lr) and E (local epochs) are constant in a job, so with m = -eta * E * u (a model-sized delta) this is
exactly

    first aggregated round:  x <- x + xt,            m = 0
    later rounds:            m <- beta * m + xt,     x <- x + m

i.e. eta and E cancel and the rule needs neither (tested against the authors' form with several eta, E). The momentum
m is float64 in the computation and float32 in the state (checkpointed with the model); it applies to every
floating-point entry of the model (the authors' code steps the whole state dict); integer buffers
(``num_batches_tracked``) take the selection-weighted mean.

Client selection (rule hook ``select_sites``, called by the controller before each round; m = the job's
``clients_per_round`` count, p_i = n_i / sum_j n_j over the population):

- ``uniform``: m distinct sites drawn without replacement with probabilities p_i (numpy's sequential draw);
  aggregation weights wt_i = p_i / sum_{j selected} p_j (the authors' weighting);
- ``adaptive``: the authors' stratified ("clustered") sampling: sort sites by p_i (largest first, ties by name), lay
  their masses m * p_i one after the other into m urns of mass 1 (a site may straddle two or more urns), draw one
  site per urn with probability equal to its mass in that urn; wt_i = (times i was drawn) / m. Every site's expected
  weight is p_i (unbiased), with less variance than independent draws. A site drawn twice trains once with weight 2/m.
  Masses are exact fractions, so the urns do not depend on float rounding.

Where the n_i come from: sites report ``train.num_samples`` with every result. Until every site of the population has
reported once, the round is a *census round*: every site trains and the weights are p_i over the participants
(FedAvg's). With the default of one federated round per job start this is the first round. ``site_num_samples``
(``{"site-1": 17998, ...}``) gives the counts up front and skips the census. Counts are refreshed from every result.
If a selected site's result is missing or rejected, the weights of the others are renormalised to sum to 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, ClassVar, Literal

import numpy as np

from aggregators.contracts.hparams import CHECKED_TOGETHER, hparam
from aggregators.functional import by_site, is_float_array, sample_weights, weighted_mean
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)

Selection = Literal["uniform", "adaptive"]
_SELECTION_STREAM = 0x466D53  # separates the selection's random stream from other seeded draws of the job


def data_shares(sites: Sequence[str], counts: Mapping[str, int]) -> list[Fraction]:
    """Exact p_i = n_i / sum_j n_j for ``sites`` (in that order)."""
    total = sum(int(counts[s]) for s in sites)
    if total <= 0:
        raise AggregationError(f"fedmos: the sites' sample counts must have a positive total, got {dict(counts)}")
    return [Fraction(int(counts[s]), total) for s in sites]


def stratified_urns(sites: Sequence[str], shares: Sequence[Fraction], m: int) -> list[dict[str, Fraction]]:
    """m urns of mass 1 filled with the masses m * p_i, largest p_i first (ties by site name)."""
    order = sorted(range(len(sites)), key=lambda i: (-shares[i], sites[i]))
    urns: list[dict[str, Fraction]] = [{}]
    room = Fraction(1)
    for i in order:
        mass = m * shares[i]
        while mass > 0:
            if room == 0:
                urns.append({})
                room = Fraction(1)
            put = min(mass, room)
            urns[-1][sites[i]] = urns[-1].get(sites[i], Fraction(0)) + put
            mass -= put
            room -= put
    if len(urns) != m or any(sum(urn.values()) != 1 for urn in urns):
        raise AggregationError(f"fedmos: stratified urns do not add up ({len(urns)} urns for m = {m})")
    return urns


def select_uniform(
    sites: Sequence[str], shares: Sequence[Fraction], m: int, rng: np.random.Generator
) -> dict[str, float]:
    """m distinct sites drawn with probabilities p_i; weights p_i renormalised over the chosen."""
    p = np.array([float(s) for s in shares], dtype=np.float64)
    chosen = rng.choice(len(sites), size=m, replace=False, p=p / p.sum())
    total = sum(shares[i] for i in chosen)
    return {sites[i]: float(shares[i] / total) for i in sorted(chosen, key=lambda i: sites[i])}


def select_adaptive(
    sites: Sequence[str], shares: Sequence[Fraction], m: int, rng: np.random.Generator
) -> dict[str, float]:
    """One draw per stratified urn; weight = (times drawn) / m."""
    counts: dict[str, int] = {}
    for urn in stratified_urns(sites, shares, m):
        names = sorted(urn)
        p = np.array([float(urn[name]) for name in names], dtype=np.float64)
        drawn = names[int(rng.choice(len(names), p=p / p.sum()))]
        counts[drawn] = counts.get(drawn, 0) + 1
    return {site: counts[site] / m for site in sorted(counts)}


def momentum_step(
    global_params: Mapping[str, np.ndarray],
    updates: Sequence[ClientUpdate],
    weights: np.ndarray,
    momentum: Mapping[str, np.ndarray],
    beta: float,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """x <- x + m with m <- beta * m + xt; ``momentum={}`` is the first aggregated round: x <- x + xt, m = 0."""
    new_params, new_momentum = {}, {}
    for key, current in global_params.items():
        arrays = [u.params[key] for u in updates]
        if not is_float_array(current):
            new_params[key] = weighted_mean(arrays, weights, current)
            continue
        x = np.asarray(current, dtype=np.float64)
        xt = weighted_mean(arrays, weights, x) - x
        if momentum:
            step = beta * np.asarray(momentum[key], dtype=np.float64) + xt
            new_momentum[key] = step.astype(np.float32)
        else:
            step = xt
            new_momentum[key] = np.zeros(np.shape(current), dtype=np.float32)
        new_params[key] = (x + step).astype(np.asarray(current).dtype)
    return new_params, new_momentum


@dataclass(frozen=True)
class FedMoS(RuleHParams, AggregationRule):
    """FedMoS server rule.

    Args:
        beta: server momentum in [0, 1) (authors' ``run.sh``: 0.8; 0 gives selection-weighted FedAvg).
        selection: ``uniform`` or ``adaptive`` (see the module docstring).
        site_num_samples: optional ``{site: n_i}`` known up front; without it the first round is a census round.
    """

    beta: float = hparam(0.8, low=0, high=1, high_open=True, note="server momentum")
    selection: Selection = "uniform"
    site_num_samples: dict[str, int] | None = field(default=None, metadata=CHECKED_TOGETHER)

    name: ClassVar[str] = "fedmos"
    secure_sum: ClassVar[str] = "selects sites by data share and applies server momentum to the plaintext average"
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    #: Server momentum carries earlier rounds into this one.
    mean_type: ClassVar[bool] = False

    def check_together(self) -> None:
        counts = self.site_num_samples
        if counts is not None and not isinstance(counts, Mapping):
            self.refuse("site_num_samples", "a mapping of site -> sample count", counts)
        for site, count in (counts or {}).items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                self.refuse("site_num_samples", "a positive integer for every site", count, f"site '{site}'")

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {"momentum": {}, "num_samples": dict(self.site_num_samples or {}), "selection": {}}

    def select_sites(
        self, population: Sequence[str], count: int, state: Mapping[str, Any], seed: int, round_num: int
    ) -> tuple[list[str], dict[str, Any]]:
        """The round's sites and the state carrying their aggregation weights (empty = census round)."""
        sites = sorted(population)
        known = state["num_samples"]
        if any(site not in known for site in sites):
            return sites, {**state, "selection": {}}
        rng = np.random.default_rng([seed, round_num, _SELECTION_STREAM])
        shares = data_shares(sites, known)
        m = min(count, len(sites))
        choose = select_uniform if self.selection == "uniform" else select_adaptive
        selection = choose(sites, shares, m, rng)
        return sorted(selection), {**state, "selection": selection}

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        weights = self._weights(updates, state.get("selection") or {})
        params, momentum = momentum_step(global_params, updates, weights, state["momentum"], self.beta)
        num_samples = {**state["num_samples"], **{u.site: int(u.num_samples) for u in updates}}
        return AggregationResult(
            params=params, state={"momentum": momentum, "num_samples": num_samples, "selection": {}}
        )

    @staticmethod
    def _weights(updates: Sequence[ClientUpdate], selection: Mapping[str, float]) -> np.ndarray:
        if not selection:
            return sample_weights(updates)
        unselected = [u.site for u in updates if u.site not in selection]
        if unselected:
            raise AggregationError(f"fedmos: results from sites that were not selected this round: {unselected}")
        weights = np.array([selection[u.site] for u in updates], dtype=np.float64)
        return weights / weights.sum()
