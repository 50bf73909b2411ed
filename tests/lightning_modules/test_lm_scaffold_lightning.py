"""SCAFFOLD inside a real Lightning fit: step counting with accumulation, fp32 state under bf16-mixed, BN buffers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules import FederatedAlgorithm, FLClassifier
from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

LR = 0.05


def _fit(tmp_path, precision="32-true", accumulate=1, control=None, arch_with_bn=False, batches=None):
    torch.manual_seed(0)
    module = FLClassifier(arch="mlp", lr=LR, init_seed=0)
    if arch_with_bn:
        module.net.hidden.append(nn.BatchNorm1d(64))
    algorithm = build_client_algorithm("scaffold")
    algorithm.bind("site-1", ClientStateStore(tmp_path, "site-1"))
    meta = {meta_keys.SCAFFOLD_CTRL_GLOBAL: control or {}, meta_keys.ROUND: 0, meta_keys.RUN_ID: "run"}
    callback = FederatedAlgorithm(algorithm, num_samples=64, site="site-1", meta_source=lambda: meta)
    data = torch.utils.data.TensorDataset(torch.rand(64, 64), torch.randint(0, 10, (64,)))
    trainer = quiet_trainer(
        1, [callback], precision=precision, accumulate_grad_batches=accumulate, limit_train_batches=batches
    )
    x0 = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))
    return module, algorithm, callback.last_meta, x0


def test_steps_and_learning_rate_sum_follow_gradient_accumulation(tmp_path):
    module, algorithm, meta, x0 = _fit(tmp_path, accumulate=2)
    assert meta[meta_keys.NUM_STEPS] == 2 and algorithm.steps == 2
    assert all(total == pytest.approx(2 * LR) for total in algorithm.lr_sum.values())
    # With c = c_i = 0 the diff is (x - y) / (K * lr) on every trainable parameter.
    diff = meta[meta_keys.SCAFFOLD_CTRL_DIFF]
    for name, value in diff.items():
        expected = (x0[name] - module.state_dict()[name]).numpy() / (2 * LR)
        np.testing.assert_allclose(value, expected, atol=1e-5, rtol=1e-4)


def test_bf16_mixed_keeps_controls_and_snapshot_in_fp32(tmp_path):
    _, algorithm, meta, _ = _fit(tmp_path, precision="bf16-mixed")
    assert all(v.dtype == torch.float32 for v in algorithm.x.values())
    assert all(v.dtype == np.float32 for v in meta[meta_keys.SCAFFOLD_CTRL_DIFF].values())
    stored = ClientStateStore(tmp_path, "site-1").latest("scaffold")
    assert all(v.dtype == torch.float32 for k, v in stored.state.items() if not k.startswith("__"))


def test_controls_cover_trainable_parameters_and_leave_batchnorm_buffers_alone(tmp_path):
    module, _, meta, _ = _fit(tmp_path, arch_with_bn=True)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    assert set(meta[meta_keys.SCAFFOLD_CTRL_DIFF]) == trainable
    assert not any("running" in key or "num_batches" in key for key in meta[meta_keys.SCAFFOLD_CTRL_DIFF])


def test_a_nonzero_global_control_moves_the_weights_against_it(tmp_path):
    plain, _, _, _ = _fit(tmp_path / "a", batches=1)
    control = {name: np.full(tuple(p.shape), 0.1, np.float32) for name, p in plain.named_parameters()}
    corrected, _, _, _ = _fit(tmp_path / "b", control=control, batches=1)
    # One step on the same batch from the same weights: y = y_plain - lr * (c - c_i) = y_plain - 0.05 * 0.1.
    for name, p in corrected.named_parameters():
        shift = (plain.state_dict()[name] - p.detach()).numpy()
        np.testing.assert_allclose(shift, LR * 0.1, atol=1e-6)


def test_gradient_correction_with_gradient_clipping_is_refused_with_the_reason(tmp_path):
    module = FLClassifier(arch="mlp", lr=LR, init_seed=0)
    algorithm = build_client_algorithm("scaffold", correction="grad")
    algorithm.bind("site-1", ClientStateStore(tmp_path, "site-1"))
    meta = {meta_keys.SCAFFOLD_CTRL_GLOBAL: {}, meta_keys.ROUND: 0, meta_keys.RUN_ID: "run"}
    callback = FederatedAlgorithm(algorithm, num_samples=16, site="site-1", meta_source=lambda: meta)
    trainer = quiet_trainer(1, [callback], gradient_clip_val=1.0)
    data = torch.utils.data.TensorDataset(torch.rand(16, 64), torch.randint(0, 10, (16,)))
    with pytest.raises(ClientAlgorithmError, match="site-1: scaffold with correction='grad' and gradient clipping"):
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=16))


def test_option_one_full_gradient_pass_leaves_batchnorm_buffers_and_uses_no_dropout(tmp_path):
    from lightning_modules.algorithms.scaffold import full_local_gradient

    torch.manual_seed(0)
    module = FLClassifier(arch="mlp", lr=LR, init_seed=0)
    module.net.hidden.append(nn.BatchNorm1d(64))
    module.net.hidden.append(nn.Dropout(0.5))
    data = torch.utils.data.TensorDataset(torch.rand(32, 64), torch.randint(0, 10, (32,)))

    class Loader:
        dataset, batch_size = data, 16

    module.trainer = type("T", (), {"train_dataloader": Loader()})()
    params = {n: p for n, p in module.named_parameters()}
    before = {n: b.clone() for n, b in module.named_buffers()}
    first = full_local_gradient(module, params)
    second = full_local_gradient(module, params)
    for name, value in before.items():
        torch.testing.assert_close(dict(module.named_buffers())[name], value, atol=0, rtol=0)
    for name in first:  # no dropout mask: the same gradient twice
        torch.testing.assert_close(first[name], second[name], atol=0, rtol=0)
    assert module.net.hidden[-1].training  # the dropout layer is back in training mode
