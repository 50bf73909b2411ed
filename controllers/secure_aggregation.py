"""The two NVFlare components the sum-type workflow adds around NVFlare's own ones (jobs/secure_aggregation.py).

- `SampleCountWeight` (site, task-result filter before NVFlare's ``HEModelEncryptor``): NVFlare weights each
  result by its ``NUM_STEPS_CURRENT_ROUND`` meta (the encryptor multiplies the update by it before encrypting, the
  aggregator divides the sum by the total); this filter sets it to the site's ``train.num_samples``, the bundle's
  FedAvg weight (docs/design.md, decision 6), so the HE job averages as the bundle's FedAvg does.
- `SumWorkflowRound` (site, task-data filter of a DP-SGD job, after NVFlare's ``HEModelDecryptor``): the round
  meta the site's privacy ledger keys on, which ``ScatterAndGather`` does not send as the bundle's controller does:
  ``server.run_id`` is the NVFlare job id of the site's own job process, ``server.round`` and ``server.num_rounds``
  are the round and planned rounds NVFlare's task headers carry (``ScatterAndGather`` sets both). No
  ``server.last_released``: that server does not track releases, and the ledger's rule for such a server applies
  (lightning_modules/privacy/ledger.py).
- `RoundRecorder` (server): one JSON line per round in ``metrics/round_metrics.jsonl`` (the file the bundle's
  controller writes and ``python -m jobs.provision.loopback`` checks): wall seconds, the sites whose result was
  accepted, the bytes of every result as it travels (NVFlare's own serialisation; a TenSEAL vector goes with its
  public context through NVFlare's HE decomposer), the bytes of the global model's weights sent down, how many
  received ciphertexts carried a context with a secret key (0: the server can add them but never decrypt), and the
  sites' scores of the received global model (``eval.*`` meta, which travels in clear) summarised as the bundle's
  controller summarises them (``site_eval``), under DP-SGD each site's ``privacy.*`` (epsilon so far, ...), and
  under ``secagg`` the key and unmask stages' seconds and bytes (``secagg``: controllers/secagg.py's COST_PROP). It
  also keeps, per site, the cumulative DP-SGD steps its last result reported (``released_steps``).
- `BudgetScatterAndGather` (server, the workflow of a DP-SGD job): NVFlare's ``ScatterAndGather``, which asks every
  site every round, ended after a round in which a site's result said that its next round would exceed its budget
  (``privacy.next_round_epsilon`` above ``privacy.target_epsilon``, controllers/budget.py): the job finishes there, its
  global model persisted, and the round's record carries ``stopped`` (rule ``privacy_budget``, the sites and why).
  Without it the next round was sent, the spent site refused it before training, NVFlare's workflow ended in a fatal
  abort, and every other site had trained and spent a round whose result nobody used.
- `ReleasedStepsBroadcast` (server, task-data filter of a DP-SGD job): puts the recorder's ``released_steps`` into
  every task's meta as ``server.released_steps``, as the bundle's controller broadcasts it, so that a site whose
  ledger is behind what it released (an old backup restored) stops (lightning_modules/privacy/ledger.py).

Nothing here encrypts, decrypts or adds: NVFlare's ``nvflare.app_opt.he`` components do, with TenSEAL.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather

from aggregators.contracts import meta_keys
from aggregators.contracts.run_records import METRICS_FILE  # the same file as the bundle's controller writes
from aggregators.types import ClientUpdate
from controllers.budget import end_of_budget_message, spent_budget
from controllers.engine import SiteResult, released_steps, site_eval_summary


class SampleCountWeight(DXOFilter):
    """Set the result's NVFlare weight (``NUM_STEPS_CURRENT_ROUND``) to the site's ``train.num_samples``."""

    def __init__(self) -> None:
        super().__init__(supported_data_kinds=[DataKind.WEIGHTS], data_kinds_to_filter=[DataKind.WEIGHTS])

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        samples = dxo.get_meta_prop(meta_keys.NUM_SAMPLES)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise ValueError(f"result without a positive integer {meta_keys.NUM_SAMPLES} (got {samples!r})")
        dxo.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, samples)
        return dxo


class SumWorkflowRound(DXOFilter):
    """Put ``server.run_id`` (this site's NVFlare job id), ``server.round`` and ``server.num_rounds`` (NVFlare's task
    headers) into the received model's meta, where the site's round reads them (module docstring)."""

    def __init__(self) -> None:
        super().__init__(supported_data_kinds=[DataKind.WEIGHTS], data_kinds_to_filter=[DataKind.WEIGHTS])

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        job_id = fl_ctx.get_job_id()
        round_num = shareable.get_header(AppConstants.CURRENT_ROUND)
        num_rounds = shareable.get_header(AppConstants.NUM_ROUNDS)
        counts = (round_num, num_rounds)
        if not job_id or any(isinstance(n, bool) or not isinstance(n, int) for n in counts) or round_num < 0:
            raise ValueError(
                f"the task lacks the job id or ScatterAndGather's round headers (job {job_id!r}, round {round_num!r} "
                f"of {num_rounds!r}): DP-SGD's ledger keys on them"
            )
        dxo.set_meta_prop(meta_keys.RUN_ID, str(job_id))
        dxo.set_meta_prop(meta_keys.ROUND, round_num)
        dxo.set_meta_prop(meta_keys.NUM_ROUNDS, num_rounds)
        return dxo


class ReleasedStepsBroadcast(DXOFilter):
    """Put the round recorder's ``released_steps`` into the task's meta (``server.released_steps``; module
    docstring). ``recorder_id``: the `RoundRecorder`'s component id."""

    def __init__(self, recorder_id: str = "rounds") -> None:
        super().__init__(supported_data_kinds=[DataKind.WEIGHTS], data_kinds_to_filter=[DataKind.WEIGHTS])
        self.recorder_id = recorder_id

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        recorder = fl_ctx.get_engine().get_component(self.recorder_id)
        if not isinstance(recorder, RoundRecorder):
            raise ValueError(f"no RoundRecorder with id {self.recorder_id!r}: the sites would get no released steps")
        if recorder.released_steps:
            dxo.set_meta_prop(meta_keys.RELEASED_STEPS, dict(recorder.released_steps))
        return dxo


