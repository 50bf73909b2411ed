"""The round meta the engine broadcasts is the wire contract's RoundInfo (aggregators/contracts/wire.py), so a site can
check it with ``RoundInfo.from_meta`` and get its problems by key."""

from __future__ import annotations

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import RoundInfo
from aggregators.registry import build_rule
from controllers import engine as engine_module
from controllers.engine import Host, InProcessTransport, RoundEngine

GLOBAL = {"w": np.array([1.0, -2.0], np.float32)}


def test_every_broadcast_parses_as_the_round_info_the_engine_built(monkeypatch):
    built: list[RoundInfo] = []

    class Spy(RoundInfo):
        def to_meta(self):
            built.append(self)
            return super().to_meta()

    monkeypatch.setattr(engine_module, "RoundInfo", Spy)
    received: list[dict] = []

    def site(round_num, params, meta):
        received.append(meta)
        return dict(params), {meta_keys.NUM_SAMPLES: 3, meta_keys.SCAFFOLD_CTRL_DIFF: {"w": np.ones(2, np.float32)}}

    rule = build_rule("scaffold")
    engine = RoundEngine(rule, num_rounds=2, rule_label="scaffold-job")
    engine.run(("site-1",), GLOBAL, rule.init_state(GLOBAL), InProcessTransport({"site-1": site}), Host(), run_id="r9")
    parsed = [RoundInfo.from_meta(meta) for meta in received]
    assert all(p.ok for p in parsed), [p.problems for p in parsed]
    assert [p.value for p in parsed] == [
        RoundInfo(0, 2, "scaffold-job", "r9", last_aggregated={}, last_released={}),
        RoundInfo(1, 2, "scaffold-job", "r9", last_aggregated={"site-1": 0}, last_released={"site-1": 0}),
    ]
    assert [b.round for b in built] == [0, 1]  # the engine built them with the wire contract's class
    assert meta_keys.SCAFFOLD_CTRL_GLOBAL in received[0]  # the rule's own broadcast travels beside it


def test_without_confirmations_the_broadcast_has_no_last_aggregated_map():
    engine = RoundEngine(build_rule("fedavg"), num_rounds=3)
    engine.last_aggregated = None  # a job resumed from a checkpoint that predates the map
    meta = engine.broadcast_meta(1, {}, "r")
    assert meta_keys.LAST_AGGREGATED not in meta
    assert RoundInfo.from_meta(meta).value == RoundInfo(1, 3, "fedavg", "r", last_released={})
