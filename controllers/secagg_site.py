"""A site's side of ``--secure-aggregation secagg`` (the server's: controllers/secagg.py; the math:
aggregators/secagg.py).

- `SecAggSite` (component ``secagg_site``): the site's state for the round in its job process: its key pairs (made
  here; the secret keys never leave), its self-mask seed, the shares it opened, the global model it received.
- `SecAggExecutor` answers the key and unmask stages (``secagg_keys``, ``secagg_shares``, ``secagg_unmask``) from
  that state. It checks what it is asked: the protocol's parameters (at least 3 sites, a majority threshold), the
  round, and in the unmask stage never both shares of one site.
- `SecAggTaskData` (task-data filter of ``train``): opens the shares addressed to this site from the task's
  ``secagg`` header and keeps the received global model.
- `SecAggMask` (task-result filter of ``train``, before the egress gate): replaces the trained weights by the masked
  input: ``num_samples * quantise(trained - global)`` plus the self-mask and the pairwise masks, modulo 2^48, six
  bytes a coordinate (`aggregators.secagg.pack`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, MetaKey
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.executor import Executor
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.apis.signal import Signal

from aggregators import secagg
from aggregators.contracts import meta_keys
from aggregators.secagg import HEADER, KEYS_TASK, MASKED_KIND, SHARES_TASK, STAGE_KIND, UNMASK_TASK

STATE_ID = "secagg_site"


@dataclass
class SiteRound:
    """This site's part of one round."""

    round_num: int
    sites: tuple[str, ...]
    index: int
    threshold: int
    degree: int | None
    keys: secagg.SiteKeys
    public: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    b_seed: bytes = b""
    shared: tuple[str, ...] = ()
    opened: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    global_weights: dict[str, np.ndarray] = field(default_factory=dict)


