"""The NVFlare side of the server: a thin adapter that runs :class:`controllers.engine.RoundEngine` in NVFlare.

Built on NVFlare's :class:`ModelController`. All round logic lives in the framework-free engine (select sites,
broadcast, validate, aggregate through a pure rule from :mod:`aggregators`, record); this class only

1. gives the engine a transport that sends the global model as an ``FLModel`` with ``send_model_and_wait`` and
   turns the returned ``FLModel`` results into :class:`controllers.engine.SiteResult`,
2. persists every round's global model (persistor) and rule state (``server_state.pt``; also after a round that
   did not aggregate, see :mod:`controllers.checkpoint` for what resume does then),
3. evaluates the global model on the test split and appends one JSON line per round to
   ``metrics/round_metrics.jsonl``, and logs through NVFlare's component logger.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.workflows.model_controller import ModelController

from aggregators import AggregationRule, ClientUpdate, build_rule, meta_keys
from aggregators.compose import compose
from controllers.adapters import result_site
from controllers.checkpoint import append_metrics, load_resume_point, save_rule_state, save_updates
from controllers.engine import Host, RoundEngine, SiteResult, scalar_meta

__all__ = ["METRICS_FILE", "STATE_FILE", "FedAlgController", "scalar_meta", "to_numpy_params"]

METRICS_FILE = Path("metrics") / "round_metrics.jsonl"
#: The final global model scored by every site (``final_site_eval``): ``{"round": n, "sites": {site: {metric: v}}}``.
FINAL_SCORES_FILE = Path("metrics") / "final_site_scores.json"
STATE_FILE = "server_state.pt"


def to_numpy_params(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Global parameters as numpy arrays whatever the persistor handed over (tensors or arrays)."""
    converted = {}
    for key, value in params.items():
        converted[key] = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    return converted


