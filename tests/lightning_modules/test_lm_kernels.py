"""Every client correction is a gradient term, and the one fused fast path is the callback's.

A callback placed after `FederatedAlgorithm` sees, in ``on_before_optimizer_step``, the task gradient plus the
algorithm's term in closed form (FedProx, FedDyn, SCAFFOLD with their defaults, under the plain SGD step where the
fused path exists), and ``correct_gradients`` never moves a weight. When nobody watches, the callback folds the
FedProx/FedDyn term into a plain SGD step (and only then), the folded step equals the gradient form in real
Lightning fits, and the fused SCAFFOLD add equals the per-tensor loop bit for bit."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules import FederatedAlgorithm, FLClassifier
from lightning_modules.algorithms import ClientAlgorithm, build_client_algorithm, kernels
from lightning_modules.algorithms.feddyn import FedDyn
from lightning_modules.algorithms.fedprox import FedProx
from lightning_modules.state_store import ClientStateStore
from tests.helpers import fit_under, small_mlp, toy_loader, weights

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


def new_module(momentum: float = 0.0) -> FLClassifier:
    return small_mlp(IN_FEATURES, NUM_CLASSES, momentum=momentum)


def fit(
    algorithm: ClientAlgorithm,
    meta: dict[str, Any],
    *,
    momentum: float = 0.0,
    around: tuple[pl.Callback, pl.Callback] | None = None,
    fuse_plain_sgd: bool = True,
    **trainer_kw: Any,
) -> nn.Module:
    """A 10-step fit; ``around``: callbacks placed before and after the algorithm's."""
    loader = toy_loader(IN_FEATURES, NUM_CLASSES)
    callback_args = {"fuse_plain_sgd": fuse_plain_sgd}
    module = new_module(momentum)
    return fit_under(
        algorithm, module, loader, meta, max_epochs=2, around=around, callback_args=callback_args, **trainer_kw
    )


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