def wire_bytes(value: Any) -> int:
    """Bytes of ``value`` serialised as NVFlare sends it (fobs; TenSEAL vectors through NVFlare's HE decomposer)."""
    from nvflare.fuel.utils import fobs

    return len(fobs.dumps(value))


def sent_weights(model: Any) -> dict[str, Any]:
    """The global model's weights as the shareable generator sends them: NVFlare's HE generator serialises every
    TenSEAL vector to its bytes alone (no context) before the model goes down; plain arrays go as they are."""
    from nvflare.app_common.abstract.model import ModelLearnableKey

    weights = model.get(ModelLearnableKey.WEIGHTS, {})
    return {k: v.serialize() if hasattr(v, "context") else v for k, v in weights.items()}


def private_ciphertexts(data: Any) -> int:
    """How many TenSEAL vectors in ``data`` (a result's parameters) came with a context holding a secret key."""
    if not isinstance(data, dict):
        return 0
    return sum(1 for v in data.values() if hasattr(v, "context") and v.context().is_private())


def site_scores(site: str, meta: Any) -> ClientUpdate:
    """A result's ``eval.*`` scores and FedAvg weight, as `controllers.engine.site_eval_summary` takes them
    (no parameters: under HE the server has none in clear)."""
    meta = dict(meta or {})
    scores = {k: v for k, v in meta.items() if meta_keys.eval_metric(k) is not None}
    weight = meta.get(meta_keys.NUM_SAMPLES)
    return ClientUpdate(site, {}, weight if isinstance(weight, int) and weight > 0 else 1, scores)


