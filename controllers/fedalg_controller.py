"""The one server workflow of the bundle: rounds of broadcast → local training → validation → aggregation.

Built on NVFlare's :class:`ModelController`; all math is delegated to a pure rule from :mod:`aggregators`
(DESIGN.md, decision 1). Per round it

1. samples the sites (all, a count, or a fraction; seeded, so reruns pick the same sites),
2. broadcasts the global model with the rule's meta (e.g. a global control variate) and round bookkeeping,
3. validates every result (keys, shapes, finite values, sample count, the rule's required meta) and rejects bad
   ones by site and key, carrying on with the rest,
4. aggregates through the rule, saves the global model (persistor) and the rule state (``server_state.pt``),
5. evaluates the global model on the test split and appends one JSON line to ``metrics/round_metrics.jsonl``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.workflows.model_controller import ModelController

from aggregators import AggregationError, AggregationRule, RoundContext, build_rule, meta_keys
from aggregators.compose import compose
from controllers.adapters import split_results
from controllers.checkpoint import append_metrics, load_resume_point, params_digest, save_rule_state, save_updates
from controllers.sampling import clients_per_round_count, select_round_sites

METRICS_FILE = Path("metrics") / "round_metrics.jsonl"
STATE_FILE = "server_state.pt"


def to_numpy_params(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Global parameters as numpy arrays whatever the persistor handed over (tensors or arrays)."""
    converted = {}
    for key, value in params.items():
        converted[key] = value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)
    return converted


