"""The server's side of ``--secure-aggregation secagg``: NVFlare's ScatterAndGather with SecAgg+'s stages around
its training task (the protocol's math: aggregators/secagg.py; the sites' side: controllers/secagg_site.py).

Each round, `SecAggScatterAndGather` runs, in NVFlare tasks to every site:

1. ``secagg_keys`` (*advertise keys*): the round, the sorted site names, the threshold and the ring degree go out;
   each site's two public keys come back.
2. ``secagg_shares`` (*share keys*): every advertised public key goes out; each site's shares of its self-mask seed
   and mask key come back, sealed for each holder.
3. ``train`` (ScatterAndGather's own task; *masked input*): with the global model, the header ``secagg`` carries
   which sites shared keys and every sealed share (only its holder can open one); `SecAggAggregator` keeps each
   site's masked weighted update (six bytes a coordinate) and its weight (NVFlare's ``NUM_STEPS_CURRENT_ROUND``,
   in clear as under ``he``).
4. ``secagg_unmask``: the names of the summed sites and of those that shared keys but sent no masked input go out;
   each holder's shares (self-mask seeds of the summed, mask keys of the dropped) come back, and the aggregator
   rebuilds only the sum: the weighted mean update, which NVFlare's ``FullModelShareableGenerator`` adds to the
   global model (``WEIGHT_DIFF``).

The stages hook into ScatterAndGather's own round at its ``ROUND_STARTED`` (1-2) and ``BEFORE_AGGREGATION`` (4)
events, which it fires in its control flow's thread: the round, its records (controllers/secure_aggregation.py's
``RoundRecorder``: the key stages' time counts in the round's), persisting and stopping stay NVFlare's; the end of a
DP site's budget ends the job after its round as under ``he``/``plain`` (``BudgetScatterAndGather``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nvflare.apis.controller_spec import ClientTask, Task
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.aggregator import Aggregator
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from aggregators import secagg
from aggregators.contracts.meta_keys import SECAGG_ROUND
from aggregators.secagg import HEADER, KEYS_TASK, MASKED_KIND, SHARES_TASK, STAGE_DATA, STAGE_KIND, UNMASK_TASK
from controllers.secure_aggregation import BudgetScatterAndGather

#: Seconds between the server's checks whether a task's answers are in: the bundle's controller's
#: (controllers/fedalg_controller.py's TASK_CHECK_PERIOD), not NVFlare's 0.2 s in effect, which each of a round's four
#: tasks would wait.
TASK_CHECK_PERIOD = 0.02
#: Seconds the unmask stage waits for the other holders once ``threshold`` of them answered.
UNMASK_WAIT_S = 2
#: The FLContext property with the round's SecAgg+ cost, which controllers/secure_aggregation.py's RoundRecorder
#: writes into the round's record: seconds of the key stages and of the unmask stage, and the bytes of the stages'
#: answers (up, all sites) and of what they and the train task's header carried down (all sites), as NVFlare
#: serialises them.
COST_PROP = "secagg.cost"


@dataclass
class RoundSetup:
    """What the server holds of one round's set-up: the sorted site names, their public keys (channel, mask) and
    the sealed shares of the sites that shared keys (source -> holder -> ciphertext)."""

    round_num: int
    sites: tuple[str, ...]
    public: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    sealed: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def index(self, site: str) -> int:
        return self.sites.index(site)

    def header(self, threshold: int, degree: int | None) -> dict[str, Any]:
        return {
            "round": self.round_num,
            "sites": list(self.sites),
            "threshold": threshold,
            "degree": degree,
            "shared": sorted(self.sealed),
            "sealed": self.sealed,
        }


def global_shapes(fl_ctx: FLContext) -> dict[str, tuple[int, ...]]:
    """The shapes of the global model's entries, which a masked input must have."""
    from nvflare.app_common.abstract.model import ModelLearnableKey

    model = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL) or {}
    return {name: np.shape(value) for name, value in model.get(ModelLearnableKey.WEIGHTS, {}).items()}


