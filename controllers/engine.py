"""The one round engine: select sites -> broadcast -> validate results -> aggregate -> record, free of any framework.

Both ways of running a federation drive this class, so a benchmark table comes from the code a job runs:

- `controllers.fedalg_controller.FedAlgController` (NVFlare) gives it a transport that calls
  ``send_model_and_wait`` and a host that saves the model through the persistor, writes the rule-state checkpoint
  and appends ``round_metrics.jsonl``;
- `InProcessTransport` runs sites as plain callables in this process (``benchmarks/in_process.py`` plugs in
  the same Lightning site round as the NVFlare client script; the robustness benchmark uses it).

What the engine guarantees, whatever the rule does:

- a client result is used only after every check passed: parameter keys, shapes, dtypes and finite values, a valid
  sample count, the meta the rule requires, no NVFlare-reserved algorithm keys, a usable ``train.param_keys`` that
  agrees with the round's trainable set (the set most sites report, see `RoundEngine.validate`), and the
  rule's own ``update_problems``. A failing site is rejected by name with every reason; the others go on;
- no exception raised by the rule (site selection, broadcast meta, update checks, aggregation, or a malformed
  value it returns) ends the job: the round is recorded as failed with the rule's name and the exception, and the
  global model and rule state stay as they were (the state as the rule's selection left it, which is what the
  round was run with). Any other exception inside a round (the transport, an observer) fails that round the same
  way;
- a non-finite aggregate (NaN/Inf), or one whose keys or shapes differ from the global model, is never persisted nor
  broadcast: the previous model is kept and the round is recorded as failed;
- every round, aggregated or failed, is handed to the host to persist. A failed round is a completed round: the
  federation moves on to the next round with the model unchanged, so the checkpoint says which round was last
  *attempted* (and, separately, which was last *aggregated*) and a resumed job continues after the attempted one,
  exactly as an uninterrupted run would (see `controllers.checkpoint.load_resume_point`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.contracts.sampling import clients_per_round_count, clients_per_round_problem, select_round_sites
from aggregators.contracts.wire import RoundInfo
from aggregators.deltas import agreed_param_keys, leaked_local_keys, param_keys_problems, shared_entries
from aggregators.types import AggregationRule, ClientUpdate, RoundContext
from aggregators.validation import meta_problems, num_samples_problems, param_problems
from controllers.budget import end_of_budget_message, required_sites, spent_budget
from controllers.checkpoint import params_digest
from controllers.model_selection import BestGlobal
from controllers.rejection import Rejection
from controllers.stopping import Plateau

LOG = logging.getLogger("fedalg.engine")
Params = dict[str, np.ndarray]
#: Record field, with ``--local-keys`` only: what the server-side evaluation of the global model used for the
#: local entries (``initial``: the initial model's values, which the global model keeps for them).
LOCAL_EVAL_FIELD = "global_eval_local_entries"


def local_leak_problem(leaked: Sequence[str]) -> str:
    """Why a result that carries local entries is rejected."""
    more = " ..." if len(leaked) > 5 else ""
    return f"sent local entries {list(leaked[:5])}{more}, which never leave a site (local_keys)"


@dataclass(frozen=True)
class SiteResult:
    """What one site sent back for a round: its full model after local training and its meta."""

    site: str
    params: Mapping[str, Any]
    meta: Mapping[str, Any]


class Transport(Protocol):
    """Delivers the global model and meta of a round to the target sites and returns what came back.

    A transport may return fewer results than targets (a site dropped out or timed out); results arrive in any order.
    """

    def train(
        self, round_num: int, targets: Sequence[str], params: Params, meta: Mapping[str, Any]
    ) -> Sequence[SiteResult]: ...


class Host:
    """Where the engine's outputs go. The defaults keep nothing and log through `logging`; the NVFlare
    controller and the in-process runner override what they need."""

    def persist(
        self,
        round_num: int,
        params: Params,
        state: Mapping[str, Any],
        digest: str,
        updates: Sequence[ClientUpdate],
        aggregated: bool,
    ) -> None:
        """Called once per round, failed or not, with the global model and rule state the next round starts from."""

    def evaluate(self, params: Params) -> dict[str, float]:
        """Metrics of the global model (e.g. test accuracy) for the round's record."""
        return {}

    def save_best(self, round_num: int, params: Params) -> None:
        """The model sent in ``round_num`` is the best global model so far on the sites' validation splits
        (controllers/model_selection.py); called before that round's `persist`."""

    def record(self, record: dict[str, Any]) -> None:
        """One JSON-able line per stage (``initial``/``resumed``, then every ``round``)."""

    def log(self, level: int, message: str) -> None:
        LOG.log(level, message)


