"""The SecAgg+ workflow's own components (controllers/secagg.py, controllers/secagg_site.py) played in-process, each
message passed as NVFlare would pass it (the site's answers as the server's stages collect them, the train task's
header as the controller builds it): five sites, threshold 3; one site drops after sending its masked update (no
unmask answer), one after sharing its keys (no masked update). The server's mean update equals FedAvg of the four
sites whose updates arrived, within one quantisation step; the masked results alone are not the updates; a site
refuses an unmask request that asks for both shares of one site, and a result of another round is refused."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.model import ModelLearnableKey, make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from aggregators import secagg
from aggregators.contracts import meta_keys
from controllers.secagg import RoundSetup, SecAggAggregator
from controllers.secagg_site import SecAggSite

SITES = tuple(f"site-{i}" for i in range(1, 6))
THRESHOLD, ROUND = 3, 4
SHAPES = {"fc.weight": (3, 4), "fc.bias": (3,)}


def _global() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.normal(0, 0.5, s).astype(np.float32) for k, s in SHAPES.items()}


def _trained(i: int, start: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + i)
    return {k: (v + rng.normal(0, 0.2, v.shape)).astype(np.float32) for k, v in start.items()}


def _server_ctx(start: dict[str, np.ndarray]) -> FLContext:
    ctx = FLContext()
    ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(start, {}), private=True, sticky=False)
    return ctx


def _result(site: str, dxo: DXO):
    shareable = dxo.to_shareable()
    shareable.set_peer_props({ReservedKey.IDENTITY_NAME: site})
    return shareable


def play(drop_after_upload: str = "site-3", drop_before_upload: str = "site-5"):
    start, weights = _global(), {s: 20 + 7 * i for i, s in enumerate(SITES)}
    sites = {s: SecAggSite() for s in SITES}
    asked = {"round": ROUND, "sites": list(SITES), "threshold": THRESHOLD, "degree": None}
    setup = RoundSetup(ROUND, SITES)
    keys = {s: sites[s].advertise(s, asked) for s in SITES}
    setup.public = {s: (a["channel_pk"], a["mask_pk"]) for s, a in keys.items()}
    setup.sealed = {s: sites[s].share(s, {**asked, "public": setup.public})["sealed"] for s in SITES}
    aggregator = SecAggAggregator()
    aggregator.begin_round(setup, THRESHOLD, None)
    ctx = _server_ctx(start)
    header = setup.header(THRESHOLD, None)
    trained, sent = {}, {}
    for s in SITES:
        sites[s].receive(s, header, dict(start))
        if s == drop_before_upload:
            continue
        trained[s] = _trained(SITES.index(s), start)
        masked = secagg.pack(sites[s].mask(s, trained[s], weights[s]))
        dxo = DXO(
            DataKind.WEIGHT_DIFF, masked, {MetaKey.NUM_STEPS_CURRENT_ROUND: weights[s], meta_keys.SECAGG_ROUND: ROUND}
        )
        sent[s] = masked
        assert aggregator.accept(_result(s, dxo), ctx)
    summed, dropped = aggregator.unmask_lists()
    returned = {
        s: sites[s].unmask(s, {"round": ROUND, "summed": summed, "dropped": dropped})["shares"]
        for s in SITES
        if s not in (drop_after_upload, drop_before_upload)
    }
    aggregator.unmask_with(returned)
    mean = from_shareable(aggregator.aggregate(ctx))
    return start, weights, trained, sent, summed, dropped, mean, sites


def test_the_mean_update_is_fedavg_of_the_uploaded_sites_despite_both_dropouts():
    start, weights, trained, _, summed, dropped, mean, _ = play()
    assert summed == ["site-1", "site-2", "site-3", "site-4"] and dropped == ["site-5"]
    assert mean.data_kind == DataKind.WEIGHT_DIFF
    total = sum(weights[s] for s in summed)
    for k in SHAPES:
        expected = sum(weights[s] * trained[s][k].astype(np.float64) for s in summed) / total - start[k]
        assert np.max(np.abs(mean.data[k] - expected)) < secagg.quantisation_step() + 1e-6  # + float32 rounding


def test_what_the_server_receives_is_not_the_update():
    start, weights, trained, sent, *_ = play()
    shapes = {k: v.shape for k, v in start.items()}
    for s, packed in sent.items():
        masked = secagg.unpack(packed, shapes)
        plain = secagg.weigh(secagg.quantise({k: trained[s][k] - start[k] for k in SHAPES}), weights[s])
        for k in SHAPES:
            assert not np.any(masked[k] == plain[k])


def test_a_site_refuses_to_return_both_shares_of_one_site():
    sites = {s: SecAggSite() for s in SITES}
    asked = {"round": ROUND, "sites": list(SITES), "threshold": THRESHOLD, "degree": None}
    public = {}
    for s in SITES:
        a = sites[s].advertise(s, asked)
        public[s] = (a["channel_pk"], a["mask_pk"])
    setup = RoundSetup(
        ROUND, SITES, public, {s: sites[s].share(s, {**asked, "public": public})["sealed"] for s in SITES}
    )
    sites["site-1"].receive("site-1", setup.header(THRESHOLD, None), {k: np.zeros(v) for k, v in SHAPES.items()})
    request = {"round": ROUND, "summed": list(SITES), "dropped": ["site-2"]}
    with pytest.raises(secagg.SecAggError, match=r"asked as both summed and dropped"):
        sites["site-1"].unmask("site-1", request)
    with pytest.raises(secagg.SecAggError, match=r"^site site-1: asked for round 5"):
        sites["site-1"].unmask("site-1", {**request, "round": ROUND + 1})


def test_the_sites_refuse_a_threshold_below_a_majority_whatever_the_server_says():
    with pytest.raises(secagg.SecAggError, match="not a majority"):
        SecAggSite().advertise("site-1", {"round": 0, "sites": list(SITES), "threshold": 2, "degree": None})


def test_a_result_of_another_round_or_from_a_site_that_shared_nothing_is_refused():
    start = _global()
    setup = RoundSetup(ROUND, SITES, {}, {"site-1": {}})
    aggregator = SecAggAggregator()
    aggregator.begin_round(setup, THRESHOLD, None)
    packed = secagg.pack({k: np.zeros(v, dtype=np.uint64) for k, v in SHAPES.items()})
    meta = {MetaKey.NUM_STEPS_CURRENT_ROUND: 5, meta_keys.SECAGG_ROUND: ROUND - 1}
    ctx = _server_ctx(start)
    assert not aggregator.accept(_result("site-1", DXO(DataKind.WEIGHT_DIFF, packed, meta)), ctx)
    meta[meta_keys.SECAGG_ROUND] = ROUND
    assert not aggregator.accept(_result("site-2", DXO(DataKind.WEIGHT_DIFF, packed, meta)), ctx)
    assert aggregator.accept(_result("site-1", DXO(DataKind.WEIGHT_DIFF, packed, meta)), ctx)
    assert ModelLearnableKey.WEIGHTS in ctx.get_prop(AppConstants.GLOBAL_MODEL)
