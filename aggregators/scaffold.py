"""SCAFFOLD, server side: model averaging plus the global control variate.

Reference: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020,
arXiv:1910.06378, Algorithm 1 (server lines):

    x <- x + eta_g * (1/|S|) * sum_{i in S} (y_i - x)
    c <- c + (|S|/N) * (1/|S|) * sum_{i in S} delta_c_i   =   c + (1/N) * sum_{i in S} delta_c_i

N is the size of the whole site population, not the number of participants: with partial participation
NVFlare's built-in SCAFFOLD workflow (weighted mean of delta_c over the participants) over-scales c by N/|S|.
With every control starting at 0 this keeps the invariant c = (1/N) * sum_{all i} c_i (tested).

The paper averages the models uniformly (``weighting="uniform"``, the default); ``weighting="samples"`` weights
them by sample count as FedAvg does. The control update is unweighted in both cases, as in the paper. Controls
cover trainable parameters only and are kept in float32; buffers are averaged like the model, never controlled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.contracts.hparams import hparam
from aggregators.contracts.wire import ControlVariate
from aggregators.deltas import model_trainable_keys
from aggregators.fedavg import weighted_model_step
from aggregators.functional import Weighting, by_site, sample_weights
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    CompanionRule,
    RoundContext,
    RuleHParams,
)

Controls = dict[str, np.ndarray]


def control_keys(
    global_params: Mapping[str, np.ndarray], global_control: Mapping[str, np.ndarray], param_keys: Sequence[str] | None
) -> list[str]:
    """The trainable parameters a control diff must cover: those of the global control once there is one; before
    that (the first round) the round's agreed ``train.param_keys`` (the round engine has already rejected by name
    every site whose set differs from the one most sites report, so a site's own set here is the round's), and
    when no site reports one, the model's trainable entries as every rule defines them
    (`aggregators.deltas.model_trainable_keys`: float entries, BatchNorm statistics excluded)."""
    if global_control:
        return list(global_control)
    if param_keys:
        return [key for key in param_keys if key in global_params]
    return model_trainable_keys(global_params)


def control_problems(
    diff: Any,
    global_params: Mapping[str, np.ndarray],
    global_control: Mapping[str, np.ndarray],
    param_keys: Sequence[str] | None = None,
) -> list[str]:
    """Why a client's ``scaffold.ctrl.diff`` cannot be used (empty list: it can), through the wire contract: it
    must cover exactly the expected trainable parameters (`control_keys`), with their shapes, finite."""
    shapes = {key: np.shape(global_params[key]) for key in control_keys(global_params, global_control, param_keys)}
    buffers = frozenset(k for k, v in global_params.items() if not np.issubdtype(np.asarray(v).dtype, np.floating))
    parsed = ControlVariate.from_meta(
        {meta_keys.SCAFFOLD_CTRL_DIFF: diff}, meta_keys.SCAFFOLD_CTRL_DIFF, shapes, allow_empty=False, buffers=buffers
    )
    return parsed.lines()


def l2_norm(arrays: Mapping[str, np.ndarray]) -> float:
    """The Euclidean norm of all arrays together (0 for none), in float64."""
    return float(np.sqrt(sum(float(np.sum(np.square(np.asarray(a, dtype=np.float64)))) for a in arrays.values())))


def update_global_control(
    control: Mapping[str, np.ndarray], diffs: Sequence[Mapping[str, np.ndarray]], population_size: int
) -> Controls:
    """c + (1/N) * sum_i delta_c_i in float64, stored as float32. An empty ``control`` means all zeros."""
    keys = set(diffs[0])
    if any(set(d) != keys for d in diffs):
        raise AggregationError("scaffold: the sites' control diffs cover different parameters")
    new_control = {}
    for key in sorted(keys):
        total = np.asarray(control[key], dtype=np.float64) if key in control else np.zeros(diffs[0][key].shape)
        for diff in diffs:
            total = total + np.asarray(diff[key], dtype=np.float64) / population_size
        new_control[key] = total.astype(np.float32)
    return new_control


@dataclass(frozen=True)
class ScaffoldControl(RuleHParams, CompanionRule):
    """SCAFFOLD's server control c alone, as a companion of another model-update rule (aggregators/compose.py).

    Keeps c <- c + (1/N) * sum_{i in S} delta_c_i and broadcasts it; the model step is left to the rule it is composed
    with (e.g. FedYogi), which then steps from the SCAFFOLD-corrected client models.
    """

    population_size: int | None = hparam(None, low=1, note="N; unset: every site connected when the job started")

    name: ClassVar[str] = "scaffold_control"
    required_meta: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_DIFF,)
    broadcast_keys: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_GLOBAL,)

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {"control": {}}

    def broadcast_meta(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {meta_keys.SCAFFOLD_CTRL_GLOBAL: dict(state["control"])}

    def diagnostics(self, state: Mapping[str, Any]) -> dict[str, float]:
        return {meta_keys.SCAFFOLD_CTRL_GLOBAL_NORM: l2_norm(state["control"])}

    def update_problems(
        self, update: ClientUpdate, global_params: Mapping[str, np.ndarray], state: Mapping[str, Any]
    ) -> list[str]:
        return control_problems(
            update.meta.get(meta_keys.SCAFFOLD_CTRL_DIFF),
            global_params,
            state["control"],
            update.meta.get(meta_keys.PARAM_KEYS),
        )

    def update_state(
        self, updates: Sequence[ClientUpdate], state: Mapping[str, Any], context: RoundContext
    ) -> dict[str, Any]:
        population = self.population_size or len(context.population)
        if population < len(updates):
            raise AggregationError(f"scaffold: {len(updates)} participants but a population of only {population}")
        updates = by_site(updates)
        first = set(updates[0].meta[meta_keys.SCAFFOLD_CTRL_DIFF])
        others = [u.site for u in updates if set(u.meta[meta_keys.SCAFFOLD_CTRL_DIFF]) != first]
        if others:  # the round engine rejects such sites first; a caller that does not gets the sites named
            raise AggregationError(
                f"scaffold: the control diffs of {others} cover other parameters than that of {updates[0].site}"
            )
        diffs = [u.meta[meta_keys.SCAFFOLD_CTRL_DIFF] for u in updates]
        return {"control": update_global_control(state["control"], diffs, population)}


@dataclass(frozen=True)
class Scaffold(RuleHParams, AggregationRule):
    """SCAFFOLD server rule.

    Args:
        server_lr: eta_g (1.0 in the paper's experiments).
        weighting: ``uniform`` (paper) or ``samples`` model averaging.
        population_size: N; ``None`` uses every site connected when the job started.
    """

    server_lr: float = hparam(1.0, low=0, low_open=True, note="eta_g")
    weighting: Weighting = "uniform"
    population_size: int | None = hparam(None, low=1, note="N; unset: every site connected when the job started")

    name: ClassVar[str] = "scaffold"
    secure_sum: ClassVar[str] = (
        "keeps the control c from every site's delta c_i, which travels beside the model; NVFlare's HE "
        "aggregator sums the model only"
    )
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None
    required_meta: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_DIFF,)
    broadcast_keys: ClassVar[tuple[str, ...]] = (meta_keys.SCAFFOLD_CTRL_GLOBAL,)

    @property
    def control(self) -> ScaffoldControl:
        """The server control c is kept exactly as the companion keeps it beside other rules."""
        return ScaffoldControl(population_size=self.population_size)

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return self.control.init_state(global_params)

    def broadcast_meta(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return self.control.broadcast_meta(state)

    def diagnostics(self, state: Mapping[str, Any]) -> dict[str, float]:
        return self.control.diagnostics(state)

    def update_problems(
        self, update: ClientUpdate, global_params: Mapping[str, np.ndarray], state: Mapping[str, Any]
    ) -> list[str]:
        return self.control.update_problems(update, global_params, state)

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        next_state = self.control.update_state(updates, state, context)
        weights = sample_weights(updates) if self.weighting == "samples" else np.full(len(updates), 1 / len(updates))
        params = weighted_model_step(global_params, updates, weights, self.server_lr)
        return AggregationResult(params=params, state=next_state)
