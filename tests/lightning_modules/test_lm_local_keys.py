"""Partial sharing at the site (FedPer, FedBN): the resolver, what is sent, what persists, what the algorithms see.

The site's result never carries a local entry; L is loaded from the site's store at round start (pending until
the server confirms the round); a missing, corrupt or other-run state restarts from the received values with a
warning naming the site and the keys; SCAFFOLD's control and FedProx's anchor exclude L.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from torch import nn

from aggregators.contracts import meta_keys
from benchmarks.in_process import initial_params, quiet_lightning, site_rounds
from jobs.build import JobBuildError, JobSpec
from lightning_modules.algorithms.base import trainable_parameters
from lightning_modules.models import BatchNormCNN
from lightning_modules.personalization import LocalKeysError, declared_head_keys, resolve_local_keys
from lightning_modules.personalization.partial_sharing import STORE_NAME

#: FedPer on the digits MLP, with the validation split every personal method needs.
FEDPER = {"dataset": "digits", "arch": "mlp", "local_keys": "net.classifier.*", "site_val_fraction": 0.1}
SPEC = JobSpec(name="fedper", **FEDPER, num_rounds=2, batch_size=32, lr=0.1)
HEAD = ("net.classifier.bias", "net.classifier.weight")


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def test_resolver_globs_and_batchnorm():
    model = BatchNormCNN()
    bn = resolve_local_keys("batchnorm", model)
    assert len(bn) == 10 and all(k.startswith(("bn1.", "bn2.")) for k in bn)
    assert "bn1.num_batches_tracked" in bn and "bn2.running_var" in bn
    assert resolve_local_keys("classifier.*, fc2.bias", model) == ("classifier.bias", "classifier.weight", "fc2.bias")
    assert resolve_local_keys("batchnorm,classifier.*", model) == tuple(
        sorted((*bn, "classifier.bias", "classifier.weight"))
    )


def test_resolver_refuses_a_pattern_matching_nothing_and_patterns_covering_everything():
    with pytest.raises(LocalKeysError, match=r"pattern 'head\.\*' matches no state_dict entry"):
        resolve_local_keys("classifier.*,head.*", BatchNormCNN())
    with pytest.raises(LocalKeysError, match="the model has no BatchNorm layer"):
        resolve_local_keys("batchnorm", nn.Linear(2, 2))
    with pytest.raises(LocalKeysError, match="cover all 2 state_dict entries"):
        resolve_local_keys("*", nn.Linear(2, 2))


def test_declared_head_is_prefixed_by_where_it_is_declared():
    assert declared_head_keys(BatchNormCNN()) == ("classifier.bias", "classifier.weight")
    assert declared_head_keys(nn.Sequential(nn.Linear(2, 2))) == ()


def test_builder_writes_explicit_names():
    assert SPEC.local_keys == ",".join(HEAD)
    assert "--local-keys net.classifier.bias,net.classifier.weight" in __import__(
        "jobs.build"
    ).build.client_script_args(SPEC)


def test_trainable_parameters_leave_the_local_entries_out():
    module = nn.Linear(2, 1)
    module.__fl_local_keys__ = frozenset({"bias"})
    assert list(trainable_parameters(module)) == ["weight"]


def run_site(tmp_path, spec=SPEC, rounds=(0,), confirmed=True, run_id="r", store_root=None):
    site = site_rounds(spec, store_root or tmp_path)["site-1"]
    start = initial_params(spec)
    results = []
    for r in rounds:
        meta = {meta_keys.ROUND: r, meta_keys.RUN_ID: run_id}
        if r > 0 and confirmed:
            meta[meta_keys.LAST_AGGREGATED] = {"site-1": r - 1}
        results.append(site.train(r, start, meta))
    return site, start, results


def test_sent_result_carries_no_local_entry_and_param_keys_exclude_them(tmp_path):
    site, start, [(sent, meta)] = run_site(tmp_path)
    assert set(sent) == set(start) - set(HEAD)
    assert not set(HEAD) & set(meta[meta_keys.PARAM_KEYS])
    assert set(site.module.state_dict()) == set(start)  # the hook is gone once the fit ended


def test_local_entries_persist_and_are_restored_over_the_received_ones(tmp_path):
    site, start, _ = run_site(tmp_path, rounds=(0, 1))
    stored = site.round_callback.local_entries.state_store.latest(STORE_NAME).state
    kept = site.module.state_dict()
    for key in HEAD:
        np.testing.assert_array_equal(stored[key].numpy(), kept[key].numpy())
        assert not np.array_equal(kept[key].numpy(), start[key])  # trained over two rounds, never reset to start
    # Round 1 started from round 0's head: a site restarted from the round-0 store ends where this one did.
    other, _, _ = run_site(tmp_path / "b", rounds=(0, 1))
    for key in HEAD:
        np.testing.assert_array_equal(other.module.state_dict()[key].numpy(), kept[key].numpy())


def test_unconfirmed_round_rolls_the_local_entries_back(tmp_path, caplog):
    site, start, _ = run_site(tmp_path, rounds=(0,))
    # Round 1 without a confirmation of round 0 (rejected): L restarts from what was committed before, nothing.
    meta = {meta_keys.ROUND: 1, meta_keys.RUN_ID: "r", meta_keys.LAST_AGGREGATED: {}}
    with caplog.at_level(logging.WARNING):
        site.train(1, start, meta)
    assert "discarded" in caplog.text


def test_corrupt_or_other_run_state_restarts_from_the_received_values_with_a_warning(tmp_path, caplog):
    site, start, _ = run_site(tmp_path, rounds=(0, 1))
    path = site.round_callback.local_entries.state_store.path(STORE_NAME)
    path.write_bytes(b"garbage")
    meta = {meta_keys.ROUND: 2, meta_keys.RUN_ID: "r", meta_keys.LAST_AGGREGATED: {}}
    with caplog.at_level(logging.WARNING):
        site.train(2, start, meta)
    assert "site-1: local entries ['net.classifier.bias', 'net.classifier.weight'] restart" in caplog.text
    assert "unusable stored state" in caplog.text
    caplog.clear()
    _, _, _ = run_site(tmp_path / "c", rounds=(0,))
    site2 = site_rounds(SPEC, tmp_path / "c")["site-1"]
    meta = {meta_keys.ROUND: 1, meta_keys.RUN_ID: "another", meta_keys.LAST_AGGREGATED: {"site-1": 0}}
    with caplog.at_level(logging.WARNING):
        site2.train(1, start, meta)
    assert "written by another run" in caplog.text


def test_missing_state_of_a_site_the_server_aggregated_is_warned(tmp_path, caplog):
    site = site_rounds(SPEC, tmp_path)["site-1"]
    meta = {meta_keys.ROUND: 3, meta_keys.RUN_ID: "r", meta_keys.LAST_AGGREGATED: {"site-1": 2}}
    with caplog.at_level(logging.WARNING):
        site.train(3, initial_params(SPEC), meta)
    assert "no stored state although the server aggregated this site's result before" in caplog.text


def test_scaffold_control_and_fedprox_anchor_exclude_the_local_entries(tmp_path):
    spec = JobSpec(name="s", **FEDPER, client="fedprox", client_args={"mu": 0.1})
    site = site_rounds(spec, tmp_path)["site-1"]
    site.train(0, initial_params(spec), {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r"})
    assert set(site.round_callback.algorithm.anchor) == {
        "net.hidden.0.weight",
        "net.hidden.0.bias",
        "net.hidden.2.weight",
        "net.hidden.2.bias",
    }


def test_fedbn_keeps_batchnorm_statistics_at_the_site(tmp_path):
    spec = JobSpec(
        name="bn", arch="bn_cnn", local_keys="batchnorm", max_train_samples=120, batch_size=20, site_val_fraction=0.1
    )
    site = site_rounds(spec, tmp_path)["site-1"]
    start = initial_params(spec)
    sent, _ = site.train(0, start, {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r"})
    assert not any(".bn" in key for key in sent)
    assert site.module.state_dict()["net.bn1.num_batches_tracked"].item() > 0
    assert not np.array_equal(site.module.state_dict()["net.bn1.running_mean"].numpy(), start["net.bn1.running_mean"])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"local_keys": "net.head.*"}, "pattern 'net.head.\\*' matches no state_dict entry"),
        ({"local_keys": "*"}, "nothing would be shared"),
        ({"local_keys": "batchnorm"}, "no BatchNorm layer"),
        (
            {
                "local_keys": "net.classifier.*",
                "server": "attack_adaptive",
                "server_args": {"attention_model_path": "x"},
            },
            "attack_adaptive",
        ),
    ],
)
def test_builder_refuses_in_one_line(settings, message):
    with pytest.raises(JobBuildError, match=message) as info:
        JobSpec(name="bad", dataset="digits", arch="mlp", **settings)
    assert "\n" not in str(info.value)


def test_module_of_another_job_is_refused_by_the_site(tmp_path):
    from lightning_modules.algorithms.base import ClientAlgorithmError
    from lightning_modules.federated import FederatedAlgorithm
    from lightning_modules.personalization.partial_sharing import local_entries_for

    callback = FederatedAlgorithm("fedavg", site="site-9", local_keys="net.other.weight")
    with pytest.raises(ClientAlgorithmError, match="site-9: local_keys names entries the model does not have"):
        local_entries_for(callback.algorithm, torch.nn.Linear(1, 1), "net.other.weight")


def test_scaffold_in_process_runs_on_the_shared_entries(tmp_path):
    from benchmarks.in_process import run_in_process

    spec = dataclasses.replace(SPEC, name="sc", client="scaffold", server="scaffold", max_test_samples=50)
    result = run_in_process(spec, tmp_path, run_id="r")
    assert [r["status"] for r in result.rounds] == ["aggregated", "aggregated"]
    assert all(not r["rejected"] for r in result.rounds)
    for key in HEAD:
        np.testing.assert_array_equal(result.params[key], initial_params(spec)[key])
