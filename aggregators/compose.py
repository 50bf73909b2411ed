"""Composition of a client algorithm with any server rule: companion state rules and the build-time check.

The job's server rule updates the model. A client algorithm that needs server-side state of its own (SCAFFOLD's
global control c, broadcast as ``scaffold.ctrl.global``) gets it from a *companion*: a rule that keeps and
broadcasts that state from the same accepted updates but never touches the model. `ComposedRule` runs the
model rule, then every companion, and checkpoints their states side by side, so SCAFFOLD + FedYogi is FedYogi's
model step on the SCAFFOLD-corrected client models plus SCAFFOLD's c <- c + (1/N) sum_i delta_c_i.

`plan_composition` decides at build time which companions a (client algorithm, server rule) pair needs, or
refuses the pair with the reason it is meaningless. Classes are read duck-typed: a client algorithm class has
``name``, ``required_server_meta``, ``sent_meta`` and, declared on its own class (`aggregators.types.declared`: an
undeclared one is refused), ``local_update`` (``gradient``, ``proximal`` or ``drift``);
a rule class has ``name``, ``required_meta``, ``broadcast_keys`` and optionally ``needs_linear_local_solver``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.scaffold import ScaffoldControl
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    CompanionRule,
    RoundContext,
    UndeclaredCapability,
    declared,
)


class CompositionError(AggregationError):
    """A client algorithm and a server rule that cannot run together, with the reason."""


Companion = CompanionRule  # server-side state of a client algorithm, kept beside any model-update rule


COMPANIONS: dict[str, type] = {ScaffoldControl.name: ScaffoldControl}

#: Meta every client sends whatever its algorithm (lightning_modules/classifier.py, FederatedRoundCallback).
COMMON_CLIENT_META = (
    meta_keys.NUM_SAMPLES,
    meta_keys.NUM_STEPS,
    meta_keys.TRAIN_LOSS,
    meta_keys.TRAIN_ACCURACY,
    meta_keys.CLIENT_ALGORITHM,
    meta_keys.PARAM_KEYS,
)
#: Sent in addition by clients whose local update is linear in their gradients (``local_update`` != ``drift``).
LINEAR_SOLVER_META = (meta_keys.FEDNOVA_TAU, meta_keys.FEDNOVA_A_NORM)

#: Why no companion can provide a key some client algorithm needs from the server.
NO_COMPANION_REASON = {
    meta_keys.FEDDYN_ALPHA: (
        "FedDyn's server step (theta = mean of the participants + h/m) is itself the model update; another rule's "
        "model update next to it would apply two different steps to one model; use --server feddyn"
    ),
}


def client_sent_meta(client_cls: type) -> set[str]:
    """Every meta key a client running ``client_cls`` sends each round (its own ``local_update`` declaration says
    whether it reports FedNova's tau and ||a||_1; undeclared: `UndeclaredCapability`)."""
    sent = set(client_cls.sent_meta) | set(COMMON_CLIENT_META)
    if declared(client_cls, "local_update") != "drift":
        sent |= set(LINEAR_SOLVER_META)
    return sent


def plan_composition(client_cls: type, rule_cls: type) -> tuple[str, ...]:
    """Companion rule names the pair needs (often none); raises `CompositionError` saying why it cannot run (a
    client that declares no ``local_update`` of its own among the reasons)."""
    who = f"client algorithm '{client_cls.name}' with server rule '{rule_cls.name}'"
    try:
        local_update = declared(client_cls, "local_update")
    except UndeclaredCapability as exc:
        raise CompositionError(str(exc)) from None
    if rule_cls.needs_linear_local_solver and local_update == "drift":
        raise CompositionError(
            f"{who}: FedNova normalises each update by ||a_i||_1, the weight of the local gradients in x - y_i; "
            f"'{client_cls.name}' adds a correction that is not a local gradient, so no such ||a_i||_1 exists and "
            "the client cannot report one"
        )
    missing_up = [k for k in rule_cls.required_meta if k not in client_sent_meta(client_cls)]
    if missing_up:
        raise CompositionError(
            f"server rule '{rule_cls.name}' needs {missing_up} from every client, which client algorithm "
            f"'{client_cls.name}' does not send; use a client algorithm that reports it (e.g. '{rule_cls.name}')"
        )
    companions = []
    for key in client_cls.required_server_meta:
        if key in rule_cls.broadcast_keys:
            continue
        needs = f"client algorithm '{client_cls.name}' needs ['{key}'] from the server, which rule '{rule_cls.name}'"
        if key in NO_COMPANION_REASON:
            raise CompositionError(f"{needs} does not send and no companion can keep: {NO_COMPANION_REASON[key]}")
        provider = next((name for name, cls in COMPANIONS.items() if key in cls.broadcast_keys), None)
        if provider is None:
            raise CompositionError(
                f"{needs} does not send and no companion rule keeps; use a server rule that maintains it "
                f"(e.g. '{client_cls.name}')"
            )
        if provider not in companions:
            companions.append(provider)
    return tuple(companions)


@dataclass(frozen=True)
class ComposedRule(AggregationRule):
    """A model-update rule plus companion state rules; state = ``{"rule": ..., "companions": {name: ...}}``."""

    rule: AggregationRule
    companions: tuple[Companion, ...]

    @property
    def name(self) -> str:  # type: ignore[override]  (a composed rule is named after its parts)
        return "+".join([self.rule.name, *(c.name for c in self.companions)])

    @property
    def required_meta(self) -> tuple[str, ...]:
        keys = [*self.rule.required_meta, *(k for c in self.companions for k in c.required_meta)]
        return tuple(dict.fromkeys(keys))

    @property
    def broadcast_keys(self) -> tuple[str, ...]:
        keys = [*self.rule.broadcast_keys, *(k for c in self.companions for k in c.broadcast_keys)]
        return tuple(dict.fromkeys(keys))

    @property
    def mean_type(self) -> bool:  # type: ignore[override]
        return self.rule.mean_type

    @property
    def needs_linear_local_solver(self) -> bool:  # type: ignore[override]
        return self.rule.needs_linear_local_solver

    def select_sites(
        self, population: Sequence[str], count: int, state: Mapping[str, Any], seed: int, round_num: int
    ) -> tuple[list[str], dict[str, Any]] | None:
        """The model rule's own site selection (FedMoS), on its part of the state; ``None`` when it has none."""
        selection = self.rule.select_sites(population, count, state["rule"], seed, round_num)
        if selection is None:
            return None
        sites, rule_state = selection
        return sites, {**state, "rule": rule_state}

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {
            "rule": self.rule.init_state(global_params),
            "companions": {c.name: c.init_state(global_params) for c in self.companions},
        }

    def broadcast_meta(self, state: Mapping[str, Any]) -> dict[str, Any]:
        meta = dict(self.rule.broadcast_meta(state["rule"]))
        for companion in self.companions:
            meta.update(companion.broadcast_meta(state["companions"][companion.name]))
        return meta

    def update_problems(
        self, update: ClientUpdate, global_params: Mapping[str, np.ndarray], state: Mapping[str, Any]
    ) -> list[str]:
        problems = list(self.rule.update_problems(update, global_params, state["rule"]))
        for companion in self.companions:
            problems += companion.update_problems(update, global_params, state["companions"][companion.name])
        return problems

    def diagnostics(self, state: Mapping[str, Any]) -> dict[str, float]:
        values = dict(self.rule.diagnostics(state["rule"]))
        for companion in self.companions:
            values.update(companion.diagnostics(state["companions"][companion.name]))
        return values

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        result = self.rule.aggregate(global_params, updates, state["rule"], context)
        companion_states = {
            c.name: c.update_state(updates, state["companions"][c.name], context) for c in self.companions
        }
        return AggregationResult(
            params=result.params, state={"rule": result.state, "companions": companion_states}, meta=result.meta
        )


def build_companion(name: str, **kwargs: Any) -> Companion:
    """Instantiate the companion called ``name``; unknown names list the valid ones."""
    try:
        companion_cls = COMPANIONS[name]
    except KeyError:
        raise AggregationError(f"unknown companion rule '{name}'; choose one of {sorted(COMPANIONS)}") from None
    try:
        return companion_cls(**kwargs)
    except TypeError as exc:
        raise AggregationError(f"bad hyperparameters for companion rule '{name}': {exc}") from None


def compose(rule: AggregationRule, companions: Mapping[str, Mapping[str, Any]] | None) -> AggregationRule:
    """``rule`` alone when there are no companions, else the `ComposedRule` (companions in name order)."""
    if not companions:
        return rule
    built = tuple(build_companion(name, **dict(args or {})) for name, args in sorted(companions.items()))
    return ComposedRule(rule=rule, companions=built)
