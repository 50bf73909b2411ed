"""Per-step kernels: when the FedProx/FedDyn term is folded into a plain SGD step (and when not), the folded step
equals the gradient form in real Lightning fits, and the fused SCAFFOLD add equals the per-tensor loop bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aggregators import meta_keys
from lightning_modules import FederatedAlgorithm, FLClassifier
from lightning_modules.algorithms import ClientAlgorithm, kernels
from lightning_modules.algorithms.feddyn import FedDyn
from lightning_modules.algorithms.fedprox import FedProx
from lightning_modules.state_store import ClientStateStore

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
    pytest.mark.filterwarnings("ignore:.*precision=.*"),
]

IN_FEATURES, NUM_CLASSES, STEPS = 12, 4, 10


class LerpSpy:
    """Counts the fused pulls (torch._foreach_lerp_ calls) while delegating to the real kernel."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = torch._foreach_lerp_

        def spy(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(torch, "_foreach_lerp_", spy)


def fit(algorithm: ClientAlgorithm, meta: dict[str, Any], *, momentum: float = 0.0, **trainer_kw: Any) -> nn.Module:
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(40, IN_FEATURES, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (40,), generator=gen)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(5))
    module = FLClassifier(
        arch="mlp",
        num_classes=NUM_CLASSES,
        arch_args={"in_features": IN_FEATURES, "hidden_sizes": (16,)},
        lr=0.2,
        momentum=momentum,
        init_seed=11,
    )
    callback = FederatedAlgorithm(algorithm, num_samples=40, site="site-1", meta_source=lambda: dict(meta))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
        **trainer_kw,
    )
    trainer.fit(module, loader)
    return module


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def feddyn(tmp_path, name: str) -> FedDyn:
    algorithm = FedDyn()
    algorithm.bind("site-1", ClientStateStore(tmp_path / name, "site-1"))
    return algorithm


FEDDYN_META = {meta_keys.FEDDYN_ALPHA: 0.3, meta_keys.ROUND: 0, meta_keys.RUN_ID: "run-a"}


@pytest.mark.parametrize("name", ["fedprox", "feddyn"])
def test_plain_sgd_fit_folds_the_term_into_the_step_and_matches_the_gradient_form(tmp_path, monkeypatch, name):
    def make(tag: str) -> ClientAlgorithm:
        return FedProx(mu=0.7) if name == "fedprox" else feddyn(tmp_path, tag)

    meta = {meta_keys.ROUND: 0} if name == "fedprox" else FEDDYN_META
    spy = LerpSpy(monkeypatch)
    folded = weights(fit(make("folded"), meta))
    assert spy.calls == STEPS  # one fused pull per optimizer step (one param group)
    # A clipping threshold no gradient reaches keeps the update the same but forces the gradient form.
    unfolded = weights(fit(make("unfolded"), meta, gradient_clip_val=1e9))
    assert spy.calls == STEPS
    plain = weights(fit(ClientAlgorithm(), meta))
    for key in folded:
        torch.testing.assert_close(folded[key], unfolded[key], atol=1e-6, rtol=0)
    assert max((folded[k] - plain[k]).abs().max().item() for k in folded) > 1e-3


@pytest.mark.parametrize(
    ("momentum", "trainer_kw"), [(0.9, {}), (0.0, {"gradient_clip_val": 0.5}), (0.0, {"accumulate_grad_batches": 2})]
)
def test_fold_is_used_only_for_a_plain_unclipped_sgd_step(monkeypatch, momentum, trainer_kw):
    spy = LerpSpy(monkeypatch)
    module = fit(FedProx(mu=0.7), {meta_keys.ROUND: 0}, momentum=momentum, **trainer_kw)
    if "accumulate_grad_batches" in trainer_kw:  # still plain SGD steps: one pull per step, never per micro-batch
        steps = module.__fl_meta__[meta_keys.NUM_STEPS]
        assert 0 < steps < STEPS and spy.calls == steps
    else:
        assert spy.calls == 0


def test_plain_sgd_step_lrs_refuses_what_it_cannot_vouch_for():
    bare = nn.Linear(2, 2)  # no trainer: nobody promises the gradient reaches the step unclipped
    assert kernels.plain_sgd_step_lrs(bare, torch.optim.SGD(bare.parameters(), lr=0.1)) is None

    class Attached(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

    module = Attached()
    module.trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    params = list(module.parameters())
    assert kernels.plain_sgd_step_lrs(module, torch.optim.SGD(params, lr=0.1)) == [0.1]
    assert kernels.plain_sgd_step_lrs(module, torch.optim.SGD(params, lr=0.1, weight_decay=1e-4)) is None
    assert kernels.plain_sgd_step_lrs(module, torch.optim.SGD(params, lr=0.1, maximize=True)) is None
    assert kernels.plain_sgd_step_lrs(module, torch.optim.Adam(params, lr=0.1)) is None

    class OtherSGD(torch.optim.SGD):
        pass

    assert kernels.plain_sgd_step_lrs(module, OtherSGD(params, lr=0.1)) is None


def test_fold_pulls_by_lr_times_coefficient_and_changes_nothing_for_a_non_fp32_target():
    class Attached(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.tensor([1.0, 2.0]))

    module = Attached()
    module.trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module.w.grad = torch.tensor([0.5, 0.5])
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    params = {"w": module.w}
    bf16_target = {"w": torch.zeros(2, dtype=torch.bfloat16)}
    assert not kernels.pull_before_plain_sgd_step_(module, optimizer, params, bf16_target, 2.0, require_all_grads=True)
    assert module.w.tolist() == [1.0, 2.0]
    target = {"w": torch.tensor([0.0, 4.0])}
    assert kernels.pull_before_plain_sgd_step_(module, optimizer, params, target, 2.0, require_all_grads=True)
    # lerp(w, target, lr * c = 0.2): 1 + 0.2 * (0 - 1) = 0.8, 2 + 0.2 * (4 - 2) = 2.4; the gradient is left alone.
    assert module.w.tolist() == pytest.approx([0.8, 2.4], abs=1e-6)
    assert module.w.grad.tolist() == [0.5, 0.5]


def test_add_in_own_dtype_is_the_per_tensor_loop_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen).to(torch.bfloat16)]
    terms = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    expected = [t.clone().add_(term.to(t.dtype), alpha=-0.37) for t, term in zip(tensors, terms, strict=True)]
    kernels.add_in_own_dtype_(tensors, terms, alpha=-0.37)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, expected, strict=True))
