"""The wire contract: one typed message per thing that travels between the server and the sites.

Both sides import this module (it needs only numpy), so a message is written and checked by the same code:
``to_meta()`` gives the namespaced meta entries (the keys of ``aggregators/contracts/meta_keys.py``, unchanged, so
exported jobs keep their meaning) and ``from_meta(meta, ...)`` reads them back, checking keys, types, shapes and
finiteness once, and returns a `Parsed`: the message, or every problem by key. Nothing here raises on bad input; the
server rejects the site by name, the client refuses the round with the site's name.

| message | direction | keys |
|---|---|---|
| `RoundInfo` | down | ``server.`` + ``round``, ``num_rounds``, ``rule``, ``run_id``, ``last_aggregated`` |
| `ControlVariate` (global) | down | ``scaffold.ctrl.global`` |
| `ControlVariate` (diff) | up | ``scaffold.ctrl.diff`` |
| `FedDynReport` | up | ``feddyn.alpha_k``, ``feddyn.param_keys`` |
| `FedNovaReport` | up | ``fednova.tau``, ``fednova.a_norm`` |
| `TrainingStats` | up | ``train.num_samples``, ``train.num_steps``, ``train.loss``, ``train.param_keys`` |
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np

from aggregators.contracts import meta_keys

T = TypeVar("T")
Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class Parsed(Generic[T]):
    """A message read from meta, or the problems found, by meta key (``value`` is ``None`` when there are any)."""

    value: T | None
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        return [f"'{key}': {problem}" for key, problem in self.problems.items()]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)


def _finite_number(value: Any, low: float | None = None, low_open: bool = False) -> str | None:
    if not _is_number(value) or not math.isfinite(float(value)):
        return f"must be a finite number, got {value!r}"
    if low is not None and (value < low or (low_open and value == low)):
        return f"must be {'>' if low_open else '>='} {low}, got {value}"
    return None


def _count(value: Any, minimum: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        return f"must be an integer >= {minimum}, got {value!r}"
    return None


# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RoundInfo:
    """What every broadcast carries besides the model: the round, the number of rounds, the rule, the run id, and
    ``last_aggregated`` (site -> the last round whose aggregate included its result), by which sites commit or roll
    back their pending state (docs/reliability.md, transactional client state); ``None``: not sent (an older
    server's checkpoint), and sites commit as before. The round engine builds its broadcast from this class."""

    round: int
    num_rounds: int
    rule: str
    run_id: str
    last_aggregated: dict[str, int] | None = None
    #: site -> the last round whose result from that site reached the server, aggregated or rejected (a DP site
    #: that finds no ledger although it is named here stops: its release has been counted nowhere else).
    last_released: dict[str, int] | None = None
    #: site -> the DP-SGD steps its last result the server received reported (``privacy.steps``): a DP site whose
    #: ledger holds fewer stops (its ledger is stale). Sent only once some site has reported steps.
    released_steps: dict[str, int] | None = None

    def to_meta(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            meta_keys.ROUND: self.round,
            meta_keys.NUM_ROUNDS: self.num_rounds,
            meta_keys.AGGREGATION_RULE: self.rule,
            meta_keys.RUN_ID: self.run_id,
        }
        if self.last_aggregated is not None:
            meta[meta_keys.LAST_AGGREGATED] = dict(self.last_aggregated)
        if self.last_released is not None:
            meta[meta_keys.LAST_RELEASED] = dict(self.last_released)
        if self.released_steps:
            meta[meta_keys.RELEASED_STEPS] = dict(self.released_steps)
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Parsed[RoundInfo]:
        problems = {}
        for key, minimum in ((meta_keys.ROUND, 0), (meta_keys.NUM_ROUNDS, 1)):
            problem = _count(meta.get(key), minimum)
            if problem:
                problems[key] = problem
        round_num, num_rounds = meta.get(meta_keys.ROUND), meta.get(meta_keys.NUM_ROUNDS)
        if not problems and round_num >= num_rounds:
            problems[meta_keys.ROUND] = f"must be below num_rounds={num_rounds}, got {round_num}"
        for key in (meta_keys.AGGREGATION_RULE, meta_keys.RUN_ID):
            if not isinstance(meta.get(key), str):
                problems[key] = f"must be text, got {meta.get(key)!r}"
        confirmed, released = meta.get(meta_keys.LAST_AGGREGATED), meta.get(meta_keys.LAST_RELEASED)
        steps = meta.get(meta_keys.RELEASED_STEPS)
        checks = (
            (meta_keys.LAST_AGGREGATED, confirmed, "round"),
            (meta_keys.LAST_RELEASED, released, "round"),
            (meta_keys.RELEASED_STEPS, steps, "step count"),
        )
        for key, value, what in checks:
            problem = None if value is None else _rounds_by_site(value, what)
            if problem:
                problems[key] = problem
        if problems:
            return Parsed(None, problems)
        return Parsed(
            cls(
                int(meta[meta_keys.ROUND]),
                int(meta[meta_keys.NUM_ROUNDS]),
                meta[meta_keys.AGGREGATION_RULE],
                meta[meta_keys.RUN_ID],
                None if confirmed is None else {site: int(r) for site, r in confirmed.items()},
                None if released is None else {site: int(r) for site, r in released.items()},
                None if steps is None else {site: int(n) for site, n in steps.items()},
            )
        )


def round_meta_problems(meta: Mapping[str, Any]) -> dict[str, str]:
    """Why the round keys a site acts on before training are unusable, by key: the round index and
    ``last_aggregated`` (which decide whether its pending state is committed or discarded). Keys that were not
    sent are not checked here; `RoundInfo.from_meta` checks a whole broadcast."""
    problems = {}
    if meta_keys.ROUND in meta and (problem := _count(meta[meta_keys.ROUND], 0)):
        problems[meta_keys.ROUND] = problem
    confirmed = meta.get(meta_keys.LAST_AGGREGATED)
    if confirmed is not None and (problem := _rounds_by_site(confirmed)):
        problems[meta_keys.LAST_AGGREGATED] = problem
    return problems


def _rounds_by_site(value: Any, what: str = "round") -> str | None:
    """Why ``value`` is not a site -> round index (or other count, ``what``) map (``None``: it is)."""
    if not isinstance(value, Mapping):
        return f"must be a dict of site name -> {what}, got {type(value).__name__}"
    bad = sorted(str(site) for site, r in value.items() if not isinstance(site, str) or _count(r, 0))
    return f"must map site names to {what}s >= 0; bad entries for {bad[:5]}" if bad else None


# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ControlVariate:
    """SCAFFOLD's control over the trainable parameters: the global c going down (``scaffold.ctrl.global``; empty in
    the first round, meaning c = 0) or a site's change delta c_i going up (``scaffold.ctrl.diff``)."""

    key: str
    arrays: dict[str, np.ndarray]

    def to_meta(self) -> dict[str, Any]:
        return {self.key: {name: np.asarray(value, dtype=np.float32) for name, value in self.arrays.items()}}

    @classmethod
    def from_meta(
        cls,
        meta: Mapping[str, Any],
        key: str,
        shapes: Shapes,
        *,
        allow_empty: bool,
        buffers: frozenset[str] = frozenset(),
    ) -> Parsed[ControlVariate]:
        """Read ``key`` and check it against ``shapes`` (the trainable parameters, by name): the same names, the same
        shapes, float arrays, finite values. ``buffers`` are model entries a control must never cover."""
        value = meta.get(key)
        if not isinstance(value, Mapping) or (not value and not allow_empty):
            return Parsed(
                None,
                {key: f"must be a {'' if allow_empty else 'non-empty '}dict of arrays, got {type(value).__name__}"},
            )
        if not value:
            return Parsed(cls(key, {}))
        problems = []
        covered = sorted(set(value) & buffers)
        if covered:
            problems.append(f"controls an integer buffer {covered[:5]}; controls cover trainable parameters only")
        unknown = sorted(set(value) - set(shapes) - buffers)
        missing = sorted(set(shapes) - set(value))
        if unknown or missing:
            problems.append(
                f"does not match this model's trainable parameters (missing {missing[:5]}, unexpected {unknown[:5]})"
            )
        for name in sorted(set(value) & set(shapes)):
            problem = _array_problem(value[name], shapes[name])
            if problem:
                problems.append(f"entry '{name}' {problem}")
        if problems:
            return Parsed(None, {key: "; ".join(problems)})
        return Parsed(cls(key, {name: np.asarray(array) for name, array in value.items()}))


def _array_problem(value: Any, shape: tuple[int, ...]) -> str | None:
    if not isinstance(value, np.ndarray) or not np.issubdtype(value.dtype, np.floating):
        return f"must be a float numpy array, got {type(value).__name__}"
    if value.shape != tuple(shape):
        return f"has shape {value.shape}, the parameter has {tuple(shape)}"
    if not np.all(np.isfinite(value)):
        return "contains NaN or Inf"
    return None


# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FedNovaReport:
    """tau_i, the optimizer steps taken, and ||a_i||_1, the normaliser of the local update (FedNova)."""

    tau: int
    a_norm: float

    def to_meta(self) -> dict[str, Any]:
        return {meta_keys.FEDNOVA_TAU: self.tau, meta_keys.FEDNOVA_A_NORM: self.a_norm}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Parsed[FedNovaReport]:
        problems = {}
        problem = _count(meta.get(meta_keys.FEDNOVA_TAU), 1)
        if problem:
            problems[meta_keys.FEDNOVA_TAU] = problem
        problem = _finite_number(meta.get(meta_keys.FEDNOVA_A_NORM), 0.0, low_open=True)
        if problem:
            problems[meta_keys.FEDNOVA_A_NORM] = problem
        if problems:
            return Parsed(None, problems)
        return Parsed(cls(int(meta[meta_keys.FEDNOVA_TAU]), float(meta[meta_keys.FEDNOVA_A_NORM])))


@dataclass(frozen=True)
class FedDynReport:
    """alpha_k, the site's FedDyn coefficient, and the parameters its state H_k covers."""

    alpha_k: float
    param_keys: tuple[str, ...]

    def to_meta(self) -> dict[str, Any]:
        return {meta_keys.FEDDYN_ALPHA_K: self.alpha_k, meta_keys.FEDDYN_PARAM_KEYS: list(self.param_keys)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Parsed[FedDynReport]:
        problems = {}
        problem = _finite_number(meta.get(meta_keys.FEDDYN_ALPHA_K), 0.0, low_open=True)
        if problem:
            problems[meta_keys.FEDDYN_ALPHA_K] = problem
        keys = meta.get(meta_keys.FEDDYN_PARAM_KEYS)
        if not isinstance(keys, list | tuple) or not keys or not all(isinstance(k, str) for k in keys):
            problems[meta_keys.FEDDYN_PARAM_KEYS] = f"must be a non-empty list of parameter names, got {keys!r}"
        if problems:
            return Parsed(None, problems)
        return Parsed(cls(float(meta[meta_keys.FEDDYN_ALPHA_K]), tuple(keys)))


@dataclass(frozen=True)
class TrainingStats:
    """What every site reports about its round: the FedAvg weight, the steps, the loss and the trainable keys."""

    num_samples: int
    num_steps: int
    loss: float
    param_keys: tuple[str, ...]

    def to_meta(self) -> dict[str, Any]:
        return {
            meta_keys.NUM_SAMPLES: self.num_samples,
            meta_keys.NUM_STEPS: self.num_steps,
            meta_keys.TRAIN_LOSS: self.loss,
            meta_keys.PARAM_KEYS: list(self.param_keys),
        }

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> Parsed[TrainingStats]:
        problems = {}
        for key in (meta_keys.NUM_SAMPLES, meta_keys.NUM_STEPS):
            problem = _count(meta.get(key), 0)
            if problem:
                problems[key] = problem
        loss = meta.get(meta_keys.TRAIN_LOSS)
        if not _is_number(loss):  # NaN is allowed: a site that took no step reports no loss
            problems[meta_keys.TRAIN_LOSS] = f"must be a number, got {loss!r}"
        keys = meta.get(meta_keys.PARAM_KEYS)
        if not isinstance(keys, list | tuple) or not all(isinstance(k, str) for k in keys):
            problems[meta_keys.PARAM_KEYS] = f"must be a list of parameter names, got {keys!r}"
        if problems:
            return Parsed(None, problems)
        return Parsed(cls(int(meta[meta_keys.NUM_SAMPLES]), int(meta[meta_keys.NUM_STEPS]), float(loss), tuple(keys)))
