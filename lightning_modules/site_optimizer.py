"""The server optimizer's step as a site takes it under secure aggregation: x_r = FedOpt(x_{r-1}, ybar_{r-1}, state).

The protocol, its state and its guarantees are described in `controllers.he_fedopt`, whose NVFlare filters call
this at every site in every round; ``python -m jobs.fedopt_final`` calls it once more after the job for x_T. It runs
at the site and reads the site's own state store, so it lives in the site's layer, below both the server's filters
and the builder, which checks a job's settings with `site_optimizer_problem` (docs/design.md, "Layers").
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.deltas import model_trainable_keys
from aggregators.functional import is_float_array
from aggregators.types import AggregationError, ClientUpdate, RoundContext
from lightning_modules.state_store import ClientStateStore, StateStoreError

#: The store's name for this state (one file per site and job).
ALGORITHM = "he_fedopt"
#: Result meta, site -> server, in clear: the digest of the state the site trained from, and its round.
DIGEST = "he_fedopt.digest"
DIGEST_ROUND = "he_fedopt.round"
#: Hex characters of the digest: 64 bits, enough to tell models apart by accident, short in the logs.
DIGEST_CHARS = 16


class SiteOptimizerError(RuntimeError):
    """The site cannot take this round's FedOpt step (one line, naming the site)."""


def digest(*parts: Any) -> str:
    """SHA-256 (first `DIGEST_CHARS` hex characters) of numbers and models (mappings of arrays, taken in key
    order with each entry's name, dtype and shape)."""
    hasher = hashlib.sha256()
    for part in parts:
        if isinstance(part, Mapping):
            for key in sorted(part):
                value = np.ascontiguousarray(part[key])
                hasher.update(f"{key}|{value.dtype.str}|{value.shape}|".encode())
                hasher.update(value.tobytes())
        else:
            hasher.update(f"{part!r}|".encode())
    return hasher.hexdigest()[:DIGEST_CHARS]


def as_model(received: Mapping[str, Any], like: Mapping[str, np.ndarray], site: str) -> dict[str, np.ndarray]:
    """The received model (decrypted entries are flat lists of floats) as float64 arrays shaped like ``like``; the
    rule types them like ``like`` (float32; integer buffers rounded back)."""
    if set(received) != set(like):
        missing, extra = sorted(set(like) - set(received)), sorted(set(received) - set(like))
        raise SiteOptimizerError(
            f"{site}: the received model's entries differ (missing {missing[:5]}, extra {extra[:5]})"
        )
    model = {}
    for key, value in like.items():
        array = np.asarray(received[key], dtype=np.float64)
        if array.size != value.size:
            raise SiteOptimizerError(f"{site}: received '{key}' has {array.size} values, the model {value.size}")
        model[key] = array.reshape(value.shape)
    return model


@dataclass(frozen=True)
class SiteState:
    """What a site keeps between rounds: x (the model it trained from), the rule's moments and step counter, the
    digest of the received model x was computed from, and the trainable entries its last result named."""

    x: dict[str, np.ndarray]
    m: dict[str, np.ndarray]
    v: dict[str, np.ndarray]
    step: int
    received: str
    param_keys: tuple[str, ...] | None = None

    @property
    def digest(self) -> str:
        """What the site sends with its result: equal at every site iff they hold the same x and moments."""
        return digest(self.x, self.m, self.v, self.step)

    def stored(self, settings: Mapping[str, Any]) -> dict[str, Any]:
        import torch

        def tensors(model: Mapping[str, np.ndarray]) -> dict[str, Any]:
            return {key: torch.from_numpy(np.array(value, copy=True)) for key, value in model.items()}

        keys = None if self.param_keys is None else list(self.param_keys)
        moments = {"m": tensors(self.m), "v": tensors(self.v), "step": self.step}
        return {"x": tensors(self.x), **moments, "received": self.received, "param_keys": keys, **settings}

    @classmethod
    def from_stored(cls, state: Mapping[str, Any]) -> SiteState:
        def arrays(model: Mapping[str, Any]) -> dict[str, np.ndarray]:
            return {key: value.numpy() for key, value in model.items()}

        keys = state.get("param_keys")
        return cls(
            x=arrays(state["x"]),
            m=arrays(state["m"]),
            v=arrays(state["v"]),
            step=int(state["step"]),
            received=str(state["received"]),
            param_keys=None if keys is None else tuple(keys),
        )