class SecAggSite(FLComponent):
    """The site's SecAgg+ state and steps (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.round: SiteRound | None = None

    def advertise(self, me: str, asked: dict[str, Any]) -> dict[str, bytes]:
        sites = tuple(asked["sites"])
        if me not in sites or list(sites) != sorted(set(sites)):
            raise secagg.SecAggError(f"site {me}: not among the round's sites {list(sites)}")
        secagg.check_protocol(len(sites), int(asked["threshold"]), asked["degree"])
        keys = secagg.make_keys()
        self.round = SiteRound(
            int(asked["round"]), sites, sites.index(me), int(asked["threshold"]), asked["degree"], keys
        )
        return {"channel_pk": keys.channel_pk, "mask_pk": keys.mask_pk}

    def _current(self, me: str, round_num: Any) -> SiteRound:
        state = self.round
        if state is None or state.round_num != round_num:
            raise secagg.SecAggError(f"site {me}: asked for round {round_num!r}, it set up {state and state.round_num}")
        return state

    def share(self, me: str, asked: dict[str, Any]) -> dict[str, bytes]:
        state = self._current(me, asked["round"])
        state.public = {site: (bytes(pk[0]), bytes(pk[1])) for site, pk in asked["public"].items()}
        if state.public.get(me) != state.keys.public():
            raise secagg.SecAggError(f"site {me}: the server relayed another public key as this site's")
        holders = self._holders(state, state.index, state.public)
        if len(holders) < state.threshold:
            raise secagg.SecAggError(
                f"site {me}: {len(holders)} neighbours advertised keys, fewer than the threshold {state.threshold}"
            )
        state.b_seed = secagg.new_seed()
        shares = secagg.share_secrets(state.b_seed, state.keys.mask_sk, state.threshold, len(holders))
        channel = {j: state.public[state.sites[j]][0] for j in holders}
        sealed = secagg.seal_shares(state.index, state.keys, shares, holders, channel)
        return {"sealed": {state.sites[j]: ct for j, ct in sealed.items()}}

    @staticmethod
    def _holders(state: SiteRound, index: int, present: Any) -> list[int]:
        n = len(state.sites)
        return [j for j in secagg.neighbours(index, n, state.degree) if state.sites[j] in present]

    def receive(self, me: str, header: dict[str, Any], weights: dict[str, Any]) -> None:
        """The train task's routing: open this site's shares, keep the global model."""
        state = self._current(me, header.get("round"))
        state.shared = tuple(header["shared"])
        if me not in state.shared:
            raise secagg.SecAggError(f"site {me}: not among the sites that shared keys this round")
        state.opened = {}
        for src, by_holder in header["sealed"].items():
            if me in by_holder and src in state.public:
                j = state.sites.index(src)
                state.opened[j] = secagg.open_share(state.index, j, state.keys, state.public[src][0], by_holder[me])
        state.global_weights = {k: _array(v) for k, v in weights.items()}

    def mask(self, me: str, trained: dict[str, Any], weight: int) -> dict[str, np.ndarray]:
        state = self.round
        if state is None or not state.global_weights:
            raise secagg.SecAggError(f"site {me}: a training result without this round's secagg set-up")
        missing = set(state.global_weights) ^ set(trained)
        if missing:
            raise secagg.SecAggError(f"site {me}: the trained model's entries differ from the global one: {missing}")
        update = {
            k: _array(v).astype(np.float64) - state.global_weights[k].astype(np.float64) for k, v in trained.items()
        }
        weighted = secagg.weigh(secagg.quantise(update), weight)
        peers = {j: state.public[state.sites[j]][1] for j in self._holders(state, state.index, state.shared)}
        return secagg.mask_update(state.index, weighted, state.b_seed, state.keys.mask_sk, peers, state.round_num)

    def unmask(self, me: str, asked: dict[str, Any]) -> dict[str, bytes]:
        state = self._current(me, asked["round"])
        summed = [state.sites.index(s) for s in asked["summed"]]
        dropped = [state.sites.index(s) for s in asked["dropped"]]
        shares = secagg.unmask_shares(state.index, state.opened, summed, dropped, state.threshold)
        self.round = None  # one answer per round: asking again gets nothing
        return {"shares": {state.sites[j]: share for j, share in shares.items()}}


def _array(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy() if hasattr(value, "detach") else np.asarray(value)


def site_state(fl_ctx: FLContext) -> SecAggSite:
    state = fl_ctx.get_engine().get_component(STATE_ID)
    if not isinstance(state, SecAggSite):
        raise secagg.SecAggError(f"no SecAggSite component with id {STATE_ID!r} at this site")
    return state


class SecAggExecutor(Executor):
    """Answers the key and unmask stages from the site's `SecAggSite`."""

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        me = fl_ctx.get_identity_name()
        state = site_state(fl_ctx)
        asked = shareable.get("secagg") or {}  # the server's stage data (controllers/secagg.py)
        steps = {KEYS_TASK: state.advertise, SHARES_TASK: state.share, UNMASK_TASK: state.unmask}
        if task_name not in steps:
            raise secagg.SecAggError(f"site {me}: unknown secagg task {task_name!r}")
        return DXO(data_kind=STAGE_KIND, data=steps[task_name](me, asked)).to_shareable()


class SecAggTaskData(DXOFilter):
    """Open the shares addressed to this site and keep the received global model (module docstring)."""

    def __init__(self) -> None:
        super().__init__(supported_data_kinds=[DataKind.WEIGHTS], data_kinds_to_filter=[DataKind.WEIGHTS])

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        header = shareable.get_header(HEADER)
        if header is None and fl_ctx.get_prop(FLContextKey.TASK_NAME) != "train":
            return dxo  # a validate task: nothing is masked
        if not isinstance(header, dict):
            raise secagg.SecAggError(f"site {fl_ctx.get_identity_name()}: the train task carries no secagg header")
        site_state(fl_ctx).receive(fl_ctx.get_identity_name(), header, dict(dxo.data))
        return dxo


class SecAggMask(DXOFilter):
    """Replace the trained weights by the site's masked input (module docstring)."""

    def __init__(self) -> None:
        super().__init__(supported_data_kinds=[DataKind.WEIGHTS], data_kinds_to_filter=[DataKind.WEIGHTS])

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        me = fl_ctx.get_identity_name()
        weight = dxo.get_meta_prop(meta_keys.NUM_SAMPLES)
        state = site_state(fl_ctx)
        masked = secagg.pack(state.mask(me, dict(dxo.data), weight))
        out = DXO(data_kind=MASKED_KIND, data=masked, meta=dict(dxo.meta))
        out.set_meta_prop(MetaKey.NUM_STEPS_CURRENT_ROUND, weight)
        out.set_meta_prop(meta_keys.SECAGG_ROUND, state.round.round_num)
        return out
