"""Our rules as NVFlare ModelAggregators: the result equals the rule's own with the real global model, bad sites are
left out by name, and rules that need the global model or broadcast meta are refused with the reason."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from aggregators.contracts import meta_keys
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext
from controllers.nvflare_aggregator import RuleAggregator

RNG = np.random.default_rng(0)
X = {"w": RNG.normal(size=(3, 4)).astype(np.float32), "b": RNG.normal(size=4).astype(np.float32)}
SAMPLES = {"site-1": 10, "site-2": 20, "site-3": 30, "site-4": 40, "site-5": 50}
Y = {site: {k: (v + RNG.normal(size=v.shape)).astype(np.float32) for k, v in X.items()} for site in SAMPLES}


def result(site: str, params=None, **meta) -> FLModel:
    base = {"client_name": site, meta_keys.NUM_SAMPLES: SAMPLES[site], meta_keys.PARAM_KEYS: ["w", "b"]}
    return FLModel(params=params if params is not None else Y[site], meta={**base, **meta}, current_round=2)


@pytest.mark.parametrize(
    ("rule", "args"), [("fedavg", {}), ("median", {}), ("trimmed_mean", {"beta": 0.2}), ("krum", {"num_byzantine": 1})]
)
def test_result_equals_the_rule_applied_with_the_real_global_model(rule, args):
    aggregator = RuleAggregator(rule, args)
    for site in reversed(SAMPLES):  # arrival order does not matter
        aggregator.accept_model(result(site))
    ours = aggregator.aggregate_model().params
    reference_rule = build_rule(rule, **args)
    updates = [ClientUpdate(s, Y[s], n, {meta_keys.PARAM_KEYS: ["w", "b"]}) for s, n in SAMPLES.items()]
    context = RoundContext(round_num=2, num_rounds=3, population=tuple(SAMPLES))
    expected = reference_rule.aggregate(X, updates, reference_rule.init_state(X), context).params
    for key in X:
        np.testing.assert_allclose(ours[key], expected[key], atol=1e-6, rtol=0)


def test_fedavg_is_the_sample_weighted_mean_in_closed_form():
    aggregator = RuleAggregator("fedavg")
    for site in SAMPLES:
        aggregator.accept_model(result(site))
    weights = np.array(list(SAMPLES.values()), dtype=np.float64) / sum(SAMPLES.values())
    expected = sum(w * Y[s]["w"].astype(np.float64) for w, s in zip(weights, SAMPLES, strict=True))
    np.testing.assert_allclose(aggregator.aggregate_model().params["w"], expected, atol=1e-6)


def test_a_bad_site_is_left_out_by_name_and_the_round_goes_on():
    aggregator = RuleAggregator("median")
    aggregator.accept_model(result("site-1"))
    bad = {k: v.copy() for k, v in Y["site-2"].items()}
    bad["w"][0, 0] = np.nan
    aggregator.accept_model(result("site-2", bad))
    aggregator.accept_model(result("site-3"))
    update = aggregator.aggregate_model()  # results are checked together when the round aggregates
    assert [r.site for r in aggregator.rejections] == ["site-2"]
    assert aggregator.rejections[0].problems == ("parameter 'w' contains NaN or Inf",)
    assert update.meta["nr_aggregated"] == 2


def constant(w: float, b: float, scale: int = 1) -> dict[str, np.ndarray]:
    """Parameters shaped like X (``scale`` = 2: each axis doubled, an array four times the model's size for w)."""
    return {
        "w": np.full((3 * scale, 4 * scale), w, dtype=np.float32),
        "b": np.full(4 * scale * scale, b, dtype=np.float32),
    }


OVERSIZED = ("parameter 'b' has shape (16,), expected (4,)", "parameter 'w' has shape (6, 8), expected (3, 4)")


def test_an_oversized_first_result_is_rejected_by_name_and_the_good_sites_aggregate(monkeypatch):
    """The first result to arrive must not define the model's shapes: the majority of the round does."""
    aggregator = RuleAggregator("fedavg")
    logged: list[str] = []
    monkeypatch.setattr(aggregator, "error", logged.append)
    aggregator.accept_model(result("site-1", constant(9.0, 9.0, scale=2)))  # arrives first
    aggregator.accept_model(result("site-2", constant(1.0, -1.0)))
    aggregator.accept_model(result("site-3", constant(2.0, 3.0)))
    update = aggregator.aggregate_model()
    assert [(r.site, r.problems) for r in aggregator.rejections] == [("site-1", OVERSIZED)]
    assert logged == ["rejected result from site-1: " + "; ".join(OVERSIZED)]
    # Sample weights 20/50 and 30/50: w = 0.4 * 1 + 0.6 * 2 = 1.6, b = 0.4 * (-1) + 0.6 * 3 = 1.4.
    assert update.params_type == ParamsType.FULL and update.meta["nr_aggregated"] == 2
    assert update.params["w"].shape == (3, 4) and update.params["b"].shape == (4,)
    np.testing.assert_allclose(update.params["w"], 1.6, atol=1e-6, rtol=0)
    np.testing.assert_allclose(update.params["b"], 1.4, atol=1e-6, rtol=0)


def test_a_tie_of_shapes_trusts_no_result_and_leaves_the_global_model_unchanged():
    aggregator = RuleAggregator("fedavg")
    aggregator.accept_model(result("site-1", constant(9.0, 9.0, scale=2)))
    aggregator.accept_model(result("site-2", constant(1.0, -1.0)))
    update = aggregator.aggregate_model()
    reason = "the round's results carry 2 different sets of parameter keys and shapes, none more often than another"
    assert [r.site for r in aggregator.rejections] == ["site-1", "site-2"]
    assert all(r.problems[0].startswith(reason) for r in aggregator.rejections)
    assert update.meta["round_failed"] == "fedavg: no valid result this round (2 rejected)"
    assert unchanged_by(update)


def test_once_a_round_aggregated_its_shapes_hold_even_against_a_misshapen_majority():
    aggregator = RuleAggregator("fedavg")
    for site in ("site-1", "site-2", "site-3"):
        aggregator.accept_model(result(site, constant(1.0, 1.0)))
    assert aggregator.aggregate_model().params_type == ParamsType.FULL
    aggregator.reset_stats()  # NVFlare's FedAvg starts the next round
    aggregator.accept_model(result("site-1", constant(9.0, 9.0, scale=2)))
    aggregator.accept_model(result("site-2", constant(9.0, 9.0, scale=2)))
    aggregator.accept_model(result("site-3", constant(2.0, 3.0)))
    update = aggregator.aggregate_model()
    assert [(r.site, r.problems) for r in aggregator.rejections] == [("site-1", OVERSIZED), ("site-2", OVERSIZED)]
    np.testing.assert_allclose(update.params["w"], 2.0, atol=1e-6, rtol=0)  # site-3 alone
    np.testing.assert_allclose(update.params["b"], 3.0, atol=1e-6, rtol=0)


def test_a_site_reporting_another_trainable_set_is_rejected_by_name_and_the_others_aggregate():
    """The round engine's trainable-set agreement, now that the aggregator sees the round's results together."""
    aggregator = RuleAggregator("fedavg")
    aggregator.accept_model(result("site-1", constant(1.0, 0.0)))
    aggregator.accept_model(result("site-2", constant(4.0, 3.0)))
    aggregator.accept_model(result("site-3", constant(9.0, 9.0), **{meta_keys.PARAM_KEYS: ["w"]}))
    update = aggregator.aggregate_model()
    assert [r.site for r in aggregator.rejections] == ["site-3"]
    assert aggregator.rejections[0].problems[0].startswith("'train.param_keys' differs from the set 2 of 3 sites")
    # Sample weights 10/30 and 20/30: w = (10 * 1 + 20 * 4) / 30 = 3, b = (10 * 0 + 20 * 3) / 30 = 2.
    np.testing.assert_allclose(update.params["w"], 3.0, atol=1e-6, rtol=0)
    np.testing.assert_allclose(update.params["b"], 2.0, atol=1e-6, rtol=0)


def unchanged_by(update: FLModel) -> bool:
    """True when NVFlare's own model update leaves the global model X exactly as it was."""
    global_model = FLModel(params_type=ParamsType.FULL, params={k: v.copy() for k, v in X.items()})
    after = FLModelUtils.update_model(global_model, update).params
    return after.keys() == X.keys() and all(np.array_equal(after[k], X[k]) for k in X)


def test_a_round_without_a_valid_result_leaves_the_global_model_unchanged_instead_of_ending_the_job():
    aggregator = RuleAggregator("median")
    bad = {k: np.full_like(v, np.inf) for k, v in Y["site-1"].items()}
    aggregator.accept_model(result("site-1", bad))
    update = aggregator.aggregate_model()  # NVFlare's FedAvg would end the job on an exception here
    assert "no valid result this round (1 rejected)" in update.meta["round_failed"]
    assert unchanged_by(update)


@pytest.mark.parametrize("failure", ["raises", "nan", "other keys"])
def test_a_rule_that_raises_or_returns_an_unusable_model_leaves_model_and_rule_state_unchanged(failure, monkeypatch):
    aggregator = RuleAggregator("fedavg")
    state_before = aggregator.state

    def broken(x, updates, state, context):
        if failure == "raises":
            raise ZeroDivisionError("division by zero")
        params = {k: np.full_like(v, np.nan) for k, v in x.items()} if failure == "nan" else {"other": x["w"]}
        return SimpleNamespace(params=params, state={"moved": True})

    monkeypatch.setattr(aggregator, "aggregation_rule", SimpleNamespace(aggregate=broken, required_meta=()))
    for site in SAMPLES:
        aggregator.accept_model(result(site))
    update = aggregator.aggregate_model()
    expected = {
        "raises": "ZeroDivisionError: division by zero",
        "nan": "rule 'fedavg' produced an unusable model: parameter 'b' contains NaN or Inf; parameter 'w'",
        "other keys": "rule 'fedavg' produced an unusable model: ",
    }[failure]
    assert update.meta["round_failed"].startswith(expected)
    assert unchanged_by(update)
    assert aggregator.state is state_before


@pytest.mark.parametrize(
    ("rule", "args", "message"),
    [
        ("fedadam", {}, "cannot run as an NVFlare ModelAggregator"),
        ("scaffold", {}, "cannot run as an NVFlare ModelAggregator"),
        ("fedatt", {}, "cannot run as an NVFlare ModelAggregator"),
        ("fedavg", {"server_lr": 0.5}, "only server_lr = 1 is exact"),
    ],
)
def test_rules_that_need_the_global_model_or_broadcast_meta_are_refused(rule, args, message):
    with pytest.raises(AggregationError, match=message):
        RuleAggregator(rule, args)