class SiteOptimizer:
    """One site's FedOpt step on the decrypted mean (module docstring), its state in ``store``."""

    def __init__(self, rule: str, rule_args: Mapping[str, Any] | None, store: ClientStateStore) -> None:
        from aggregators.registry import build_rule

        self.rule = build_rule(rule, **dict(rule_args or {}))
        self.store = store
        self.site = store.site_name
        #: Stored with the state: a state written under other settings is refused, never stepped on.
        self.settings = {"rule": rule, "rule_args": json.dumps(dict(rule_args or {}), sort_keys=True)}

    def start_round(self, round_num: int, received: Mapping[str, Any]) -> SiteState:
        """x_r for round ``round_num`` from the received model (module docstring), stored before it is returned."""
        stored = self.load()
        if stored is None:
            if round_num != 0:
                raise self._error(
                    f"no stored FedOpt state, but the server sends round {round_num}'s model: x_{round_num} needs "
                    "every global model since round 0 (the site joined late or lost its state store)"
                )
            if not all(isinstance(value, np.ndarray) for value in received.values()):
                raise self._error(
                    "round 0's model is not the initial model in clear (NVFlare sends that one unencrypted)"
                )
            initial = {key: np.array(value, copy=True) for key, value in received.items()}
            state = SiteState(x=initial, m={}, v={}, step=0, received=digest(as_model(received, initial, self.site)))
            return self._save(state, round_num)
        state, written = stored
        model = as_model(received, state.x, self.site)
        if written == round_num:  # the same round again: the site stored x_r and stopped before sending its result
            if digest(model) != state.received:
                raise self._error(
                    f"round {round_num} again with another global model than the one its stored x_{round_num} was "
                    "computed from"
                )
            return state
        if written != round_num - 1:
            raise self._error(
                f"its stored FedOpt state is of round {written}, the server sends round {round_num}'s model: the "
                "sites' x would differ (it missed a round, or the job restarted)"
            )
        return self._save(self.step(state, model), round_num)

    def step(self, state: SiteState, mean: Mapping[str, np.ndarray]) -> SiteState:
        """One FedOpt step from ``state`` on the weighted mean ``mean`` (the bundle's rule; nothing is stored)."""
        keys = state.param_keys if state.param_keys is not None else model_trainable_keys(state.x)
        update = ClientUpdate(site=self.site, params=mean, num_samples=1, meta={meta_keys.PARAM_KEYS: list(keys)})
        moments = {"m": state.m, "v": state.v, "step": state.step}
        context = RoundContext(round_num=state.step, num_rounds=state.step + 1, population=(self.site,))
        try:
            result = self.rule.aggregate(state.x, [update], moments, context)
        except AggregationError as exc:
            raise self._error(str(exc)) from None
        return SiteState(
            x={key: np.asarray(value) for key, value in result.params.items()},
            m=dict(result.state["m"]),
            v=dict(result.state["v"]),
            step=int(result.state["step"]),
            received=digest(mean),
            param_keys=state.param_keys,
        )

    def record_result(self, round_num: int, param_keys: Any) -> SiteState:
        """The state this round's result was trained from (its digest goes with the result); the trainable entries
        the result names are kept for the next step (the rule's buffers are the others)."""
        stored = self.load()
        if stored is None or stored[1] != round_num:
            found = "none" if stored is None else f"round {stored[1]}'s"
            raise self._error(f"sends round {round_num}'s result but its stored FedOpt state is {found}")
        state = stored[0]
        if isinstance(param_keys, list | tuple) and tuple(param_keys) != state.param_keys:
            bad = [key for key in param_keys if key not in state.x or not is_float_array(state.x[key])]
            if bad:
                raise self._error(f"its result names trainable entries that are not float entries of x: {bad[:5]}")
            state = SiteState(state.x, state.m, state.v, state.step, state.received, tuple(param_keys))
            self._save(state, round_num)
        return state

    def final_model(self, last_mean: Mapping[str, Any], last_round: int) -> dict[str, np.ndarray]:
        """x_T, the FedOpt model after the job's last round ``last_round``: the step on the server's saved mean
        ybar_{T-1} (decrypted), from the state stored in that round. Nothing is stored."""
        stored = self.load()
        if stored is None or stored[1] != last_round:
            found = "none" if stored is None else f"of round {stored[1]}"
            raise self._error(f"the final model needs the state of round {last_round}; stored: {found}")
        state = stored[0]
        return self.step(state, as_model(last_mean, state.x, self.site)).x

    def load(self) -> tuple[SiteState, int] | None:
        """(state, the round it was written in), or ``None`` when this site has none for the job."""
        try:
            stored = self.store.load(ALGORITHM)
        except StateStoreError as exc:
            raise SiteOptimizerError(str(exc)) from None
        if stored is None:
            return None
        mismatched = {k: stored.state.get(k) for k, v in self.settings.items() if stored.state.get(k) != v}
        if mismatched:
            raise self._error(f"its stored FedOpt state was written with {mismatched}, this job runs {self.settings}")
        return SiteState.from_stored(stored.state), stored.round_num

    def _save(self, state: SiteState, round_num: int) -> SiteState:
        self.store.save(ALGORITHM, state.stored(self.settings), round_num=round_num)
        return state

    def _error(self, problem: str) -> SiteOptimizerError:
        return SiteOptimizerError(f"FedOpt at {self.site}: {problem}")