#: Called with (round_num, global params before aggregation, accepted updates, context) once per round that has
#: accepted updates, before the rule aggregates (the attack-adaptive capture of training rounds uses it).
RoundObserver = Callable[[int, Params, Sequence[ClientUpdate], RoundContext], None]


@dataclass
class RoundOutcome:
    """The global model and rule state after one round, the metrics line, and whether the rule's aggregate was used."""

    params: Params
    state: dict[str, Any]
    record: dict[str, Any]
    aggregated: bool
    updates: list[ClientUpdate] = field(default_factory=list)


class RuleFailure(Exception):
    """The rule raised or produced something unusable; the message names the rule and what it was doing."""


def validate_result(
    result: SiteResult,
    global_params: Mapping[str, np.ndarray],
    required_meta: Iterable[str] = (),
    rule_check: Callable[[ClientUpdate], list[str]] | None = None,
    round_num: int | None = None,
) -> ClientUpdate | Rejection:
    """The checked `ClientUpdate` of one site, or every reason it cannot be used (module docstring).

    With ``round_num``, a result that says it was trained in another round (``train.round``) is refused: it was
    computed from another global model (a late or replayed result). A result that does not say is not refused.
    """
    params, meta = dict(result.params or {}), dict(result.meta or {})
    problems = param_problems(global_params, params)
    if wrong_round := other_round_problem(meta, round_num):
        problems.append(wrong_round)
    problems += meta_problems(meta, [meta_keys.NUM_SAMPLES, *required_meta])
    num_samples = meta.get(meta_keys.NUM_SAMPLES)
    if meta_keys.NUM_SAMPLES in meta:
        problems += num_samples_problems(num_samples)
    reserved = sorted(set(meta) & set(meta_keys.NVFLARE_RESERVED))
    if reserved:
        # NVFlare's built-in Lightning handler ran on that client: its correction came on top of ours.
        problems.append(f"meta carries NVFlare's reserved keys {reserved}: a built-in algorithm handler was active")
    problems += param_keys_problems(meta.get(meta_keys.PARAM_KEYS), global_params)
    if problems:
        return Rejection(site=result.site, problems=tuple(problems))
    update = ClientUpdate(site=result.site, params=params, num_samples=int(num_samples), meta=meta)
    rule_problems = rule_check(update) if rule_check is not None else []
    return Rejection(site=result.site, problems=tuple(rule_problems)) if rule_problems else update


def other_round_problem(meta: Mapping[str, Any], round_num: int | None) -> str | None:
    """Why a result is not one of round ``round_num`` (its ``train.round`` names another), or None; a result that
    does not say, or no round to compare with, is taken as the round's."""
    trained = meta.get(meta_keys.TRAINED_ROUND, round_num)
    if round_num is None or trained == round_num:
        return None
    return f"a result trained in round {trained!r} arrived in round {round_num} (late or replayed)"


def aggregate_problems(global_params: Mapping[str, np.ndarray], params: Mapping[str, Any]) -> list[str]:
    """Why a rule's new global model must not be used: keys, shapes or types that differ from the current model,
    or NaN/Inf (the same checks a client result passes)."""
    if not isinstance(params, Mapping):
        return [f"the aggregate is a {type(params).__name__}, not a mapping of parameter arrays"]
    return param_problems(global_params, params)


