"""``controllers.adapters``: real NVFlare ``FLModel`` results in; validated updates or named rejections out."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from aggregators.fedavg import fedavg_params
from aggregators.types import ClientUpdate
from controllers.adapters import Rejection, result_site, split_results, to_client_update

GLOBAL = {
    "fc.weight": np.zeros((2, 2), dtype=np.float32),
    "fc.bias": np.zeros(2, dtype=np.float32),
    "bn.num_batches_tracked": np.array(0, dtype=np.int64),
}


def _params(fill: float = 1.0) -> dict[str, np.ndarray]:
    return {
        "fc.weight": np.full((2, 2), fill, dtype=np.float32),
        "fc.bias": np.full(2, fill, dtype=np.float32),
        "bn.num_batches_tracked": np.array(4, dtype=np.int64),
    }


def _result(site: str | None, params=None, num_samples=10, **extra_meta) -> FLModel:
    meta = dict(extra_meta)
    if site is not None:
        meta["client_name"] = site
    if num_samples is not None:
        meta["train.num_samples"] = num_samples
    return FLModel(params_type=ParamsType.FULL, params=_params() if params is None else params, meta=meta)


def test_good_result_is_accepted():
    # Prepare
    result = _result("site-1", num_samples=np.int64(25), **{"train.loss": 0.5})

    # Execute
    update = to_client_update(result, GLOBAL)

    # Assert
    assert isinstance(update, ClientUpdate)
    assert update.site == "site-1"
    assert update.num_samples == 25 and type(update.num_samples) is int
    assert update.meta["train.loss"] == 0.5
    assert update.meta["train.num_samples"] == 25
    assert set(update.params) == set(GLOBAL)
    for key, value in _params().items():
        np.testing.assert_array_equal(update.params[key], value)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_result_is_rejected_naming_site_and_key(bad):
    # Prepare
    params = _params()
    params["fc.bias"] = np.array([1.0, bad], dtype=np.float32)

    # Execute
    rejection = to_client_update(_result("site-2", params), GLOBAL)

    # Assert
    assert isinstance(rejection, Rejection)
    assert rejection.site == "site-2"
    assert len(rejection.problems) == 1
    assert "'fc.bias'" in rejection.problems[0] and "NaN or Inf" in rejection.problems[0]


def test_missing_num_samples_is_rejected():
    # Execute
    rejection = to_client_update(_result("site-3", num_samples=None), GLOBAL)

    # Assert
    assert isinstance(rejection, Rejection)
    assert rejection.site == "site-3"
    assert rejection.problems == ("required meta key 'train.num_samples' is missing",)


@pytest.mark.parametrize("count", [True, 3.5, 10.0, -1, "10", None])
def test_bad_num_samples_is_rejected(count):
    # Prepare: None is present-but-None (the key exists), unlike test_missing_num_samples_is_rejected.
    result = FLModel(params=_params(), meta={"client_name": "site-4", "train.num_samples": count})

    # Execute
    rejection = to_client_update(result, GLOBAL)

    # Assert
    assert isinstance(rejection, Rejection)
    assert any("sample count" in p for p in rejection.problems)


def test_required_rule_meta_missing_is_rejected_and_present_is_accepted():
    # Prepare
    required = ("scaffold.ctrl.diff",)
    without = _result("site-1")
    with_meta = _result("site-1", **{"scaffold.ctrl.diff": {"fc.weight": np.zeros((2, 2))}})

    # Execute
    rejection = to_client_update(without, GLOBAL, required)
    update = to_client_update(with_meta, GLOBAL, required)

    # Assert
    assert isinstance(rejection, Rejection)
    assert rejection.problems == ("required meta key 'scaffold.ctrl.diff' is missing",)
    assert isinstance(update, ClientUpdate)
    assert "scaffold.ctrl.diff" in update.meta


def test_torch_tensors_instead_of_numpy_are_rejected_by_key():
    # Prepare: the NVFlare pitfall of leaving the exchange format as PyTorch on the client.
    params = {key: torch.from_numpy(np.array(value)) for key, value in _params().items()}

    # Execute
    rejection = to_client_update(_result("site-5", params), GLOBAL)

    # Assert
    assert isinstance(rejection, Rejection)
    assert len(rejection.problems) == len(GLOBAL)
    for key in GLOBAL:
        assert any(f"'{key}' is a Tensor" in p for p in rejection.problems), key


def test_result_without_params_is_rejected_as_missing_keys():
    # Execute
    rejection = to_client_update(FLModel(meta={"client_name": "site-6", "train.num_samples": 3}), GLOBAL)

    # Assert
    assert isinstance(rejection, Rejection)
    assert len(rejection.problems) == 1 and "missing parameter keys" in rejection.problems[0]


def test_all_problems_are_collected():
    # Prepare
    params = _params()
    params["fc.weight"] = np.full((2, 2), np.nan, dtype=np.float32)
    params["fc.bias"] = np.zeros(3, dtype=np.float32)

    # Execute
    rejection = to_client_update(_result("site-7", params, num_samples=None), GLOBAL, ("fedprox.mu",))

    # Assert
    assert isinstance(rejection, Rejection)
    joined = "\n".join(rejection.problems)
    assert len(rejection.problems) == 4
    for fragment in ("'fc.weight'", "'fc.bias'", "'train.num_samples'", "'fedprox.mu'"):
        assert fragment in joined


def test_unknown_site_name():
    assert result_site(_result(None)) == "<unknown site>"
    assert result_site(object()) == "<unknown site>"
    assert to_client_update(_result(None, num_samples=None), GLOBAL).site == "<unknown site>"


def test_rejection_str_names_site_and_every_problem():
    # Prepare
    rejection = Rejection(site="site-9", problems=("parameter 'a' contains NaN or Inf", "required meta key 'b' ..."))

    # Execute
    text = str(rejection)

    # Assert
    assert text == "rejected result from site-9: parameter 'a' contains NaN or Inf; required meta key 'b' ..."


def test_split_results_sorts_by_site_whatever_the_arrival_order():
    # Prepare
    results = [_result(f"site-{i}", _params(float(i)), num_samples=i) for i in (3, 1, 2)]
    bad = _result("site-0", {**_params(), "fc.bias": np.array([np.nan, 0.0], dtype=np.float32)})

    for arrival in itertools.permutations([*results, bad]):
        # Execute
        updates, rejections = split_results(list(arrival), GLOBAL)

        # Assert
        assert [u.site for u in updates] == ["site-1", "site-2", "site-3"]
        assert [r.site for r in rejections] == ["site-0"]
        assert [u.num_samples for u in updates] == [1, 2, 3]


def test_aggregation_through_split_results_is_bit_identical_for_any_arrival_order():
    # Prepare: 4 float64 clients (with 3+ clients fedavg_params alone is order dependent in the last bits).
    rng = np.random.default_rng(7)
    global_params = {"w": np.zeros(2000, dtype=np.float64)}
    results = [
        FLModel(params={"w": rng.normal(size=2000)}, meta={"client_name": f"site-{i}", "train.num_samples": n})
        for i, n in enumerate([3, 7, 11, 5])
    ]
    reference = None

    for arrival in itertools.permutations(results):
        # Execute
        updates, _ = split_results(list(arrival), global_params)
        aggregated = fedavg_params(global_params, updates)["w"]

        # Assert
        if reference is None:
            reference = aggregated
        assert aggregated.tobytes() == reference.tobytes()


def test_rejected_result_never_reaches_the_average():
    # Prepare: site-1 (w=1, n=1), site-2 (w=3, n=3) and a NaN site with a huge sample count.
    # By hand: (1*1 + 3*3) / 4 = 2.5
    nan_params = {**_params(), "fc.weight": np.full((2, 2), np.nan, dtype=np.float32)}
    results = [
        _result("site-1", _params(1.0), 1),
        _result("site-x", nan_params, 10_000),
        _result("site-2", _params(3.0), 3),
    ]

    # Execute
    updates, rejections = split_results(results, GLOBAL)
    aggregated = fedavg_params(GLOBAL, updates)

    # Assert
    assert [r.site for r in rejections] == ["site-x"]
    np.testing.assert_allclose(aggregated["fc.weight"], np.full((2, 2), 2.5), atol=1e-6, rtol=0)
    np.testing.assert_allclose(aggregated["fc.bias"], np.full(2, 2.5), atol=1e-6, rtol=0)


def test_split_results_passes_required_meta_to_every_result():
    # Prepare
    results = [_result("site-1", **{"fednova.a_norm": 2.0}), _result("site-2")]

    # Execute
    updates, rejections = split_results(results, GLOBAL, iter(["fednova.a_norm"]))  # a one-shot iterable

    # Assert
    assert [u.site for u in updates] == ["site-1"]
    assert [r.site for r in rejections] == ["site-2"]


def test_empty_results():
    assert split_results([], GLOBAL) == ([], [])
