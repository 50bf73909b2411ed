"""The NVFlare side of the server: a thin adapter that runs `controllers.engine.RoundEngine` in NVFlare.

Built on NVFlare's `ModelController`. All round logic lives in the framework-free engine (select sites,
broadcast, validate, aggregate through a pure rule from `aggregators`, record); this class only

1. gives the engine a transport that sends the global model as an ``FLModel`` with ``send_model_and_wait`` and
   turns the returned ``FLModel`` results into `controllers.engine.SiteResult`,
2. persists every round's global model (persistor) and rule state (``server_state.pt``; also after a round that
   did not aggregate, see `controllers.checkpoint` for what resume does then),
3. evaluates the global model on the test split and appends one JSON line per round to
   ``metrics/round_metrics.jsonl`` (with where the round's wall time went: ``train_wait_s``, ``evaluate_s``,
   ``persist_s``; see `ROUND_TIMING_KEYS`), and logs through NVFlare's component logger.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.model_controller import ModelController

from aggregators.compose import compose
from aggregators.contracts import meta_keys

# The metrics files every reader of a run finds (``FINAL_SCORES_FILE``: the final global model scored by every site).
from aggregators.contracts.run_records import FINAL_SCORES_FILE, METRICS_FILE
from aggregators.registry import build_rule
from aggregators.types import AggregationRule, ClientUpdate
from controllers.adapters import result_site
from controllers.checkpoint import (
    append_metrics,
    commit_rule_state,
    load_resume_point,
    pending_state_path,
    save_rule_state,
    save_updates,
)
from controllers.engine import Host, RoundEngine, SiteResult, scalar_meta
from controllers.model_selection import BestGlobal
from controllers.round_settings import ControllerSettings
from controllers.stopping import Plateau

__all__ = ["METRICS_FILE", "STATE_FILE", "ControllerSettings", "FedAlgController", "scalar_meta", "to_numpy_params"]

STATE_FILE = "server_state.pt"
#: Seconds between the server's checks whether a round's results are all in (NVFlare's ``task_check_period``).
#: NVFlare's 0.5 s default (0.2 s in effect, see `FedAlgController.set_communicator`) is waiting added to
#: every round, twice (the task monitor, then the wait for it); a check is a lock and a scan of the open tasks and
#: of the sites' liveness, so 50 a second cost nothing measurable (docs/deployment.md, section 9).
TASK_CHECK_PERIOD = 0.02
#: Per-round record fields with the server's own timings (seconds): the broadcast-and-wait for the sites' results,
#: the global model's evaluation, and saving the model and rule state. The rest of ``elapsed_s`` is validation and
#: aggregation; ``train_wait_s`` minus the sites' ``train.fit_seconds`` is the waiting the round cost.
ROUND_TIMING_KEYS = ("train_wait_s", "evaluate_s", "persist_s")


def resumed_population(connected: Sequence[str], saved: Sequence[str] | None) -> tuple[str, ...]:
    """The population of a resumed job: the stopped job's sites plus any connected now. A site that is down when
    the job resumes still counts (SCAFFOLD's c = mean(c_i) and FedDyn's h / m are over the whole population, and
    an uninterrupted job would have kept counting it); ``saved`` is None for checkpoints written without it."""
    return tuple(sorted(set(connected) | set(saved or ())))


def to_numpy_params(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Global parameters as numpy arrays whatever the persistor handed over (tensors or arrays)."""
    converted = {}
    for key, value in params.items():
        converted[key] = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    return converted