class SecAggAggregator(Aggregator):
    """Keeps each site's masked input and weight for the round; `aggregate` unmasks the sum with the shares the
    controller collected (`unmask_with`) and returns the weighted mean update as a ``WEIGHT_DIFF``."""

    def __init__(self) -> None:
        super().__init__()
        self.setup: RoundSetup | None = None
        self.threshold = 0
        self.degree: int | None = None
        self.masked: dict[str, dict[str, np.ndarray]] = {}
        self.weights: dict[str, int] = {}
        self.returned: dict[str, dict[str, bytes]] = {}

    def begin_round(self, setup: RoundSetup, threshold: int, degree: int | None) -> None:
        self.setup, self.threshold, self.degree = setup, threshold, degree
        self.reset()

    def reset(self, fl_ctx: FLContext | None = None) -> None:
        self.masked, self.weights, self.returned = {}, {}, {}

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        site = shareable.get_peer_prop(ReservedKey.IDENTITY_NAME, "?")
        dxo = from_shareable(shareable)
        setup = self.setup
        problem = None
        if setup is None or dxo.get_meta_prop(SECAGG_ROUND) != setup.round_num:
            problem = "not a masked result of this round"
        elif site not in setup.sealed:
            problem = "the site did not share its keys this round, so its masks cannot be removed"
        elif dxo.data_kind != MASKED_KIND:
            problem = f"data kind {dxo.data_kind}, expected {MASKED_KIND}"
        weight = dxo.get_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND)
        if problem is None and (isinstance(weight, bool) or not isinstance(weight, int) or weight < 1):
            problem = f"weight {weight!r} is not a positive integer"
        if problem:
            self.log_error(fl_ctx, f"result of site {site} refused: {problem}")
            return False
        try:
            self.masked[site] = secagg.unpack(dxo.data, global_shapes(fl_ctx))
        except secagg.SecAggError as exc:
            self.log_error(fl_ctx, f"result of site {site} refused: {exc}")
            return False
        self.weights[site] = weight
        return True

    def unmask_lists(self) -> tuple[list[str], list[str]]:
        """The sites summed (their masked input arrived) and dropped (shared keys, sent no masked input)."""
        shared = sorted(self.setup.sealed) if self.setup else []
        return sorted(self.masked), [s for s in shared if s not in self.masked]

    def unmask_with(self, returned: dict[str, dict[str, bytes]]) -> None:
        self.returned = returned

    def aggregate(self, fl_ctx: FLContext) -> Shareable:
        setup = self.setup
        summed, dropped = self.unmask_lists()
        if setup is None or len(summed) < self.threshold:
            raise secagg.SecAggError(
                f"secagg round: {len(summed)} masked results, fewer than the threshold {self.threshold}"
            )
        total = secagg.masked_sum([self.masked[s] for s in summed])
        returned = {
            setup.index(holder): {setup.index(src): share for src, share in shares.items()}
            for holder, shares in self.returned.items()
        }
        weighted_sum = secagg.unmask(
            total,
            [setup.index(s) for s in summed],
            [setup.index(s) for s in dropped],
            returned,
            {setup.index(s): mask_pk for s, (_, mask_pk) in setup.public.items()},
            len(setup.sites),
            self.threshold,
            setup.round_num,
            self.degree,
        )
        mean = secagg.mean_update(weighted_sum, sum(self.weights[s] for s in summed))
        self.log_info(fl_ctx, f"secagg round {setup.round_num}: unmasked the sum of {summed}, dropped {dropped}")
        self.reset()
        dxo = DXO(data_kind=DataKind.WEIGHT_DIFF, data={k: v.astype(np.float32) for k, v in mean.items()})
        return dxo.to_shareable()