def non_finite_state_keys(state: Any, path: str = "") -> list[str]:
    """Paths (``a.b.c``) of the NaN/Inf values in a rule's state (nested mappings, sequences, arrays, floats).

    The state is saved with the checkpoint and part of it is broadcast (SCAFFOLD's control, FedDyn's h), so a
    non-finite entry would reach every site or the next rounds' models (FedOpt's moments) as surely as a
    non-finite model.
    """
    if isinstance(state, Mapping):
        return [
            bad
            for key, value in state.items()
            for bad in non_finite_state_keys(value, f"{path}.{key}" if path else str(key))
        ]
    if isinstance(state, list | tuple):
        return [bad for i, value in enumerate(state) for bad in non_finite_state_keys(value, f"{path}[{i}]")]
    if isinstance(state, float | np.floating) or (
        isinstance(state, np.ndarray) and np.issubdtype(state.dtype, np.inexact)
    ):
        return [] if np.all(np.isfinite(state)) else [path or "(state)"]
    return []


class RoundEngine:
    """Federated rounds driven by an aggregation rule; see the module docstring for what it guarantees.

    Args:
        rule: the aggregation rule (a composed rule when the client algorithm needs companion state).
        num_rounds: number of rounds of the federation.
        clients_per_round: ``None`` for all sites, an int count or a float fraction in (0, 1].
        min_accepted: fewest valid results needed to aggregate (at least 1); with fewer the round fails and the
            model is kept.
        seed: seeds the site sampling (rules with their own selection get it too).
        rule_label: the rule name broadcast to clients (``server.rule``) and used in messages; the rule's own
            ``name`` when ``None``.
        observers: called before each aggregation with the accepted updates (see `RoundObserver`).
        local_keys: entries that never leave the sites (``--local-keys``: FedPer, FedBN, FedRep's head). The rule,
            the validation, the key agreement, the observers and every distance see the other entries only; the
            global model keeps its initial values for these, untouched by every rule, so a server-side evaluation
            of the global model uses the initial values for them (said in every record, `LOCAL_EVAL_FIELD`);
            a site that sends one is rejected by name (docs/personalization.md, "Partial sharing").
        stop_patience: stop after this many rounds without improvement of the sites' validation score
            (controllers/stopping.py; ``None``: run every round). The round that stops says so in its record
            (``stopped``).
    """

    def __init__(
        self,
        rule: AggregationRule,
        *,
        num_rounds: int,
        clients_per_round: int | float | None = None,
        min_accepted: int = 1,
        seed: int = 0,
        rule_label: str | None = None,
        observers: Sequence[RoundObserver] = (),
        local_keys: Sequence[str] = (),
        min_responses: int | None = None,
        stop_patience: int | None = None,
    ) -> None:
        if isinstance(min_accepted, bool) or not isinstance(min_accepted, int | np.integer) or min_accepted < 1:
            raise ValueError(
                f"min_accepted must be an integer >= 1 (a round needs at least one valid result to aggregate), "
                f"got {min_accepted!r}"
            )
        if isinstance(num_rounds, bool) or not isinstance(num_rounds, int | np.integer) or num_rounds < 0:
            raise ValueError(f"num_rounds must be an integer >= 0, got {num_rounds!r}")
        # Refused here, not at the first round: a value that cannot be resolved would fail every round.
        problem = clients_per_round_problem(clients_per_round)
        if problem:
            raise ValueError(problem)
        if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be an integer >= 0 (it seeds numpy's site sampling), got {seed!r}")
        self.rule = rule
        self.num_rounds = int(num_rounds)
        self.clients_per_round = clients_per_round
        self.min_accepted = int(min_accepted)
        self.seed = seed
        self.rule_label = rule_label or rule.name
        self.observers = tuple(observers)
        self.local_keys = tuple(sorted(local_keys))
        #: site -> the last round whose aggregate included its result, broadcast so that sites commit or roll back
        #: the client state of their previous round (transactional client state). A resumed job restores it from
        #: its checkpoint; ``None`` (a checkpoint without it): no confirmations are sent and sites commit as before.
        self.last_aggregated: dict[str, int] | None = {}
        #: site -> the last round whose result from it reached the server (aggregated or rejected), broadcast so that
        #: a DP site that lost its ledger after releasing something stops rather than restart its count.
        self.last_released: dict[str, int] = {}
        #: site -> the DP-SGD steps (``privacy.steps``) of its last result that reached the server, broadcast so that a
        #: DP site whose ledger holds fewer (restored from an old backup) stops instead of under-reporting epsilon.
        self.released_steps: dict[str, int] = {}
        #: DP sites that cannot afford another round (controllers/budget.py), with why: they get no more rounds.
        self.out_of_budget: dict[str, str] = {}
        self.needed_sites = required_sites(self.min_accepted, min_responses)
        self.plateau = None if stop_patience is None else Plateau(stop_patience)
        #: The best global model on the sites' validation scores; none with local keys (module model_selection).
        self.best_global: BestGlobal | None = None if self.local_keys else BestGlobal()

    # -- the whole federation -------------------------------------------------------------------------------------

    def initial_record(
        self,
        params: Params,
        host: Host,
        stage: str = "initial",
        run_id: str = "",
        stopped: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The metrics line of the starting model (``stage`` is ``initial`` or ``resumed``; ``stopped``: the stopping
        rule's note when a resumed job's restored history already reached the plateau)."""
        record = {
            "stage": stage,
            "round": None,
            "run_id": run_id,  # the sites keep this run's algorithm state under client_state/<run id>/
            "rule": self.rule.name,
            "num_rounds": self.num_rounds,  # lets a report tell a finished job from one that stopped early
            "global_sha256": params_digest(params),
        }
        if stopped:
            record["stopped"] = stopped
        record.update(self.local_eval_note())
        record.update(host.evaluate(params))
        host.record(record)
        return record

    def run(
        self,
        population: Sequence[str],
        params: Params,
        state: dict[str, Any],
        transport: Transport,
        host: Host,
        *,
        run_id: str,
        first_round: int = 0,
        stage: str = "initial",
        should_stop: Callable[[], bool] = lambda: False,
    ) -> tuple[Params, dict[str, Any]]:
        """Rounds ``first_round`` .. ``num_rounds - 1``; returns the final global model and rule state.

        ``should_stop`` is asked before every round (NVFlare's abort signal).
        """
        population = tuple(sorted(population))
        stopped = self._stopped_before(first_round, host)
        self.initial_record(params, host, stage, run_id, stopped)
        if stopped:
            return params, state
        for round_num in range(first_round, self.num_rounds):
            if should_stop():
                host.log(logging.WARNING, f"abort requested; stopping before round {round_num + 1}")
                break
            remaining = len(set(population) - set(self.out_of_budget))
            if self.out_of_budget and remaining < self.needed_sites:
                message = end_of_budget_message(round_num, self.out_of_budget, remaining, self.needed_sites)
                host.log(logging.ERROR, message)
                break
            outcome = self.run_round(round_num, population, params, state, transport, host, run_id=run_id)
            params, state = outcome.params, outcome.state
            if "stopped" in outcome.record:
                break
        return params, state

    # -- one round ----------------------------------------------------------------------------------------------------

    def run_round(
        self,
        round_num: int,
        population: Sequence[str],
        params: Params,
        state: dict[str, Any],
        transport: Transport,
        host: Host,
        *,
        run_id: str,
    ) -> RoundOutcome:
        """One round. When it fails, the outcome's params are the input params (the same object) and its state is
        the input state as the rule's site selection left it."""
        started = time.monotonic()
        population = tuple(population)
        record: dict[str, Any] = {"stage": "round", "round": round_num, "rule": self.rule.name}
        updates: list[ClientUpdate] = []
        rejections: list[Rejection] = []
        new_params, new_state, failure = params, state, None
        try:
            targets, state = self._select(population, state, round_num)
            new_state = state
            record["sites"] = targets
            host.log(logging.INFO, f"round {round_num + 1}/{self.num_rounds}: training on {targets}")
            results = transport.train(round_num, targets, params, self.broadcast_meta(round_num, state, run_id))
            self.last_released.update({result.site: round_num for result in results})
            self.released_steps = released_steps(self.released_steps, results)
            self.note_spent_budgets(results, round_num, host)
            updates, rejections = self.validate(results, params, state, round_num)
            shared = self.shared(params)
            for rejection in rejections:
                host.log(logging.ERROR, f"round {round_num + 1}: {rejection}")
            if len(updates) < self.min_accepted:
                failure = (
                    f"only {len(updates)} valid result(s), {self.min_accepted} needed; "
                    "the global model is left unchanged this round"
                )
            else:
                context = RoundContext(round_num=round_num, num_rounds=self.num_rounds, population=population)
                new_shared, new_state = self._aggregate(shared, updates, state, context)
                new_params = self.with_local_entries(new_shared, params)
        except RuleFailure as exc:
            failure = f"{exc}; the global model is left unchanged this round"
        except Exception as exc:  # not the rule's (transport, observer): still no reason to end the job
            LOG.debug("round %d failed", round_num + 1, exc_info=True)
            failure = (
                f"round failed under rule '{self.rule.name}': {type(exc).__name__}: {exc}; "
                "the global model is left unchanged this round"
            )
        if failure is not None:
            host.log(logging.ERROR, f"round {round_num + 1}: {failure}")
            new_params = params
        record.setdefault("sites", [])
        record["rejected"] = {r.site: list(r.problems) for r in rejections}
        aggregated = failure is None
        if aggregated and self.last_aggregated is not None:
            self.last_aggregated.update({u.site: round_num for u in updates})
        record["status"] = "aggregated" if aggregated else "failed"
        if failure is not None:
            record["failure"] = failure
        record["aggregated"] = [u.site for u in updates] if aggregated else []
        digest = params_digest(new_params)
        record["global_sha256"] = digest
        record.update(site_metrics(updates))
        if self.best_global is not None and self.best_global.observe(record.get("site_eval") or {}, round_num):
            record["best_global"] = self.best_global.note()
            host.save_best(round_num, params)  # the model the sites scored: the one sent this round
        self._check_plateau(record, round_num, host)  # before persisting: the checkpoint holds the rule's history
        host.persist(round_num, new_params, new_state, digest, updates, aggregated)
        diagnostics = self._diagnostics(new_state, host) if aggregated else {}
        if diagnostics:
            record["rule_diagnostics"] = diagnostics
        record.update(self.local_eval_note())
        record.update(host.evaluate(new_params))
        record["elapsed_s"] = round(time.monotonic() - started, 4)  # the precision of its parts (ROUND_TIMING_KEYS)
        host.record(record)
        return RoundOutcome(params=new_params, state=new_state, record=record, aggregated=aggregated, updates=updates)

    def _stopped_before(self, first_round: int, host: Host) -> dict[str, Any] | None:
        """The stopping rule's note when the history a resumed job restored already reached the plateau: the
        uninterrupted job stopped after the round before ``first_round``, so no round is left to run."""
        if self.plateau is None or not self.plateau.reached() or not 0 < first_round < self.num_rounds:
            return None
        note = self.plateau.note(first_round - 1)
        host.log(
            logging.INFO,
            f"validation plateau already reached after round {first_round}/{self.num_rounds} by the resumed run's "
            f"history (the sites' mean {note['metric']}, best {note['best']:.4f}, "
            f"{note['rounds_without_improvement']} round(s) without improvement): no round to run (--stop-patience)",
        )
        return note

    def _check_plateau(self, record: dict[str, Any], round_num: int, host: Host) -> None:
        """Feed the stopping rule this round's site scores; mark the record when the job stops after it."""
        if self.plateau is None:
            return
        self.plateau.observe(record.get("site_eval") or {})
        if self.plateau.reached() and round_num + 1 < self.num_rounds:
            record["stopped"] = note = self.plateau.note(round_num)
            host.log(
                logging.INFO,
                f"round {round_num + 1}/{self.num_rounds}: validation plateau, the sites' mean {note['metric']} has "
                f"not improved for {note['rounds_without_improvement']} round(s) (best {note['best']:.4f}); "
                "stopping (--stop-patience)",
            )

    # -- partial sharing (local_keys) ------------------------------------------------------------------------------

    def shared(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The entries the rule sees: ``params`` without the sites' local ones."""
        return shared_entries(params, self.local_keys) if self.local_keys else dict(params)

    def with_local_entries(self, shared: Mapping[str, Any], params: Mapping[str, Any]) -> Params:
        """The next global model: the rule's ``shared`` entries, the local ones as they were in ``params`` (never
        changed by any rule), in ``params``' key order."""
        if not self.local_keys:
            return dict(shared)
        return {key: (params[key] if key in self.local_keys else shared[key]) for key in params}

    def init_state(self, params: Params) -> dict[str, Any]:
        """The rule's initial state, over the shared entries only (SCAFFOLD's c, FedOpt's moments, ...)."""
        return self.rule.init_state(self.shared(params))

    def local_eval_note(self) -> dict[str, Any]:
        """What a server-side evaluation of the global model uses for the local entries (records with them only)."""
        return {LOCAL_EVAL_FIELD: "initial"} if self.local_keys else {}

    def broadcast_meta(self, round_num: int, state: Mapping[str, Any], run_id: str) -> dict[str, Any]:
        """The wire contract's `aggregators.contracts.wire.RoundInfo` (what sites parse with ``RoundInfo.from_meta``)
        plus the rule's own broadcast (e.g. SCAFFOLD's global control), which may not overwrite it."""
        rule_meta = self._call("broadcast_meta", lambda: dict(self.rule.broadcast_meta(state)))
        confirmed = None if self.last_aggregated is None else dict(self.last_aggregated)
        released = dict(self.last_released)
        steps = dict(self.released_steps)
        info = RoundInfo(round_num, self.num_rounds, self.rule_label, run_id, confirmed, released, steps).to_meta()
        clash = sorted(set(rule_meta) & set(info))
        if clash:
            raise RuleFailure(f"rule '{self.rule.name}' broadcasts the engine's round keys {clash}")
        return {**info, **rule_meta}

    def validate(
        self, results: Sequence[SiteResult], params: Params, state: Mapping[str, Any], round_num: int | None = None
    ) -> tuple[list[ClientUpdate], list[Rejection]]:
        """Accepted updates sorted by site (aggregation never depends on arrival order) and the rejections.

        Three passes: every result on its own (`validate_result`; a second result from a site already seen is
        rejected, a site counts once per round); then the round's trainable set: the ``train.param_keys`` most of
        the remaining sites report (`aggregators.deltas.agreed_param_keys`, which says why the majority is
        the job's), rejecting by name every site whose set differs or that reports none while others do; then the
        rule's own checks, which therefore only see updates that agree on the trainable set (SCAFFOLD's round-1
        control check relies on it).
        """
        checked, rejections = self._checked_results(results, self.shared(params), round_num)
        _, disagreeing = agreed_param_keys({u.site: u.meta.get(meta_keys.PARAM_KEYS) for u in checked})
        updates: list[ClientUpdate] = []
        for update in checked:
            if update.site in disagreeing:
                problems = [disagreeing[update.site]]
            else:
                problems = self._rule_problems(update, self.shared(params), state)
            if problems:
                rejections.append(Rejection(site=update.site, problems=tuple(problems)))
            else:
                updates.append(update)
        return sorted(updates, key=lambda u: u.site), rejections

    def _checked_results(
        self, results: Sequence[SiteResult], params: Params, round_num: int | None
    ) -> tuple[list[ClientUpdate], list[Rejection]]:
        """Each result checked on its own (no rule check yet), a second one from the same site rejected. A result of
        another round is rejected without counting as the site's result, so a late one never displaces the site's
        current result, whichever arrives first."""
        checked: list[ClientUpdate] = []
        rejections: list[Rejection] = []
        seen: set[str] = set()
        for result in results:
            of_this_round = other_round_problem(result.meta or {}, round_num) is None
            if of_this_round and result.site in seen:
                rejections.append(Rejection(result.site, ("a second result from this site in the same round",)))
                continue
            if of_this_round:
                seen.add(result.site)
            leaked = leaked_local_keys(result.params or {}, self.local_keys)
            if leaked:  # named as what it is, not as an unexpected key
                rejections.append(Rejection(result.site, (local_leak_problem(leaked),)))
                continue
            outcome = validate_result(result, params, self.rule.required_meta, round_num=round_num)
            (checked if isinstance(outcome, ClientUpdate) else rejections).append(outcome)
        return checked, rejections

    def _rule_problems(self, update: ClientUpdate, params: Params, state: Mapping[str, Any]) -> list[str]:
        try:
            return list(self.rule.update_problems(update, params, state))
        except Exception as exc:  # a rule's check that crashes rejects the site, never the job
            return [f"rule '{self.rule.name}' raised while checking the update: {type(exc).__name__}: {exc}"]

    def note_spent_budgets(self, results: Sequence[SiteResult], round_num: int, host: Host) -> None:
        """Record (and say once) every site whose result says it cannot afford another round."""
        for result in results:
            why = spent_budget(result.meta or {})
            if why and result.site not in self.out_of_budget:
                self.out_of_budget[result.site] = why
                if round_num + 1 < self.num_rounds:
                    host.log(logging.WARNING, f"{result.site} takes no more rounds: {why}")

    def _select(
        self, population: tuple[str, ...], state: dict[str, Any], round_num: int
    ) -> tuple[list[str], dict[str, Any]]:
        # Sites out of privacy budget are not sampled; the rule's population (its rates, SCAFFOLD's N) is unchanged.
        population = tuple(site for site in population if site not in self.out_of_budget)
        count = clients_per_round_count(self.clients_per_round, len(population))
        # The one site selection (aggregators/contracts/sampling.py): the rule's own, else the seeded sampling.
        return self._call(
            "select_sites", lambda: select_round_sites(self.rule, population, count, state, self.seed, round_num)
        )

    def _aggregate(
        self, params: Params, updates: list[ClientUpdate], state: dict[str, Any], context: RoundContext
    ) -> tuple[Params, dict[str, Any]]:
        for observer in self.observers:
            observer(context.round_num, params, updates, context)
        result = self._call("aggregate", lambda: self.rule.aggregate(params, updates, state, context))
        new_params, new_state = getattr(result, "params", None), getattr(result, "state", None)
        problems = aggregate_problems(params, new_params)
        if not isinstance(new_state, Mapping):
            problems.append(f"its state is a {type(new_state).__name__}, not a mapping")
        elif bad_state := non_finite_state_keys(new_state):
            problems.append(f"its state has NaN or Inf in {bad_state[:5]}{' ...' if len(bad_state) > 5 else ''}")
        if problems:
            raise RuleFailure(f"rule '{self.rule.name}' produced an unusable model: " + "; ".join(problems))
        return dict(new_params), dict(new_state)

    def _diagnostics(self, state: Mapping[str, Any], host: Host) -> dict[str, float]:
        try:
            return dict(self._call("diagnostics", lambda: self.rule.diagnostics(state)))
        except RuleFailure as exc:  # only a log line: the round itself succeeded
            host.log(logging.WARNING, str(exc))
            return {}

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # no rule error may end the job (module docstring)
            raise RuleFailure(f"rule '{self.rule.name}' failed in {what}: {type(exc).__name__}: {exc}") from exc


def scalar_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The namespaced scalar values a client reported (e.g. ``train.accuracy``, ``fedprox.mu``) for the metrics log."""
    return {
        key: value
        for key, value in sorted(meta.items())
        if meta_keys.is_namespaced(key) and isinstance(value, bool | int | float | str | np.generic)
    }


def site_metrics(updates: Sequence[ClientUpdate]) -> dict[str, Any]:
    """Per-site training loss, sample and step counts and scalar meta of the accepted updates, and the summary of
    the sites' evaluations of the global model they received (when they sent ``eval.*`` meta)."""
    record = {
        "site_train_loss": {u.site: u.meta.get(meta_keys.TRAIN_LOSS) for u in updates},
        "site_num_samples": {u.site: u.num_samples for u in updates},
        "site_num_steps": {u.site: u.meta.get(meta_keys.NUM_STEPS) for u in updates},
        "site_meta": {u.site: scalar_meta(u.meta) for u in updates},
    }
    summary = site_eval_summary(updates)
    if summary:
        record["site_eval"] = summary
    privacy = {u.site: meta_keys.privacy_of(u.meta) for u in updates if meta_keys.PRIVACY_EPSILON in u.meta}
    if privacy:  # sample-level DP-SGD at the sites: each site's epsilon so far (docs/privacy.md)
        record["privacy"] = privacy
    return record


def lower_is_better(metric: str) -> bool:
    return any(word in metric.lower() for word in ("loss", "error", "mae", "mse", "rmse"))


def site_eval_summary(updates: Sequence[ClientUpdate]) -> dict[str, dict[str, Any]]:
    """Per metric the sites reported under ``eval.``: the sample-weighted mean, the worst site and its value, and
    the spread (best minus worst). "Worst" is the highest value for losses and errors, the lowest otherwise."""
    by_metric: dict[str, dict[str, tuple[float, int]]] = {}
    for update in updates:
        for key, value in update.meta.items():
            name = meta_keys.eval_metric(key)
            if name is not None and isinstance(value, int | float) and np.isfinite(value):
                by_metric.setdefault(name, {})[update.site] = (float(value), update.num_samples)
    summary = {}
    for name, values in sorted(by_metric.items()):
        weights = np.array([n for _, n in values.values()], dtype=np.float64)
        scores = np.array([v for v, _ in values.values()], dtype=np.float64)
        pick = max if lower_is_better(name) else min
        worst_site = pick(values, key=lambda site: values[site][0])
        summary[name] = {
            "per_site": {site: v for site, (v, _) in sorted(values.items())},
            "mean": float(np.dot(weights, scores) / weights.sum()),
            "worst": values[worst_site][0],
            "worst_site": worst_site,
            "spread": float(scores.max() - scores.min()),
        }
    return summary


SiteFn = Callable[[int, Params, Mapping[str, Any]], tuple[Mapping[str, Any], Mapping[str, Any]]]


class InProcessTransport:
    """Sites as callables in this process: ``site(round_num, global params, meta) -> (params, meta)``.

    Each site gets its own copy of the model and meta, as over a network, so no site can alter what another
    receives. Sites train one after the other in sorted order.
    """

    def __init__(self, sites: Mapping[str, SiteFn]) -> None:
        self.sites = dict(sites)
        #: (round, site, error) of every site call that raised: that site sent nothing that round, as a site
        #: process that crashes in a real federation sends nothing; the round goes on with the others.
        self.failures: list[tuple[int, str, str]] = []

    def train(
        self, round_num: int, targets: Sequence[str], params: Params, meta: Mapping[str, Any]
    ) -> list[SiteResult]:
        unknown = sorted(set(targets) - set(self.sites))
        if unknown:
            raise KeyError(f"no in-process site called {unknown}; sites: {sorted(self.sites)}")
        results = []
        for site in sorted(targets):
            sent = {key: np.array(value, copy=True) for key, value in params.items()}
            try:
                site_params, site_meta = self.sites[site](round_num, sent, copy.deepcopy(dict(meta)))
            except Exception as exc:
                self.failures.append((round_num, site, f"{type(exc).__name__}: {exc}"))
                LOG.error(
                    "round %d: %s failed and sends no result: %s: %s", round_num + 1, site, type(exc).__name__, exc
                )
                continue
            results.append(SiteResult(site=site, params=site_params, meta=site_meta))
        return results


def released_steps(known: Mapping[str, int], results: Sequence[Any]) -> dict[str, int]:
    """``known`` updated with the DP-SGD step count (``privacy.steps``, a site's cumulative count) each result
    reports; a count never goes down (a result that reports fewer steps than the site released before leaves the
    record as it was: the site's own ledger check stops it)."""
    updated = dict(known)
    for result in results:
        steps = (result.meta or {}).get(meta_keys.PRIVACY_STEPS)
        if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0:
            updated[result.site] = max(steps, updated.get(result.site, 0))
    return updated
