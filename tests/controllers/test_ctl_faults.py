"""Fault injection: real Lightning sites (SCAFFOLD, digits MLP) under the round engine, one fault at a time.

Each test names the fault, the outcome we require, and checks it; docs/reliability.md lists them with the result.
The federation runs in process (benchmarks/in_process.py: the engine the NVFlare controller drives, the client
script's site round); faults are injected between the sites and the engine, or into the sites' state files.
Throughout: the global model never absorbs a non-finite value, every round is recorded, and the job never ends
because of one site.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from benchmarks.in_process import quiet_lightning, run_in_process
from controllers.engine import SiteResult
from jobs.spec import JobSpec
from lightning_modules.state_store import ClientStateStore

SITES = ("site-1", "site-2", "site-3")
ROUNDS = 3


def spec(**overrides) -> JobSpec:
    settings = {
        "name": "faults",
        "client": "scaffold",
        "server": "scaffold",
        "dataset": "digits",
        "arch": "mlp",
        "num_rounds": ROUNDS,
        "batch_size": 32,
        "lr": 0.1,
        "max_train_samples": 600,
    }
    return JobSpec(**{**settings, **overrides})


Fault = Callable[[int, list[SiteResult]], list[SiteResult]]


class FaultyTransport:
    """Passes the sites' results through ``fault(round, results)`` before the engine sees them."""

    def __init__(self, inner, fault: Fault) -> None:
        self.inner, self.fault = inner, fault

    def train(self, round_num, targets, params, meta):
        return self.fault(round_num, list(self.inner.train(round_num, targets, params, meta)))


def run(tmp_path, fault: Fault | None = None, **overrides):
    wrap = (lambda transport: FaultyTransport(transport, fault)) if fault else None
    with quiet_lightning():
        return run_in_process(spec(**overrides), tmp_path, evaluate=False, run_id="faults", wrap_transport=wrap)


def site_controls(root, site: str) -> dict[str, np.ndarray]:
    stored = ClientStateStore(root, site).latest("scaffold")
    return {k: v.numpy() for k, v in stored.state.items() if isinstance(v, torch.Tensor)}


def mean_site_control(root) -> dict[str, np.ndarray]:
    controls = [site_controls(root, site) for site in SITES]
    return {key: np.mean([c[key] for c in controls], axis=0) for key in controls[0]}


def assert_finite(params) -> None:
    assert all(np.isfinite(v).all() for v in params.values())


def replace(results: list[SiteResult], site: str, **changes) -> list[SiteResult]:
    return [
        SiteResult(r.site, changes.get("params", r.params), changes.get("meta", r.meta)) if r.site == site else r
        for r in results
    ]


def test_without_faults_scaffold_keeps_c_equal_to_the_mean_of_the_site_controls(tmp_path):
    result = run(tmp_path)
    assert [r["status"] for r in result.rounds] == ["aggregated"] * ROUNDS
    expected = mean_site_control(tmp_path)
    for key, value in result.state["control"].items():
        np.testing.assert_allclose(value, expected[key], atol=1e-6)


def test_a_site_that_sends_nan_every_round_is_rejected_by_name_and_never_absorbed(tmp_path):
    def nan_site_2(round_num, results):
        bad = next(r for r in results if r.site == "site-2")
        params = {k: np.full_like(np.asarray(v), np.nan) for k, v in bad.params.items()}
        return replace(results, "site-2", params=params)

    result = run(tmp_path, nan_site_2)
    assert [sorted(r["rejected"]) for r in result.rounds] == [["site-2"]] * ROUNDS
    assert [r["aggregated"] for r in result.rounds] == [["site-1", "site-3"]] * ROUNDS
    assert_finite(result.params)
    assert all(np.isfinite(v).all() for v in result.state["control"].values())


def test_a_nan_control_diff_is_rejected_and_the_global_control_stays_finite(tmp_path):
    def nan_control(round_num, results):
        bad = next(r for r in results if r.site == "site-1")
        diff = {k: np.full_like(v, np.inf) for k, v in bad.meta[meta_keys.SCAFFOLD_CTRL_DIFF].items()}
        return replace(results, "site-1", meta={**bad.meta, meta_keys.SCAFFOLD_CTRL_DIFF: diff})

    result = run(tmp_path, nan_control)
    assert all("site-1" in r["rejected"] for r in result.rounds)
    assert all(np.isfinite(v).all() for v in result.state["control"].values())


