"""Types shared by every aggregation rule: what a client contributes and what a round produces.

Rules are pure: ``(global params, client updates, state) -> (new params, new state, meta to broadcast)``.
Parameters are plain ``dict[str, np.ndarray]`` so rules need neither NVFlare nor torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from aggregators.contracts.hparams import HParams

Params = dict[str, np.ndarray]


class AggregationError(ValueError):
    """A round cannot be aggregated (no usable update, zero total weight, mismatched keys or shapes)."""


@dataclass(frozen=True)
class RuleHParams(HParams):
    """Base of the server rules (and companions) that declare their hyperparameters as dataclass fields
    (`aggregators.contracts.hparams`): a bad value is an `AggregationError`."""

    error: ClassVar[type[Exception]] = AggregationError


@dataclass(frozen=True)
class ClientUpdate:
    """One client's contribution to a round.

    ``params`` are the client's full model after local training (same keys and shapes as the global model);
    ``num_samples`` is the client's training-set size, the FedAvg weight; ``meta`` carries the rule-specific
    namespaced keys (for example ``scaffold.ctrl.diff``).
    """

    site: str
    params: Mapping[str, np.ndarray]
    num_samples: int
    meta: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RoundContext:
    """What a rule may know about the round besides the updates: its index and the whole site population."""

    round_num: int
    num_rounds: int
    population: tuple[str, ...]


@dataclass(frozen=True)
class AggregationResult:
    """A rule's output: the next global model, the rule's next state, and meta to broadcast with the model."""

    params: Params
    state: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)


class ServerState:
    """What rules and companions share: a name, the meta they require and broadcast, their state and checks."""

    name: ClassVar[str] = ""
    required_meta: ClassVar[tuple[str, ...]] = ()
    broadcast_keys: ClassVar[tuple[str, ...]] = ()

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return {}

    def broadcast_meta(self, state: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def update_problems(
        self, update: ClientUpdate, global_params: Mapping[str, np.ndarray], state: Mapping[str, Any]
    ) -> list[str]:
        return []

    def diagnostics(self, state: Mapping[str, Any]) -> dict[str, float]:
        """Scalars of the state worth watching per round (e.g. the norm of SCAFFOLD's global control); the engine
        writes them to the round's metrics line under ``rule_diagnostics``."""
        return {}


class UndeclaredCapability(ValueError):
    """A client algorithm or server rule that does not declare, on its own class, a capability the job asks."""


#: What to declare for each capability a class is asked (the end of the refusal's one line). A client algorithm's
#: and a rule's capabilities alike: every admission reads the class's own declaration (`declared`), never its
#: parent's, so a subclass that changes what its parent does is not admitted by its parent's lines.
TO_DECLARE: dict[str, str] = {
    "dp_sgd": "DPSGD(composes, why) (whether its outputs can be accounted under sample-level DP-SGD)",
    "released": "(Released(key, what, status), ...) for every key of sent_meta (() when it sends none)",
    "local_update": '"gradient", "proximal" or "drift" (how its local update relates to the local gradients)',
    "secure_sum": (
        "None for a client that needs nothing from the server but the global model, SECURE_SUM or SITE_STEP for a "
        "rule that runs on the sum, or else why it cannot run on a sum"
    ),
    "translation_equivariant": (
        'the settings under which its result ignores the global model ("" always), or None (it does not)'
    ),
    "partial_sharing_refused": "None (it aggregates the shared entries alone) or why it cannot",
    "client_level_dp": 'None (its result is no client-level DP release) or its DP mechanism\'s name ("DP-FedAvg")',
}
#: The capabilities every rule of `aggregators.registry.RULES` declares on its own class.
RULE_CAPABILITIES = ("secure_sum", "translation_equivariant", "partial_sharing_refused", "client_level_dp")
_REFUSE = object()


def undeclared_problem(cls: type, capability: str) -> str:
    """One line: ``cls`` (a client algorithm or rule class) declares no ``capability`` of its own, and what to
    declare."""
    kind = "client algorithm" if hasattr(cls, "required_server_meta") else "server rule"
    return (
        f"{kind} '{getattr(cls, 'name', '') or cls.__qualname__}' declares no {capability} of its own (a class never "
        f"inherits one): declare {capability} = {TO_DECLARE[capability]} on {cls.__qualname__}"
    )


def declared(cls: type, capability: str, undeclared: Any = _REFUSE) -> Any:
    """``capability`` as declared in ``cls``'s own body, never inherited: the one admission rule. Undeclared: the
    refusal value ``undeclared`` where one is given (an answer that refuses, e.g. `UNDECLARED_SECURE_SUM`), else
    `UndeclaredCapability` with `undeclared_problem`'s line."""
    own = vars(cls)
    if capability in own:
        return own[capability]
    if undeclared is _REFUSE:
        raise UndeclaredCapability(undeclared_problem(cls, capability))
    return undeclared


#: `AggregationRule.secure_sum` values of a rule that runs on the sum: the weighted mean itself, or a server
#: optimizer every site applies to the decrypted mean.
SECURE_SUM = "sum"
SITE_STEP = "site_step"
#: What a rule that declares no ``secure_sum`` of its own gets (a subclass may aggregate otherwise than its parent).
UNDECLARED_SECURE_SUM = "declares no secure_sum of its own: that it is a weighted sum of the updates is not known"


def declared_secure_sum(rule_cls: type) -> str:
    """The rule's own ``secure_sum`` declaration (`SECURE_SUM`, `SITE_STEP` or a refusal), never inherited."""
    return declared(rule_cls, "secure_sum", None) or UNDECLARED_SECURE_SUM


class AggregationRule(ServerState):
    """The base of every aggregation rule: what the round engine (``controllers/engine.py``) calls, with defaults.

    A rule declares ``name``, the meta every client result must carry (``required_meta``) and the meta keys it
    broadcasts (``broadcast_keys``), and overrides only the hooks it needs:

    - `aggregate` (stateful rules) or `aggregate_params` (stateless ones: the state passes through);
    - `init_state` / `broadcast_meta`: its server state and what the clients receive from it;
    - `update_problems`: its own checks of a client's update (a non-empty list rejects that site);
    - `select_sites`: its own choice of the round's sites (``None``: the engine's seeded sampling).

    State is returned, never mutated, so it can be checkpointed.
    """

    #: FedNova's normaliser needs clients whose local update is linear in their gradients (aggregators/compose.py).
    needs_linear_local_solver: ClassVar[bool] = False
    #: Identical client models give exactly that model (a weighted-mean-type rule); the contract tests check it.
    mean_type: ClassVar[bool] = True
    #: Capabilities (`RULE_CAPABILITIES`): every rule declares each on its own class, and each is read with
    #: `declared`, never inherited, so they have no value here; a rule that does not declare one is refused where the
    #: job asks it (`undeclared_problem`).
    #: The result does not depend on the global model x, rule(x, {y_i}) = rule(0, {y_i}), under the settings named
    #: here (``None``: it does): such a rule may run as an NVFlare ModelAggregator (controllers/nvflare_aggregator.py).
    translation_equivariant: ClassVar[str | None]
    #: Why the rule cannot aggregate the shared entries alone (``None``: it can): the job builder refuses it with
    #: partial sharing (``local_keys``: FedPer, FedBN, FedRep).
    partial_sharing_refused: ClassVar[str | None]
    #: How the rule runs under secure aggregation (jobs/secure_aggregation.py), where the server only ever holds the
    #: weighted sum of the sites' encrypted updates: `SECURE_SUM` (the rule is that weighted mean), `SITE_STEP` (a
    #: server optimizer that every site applies to the decrypted mean), or else why it cannot (what it needs of the
    #: individual updates) (`declared_secure_sum`: undeclared, it cannot).
    secure_sum: ClassVar[str]
    #: The name of its DP mechanism when the rule's result is a client-level DP release (``"DP-FedAvg"``), ``None``:
    #: it is not one. The builder then refuses what would escape that noise (a companion's state, float buffers,
    #: cross-site models, streamed logs: jobs/spec.py, jobs/log_streaming.py).
    client_level_dp: ClassVar[str | None]

    def select_sites(
        self, population: Sequence[str], count: int, state: Mapping[str, Any], seed: int, round_num: int
    ) -> tuple[list[str], dict[str, Any]] | None:
        return None

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        return AggregationResult(params=self.aggregate_params(global_params, updates, context), state=dict(state))

    def aggregate_params(
        self, global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], context: RoundContext
    ) -> Params:
        """The next global model of a stateless rule (stateful rules override `aggregate` instead)."""
        raise NotImplementedError(f"rule '{self.name}' implements neither aggregate nor aggregate_params")


class CompanionRule(ServerState):
    """Server-side state of a client algorithm kept beside any model-update rule (``aggregators/compose.py``)."""

    def update_state(
        self, updates: Sequence[ClientUpdate], state: Mapping[str, Any], context: RoundContext
    ) -> dict[str, Any]:
        raise NotImplementedError(f"companion '{self.name}' implements no update_state")