def divergence_problem(round_num: int, reports: Mapping[str, Mapping[str, Any]]) -> str | None:
    """One line naming the sites whose result does not carry the round's common state digest (``reports``: each
    accepted site's result meta), or ``None`` when every site trained from the same x and moments."""
    problems = {}
    digests = {}
    for site, meta in sorted(reports.items()):
        value, trained = meta.get(DIGEST), meta.get(DIGEST_ROUND)
        if not isinstance(value, str) or trained != round_num:
            problems[site] = f"no {DIGEST} of round {round_num} (got {value!r} of round {trained!r})"
        else:
            digests[site] = value
    ranked = Counter(digests.values()).most_common()
    if len(ranked) > 1:
        common, votes = ranked[0]
        if 2 * votes <= len(reports):  # no majority: no site can be blamed, all are named
            problems.update({site: f"digest {value}" for site, value in digests.items()})
        else:
            problems.update({s: f"digest {v}, the others {common}" for s, v in digests.items() if v != common})
    if not problems:
        return None
    named = "; ".join(f"{site}: {problem}" for site, problem in sorted(problems.items()))
    return (
        f"FedOpt at the sites, round {round_num}: the sites did not train from the same x and moments ({named}); "
        "the job stops before aggregating"
    )


def site_optimizer_problem(spec: Any) -> str | None:
    """Why the job's settings cannot run FedOpt at the sites (one line, naming the setting), or ``None``."""
    weighting = dict(spec.server_args).get("weighting", "samples")
    if weighting != "samples":
        return (
            f"server_args weighting '{weighting}': the sites step on the mean NVFlare's aggregator forms, weighted by "
            "train.num_samples; allowed: samples"
        )
    if spec.min_responses is not None and spec.min_responses != spec.num_sites:
        return (
            f"min_responses {spec.min_responses}: every site takes the FedOpt step and must train every round, so "
            f"every round waits for all {spec.num_sites} sites; allowed: unset or {spec.num_sites}"
        )
    return None