def test_a_duplicate_result_counts_once(tmp_path):
    def duplicate(round_num, results):
        return results + [r for r in results if r.site == "site-3"]

    result = run(tmp_path, duplicate, num_rounds=1)
    (record,) = result.rounds
    assert record["aggregated"] == list(SITES)
    assert record["rejected"] == {"site-3": ["a second result from this site in the same round"]}


def test_a_result_that_never_arrives_leaves_a_round_of_the_others_with_population_scaling(tmp_path):
    def site_3_times_out_in_round_2(round_num, results):
        return [r for r in results if not (round_num == 1 and r.site == "site-3")]

    result = run(tmp_path, site_3_times_out_in_round_2)
    assert [r["aggregated"] for r in result.rounds] == [list(SITES), ["site-1", "site-2"], list(SITES)]
    assert_finite(result.params)


def test_a_result_that_arrives_a_round_late_is_rejected_and_c_stays_the_mean_of_the_site_controls(tmp_path):
    """site-3's round-1 result is held back and delivered in round 2, next to its round-2 result."""
    held: list[SiteResult] = []

    def delay_site_3(round_num, results):
        if round_num == 0:
            held.extend(r for r in results if r.site == "site-3")
            return [r for r in results if r.site != "site-3"]
        if round_num == 1:
            return held + results
        return results

    result = run(tmp_path, delay_site_3)
    assert [r["aggregated"] for r in result.rounds] == [["site-1", "site-2"], list(SITES), list(SITES)]
    assert result.rounds[1]["rejected"] == {
        "site-3": ["a result trained in round 0 arrived in round 1 (late or replayed)"]
    }
    assert_finite(result.params)
    expected = mean_site_control(tmp_path)
    for key, value in result.state["control"].items():
        np.testing.assert_allclose(value, expected[key], atol=1e-6)


def test_an_oversized_payload_is_rejected_by_name(tmp_path):
    def oversized(round_num, results):
        bad = next(r for r in results if r.site == "site-1")
        params = {k: np.zeros(np.asarray(v).size * 4, np.float32) for k, v in bad.params.items()}
        return replace(results, "site-1", params=params)

    result = run(tmp_path, oversized, num_rounds=1)
    (record,) = result.rounds
    assert record["aggregated"] == ["site-2", "site-3"]
    assert any("shape" in problem for problem in record["rejected"]["site-1"])


def test_a_corrupt_state_file_stops_that_site_only_and_its_error_names_the_file(tmp_path, caplog):
    run(tmp_path, num_rounds=1)
    state_file = ClientStateStore(tmp_path, "site-2").path("scaffold")
    state_file.write_bytes(state_file.read_bytes()[:40])  # truncated
    with caplog.at_level(logging.ERROR, logger="controllers.engine"):
        result = run(tmp_path, num_rounds=1)
    (record,) = result.rounds
    assert record["aggregated"] == ["site-1", "site-3"] and record["status"] == "aggregated"
    [failure] = [r.getMessage() for r in caplog.records if "failed and sends no result" in r.getMessage()]
    assert (
        failure.startswith("round 1: site-2 failed and sends no result: StateStoreError") and str(state_file) in failure
    )


def test_a_full_disk_while_a_site_saves_its_state_keeps_the_committed_state(tmp_path, monkeypatch):
    run(tmp_path, num_rounds=1)
    before = site_controls(tmp_path, "site-1")
    import lightning_modules.state_store as state_store

    real_fsync = state_store.os.fsync

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state_store.os, "fsync", full_disk)
    result = run(tmp_path, num_rounds=1)  # every site fails to save: none sends a result
    monkeypatch.setattr(state_store.os, "fsync", real_fsync)
    (record,) = result.rounds
    assert record["status"] == "failed" and record["aggregated"] == []
    after = site_controls(tmp_path, "site-1")
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value)  # the committed c_i is intact
    assert not list(tmp_path.rglob("*.tmp*"))  # no half-written file left behind


