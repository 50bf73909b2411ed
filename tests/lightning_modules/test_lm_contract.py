"""The contract every client algorithm keeps, checked for every algorithm in the registry (no hand-kept list):
a short fit leaves finite weights and finite numeric meta; the meta validates through the wire contract; the state
the algorithm keeps between rounds is finite, reads back identically through a new store, and a new instance of
the algorithm (a restarted site process) starts its next round from it."""

from __future__ import annotations

import math

import pytest
import torch

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import ControlVariate, FedDynReport, FedNovaReport, TrainingStats
from lightning_modules import FederatedAlgorithm, FLClassifier
from lightning_modules.algorithms import CLIENT_ALGORITHMS, build_client_algorithm
from lightning_modules.personalization.partial_sharing import STORE_NAME
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

META = {meta_keys.ROUND: 0, meta_keys.RUN_ID: "run", meta_keys.SCAFFOLD_CTRL_GLOBAL: {}, meta_keys.FEDDYN_ALPHA: 0.1}


def fit(name: str, root, round_num: int = 0) -> tuple[FLClassifier, dict]:
    torch.manual_seed(0)
    module = FLClassifier(arch="mlp", lr=0.05, arch_args=dict(CLIENT_ALGORITHMS[name].default_arch_args), init_seed=0)
    algorithm = build_client_algorithm(name)
    algorithm.bind("site-1", ClientStateStore(root, "site-1"))
    meta = {**META, meta_keys.ROUND: round_num}
    callback = FederatedAlgorithm(algorithm, num_samples=48, site="site-1", meta_source=lambda: meta)
    data = torch.utils.data.TensorDataset(torch.rand(48, 64), torch.arange(48) % 10)
    trainer = quiet_trainer(1, [callback])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return module, callback.last_meta


@pytest.mark.parametrize("name", sorted(CLIENT_ALGORITHMS))
def test_outputs_are_finite_and_the_meta_validates_through_the_wire(tmp_path, name):
    module, meta = fit(name, tmp_path)
    assert all(bool(torch.isfinite(v).all()) for v in module.state_dict().values() if v.is_floating_point())
    numbers = {k: v for k, v in meta.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    assert all(math.isfinite(v) for v in numbers.values()), numbers
    assert all(meta_keys.is_namespaced(key) for key in meta)
    stats = TrainingStats.from_meta(meta)
    assert stats.ok, stats.problems
    local = getattr(module, "__fl_local_keys__", frozenset())  # a head the site keeps (FedRep) is not sent
    trainable = {n: tuple(p.shape) for n, p in module.named_parameters() if p.requires_grad and n not in local}
    assert set(stats.value.param_keys) == set(trainable)
    if meta_keys.SCAFFOLD_CTRL_DIFF in meta:
        key = meta_keys.SCAFFOLD_CTRL_DIFF
        assert ControlVariate.from_meta(meta, key, trainable, allow_empty=False).ok
    if meta_keys.FEDDYN_ALPHA_K in meta:
        assert FedDynReport.from_meta(meta).ok
    if meta_keys.FEDNOVA_TAU in meta:
        assert FedNovaReport.from_meta(meta).ok


@pytest.mark.parametrize("name", sorted(CLIENT_ALGORITHMS))
def test_the_kept_state_reads_back_and_a_restarted_site_starts_from_it(tmp_path, name):
    algorithm = name
    fit(name, tmp_path)
    store = ClientStateStore(tmp_path, "site-1")
    name = STORE_NAME if getattr(CLIENT_ALGORITHMS[name], "needs_head", False) else name  # FedRep's kept head
    stored = store.latest(name)  # the round's new state, pending until the server confirms the round
    if stored is None:
        assert not [p for p in tmp_path.rglob("*") if p.is_file()], f"{name} wrote state it does not read"
        return  # a stateless algorithm (FedAvg, FedProx, FedMoS: per-round state only)
    assert store.load(name) is None  # nothing is committed before the confirmation
    store.settle_all(1, {"site-1": 0})  # the next round starts: the server confirms round 0
    again = ClientStateStore(tmp_path, "site-1").load(name)
    tensors = {k: v for k, v in stored.state.items() if isinstance(v, torch.Tensor)}
    assert all(bool(torch.isfinite(v).all()) for v in tensors.values())
    for key, value in tensors.items():
        torch.testing.assert_close(again.state[key], value, atol=0, rtol=0)
    fit(algorithm, tmp_path, round_num=1)  # a new instance (a restarted process) runs its next round from the file