class FedAlgController(ModelController):
    """Federated rounds driven by an aggregation rule from `aggregators.registry.RULES`.

    The job's settings come as one value, ``settings`` (`controllers.round_settings.ControllerSettings`, or its plain
    JSON form as NVFlare's job config holds it): every setting by its job name (``server``, ``server_args``,
    ``num_rounds``, ``clients_per_round``, ...), each defaulted from and checked against its one declaration in
    ``aggregators/contracts/job_settings.py``, once, when the value is built; a bad value is refused when NVFlare builds
    the controller, with one line naming the setting, the value and what is allowed, never at the first round. The
    controller reads them from `round_settings`.

    Args:
        settings: the round settings (see `controllers.round_settings.ControllerSettings` for each): the rule and
            its arguments, the rounds, the sites per round and the results a round waits for and needs, the seed of
            the sampling, the round timeout, ``save_client_updates`` (also write every accepted client model to
            ``<run_dir>/client_updates/round_XXXXX.npz``), ``resume_from`` (a previous run's server app folder:
            continue after its last attempted round with its global model, rule state and run id),
            ``final_site_eval``, ``cross_site_eval``, ``stop_patience``, and the resolved ``local_keys`` and
            ``companions``. ``None``: every declared default.
        evaluator_id: id of a server component with ``evaluate(params) -> dict`` ("" disables evaluation).
        persistor_id: id of the model persistor component.
        task_check_period: seconds between NVFlare's checks whether a round's results are in.
    """

    def __init__(
        self,
        *,
        settings: ControllerSettings | Mapping[str, Any] | None = None,
        evaluator_id: str = "evaluator",
        persistor_id: str = "persistor",
        task_check_period: float = TASK_CHECK_PERIOD,
    ) -> None:
        #: The typed settings, checked once here (what the controller reads).
        self.round_settings = ControllerSettings.of(settings)
        super().__init__(persistor_id=persistor_id, task_check_period=task_check_period)
        # Write the settings and the wiring into exported configs, defaults included, so a job folder documents
        # itself. ``settings`` is the plain JSON form NVFlare writes (NVFlare reads the argument back from here).
        self._always_serialize_args = ("settings", "evaluator_id", "task_check_period")
        self.settings = self.round_settings.as_dict()
        self.evaluator_id = evaluator_id
        # Fail at job start, not after the first round, when the rule or its arguments are wrong.
        rounds = self.round_settings
        self._rule: AggregationRule = compose(build_rule(rounds.server, **rounds.server_args), rounds.companions)
        self._round_engine()
        self._run_id = ""
        self._last_aggregated_round: int | None = None  # recorded in server_state.pt (controllers/checkpoint.py)
        self._active_engine: RoundEngine | None = None  # the engine of the running job (its site confirmations)
        self._reachable: tuple[str, ...] = ()  # the sites this job was deployed to: the only ones that get tasks
        self._population: tuple[str, ...] = ()  # the sites the rules count (resume keeps those of the stopped job)
        self._timings: dict[str, float] = {}  # this round's ROUND_TIMING_KEYS, written with its metrics record

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse a setting assigned on the controller: it would be read nowhere (`round_settings` holds them)."""
        if name in ControllerSettings.names():
            raise AttributeError(f"{name} is a round setting: replace round_settings (dataclasses.replace) instead")
        super().__setattr__(name, value)

    def set_communicator(self, communicator: Any) -> None:
        """Also make NVFlare's task monitor poll at ``task_check_period``: NVFlare 2.9's ``Controller`` writes the
        period to ``communicator.task_check_period``, an attribute ``WFCommServer`` never reads (it keeps polling
        every 0.2 s, its constructor default), so without this the setting has no effect at all."""
        super().set_communicator(communicator)
        if isinstance(getattr(communicator, "_task_check_period", None), int | float):
            communicator._task_check_period = self._task_check_period

    def _round_engine(self) -> RoundEngine:
        """The engine for the current settings (built where used, so a changed setting is always honoured)."""
        rounds = self.round_settings
        return RoundEngine(
            self._rule,
            num_rounds=rounds.num_rounds,
            clients_per_round=rounds.clients_per_round,
            min_accepted=rounds.min_accepted,
            min_responses=rounds.min_responses,
            seed=rounds.seed,
            rule_label=rounds.server,
            local_keys=rounds.local_keys,
            stop_patience=rounds.stop_patience,
        )

    def run(self) -> None:
        # A fresh id per run: clients discard persisted state written by an earlier run in a reused workspace.
        self._run_id = uuid.uuid4().hex
        self._last_aggregated_round = None
        rounds = self.round_settings
        initial = self.load_model()
        if initial is None:
            return
        global_params = to_numpy_params(initial.params)
        # The job's sites: NVFlare deploys a job to the sites connected when it starts, and only they get tasks.
        self._reachable = tuple(sorted(client.name for client in self.engine.get_clients()))
        population = self._population = self._reachable
        engine = self._active_engine = self._round_engine()
        state = engine.init_state(global_params)  # over the shared entries only (local_keys)
        evaluator = self.get_component(self.evaluator_id) if self.evaluator_id else None
        first_round, stage = 0, "initial"
        if rounds.resume_from:
            # docs/design.md decision 5: continue a stopped job as if it had never stopped.
            resume = load_resume_point(Path(rounds.resume_from), self._rule.name)
            first_round, stage = resume.next_round, "resumed"
            global_params, state, self._run_id = resume.global_params, resume.state, resume.run_id or self._run_id
            self._last_aggregated_round = resume.last_aggregated_round
            engine.last_aggregated = resume.last_aggregated_sites
            engine.last_released = dict(resume.last_aggregated_sites or {})  # at least these sites have released
            engine.released_steps = dict(resume.released_steps or {})  # what the DP sites had released
            population = self._population = resumed_population(self._reachable, resume.population)
            if engine.plateau is not None:  # the stopping rule goes on from the stopped run's history
                engine.plateau, problem = Plateau.restored(engine.plateau.patience, resume.stopping, first_round)
                if problem:
                    self.warning(f"--stop-patience counts from round {first_round + 1}, not from round 1: {problem}")
            if engine.best_global is not None:  # the best model so far stays the one to beat
                engine.best_global, problem = BestGlobal.restored(resume.best_global, first_round)
                if problem:
                    self.warning(f"best global model: chosen among rounds {first_round + 1} on: {problem}")
            self.info(f"resuming from {rounds.resume_from} at round {first_round + 1}/{rounds.num_rounds}")
            absent = sorted(set(population) - set(self._reachable))
            if absent:
                self.warning(
                    f"resuming without {absent} (not connected when the job started): they stay in the population "
                    "(SCAFFOLD and FedDyn scale by its size, site sampling draws from it) and get no task in this job"
                )
        self.info(
            f"rule={rounds.server} {rounds.server_args}; population={list(population)}; rounds={rounds.num_rounds}"
        )
        final_params, _ = engine.run(
            population,
            global_params,
            state,
            _FLModelTransport(self),
            _ControllerHost(self, evaluator),
            run_id=self._run_id,
            first_round=first_round,
            stage=stage,
            should_stop=lambda: self.abort_signal.triggered,
        )
        if rounds.final_site_eval and not self.abort_signal.triggered:
            self._score_final_model(population, final_params)
        if rounds.cross_site_eval and not self.abort_signal.triggered:
            self._cross_site_eval(population)
        if not self.abort_signal.triggered:
            self._report_outputs()

    def save_best_model(self, model: FLModel) -> None:
        """The persistor saves ``model`` as the best global model (controllers/model_selection.py): NVFlare's
        ``GLOBAL_BEST_MODEL_AVAILABLE`` event with the model as ``GLOBAL_MODEL``; PTFileModelPersistor writes
        ``best_FL_global_model.pt``."""
        fl_ctx = self.fl_ctx
        previous = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
        learnable = make_model_learnable(weights=model.params, meta_props=model.meta)
        # Sticky and private, as NVFlare's load_model set it (a different mask is refused with a warning), and put
        # back after the event: other components read GLOBAL_MODEL as the job's model.
        fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=True)
        try:
            self.event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE)
        finally:
            if previous is not None:
                fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, previous, private=True, sticky=True)

    def _score_final_model(self, population: Sequence[str], params: dict[str, np.ndarray]) -> None:
        """Every site scores the final global model on its own validation split (a site x metric table)."""
        rounds = self.round_settings
        outgoing = outgoing_model(rounds.num_rounds, rounds.num_rounds, params, {meta_keys.RUN_ID: self._run_id})
        targets = [site for site in population if site in self._reachable]
        results = self.send_model_and_wait(
            task_name="validate", targets=targets, data=outgoing, timeout=rounds.train_timeout
        )
        scores = {result_site(r): numeric_metrics(getattr(r, "metrics", None)) for r in results}
        withheld = {result_site(r): list(names) for r in results if (names := withheld_scores(r))}
        missing = sorted(set(population) - set(scores))
        if missing:
            self.warning(f"final model: no scores from {missing}")
        path = Path(self.get_run_dir()) / FINAL_SCORES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {"round": rounds.num_rounds, "sites": scores, **({"withheld": withheld} if withheld else {})}
        path.write_text(json.dumps(record, indent=1, sort_keys=True))
        for site, metrics in sorted(scores.items()):
            shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()) or "-"
            if site in withheld:
                shown = f"withheld at the site under DP-SGD ({', '.join(withheld[site]) or 'no validation split'})"
            self.info(f"final model at {site}: {shown}")

    def _cross_site_eval(self, population: Sequence[str]) -> None:
        """Every site's kept and local-only models on the other sites' validation splits (controllers/cross_site.py)."""
        from controllers.cross_site import CROSS_SITE_SCORES_FILE, cross_site_record, run_cross_site

        record = cross_site_record(
            run_cross_site(
                self._ask, [site for site in population if site in self._reachable], self._run_id, self.warning
            )
        )
        path = Path(self.get_run_dir()) / CROSS_SITE_SCORES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, sort_keys=True))
        for site, scores in sorted(record["sites"].items()):
            self.info(f"cross-site view of {site}'s models: " + ", ".join(f"{k}={v:.4f}" for k, v in scores.items()))
        self.info(f"cross-site scores: {path}")

    def _ask(self, task: str, targets: Sequence[str], params: dict[str, Any], meta: dict[str, Any]) -> list[Any]:
        """One cross-site task to ``targets`` over NVFlare, their answers (controllers/cross_site.py)."""
        from controllers.cross_site import Answer

        rounds = self.round_settings
        outgoing = outgoing_model(rounds.num_rounds, rounds.num_rounds, params, meta)
        results = self.send_model_and_wait(
            task_name=task, targets=list(targets), data=outgoing, timeout=rounds.train_timeout
        )
        return [
            Answer(
                result_site(r),
                getattr(r, "params", None) or {},
                getattr(r, "meta", None) or {},
                getattr(r, "metrics", None) or {},
            )
            for r in results
        ]

    def _run_round(
        self,
        round_num: int,
        population: tuple[str, ...],
        global_params: dict[str, np.ndarray],
        state: dict[str, Any],
        evaluator: Any,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """One round through the engine (what `run` does per round); the next global model and rule state."""
        outcome = self._round_engine().run_round(
            round_num,
            population,
            global_params,
            state,
            _FLModelTransport(self),
            _ControllerHost(self, evaluator),
            run_id=self._run_id,
        )
        return outcome.params, outcome.state

    def _updates_path(self, round_num: int) -> Path:
        return Path(self.get_run_dir()) / "client_updates" / f"round_{round_num:05d}.npz"

    def _report_outputs(self) -> None:
        app_dir = Path(self.get_app_dir())
        models = sorted(str(p) for p in app_dir.glob("*.pt") if p.name != STATE_FILE)
        message = (
            f"finished {self.round_settings.num_rounds} rounds. metrics: {Path(self.get_run_dir()) / METRICS_FILE}; "
            f"global model: {', '.join(models) or '(no persistor configured)'}; rule state: {app_dir / STATE_FILE}"
        )
        self.info(message)
        print(message, flush=True)


def withheld_scores(result: Any) -> Sequence[str]:
    """The names of the scores a DP site kept to itself (``privacy.withheld`` of its final-evaluation reply)."""
    withheld = (getattr(result, "meta", None) or {}).get(meta_keys.PRIVACY_WITHHELD)
    return withheld if isinstance(withheld, list) else ()


def numeric_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The finite-or-not numbers among a site's reported metrics (anything else is dropped)."""
    return {
        str(k): float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def outgoing_model(round_num: int, num_rounds: int, params: dict[str, np.ndarray], meta: Mapping[str, Any]) -> FLModel:
    """What the server sends a site for a round: the full global model and the engine's broadcast meta."""
    return FLModel(
        params_type=ParamsType.FULL, params=params, current_round=round_num, total_rounds=num_rounds, meta=dict(meta)
    )


class _FLModelTransport:
    """The engine's transport over NVFlare: one ``FLModel`` out to the targets, ``FLModel`` results back."""

    def __init__(self, controller: FedAlgController) -> None:
        self.controller = controller

    def train(
        self, round_num: int, targets: Sequence[str], params: dict[str, np.ndarray], meta: Mapping[str, Any]
    ) -> list[SiteResult]:
        ctl, rounds = self.controller, self.controller.round_settings
        outgoing = outgoing_model(round_num, rounds.num_rounds, params, meta)
        # A site of the population that is not in this job (down when a resumed job started) cannot answer, and an
        # empty target list would make NVFlare send to every site: ask only the job's sites, wait for no more.
        reachable = [site for site in targets if site in ctl._reachable]
        if not reachable:
            return []
        waits_for = None if rounds.min_responses is None else min(rounds.min_responses, len(reachable))
        started = time.monotonic()
        results = ctl.send_model_and_wait(
            targets=reachable, data=outgoing, min_responses=waits_for, timeout=rounds.train_timeout
        )
        ctl._timings["train_wait_s"] = round(time.monotonic() - started, 4)
        return [
            SiteResult(
                site=result_site(r), params=getattr(r, "params", None) or {}, meta=getattr(r, "meta", None) or {}
            )
            for r in results
        ]


class _ControllerHost(Host):
    """The engine's outputs in NVFlare: persistor + ``server_state.pt``, the evaluator component, the metrics file
    in the run folder, and the controller's logger."""

    def __init__(self, controller: FedAlgController, evaluator: Any) -> None:
        self.controller = controller
        self.evaluator = evaluator

    def persist(
        self,
        round_num: int,
        params: dict[str, np.ndarray],
        state: Mapping[str, Any],
        digest: str,
        updates: Sequence[ClientUpdate],
        aggregated: bool,
    ) -> None:
        ctl = self.controller
        started = time.monotonic()
        if aggregated:
            ctl._last_aggregated_round = round_num
        state_path = Path(ctl.get_app_dir()) / STATE_FILE
        # State pending, model, rename: a server killed between any two steps leaves a resumable pair
        # (controllers/checkpoint.py).
        save_rule_state(
            pending_state_path(state_path),
            ctl._rule.name,
            round_num,
            state,
            run_id=ctl._run_id,
            global_sha256=digest,
            last_aggregated_round=ctl._last_aggregated_round,
            last_aggregated_sites=ctl._active_engine.last_aggregated if ctl._active_engine else None,
            population=ctl._population,
            released_steps=ctl._active_engine.released_steps if ctl._active_engine else None,
            stopping=ctl._active_engine.plateau.state() if ctl._active_engine and ctl._active_engine.plateau else None,
            best_global=ctl._active_engine.best_global.state()
            if ctl._active_engine and ctl._active_engine.best_global
            else None,
        )
        ctl.save_model(FLModel(params_type=ParamsType.FULL, params=params, meta={"round": round_num}))
        commit_rule_state(state_path)
        if ctl.round_settings.save_client_updates:
            save_updates(ctl._updates_path(round_num), updates, params)
        ctl._timings["persist_s"] = round(time.monotonic() - started, 4)

    def save_best(self, round_num: int, params: dict[str, np.ndarray]) -> None:
        self.controller.save_best_model(FLModel(params_type=ParamsType.FULL, params=params, meta={"round": round_num}))

    def evaluate(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        if self.evaluator is None:
            return {}
        started = time.monotonic()
        metrics = self.evaluator.evaluate(params)
        self.controller._timings["evaluate_s"] = round(time.monotonic() - started, 4)
        self.controller.info("global model: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return metrics

    def record(self, record: dict[str, Any]) -> None:
        if record.get("stage") == "round":  # the initial record has no round to time
            record.update(self.controller._timings)
        self.controller._timings = {}
        append_metrics(Path(self.controller.get_run_dir()) / METRICS_FILE, record)

    def log(self, level: int, message: str) -> None:
        if level >= logging.ERROR:
            self.controller.error(message)
        elif level >= logging.WARNING:
            self.controller.warning(message)
        else:
            self.controller.info(message)