class RoundRecorder(FLComponent):
    """Round records of NVFlare's ScatterAndGather (module docstring); ``secure_aggregation`` is the job's setting.
    With ``end_on_spent_budget`` (the workflow is a `BudgetScatterAndGather`) the round after which a site cannot
    afford another is the last, and its record says so (``stopped``)."""

    def __init__(self, num_rounds: int, secure_aggregation: str, end_on_spent_budget: bool = False) -> None:
        super().__init__()
        self.num_rounds = num_rounds
        self.secure_aggregation = secure_aggregation
        self.end_on_spent_budget = end_on_spent_budget
        #: DP sites whose last result said that their next round would exceed their budget, with why
        self.out_of_budget: dict[str, str] = {}
        self._path: Path | None = None
        self._round: dict[str, Any] = {}
        self._started = 0.0
        #: site -> the cumulative DP-SGD steps of its last result that reached the server (`ReleasedStepsBroadcast`)
        self.released_steps: dict[str, int] = {}

    def note_result(self, site: str, meta: Any) -> None:
        """Keep the DP-SGD step count a site's result reports (never lowered; controllers/engine.released_steps)."""
        self.released_steps = released_steps(self.released_steps, [SiteResult(site, {}, dict(meta or {}))])

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.START_RUN:
            run_dir = fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())
            self._path = Path(run_dir) / METRICS_FILE
            self._append(
                {
                    "stage": "start",
                    "num_rounds": self.num_rounds,
                    "secure_aggregation": self.secure_aggregation,
                    "run_id": fl_ctx.get_job_id(),
                }
            )
        elif event_type == AppEventType.ROUND_STARTED:
            self._started = time.monotonic()
            self._round = {"round": fl_ctx.get_prop(AppConstants.CURRENT_ROUND), "accepted": [], "rejected": []}
            self._round.update(result_bytes={}, private_ciphertexts=0, measure_s=0.0, scores={}, privacy={})
            model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            self._round["global_bytes"] = self._measured(lambda: wire_bytes(sent_weights(model)) if model else None)
        elif event_type == AppEventType.BEFORE_CONTRIBUTION_ACCEPT and self._round:
            result = fl_ctx.get_prop(AppConstants.TRAINING_RESULT)
            site = result.get_peer_prop(ReservedKey.IDENTITY_NAME, "?")
            self._round["result_bytes"][site] = self._measured(lambda: wire_bytes(result))
            dxo = from_shareable(result)
            self.note_result(site, dxo.meta)
            why = spent_budget(dxo.meta or {})
            if why:
                self.out_of_budget.setdefault(site, why)
            self._round["private_ciphertexts"] += private_ciphertexts(dxo.data)
            self._round["scores"][site] = site_scores(site, dxo.meta)
            if meta_keys.PRIVACY_EPSILON in (dxo.meta or {}):
                self._round["privacy"][site] = meta_keys.privacy_of(dxo.meta)
        elif event_type == AppEventType.AFTER_CONTRIBUTION_ACCEPT and self._round:
            result = fl_ctx.get_prop(AppConstants.TRAINING_RESULT)
            site = result.get_peer_prop(ReservedKey.IDENTITY_NAME, "?") if result is not None else "?"
            accepted = fl_ctx.get_prop(AppConstants.AGGREGATION_ACCEPTED)
            self._round["accepted" if accepted else "rejected"].append(site)
        elif event_type == AppEventType.ROUND_DONE and self._round:
            record = self._round
            record["elapsed_s"] = round(time.monotonic() - self._started, 4)
            record["measure_s"] = round(record["measure_s"], 4)
            record["status"] = "aggregated" if record["accepted"] else "failed"
            record["aggregated"] = sorted(record.pop("accepted"))
            scores = record.pop("scores")
            summary = site_eval_summary([scores[site] for site in record["aggregated"] if site in scores])
            if summary:
                record["site_eval"] = summary
            if not record["privacy"]:
                del record["privacy"]
            if self.ends_after(record["round"]):
                record["stopped"] = self.budget_note(record["round"], len(record["aggregated"]))
            secagg_cost = fl_ctx.get_prop("secagg.cost")  # controllers/secagg.py's COST_PROP, under secagg only
            if secagg_cost:
                record["secagg"] = dict(secagg_cost)
            self._append({"stage": "round", **record})
            self._round = {}

    def ends_after(self, round_num: Any) -> bool:
        """Whether the job ends after round ``round_num`` (0-based) because a site cannot afford the next one."""
        last = isinstance(round_num, int) and round_num + 1 >= self.num_rounds
        return self.end_on_spent_budget and bool(self.out_of_budget) and not last

    def budget_note(self, round_num: int, sites: int) -> dict[str, Any]:
        """The ``stopped`` note of the last round (read by ``aggregators.contracts.run_records.stop_note``): every site
        is asked every round, so one spent site ends the job."""
        message = end_of_budget_message(round_num + 1, self.out_of_budget, sites - len(self.out_of_budget), sites)
        return {"rule": "privacy_budget", "round": round_num, "out_of_budget": dict(self.out_of_budget),
                "message": f"{message} (NVFlare's ScatterAndGather asks every site every round)"}  # fmt: skip

    def _measured(self, measure: Any) -> int | None:
        """Run ``measure``, adding its seconds to the round's ``measure_s`` (kept apart from the round's own cost)."""
        started = time.monotonic()
        try:
            return measure()
        except Exception:  # a size we cannot take is left out of the record, never a failed round
            return None
        finally:
            self._round["measure_s"] += time.monotonic() - started

    def _append(self, record: dict[str, Any]) -> None:
        if self._path is None:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with self._path.open("a") as handle:
            handle.write(json.dumps(record, sort_keys=True) + "\n")


class BudgetScatterAndGather(ScatterAndGather):
    """NVFlare's ``ScatterAndGather`` that finishes after a round once the `RoundRecorder` (``recorder_id``) holds a
    site whose next round would exceed its privacy budget (module docstring): no round is sent that a site would
    refuse, and none trained that nobody uses. The round's model is persisted as every round's is."""

    def __init__(self, *args: Any, recorder_id: str = "rounds", **kwargs: Any) -> None:
        # *args and **kwargs: NVFlare's job API then reads ScatterAndGather's own arguments for the job's config.
        super().__init__(*args, **kwargs)
        self.recorder_id = recorder_id

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        super().handle_event(event_type, fl_ctx)
        if event_type != AppEventType.ROUND_DONE:
            return
        recorder = fl_ctx.get_engine().get_component(self.recorder_id)
        if not isinstance(recorder, RoundRecorder):
            raise ValueError(f"no RoundRecorder with id {self.recorder_id!r}: the workflow cannot see spent budgets")
        if recorder.ends_after(self._current_round - self._start_round):
            note = recorder.budget_note(self._current_round - self._start_round, len(self._engine.get_clients()))
            self.log_warning(fl_ctx, note["message"])
            # ScatterAndGather's loop runs while _current_round < _start_round + _num_rounds: this round is the last
            self._num_rounds = self._current_round - self._start_round + 1