def nan_in_round_2(site: str) -> Fault:
    """The fault: ``site``'s round-2 model is all NaN (rejected by the server after the site computed its state)."""

    def fault(round_num, results):
        if round_num != 1:
            return results
        bad = next(r for r in results if r.site == site)
        return replace(results, site, params={k: np.full_like(np.asarray(v), np.nan) for k, v in bad.params.items()})

    return fault


def test_after_a_rejected_result_c_still_equals_the_mean_of_the_site_controls(tmp_path):
    result = run(tmp_path, nan_in_round_2("site-2"))
    expected = mean_site_control(tmp_path)
    for key, value in result.state["control"].items():
        np.testing.assert_allclose(value, expected[key], atol=1e-6)


def test_a_dropped_result_leaves_c_equal_to_the_mean_of_the_site_controls(tmp_path):
    """site-2's round-2 result never arrives (a timeout): its c_i of that round is rolled back at its next round."""

    result = run(tmp_path, drop_site_2_in_round_2)
    assert [sorted(r["aggregated"]) for r in result.rounds][1] == ["site-1", "site-3"]
    expected = mean_site_control(tmp_path)
    for key, value in result.state["control"].items():
        np.testing.assert_allclose(value, expected[key], atol=1e-6)


class ReplayingTransport:
    """Every site trains round 2 twice (a retried task); only the second attempt's results reach the server."""

    def __init__(self, inner) -> None:
        self.inner, self.attempts = inner, []

    def train(self, round_num, targets, params, meta):
        if round_num == 1:
            self.attempts.append(list(self.inner.train(round_num, targets, params, meta)))
        results = list(self.inner.train(round_num, targets, params, meta))
        if round_num == 1:
            self.attempts.append(results)
        return results


def test_a_replayed_round_starts_from_the_committed_state_and_sends_the_same_diff(tmp_path):
    transports = []

    def wrap(transport):
        transports.append(ReplayingTransport(transport))
        return transports[0]

    with quiet_lightning():
        result = run_in_process(spec(), tmp_path, evaluate=False, run_id="faults", wrap_transport=wrap)
    first, second = transports[0].attempts
    for a, b in zip(first, second, strict=True):
        for key, diff in a.meta[meta_keys.SCAFFOLD_CTRL_DIFF].items():
            np.testing.assert_array_equal(diff, b.meta[meta_keys.SCAFFOLD_CTRL_DIFF][key])
    expected = mean_site_control(tmp_path)
    for key, value in result.state["control"].items():
        np.testing.assert_allclose(value, expected[key], atol=1e-6)


def drop_site_2_in_round_2(round_num, results):
    return [r for r in results if not (round_num == 1 and r.site == "site-2")]


FEDDYN_FAULTS = {
    "rejected": lambda transport: FaultyTransport(transport, nan_in_round_2("site-3")),
    "dropped": lambda transport: FaultyTransport(transport, drop_site_2_in_round_2),
    "replayed": ReplayingTransport,
}


@pytest.mark.parametrize("fault", sorted(FEDDYN_FAULTS))
def test_feddyn_server_sum_equals_the_sum_of_the_site_states_after_a_fault(tmp_path, fault):
    """FedDyn's server keeps h = sum_k H_k (its h/m term); a rejected, dropped or replayed round must not break it."""
    feddyn = spec(client="feddyn", server="feddyn", server_args={"alpha": 0.01})
    with quiet_lightning():
        result = run_in_process(feddyn, tmp_path, evaluate=False, run_id="faults", wrap_transport=FEDDYN_FAULTS[fault])
    expected_round_2 = {"rejected": ["site-1", "site-2"], "dropped": ["site-1", "site-3"], "replayed": list(SITES)}
    assert result.rounds[1]["aggregated"] == expected_round_2[fault]
    stored = [ClientStateStore(tmp_path, site).latest("feddyn").state for site in SITES]
    for key, value in result.state["h_sum"].items():
        np.testing.assert_allclose(value, sum(s[key].numpy() for s in stored), atol=1e-6)