# -- every correction a gradient term -------------------------------------------------------------------------------
class Gradients(pl.Callback):
    """Records every step's weights and gradients in ``on_before_optimizer_step`` (before or after the algorithm)."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        params = dict(pl_module.named_parameters())
        self.weights.append({name: p.detach().clone() for name, p in params.items()})
        self.grads.append({name: p.grad.detach().clone() for name, p in params.items()})


def controls(net: nn.Module) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {n: rng.standard_normal(tuple(p.shape)).astype(np.float32) for n, p in net.named_parameters()}


MU, ALPHA = 0.7, 0.3
C_GLOBAL = controls(new_module())
ROUND_META = {meta_keys.ROUND: 0, meta_keys.RUN_ID: "run-a"}
DEFAULTS = {  # name: (client args, server meta); H_k = 0 and c_i = 0 in the site's first round
    "fedprox": ({"mu": MU}, ROUND_META),
    "feddyn": ({}, {**ROUND_META, meta_keys.FEDDYN_ALPHA: ALPHA}),
    "scaffold": ({}, {**ROUND_META, meta_keys.SCAFFOLD_CTRL_GLOBAL: C_GLOBAL}),
}


def bound(name: str, tmp_path) -> ClientAlgorithm:
    algorithm = build_client_algorithm(name, **DEFAULTS[name][0])
    algorithm.bind("site-1", ClientStateStore(tmp_path / name, "site-1"))
    return algorithm


def closed_form_term(name: str, weights: dict[str, torch.Tensor], received: dict[str, torch.Tensor]) -> dict:
    if name == "scaffold":  # c - c_i
        return {n: torch.from_numpy(C_GLOBAL[n]) for n in weights}
    coefficient = MU if name == "fedprox" else ALPHA  # mu * (w - w_t); alpha * (theta - theta_server + H_k)
    return {n: coefficient * (w - received[n]) for n, w in weights.items()}


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_a_callback_after_the_algorithm_sees_the_task_gradient_plus_the_term(tmp_path, name):
    before, after = Gradients(), Gradients()
    fit(bound(name, tmp_path), DEFAULTS[name][1], around=(before, after))
    assert len(after.grads) == len(before.grads) == STEPS
    received = before.weights[0]  # nothing moves before the first step
    for step, (at_step, task, seen) in enumerate(zip(before.weights, before.grads, after.grads, strict=True)):
        assert all(torch.equal(at_step[n], after.weights[step][n]) for n in at_step)  # nothing moved in between
        term = closed_form_term(name, at_step, received)
        for n in task:
            torch.testing.assert_close(seen[n], task[n] + term[n], atol=1e-6, rtol=0)
        if step:  # the weights have left the received model: the term is not zero
            assert max(term[n].abs().max().item() for n in term) > 1e-4


@pytest.mark.parametrize("name", list(DEFAULTS))
def test_correct_gradients_adds_the_term_and_never_moves_a_weight(tmp_path, name):
    """On a module attached to a trainer with a plain SGD optimizer: where the fused path would apply."""
    net = new_module()
    net.trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    algorithm = bound(name, tmp_path)
    algorithm.on_round_start(net, DEFAULTS[name][1])
    received = {n: p.detach().clone() for n, p in net.named_parameters()}
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.25)
            p.grad = torch.full_like(p, 0.5)
    moved = {n: p.detach().clone() for n, p in net.named_parameters()}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    assert kernels.plain_sgd_step_lrs(net, optimizer) == [0.1]
    algorithm.correct_gradients(net, optimizer)
    term = closed_form_term(name, moved, received)
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), moved[n])
        torch.testing.assert_close(p.grad, 0.5 + term[n], atol=1e-6, rtol=0)


class Silent(pl.Callback):
    observes_gradients = False  # overrides the hook without reading .grad: the fused path stays available

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        pass


class Watching(pl.LightningModule):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        pass


def test_gradient_observers_are_the_later_callbacks_and_the_module_hook():
    from nvflare.app_opt.lightning.algorithm import _AlgorithmHandlerManager
    from nvflare.app_opt.lightning.api import FLCallback

    nvflare = FLCallback.__new__(FLCallback)  # its constructor talks to NVFlare's client API; only the hook matters
    nvflare._algorithm_handler_manager = _AlgorithmHandlerManager()
    driver, early, late = FederatedAlgorithm("fedavg"), Gradients(), Gradients()
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.callbacks = [early, driver, Silent(), nvflare]
    assert kernels.gradient_observers(trainer, new_module(), driver) == []  # NVFlare's handlers are all off
    assert kernels.gradient_observers(trainer, Watching(), driver) == ["Watching.on_before_optimizer_step"]
    trainer.callbacks = [early, driver, late]
    assert kernels.gradient_observers(trainer, new_module(), driver) == ["Gradients"]
    nvflare._algorithm_handler_manager._handlers = {"fedprox": object()}  # NVFlare's built-in FedProx switched on
    trainer.callbacks = [driver, nvflare]
    assert kernels.gradient_observers(trainer, new_module(), driver) == ["FLCallback"]
    trainer.callbacks = [late]  # a driver not in the list (called by hand): every callback may watch
    assert kernels.gradient_observers(trainer, new_module(), driver) == ["Gradients"]


def test_a_watching_callback_turns_the_fold_off_and_fuse_plain_sgd_false_too(tmp_path, monkeypatch):
    spy = LerpSpy(monkeypatch)
    fit(FedProx(mu=0.7), {meta_keys.ROUND: 0}, around=(Gradients(), Gradients()))
    assert spy.calls == 0
    fit(FedProx(mu=0.7), {meta_keys.ROUND: 0}, fuse_plain_sgd=False)
    assert spy.calls == 0
    fit(FedProx(mu=0.7), {meta_keys.ROUND: 0}, around=(Gradients(), Silent()))
    assert spy.calls == STEPS


def test_scaffold_unwatched_is_the_post_step_correction_bit_for_bit_and_watched_the_same_update(tmp_path):
    """Nobody watching: the callback's fused path, what earlier releases trained (committed jobs keep their bits)."""
    meta = DEFAULTS["scaffold"][1]
    unwatched = weights(fit(bound("scaffold", tmp_path / "a"), meta))
    post_step = build_client_algorithm("scaffold", correction="step")
    post_step.bind("site-1", ClientStateStore(tmp_path / "b", "site-1"))
    watched = weights(fit(bound("scaffold", tmp_path / "c"), meta, around=(Gradients(), Gradients())))
    for key, value in weights(fit(post_step, meta)).items():
        assert torch.equal(unwatched[key], value), key
        torch.testing.assert_close(watched[key], value, atol=1e-6, rtol=0)
