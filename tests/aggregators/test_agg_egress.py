"""The egress gate's rule (aggregators/contracts/egress.py) in closed form, and its NVFlare filter on real
shareables."""

from __future__ import annotations

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind, MetaKey, from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey
from nvflare.app_common.app_constant import AppConstants

from aggregators.contracts.egress import INITIAL_METRICS, TRANSPORT_HEADERS, Carried, Release, judge, undeclared
from aggregators.contracts.egress_gate import EgressGate, EgressRefused

TRAIN = Release("train", ("WEIGHTS",), ("w", "b"), ("train.num_samples", "privacy.*"))


def test_undeclared_names_match_exact_names_and_patterns():
    assert undeclared(["privacy.epsilon", "eval.loss", "w", "w2"], ["privacy.*", "w"]) == ("eval.loss", "w2")
    assert undeclared([], ["*"]) == () and undeclared(["a"], []) == ("a",)


def test_a_declared_result_passes_untouched():
    carried = Carried.of(
        "WEIGHTS", {"w": 0, "b": 0}, {"train.num_samples": 3, "privacy.epsilon": 1.0}, {"current_round": 0}
    )
    assert judge(carried, TRAIN).clean


def test_undeclared_meta_metrics_headers_and_entries_are_stripped_by_name():
    meta = {"train.num_samples": 3, "train.loss": 0.1, INITIAL_METRICS: {"val_loss": 0.2}}
    carried = Carried.of("WEIGHTS", {"w": 0}, meta, {"__task_id__": "t", "leak": 1}, ["extra"])
    assert carried.metrics == ("val_loss",) and INITIAL_METRICS not in carried.meta
    verdict = judge(carried, TRAIN)
    assert not verdict.refuse
    assert dict(verdict.strip) == {
        "meta": ("train.loss",),
        "metrics": ("val_loss",),
        "headers": ("leak",),
        "top_level": ("extra",),
    }
    line = verdict.describe("site-2", "train")
    assert line.startswith("site-2: egress gate stripped") and "train.loss" in line and "val_loss" in line


def test_undeclared_weights_or_kind_refuse_the_whole_result():
    verdict = judge(Carried.of("WEIGHTS", {"w": 0, "head.w": 0}, {}), TRAIN)
    assert verdict.refuse == "undeclared data keys ['head.w']" and "nothing of it sent" in verdict.describe("s", "t")
    assert "DXO kind 'WEIGHT_DIFF'" in judge(Carried.of("WEIGHT_DIFF", {"w": 0}, {}), TRAIN).refuse


def test_a_metrics_result_has_its_scores_checked_as_metrics():
    release = Release("validate", ("METRICS",), (), ("privacy.*",), ("val_*",))
    verdict = judge(Carried.of("METRICS", {"val_loss": 1.0, "test_loss": 2.0}, {"privacy.withheld": []}), release)
    assert dict(verdict.strip) == {"metrics": ("test_loss",)} and not verdict.refuse


def test_an_error_reply_without_a_dxo_is_not_refused():
    assert judge(Carried.of(None, None, None, {"__rc__": "ERROR"}), TRAIN).clean


def test_a_release_is_validated_and_round_trips_through_the_job_config():
    assert Release(**TRAIN.to_config()) == TRAIN
    assert "headers" not in TRAIN.to_config() and "metrics" not in TRAIN.to_config()  # the defaults
    with pytest.raises(ValueError, match="declares no DXO kind"):
        Release("train", (), ("w",), ())
    with pytest.raises(ValueError, match="list of names"):
        Release("train", ("WEIGHTS",), "w", ())
    with pytest.raises(ValueError, match="non-empty strings"):
        Release("train", ("WEIGHTS",), ("w", ""), ())
    merged = TRAIN.merged(Release("train", ("WEIGHTS",), ("c",), ("NUM_STEPS_CURRENT_ROUND",)))
    assert merged.data == ("w", "b", "c") and merged.meta[-1] == "NUM_STEPS_CURRENT_ROUND"


def test_the_transport_headers_are_nvflares_own_names():
    reserved = {v for k, v in vars(ReservedHeaderKey).items() if k.isupper() and v != ReservedHeaderKey.HEADERS}
    rounds = {AppConstants.CURRENT_ROUND, AppConstants.START_ROUND, AppConstants.NUM_ROUNDS, AppConstants.VALIDATE_TYPE}
    assert set(TRANSPORT_HEADERS) == reserved | rounds


def fl_ctx(site: str = "site-1") -> FLContext:
    ctx = FLContext()
    ctx.set_prop("__identity_name__", site, private=False)
    return ctx


def test_the_gate_strips_the_scores_nvflare_attaches_and_logs_them(caplog):
    gate = EgressGate(**TRAIN.to_config())
    meta = {"train.num_samples": 3, "eval.val_loss": 0.5, INITIAL_METRICS: {"val_loss": 0.5}}
    shareable = DXO(DataKind.WEIGHTS, data={"w": np.ones(2), "b": np.zeros(1)}, meta=meta).to_shareable()
    shareable.set_header(AppConstants.CURRENT_ROUND, 0)
    shareable.set_header("stray", "x")
    with caplog.at_level("WARNING"):
        out = gate.process(shareable, fl_ctx())
    dxo = from_shareable(out)
    assert dxo.meta == {"train.num_samples": 3} and sorted(dxo.data) == ["b", "w"]
    assert out.get_header("stray") is None and out.get_header(AppConstants.CURRENT_ROUND) == 0
    assert "egress gate stripped" in caplog.text and "eval.val_loss" in caplog.text and "val_loss" in caplog.text


def test_the_gate_refuses_undeclared_weights(caplog):
    gate = EgressGate(**TRAIN.to_config())
    shareable = DXO(DataKind.WEIGHTS, data={"w": np.ones(2), "head.w": np.ones(1)}, meta={}).to_shareable()
    with pytest.raises(EgressRefused, match=r"head\.w"):
        gate.process(shareable, fl_ctx("site-3"))
    assert "site-3: egress gate refused" in caplog.text


def test_the_gate_empties_a_metrics_result_it_does_not_declare():
    gate = EgressGate("validate", ["METRICS"], [], ["privacy.*"])
    shareable = DXO(DataKind.METRICS, data={"val_loss": 0.3}, meta={"privacy.withheld": ["val_loss"]}).to_shareable()
    dxo = from_shareable(gate.process(shareable, fl_ctx()))
    assert dxo.data == {} and dxo.meta == {"privacy.withheld": ["val_loss"]}
    assert MetaKey.INITIAL_METRICS == INITIAL_METRICS