def scalar_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The namespaced scalar values a client reported (e.g. ``train.accuracy``, ``fedprox.mu``) for the metrics log."""
    return {
        key: value
        for key, value in sorted(meta.items())
        if meta_keys.is_namespaced(key) and isinstance(value, bool | int | float | str | np.generic)
    }


class FedAlgController(ModelController):
    """Federated rounds driven by an aggregation rule from :data:`aggregators.RULES`.

    Args:
        num_rounds: number of federated rounds.
        rule: aggregation rule name (``fedavg``, ...); ``rule_args`` are its hyperparameters.
        clients_per_round: ``None`` for all sites, an int count, or a float fraction in (0, 1].
        min_responses: results to wait for per round; ``None`` waits for every sampled site.
        min_accepted: fewest valid results needed to aggregate; with fewer the global model is kept as it is.
        seed: seeds the site sampling.
        evaluator_id: id of a server component with ``evaluate(params) -> dict`` ("" disables evaluation).
        train_timeout: seconds to wait for a round's results (0 = no timeout).
        save_client_updates: also write every accepted client model to
            ``<run_dir>/client_updates/round_XXXXX.npz`` (one array per ``<site>/<key>``), for audits and
            end-to-end tests; off by default because it costs one model per site per round of disk.
        companions: companion rules kept beside ``rule`` for the client algorithm's server state, name -> args
            (e.g. ``{"scaffold_control": {}}`` for SCAFFOLD clients under FedYogi; see aggregators/compose.py).
        resume_from: a previous run's server app folder (``server_state.pt`` + ``FL_global_model.pt``): the job
            continues after that run's last completed round with its global model, rule state and run id.
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
        # Fail at job start, not after the first round, when the rule or its settings are wrong.
        self._rule: AggregationRule = compose(build_rule(rule, **(rule_args or {})), companions)

    def run(self) -> None:
        # A fresh id per run: clients discard persisted state written by an earlier run in a reused workspace.
        self._run_id = uuid.uuid4().hex
        initial = self.load_model()
        if initial is None:
            return
        global_params = to_numpy_params(initial.params)
        population = tuple(sorted(client.name for client in self.engine.get_clients()))
        state = self._rule.init_state(global_params)
        evaluator = self.get_component(self.evaluator_id) if self.evaluator_id else None
        self.info(f"rule={self.rule} {self.rule_args or {}}; population={list(population)}; rounds={self.num_rounds}")
        first_round, stage = 0, "initial"
        if self.resume_from:
            # DESIGN.md decision 5: continue a stopped job as if it had never stopped.
            resume = load_resume_point(Path(self.resume_from), self._rule.name)
            first_round, stage = resume.next_round, "resumed"
            global_params, state, self._run_id = resume.global_params, resume.state, resume.run_id or self._run_id
            self.info(f"resuming from {self.resume_from} at round {first_round + 1}/{self.num_rounds}")
        initial_record = {"stage": stage, "round": None, "global_sha256": params_digest(global_params)}
        self._log_metrics({**initial_record, **self._evaluate(evaluator, global_params)})

        for round_num in range(first_round, self.num_rounds):
            if self.abort_signal.triggered:
                self.warning(f"abort requested; stopping before round {round_num + 1}")
                return
            global_params, state = self._run_round(round_num, population, global_params, state, evaluator)
        self._report_outputs()

    def _run_round(
        self,
        round_num: int,
        population: tuple[str, ...],
        global_params: dict[str, np.ndarray],
        state: dict[str, Any],
        evaluator: Any,
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        started = time.monotonic()
        count = clients_per_round_count(self.clients_per_round, len(population))
        targets, state = select_round_sites(self._rule, population, count, state, self.seed, round_num)
        self.info(f"round {round_num + 1}/{self.num_rounds}: training on {targets}")
        results = self.send_model_and_wait(
            targets=targets,
            data=self._outgoing_model(round_num, global_params, state),
            min_responses=self.min_responses,
            timeout=self.train_timeout,
        )
        rule_check = getattr(self._rule, "update_problems", None)
        check = (lambda update: rule_check(update, global_params, state)) if rule_check else None
        updates, rejections = split_results(results, global_params, self._rule.required_meta, check)
        for rejection in rejections:
            self.error(f"round {round_num + 1}: {rejection}")
        record: dict[str, Any] = {"stage": "round", "round": round_num, "sites": targets}
        record["rejected"] = {r.site: list(r.problems) for r in rejections}
        if len(updates) < self.min_accepted:
            self.error(
                f"round {round_num + 1}: only {len(updates)} valid result(s), {self.min_accepted} needed; "
                "the global model is left unchanged this round"
            )
            digest = params_digest(global_params)
        else:
            global_params, state, digest = self._aggregate(round_num, population, global_params, updates, state)
        record["aggregated"] = [u.site for u in updates] if len(updates) >= self.min_accepted else []
        record["global_sha256"] = digest
        if self.save_client_updates:
            save_updates(self._updates_path(round_num), updates, global_params)
        record.update(self._site_metrics(updates))
        record.update(self._evaluate(evaluator, global_params))
        record["elapsed_s"] = round(time.monotonic() - started, 3)
        self._log_metrics(record)
        return global_params, state

    def _updates_path(self, round_num: int) -> Path:
        return Path(self.get_run_dir()) / "client_updates" / f"round_{round_num:05d}.npz"

    def _outgoing_model(self, round_num: int, params: dict[str, np.ndarray], state: dict[str, Any]) -> FLModel:
        meta = {
            meta_keys.ROUND: round_num,
            meta_keys.NUM_ROUNDS: self.num_rounds,
            meta_keys.AGGREGATION_RULE: self.rule,
            meta_keys.RUN_ID: self._run_id,
            **self._rule.broadcast_meta(state),
        }
        return FLModel(
            params_type=ParamsType.FULL,
            params=params,
            current_round=round_num,
            total_rounds=self.num_rounds,
            meta=meta,
        )

    def _aggregate(self, round_num, population, global_params, updates, state):
        """The next global model and rule state, and the model's digest (hashed once: it goes to the state checkpoint
        and to the metrics line). On an aggregation error the current model and state are kept."""
        context = RoundContext(round_num=round_num, num_rounds=self.num_rounds, population=population)
        try:
            result = self._rule.aggregate(global_params, updates, state, context)
        except AggregationError as exc:
            self.error(f"round {round_num + 1}: aggregation failed, global model unchanged: {exc}")
            return global_params, state, params_digest(global_params)
        digest = params_digest(result.params)
        self.save_model(FLModel(params_type=ParamsType.FULL, params=result.params, meta={"round": round_num}))
        save_rule_state(
            Path(self.get_app_dir()) / STATE_FILE,
            self._rule.name,
            round_num,
            result.state,
            run_id=self._run_id,
            global_sha256=digest,
        )
        return result.params, result.state, digest

    @staticmethod
    def _site_metrics(updates) -> dict[str, Any]:
        return {
            "site_train_loss": {u.site: u.meta.get(meta_keys.TRAIN_LOSS) for u in updates},
            "site_num_samples": {u.site: u.num_samples for u in updates},
            "site_num_steps": {u.site: u.meta.get(meta_keys.NUM_STEPS) for u in updates},
            "site_meta": {u.site: scalar_meta(u.meta) for u in updates},
        }

    def _evaluate(self, evaluator: Any, params: dict[str, np.ndarray]) -> dict[str, float]:
        if evaluator is None:
            return {}
        metrics = evaluator.evaluate(params)
        self.info("global model: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        return metrics

    def _log_metrics(self, record: dict[str, Any]) -> None:
        append_metrics(Path(self.get_run_dir()) / METRICS_FILE, record)

    def _report_outputs(self) -> None:
        app_dir = Path(self.get_app_dir())
        models = sorted(str(p) for p in app_dir.glob("*.pt") if p.name != STATE_FILE)
        message = (
            f"finished {self.num_rounds} rounds. metrics: {Path(self.get_run_dir()) / METRICS_FILE}; "
            f"global model: {', '.join(models) or '(no persistor configured)'}; rule state: {app_dir / STATE_FILE}"
        )
        self.info(message)
        print(message, flush=True)