class FedAlgController(ModelController):
    """Federated rounds driven by an aggregation rule from :data:`aggregators.RULES`.

    Args:
        num_rounds: number of federated rounds.
        rule: aggregation rule name (``fedavg``, ...); ``rule_args`` are its hyperparameters.
        clients_per_round: ``None`` for all sites, an int count, or a float fraction in (0, 1].
        min_responses: results to wait for per round; ``None`` waits for every sampled site.
        min_accepted: fewest valid results needed to aggregate, at least 1 (refused here otherwise); with fewer the
            round is recorded as failed and the global model is kept as it is.
        seed: seeds the site sampling.
        evaluator_id: id of a server component with ``evaluate(params) -> dict`` ("" disables evaluation).
        train_timeout: seconds to wait for a round's results (0 = no timeout).
        save_client_updates: also write every accepted client model to
            ``<run_dir>/client_updates/round_XXXXX.npz`` (one array per ``<site>/<key>``), for audits and
            end-to-end tests; off by default because it costs one model per site per round of disk.
        companions: companion rules kept beside ``rule`` for the client algorithm's server state, name -> args
            (e.g. ``{"scaffold_control": {}}`` for SCAFFOLD clients under FedYogi; see aggregators/compose.py).
        resume_from: a previous run's server app folder (``server_state.pt`` + ``FL_global_model.pt``): the job
            continues after that run's last attempted round (aggregated or not) with its global model, rule state
            and run id.
        final_site_eval: after the last round, send the final global model to every site as a ``validate`` task
            and write their scores on their own validation splits to ``<run dir>/metrics/final_site_scores.json``.
    """

    def __init__(
        self,
        *,
        num_rounds: int = 5,
        rule: str = "fedavg",
        rule_args: dict[str, Any] | None = None,
        clients_per_round: int | float | None = None,
        min_responses: int | None = None,
        min_accepted: int = 1,
        seed: int = 0,
        evaluator_id: str = "evaluator",
        train_timeout: int = 0,
        save_client_updates: bool = False,
        persistor_id: str = "persistor",
        task_check_period: float = 0.5,
        companions: dict[str, dict[str, Any]] | None = None,
        resume_from: str | None = None,
        final_site_eval: bool = False,
    ) -> None:
        super().__init__(persistor_id=persistor_id, task_check_period=task_check_period)
        # Write every setting into exported configs, defaults included, so a job folder documents itself.
        self._always_serialize_args = (
            "num_rounds",
            "rule",
            "rule_args",
            "clients_per_round",
            "min_responses",
            "min_accepted",
            "seed",
            "evaluator_id",
            "train_timeout",
        )
        self.num_rounds = num_rounds
        self.rule = rule
        self.rule_args = rule_args
        self.clients_per_round = clients_per_round
        self.min_responses = min_responses
        self.min_accepted = min_accepted
        self.seed = seed
        self.evaluator_id = evaluator_id
        self.train_timeout = train_timeout
        self.save_client_updates = save_client_updates
        self.companions = companions
        self.resume_from = resume_from
        self.final_site_eval = final_site_eval
        # Fail at job start, not after the first round, when the rule or its settings are wrong (min_accepted >= 1
        # is checked by the engine).
        self._rule: AggregationRule = compose(build_rule(rule, **(rule_args or {})), companions)
        self._round_engine()
        self._run_id = ""
        self._last_aggregated_round: int | None = None  # recorded in server_state.pt (controllers/checkpoint.py)
        self._active_engine: RoundEngine | None = None  # the engine of the running job (its site confirmations)

    def _round_engine(self) -> RoundEngine:
        """The engine for the current settings (built where used, so a changed setting is always honoured)."""
        return RoundEngine(
            self._rule,
            num_rounds=self.num_rounds,
            clients_per_round=self.clients_per_round,
            min_accepted=self.min_accepted,
            seed=self.seed,
            rule_label=self.rule,
        )

    def run(self) -> None:
        # A fresh id per run: clients discard persisted state written by an earlier run in a reused workspace.
        self._run_id = uuid.uuid4().hex
        self._last_aggregated_round = None
        initial = self.load_model()
        if initial is None:
            return
        global_params = to_numpy_params(initial.params)
        population = tuple(sorted(client.name for client in self.engine.get_clients()))
        state = self._rule.init_state(global_params)
        evaluator = self.get_component(self.evaluator_id) if self.evaluator_id else None
        self.info(f"rule={self.rule} {self.rule_args or {}}; population={list(population)}; rounds={self.num_rounds}")
        first_round, stage = 0, "initial"
        engine = self._active_engine = self._round_engine()
        if self.resume_from:
            # docs/design.md decision 5: continue a stopped job as if it had never stopped.
            resume = load_resume_point(Path(self.resume_from), self._rule.name)
            first_round, stage = resume.next_round, "resumed"
            global_params, state, self._run_id = resume.global_params, resume.state, resume.run_id or self._run_id
            self._last_aggregated_round = resume.last_aggregated_round
            engine.last_aggregated = resume.last_aggregated_sites
            self.info(f"resuming from {self.resume_from} at round {first_round + 1}/{self.num_rounds}")
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
        if self.final_site_eval and not self.abort_signal.triggered:
            self._score_final_model(population, final_params)
        if not self.abort_signal.triggered:
            self._report_outputs()

    def _score_final_model(self, population: Sequence[str], params: dict[str, np.ndarray]) -> None:
        """Every site scores the final global model on its own validation split (a site x metric table)."""
        outgoing = outgoing_model(self.num_rounds, self.num_rounds, params, {meta_keys.RUN_ID: self._run_id})
        results = self.send_model_and_wait(
            task_name="validate", targets=list(population), data=outgoing, timeout=self.train_timeout
        )
        scores = {result_site(r): numeric_metrics(getattr(r, "metrics", None)) for r in results}
        missing = sorted(set(population) - set(scores))
        if missing:
            self.warning(f"final model: no scores from {missing}")
        path = Path(self.get_run_dir()) / FINAL_SCORES_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"round": self.num_rounds, "sites": scores}, indent=1, sort_keys=True))
        for site, metrics in sorted(scores.items()):
            self.info(f"final model at {site}: " + (", ".join(f"{k}={v:.4f}" for k, v in metrics.items()) or "-"))

    def _run_round(
        self,
        round_num: int,
        population: tuple[str, ...],
        global_params: dict[str, np.ndarray],
        state: dict[str, Any],
        evaluator: Any,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """One round through the engine (what :meth:`run` does per round); the next global model and rule state."""
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
            f"finished {self.num_rounds} rounds. metrics: {Path(self.get_run_dir()) / METRICS_FILE}; "
            f"global model: {', '.join(models) or '(no persistor configured)'}; rule state: {app_dir / STATE_FILE}"
        )
        self.info(message)
        print(message, flush=True)


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
        ctl = self.controller
        outgoing = outgoing_model(round_num, ctl.num_rounds, params, meta)
        results = ctl.send_model_and_wait(
            targets=list(targets), data=outgoing, min_responses=ctl.min_responses, timeout=ctl.train_timeout
        )
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
        if aggregated:
            ctl._last_aggregated_round = round_num
        ctl.save_model(FLModel(params_type=ParamsType.FULL, params=params, meta={"round": round_num}))
        save_rule_state(
            Path(ctl.get_app_dir()) / STATE_FILE,
            ctl._rule.name,
            round_num,
            state,
            run_id=ctl._run_id,
            global_sha256=digest,
            last_aggregated_round=ctl._last_aggregated_round,
            last_aggregated_sites=ctl._active_engine.last_aggregated if ctl._active_engine else None,
        )
        if ctl.save_client_updates:
            save_updates(ctl._updates_path(round_num), updates, params)

    def evaluate(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        if self.evaluator is None:
            return {}
        metrics = self.evaluator.evaluate(params)
        self.controller.info("global model: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return metrics

    def record(self, record: dict[str, Any]) -> None:
        append_metrics(Path(self.controller.get_run_dir()) / METRICS_FILE, record)

    def log(self, level: int, message: str) -> None:
        if level >= logging.ERROR:
            self.controller.error(message)
        elif level >= logging.WARNING:
            self.controller.warning(message)
        else:
            self.controller.info(message)