class SecAggScatterAndGather(BudgetScatterAndGather):
    """ScatterAndGather with SecAgg+'s key stages before each round's training task and the unmask stage before
    its aggregation (module docstring). ``threshold``: shares that rebuild a site's secret; ``degree``: the ring
    neighbourhood (``None``: every site); ``stage_timeout``: seconds a stage waits for the sites. As a
    `BudgetScatterAndGather` it finishes after the round in which a DP site's result says that its next round would
    exceed its budget (the `RoundRecorder` ``recorder_id`` decides, with ``end_on_spent_budget``): no key stage and
    no training for a round whose result could not be used."""

    def __init__(
        self,
        *,
        threshold: int,
        degree: int | None = None,
        stage_timeout: int = 300,
        min_clients: int = 3,
        num_rounds: int = 5,
        wait_time_after_min_received: int = 0,
        aggregator_id: str = "aggregator",
        persistor_id: str = "persistor",
        shareable_generator_id: str = "shareable_generator",
        train_timeout: int = 0,
        task_check_period: float = TASK_CHECK_PERIOD,
        recorder_id: str = "rounds",
    ):
        # NVFlare's job API writes a component's constructor arguments by name: each is declared here.
        super().__init__(
            min_clients=min_clients,
            num_rounds=num_rounds,
            wait_time_after_min_received=wait_time_after_min_received,
            aggregator_id=aggregator_id,
            persistor_id=persistor_id,
            shareable_generator_id=shareable_generator_id,
            train_timeout=train_timeout,
            task_check_period=task_check_period,
            recorder_id=recorder_id,
        )
        self.threshold, self.degree, self.stage_timeout = threshold, degree, stage_timeout
        self._abort: Signal | None = None
        self._setup: RoundSetup | None = None
        self._cost: dict[str, float] = {}

    def set_communicator(self, communicator: Any) -> None:
        """Poll at ``task_check_period`` (the bundle's controller's 0.02 s): each of the round's four tasks waits
        for its answers, and NVFlare's monitor otherwise polls every 0.2 s (controllers/fedalg_controller.py)."""
        super().set_communicator(communicator)
        if isinstance(getattr(communicator, "_task_check_period", None), int | float):
            communicator._task_check_period = self._task_check_period

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        self._abort = abort_signal
        super().control_flow(abort_signal, fl_ctx)

    def fire_event(self, event_type: str, fl_ctx: FLContext) -> None:
        super().fire_event(event_type, fl_ctx)
        if event_type == AppEventType.ROUND_STARTED:
            self._key_stages(fl_ctx)
        elif event_type == AppEventType.BEFORE_AGGREGATION:
            self._unmask_stage(fl_ctx)

    def _aggregator(self) -> SecAggAggregator:
        if not isinstance(self.aggregator, SecAggAggregator):
            raise TypeError(f"secagg needs a SecAggAggregator, got {type(self.aggregator).__name__}")
        return self.aggregator

    def _stage(
        self, name: str, data: dict[str, Any], targets: list[str], fl_ctx: FLContext, enough: int | None = None
    ) -> dict[str, Any]:
        """Send ``data`` to ``targets`` as task ``name``; each answering site's answer (its DXO's data). The task
        ends when every target answered, or ``UNMASK_WAIT_S`` after ``enough`` did (``None``: every target), or at
        ``stage_timeout``."""
        answers: dict[str, Any] = {}

        def received(client_task: ClientTask, fl_ctx: FLContext) -> None:
            result = client_task.result
            if result is not None and result.get_return_code() == "OK":
                dxo = from_shareable(result)
                if dxo.data_kind == STAGE_KIND and set(dxo.data) == set(STAGE_DATA[name]):
                    answers[client_task.client.name] = dxo.data
                    self._count("up_bytes", wire_size(result))
            client_task.result = None

        started = time.monotonic()
        shareable = Shareable()
        shareable["secagg"] = data
        self._count("down_bytes", wire_size(shareable) * len(targets))
        task = Task(name=name, data=shareable, timeout=self.stage_timeout, result_received_cb=received)
        self.broadcast_and_wait(
            task,
            fl_ctx,
            targets=targets,
            min_responses=len(targets) if enough is None else enough,
            wait_time_after_min_received=0 if enough is None else UNMASK_WAIT_S,
            abort_signal=self._abort,
        )
        stage = "unmask_s" if name == UNMASK_TASK else "setup_s"
        self._count(stage, time.monotonic() - started)
        return answers

    def _count(self, key: str, amount: float) -> None:
        self._cost[key] = self._cost.get(key, 0) + amount

    def _key_stages(self, fl_ctx: FLContext) -> None:
        self._cost = {"setup_s": 0.0, "unmask_s": 0.0, "up_bytes": 0, "down_bytes": 0}
        sites = tuple(sorted(c.name for c in self._engine.get_clients()))
        secagg.check_protocol(len(sites), self.threshold, self.degree)
        setup = RoundSetup(fl_ctx.get_prop(AppConstants.CURRENT_ROUND), sites)
        common = {"round": setup.round_num, "sites": list(sites), "threshold": self.threshold, "degree": self.degree}
        keys = self._stage(KEYS_TASK, common, list(sites), fl_ctx)
        setup.public = {site: (bytes(a["channel_pk"]), bytes(a["mask_pk"])) for site, a in keys.items()}
        shares = self._stage(SHARES_TASK, {**common, "public": setup.public}, sorted(setup.public), fl_ctx)
        setup.sealed = {site: dict(a["sealed"]) for site, a in shares.items() if site in setup.public}
        if len(setup.sealed) < self.threshold:
            raise secagg.SecAggError(
                f"secagg round {setup.round_num}: {len(setup.public)} sites advertised keys and {len(setup.sealed)} "
                f"shared them, fewer than the threshold {self.threshold}"
            )
        self.log_info(
            fl_ctx, f"secagg round {setup.round_num}: {len(setup.public)} advertised, {len(setup.sealed)} shared"
        )
        self._setup = setup
        self._count("down_bytes", wire_size(setup.header(self.threshold, self.degree)) * len(setup.sealed))
        self._aggregator().begin_round(setup, self.threshold, self.degree)

    def _prepare_train_task_data(self, client_task: ClientTask, fl_ctx: FLContext) -> None:
        if self._setup is not None:
            client_task.task.data.set_header(HEADER, self._setup.header(self.threshold, self.degree))
        super()._prepare_train_task_data(client_task, fl_ctx)

    def _unmask_stage(self, fl_ctx: FLContext) -> None:
        aggregator = self._aggregator()
        summed, dropped = aggregator.unmask_lists()
        setup = self._setup
        if setup is None or len(summed) < self.threshold:
            return  # the aggregator refuses the round in one line
        data = {"round": setup.round_num, "summed": summed, "dropped": dropped}
        # With every site a holder of every site's shares (no ring degree), any t holders rebuild every secret: a
        # site that dropped after its masked input delays the round by UNMASK_WAIT_S, not by the stage timeout.
        enough = self.threshold if self.degree is None else None
        answers = self._stage(UNMASK_TASK, data, sorted(setup.sealed), fl_ctx, enough=enough)
        aggregator.unmask_with({site: dict(a["shares"]) for site, a in answers.items()})
        fl_ctx.set_prop(COST_PROP, {k: round(v, 4) for k, v in self._cost.items()}, private=True, sticky=False)


def wire_size(value: Any) -> int:
    """Bytes of ``value`` as NVFlare serialises it (fobs)."""
    from nvflare.fuel.utils import fobs

    return len(fobs.dumps(value))
