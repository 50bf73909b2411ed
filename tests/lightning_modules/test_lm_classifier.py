"""Tests for the Lightning glue: FLClassifier on the client-algorithm callback, the client-algorithm registry,
the trainer/meta refusals and ``evaluate_classifier``.

Every check that involves training runs a real ``pl.Trainer`` on CPU over a few tiny synthetic batches and compares
against values worked out independently in the test (closed forms, autograd on a separate copy of the net, numpy).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.core.optimizer import LightningOptimizer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aggregators.contracts import meta_keys
from lightning_modules import FederatedAlgorithm, FLClassifier
from lightning_modules.algorithms import (
    CLIENT_ALGORITHMS,
    ClientAlgorithm,
    ClientAlgorithmError,
    build_client_algorithm,
    check_server_meta,
)
from lightning_modules.evaluation import evaluate_classifier
from lightning_modules.federated import check_trainer_supports
from lightning_modules.models import build_model

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*number of training batches.*"),
    pytest.mark.filterwarnings("ignore:.*precision=.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

IN_FEATURES = 64
NUM_CLASSES = 10
ARCH_ARGS = {"in_features": IN_FEATURES, "hidden_sizes": (16,)}
BATCH = 8


# --------------------------------------------------------------------------------------------------------------------
# helpers


def make_data(n: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, IN_FEATURES, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (n,), generator=gen)
    return x, y


def make_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int = BATCH) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def make_module(seed: int = 0, lr: float = 0.1, cls: type[FLClassifier] = FLClassifier, **kwargs: Any) -> FLClassifier:
    torch.manual_seed(seed)
    kwargs.setdefault("arch_args", ARCH_ARGS)
    return cls(arch="mlp", num_classes=NUM_CLASSES, lr=lr, **kwargs)


def make_trainer(**overrides: Any) -> pl.Trainer:
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "max_epochs": 1,
        "num_sanity_val_steps": 0,
    }
    settings.update(overrides)
    return pl.Trainer(**settings)


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


class MetaSource:
    """A ``meta_source`` for FederatedRoundCallback that counts its calls and can change per round."""

    def __init__(self, *metas: Mapping[str, Any]) -> None:
        self.metas = [dict(m) for m in metas]
        self.calls = 0

    def __call__(self) -> Mapping[str, Any]:
        meta = self.metas[min(self.calls, len(self.metas) - 1)]
        self.calls += 1
        return meta


class Recorder(ClientAlgorithm):
    """Records every hook call and what the module looked like at that moment."""

    name = "recorder"

    def __init__(self) -> None:
        self.events: list[str] = []
        self.seen_meta: list[dict[str, Any]] = []
        self.seen_modules: list[nn.Module] = []
        self.task_losses: list[float] = []
        self.correct_predictions = 0
        self.num_predictions = 0
        self.logits_require_grad: list[bool] = []
        self.logits_dtypes: list[torch.dtype] = []
        self.grads_present: list[bool] = []
        self.grad_dtypes: list[set[torch.dtype]] = []
        self.weights_changed: list[bool] = []
        self.optimizers: list[Any] = []
        self._before_step: list[torch.Tensor] = []

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        self.events.append("on_round_start")
        self.seen_meta.append(dict(meta))
        self.seen_modules.append(module)

    def loss_terms(self, module: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor | None:
        self.events.append("loss_terms")
        _, y = batch
        self.task_losses.append(F.cross_entropy(logits.detach().float(), y).item())
        self.correct_predictions += int((logits.detach().argmax(dim=1) == y).sum())
        self.num_predictions += len(y)
        self.logits_require_grad.append(logits.requires_grad)
        self.logits_dtypes.append(logits.dtype)
        return None

    def correct_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("correct_gradients")
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.grads_present.append(bool(trainable) and all(p.grad is not None for p in trainable))
        self.grad_dtypes.append({p.grad.dtype for p in trainable if p.grad is not None})
        self.optimizers.append(optimizer)
        self._before_step = [p.detach().clone() for p in trainable]

    def after_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.events.append("after_step")
        trainable = [p for p in module.parameters() if p.requires_grad]
        self.weights_changed.append(
            len(trainable) == len(self._before_step)
            and all(not torch.equal(before, p.detach()) for before, p in zip(self._before_step, trainable, strict=True))
        )

    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        self.events.append("on_round_end")
        return {"recorder.num_events": len(self.events)}

    def count(self, event: str) -> int:
        return self.events.count(event)


class EventCallback(pl.Callback):
    """Puts Lightning's own per-step hooks into the recorder's event list, to pin the relative order."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.recorder.events.append("lightning.on_before_optimizer_step")


def fit_with_recorder(
    n: int = 32, meta: Mapping[str, Any] | None = None, site: str = "site-1", **trainer_kwargs: Any
) -> tuple[FLClassifier, Recorder, FederatedAlgorithm, MetaSource, pl.Trainer]:
    x, y = make_data(n)
    module = make_module()
    recorder = Recorder()
    source = MetaSource(meta if meta is not None else {"server.round": 1})
    callback = FederatedAlgorithm(recorder, num_samples=n, site=site, meta_source=source)
    trainer = make_trainer(callbacks=[callback, EventCallback(recorder)], **trainer_kwargs)
    trainer.fit(module, make_loader(x, y))
    return module, recorder, callback, source, trainer


def task_gradients(weights: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """∇ of the mean cross-entropy at ``weights``, by autograd on an independent copy of the network."""
    net = build_model("mlp", num_classes=NUM_CLASSES, **ARCH_ARGS)
    net.load_state_dict({k.removeprefix("net."): v for k, v in weights.items()})
    loss = F.cross_entropy(net(x), y)
    names = [name for name, _ in net.named_parameters()]
    grads = torch.autograd.grad(loss, [p for _, p in net.named_parameters()])
    return {f"net.{name}": g for name, g in zip(names, grads, strict=True)}


# --------------------------------------------------------------------------------------------------------------------
# hook order and counts


def test_hooks_run_in_order_once_per_optimizer_step():
    meta = {"server.round": 3, "test.value": 7}
    module, rec, _, source, trainer = fit_with_recorder(meta=meta)
    steps = 32 // BATCH

    assert source.calls == 1
    assert rec.seen_meta == [meta]
    assert rec.seen_modules == [module]
    per_step = ["loss_terms", "correct_gradients", "lightning.on_before_optimizer_step", "after_step"]
    assert rec.events == ["on_round_start", *per_step * steps, "on_round_end"]

    assert rec.grads_present == [True] * steps  # gradients exist when correct_gradients runs
    assert rec.weights_changed == [True] * steps  # ... and the step happens between correct_gradients and after_step
    assert rec.logits_require_grad == [True] * steps  # loss terms can backpropagate through the logits
    # The hooks get the raw torch optimizer (the one the trainer holds), not Lightning's LightningOptimizer wrapper.
    assert len(rec.optimizers) == steps
    assert all(opt is trainer.optimizers[0] for opt in rec.optimizers)
    assert not any(isinstance(opt, LightningOptimizer) for opt in rec.optimizers)
    assert module.__fl_meta__[meta_keys.NUM_STEPS] == steps


def test_a_multi_epoch_round_starts_and_ends_once():
    module, rec, callback, source, _ = fit_with_recorder(n=32, max_epochs=2)
    assert source.calls == 1
    assert rec.count("on_round_start") == 1
    assert rec.count("on_round_end") == 1
    assert rec.count("after_step") == 8
    assert callback.last_meta[meta_keys.NUM_STEPS] == 8  # both epochs belong to the same round
    assert module.__fl_meta__[meta_keys.TRAIN_LOSS] == pytest.approx(float(np.mean(rec.task_losses)), abs=1e-6)


def test_gradient_accumulation_counts_optimizer_steps_not_batches():
    module, rec, callback, _, _ = fit_with_recorder(n=32, accumulate_grad_batches=2)
    # 4 batches, 2 per optimizer step.
    assert rec.count("loss_terms") == 4
    assert rec.count("correct_gradients") == 2
    assert rec.count("after_step") == 2
    assert rec.grads_present == [True, True]
    assert rec.weights_changed == [True, True]
    step = ["loss_terms", "loss_terms", "correct_gradients", "lightning.on_before_optimizer_step", "after_step"]
    assert rec.events == ["on_round_start", *step * 2, "on_round_end"]
    assert callback.last_meta[meta_keys.NUM_STEPS] == 2
    assert module.__fl_meta__[meta_keys.NUM_STEPS] == 2


# --------------------------------------------------------------------------------------------------------------------
# the corrections really reach the weights (closed forms)


class AddConstantToGrad(ClientAlgorithm):
    name = "add_const"

    def __init__(self, c: float) -> None:
        self.c = c

    def correct_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        for p in module.parameters():
            if p.requires_grad:
                p.grad.add_(self.c)


class L2OnClassifierWeight(ClientAlgorithm):
    name = "l2_classifier"

    def __init__(self, k: float) -> None:
        self.k = k

    def loss_terms(self, module: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor | None:
        return self.k * (module.net.classifier.weight**2).sum()


def one_step(algorithm: ClientAlgorithm | None, lr: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    x, y = make_data(BATCH)
    module = make_module(lr=lr)
    callback = FederatedAlgorithm(algorithm or ClientAlgorithm(), num_samples=BATCH, meta_source=MetaSource({}))
    before = snapshot(module)
    make_trainer(callbacks=[callback]).fit(module, make_loader(x, y))
    return before, snapshot(module)


def test_plain_step_matches_sgd_closed_form():
    lr = 0.1
    x, y = make_data(BATCH)
    before, after = one_step(None, lr)
    grads = task_gradients(before, x, y)
    assert set(after) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(after[name], before[name] - lr * g, atol=1e-6, rtol=0)


def test_gradient_correction_is_applied_before_the_step():
    lr, c = 0.1, 0.5
    plain_before, plain_after = one_step(None, lr)
    corr_before, corr_after = one_step(AddConstantToGrad(c), lr)
    for name in plain_before:
        torch.testing.assert_close(corr_before[name], plain_before[name], atol=0, rtol=0)  # same start
        torch.testing.assert_close(corr_after[name], plain_after[name] - lr * c, atol=1e-6, rtol=0)


def test_loss_terms_are_added_to_the_task_loss():
    lr, k = 0.1, 0.3
    x, y = make_data(BATCH)
    before, after = one_step(L2OnClassifierWeight(k), lr)
    grads = task_gradients(before, x, y)
    for name, g in grads.items():
        expected_grad = g + 2 * k * before[name] if name == "net.classifier.weight" else g
        torch.testing.assert_close(after[name], before[name] - lr * expected_grad, atol=1e-6, rtol=0)


# --------------------------------------------------------------------------------------------------------------------
# round-end meta


def test_end_round_meta_is_complete_namespaced_and_never_reserved():
    module, rec, callback, _, _ = fit_with_recorder(n=32, site="site-2")
    meta = module.__fl_meta__
    assert meta is callback.last_meta
    assert set(meta) == {
        meta_keys.NUM_STEPS,
        meta_keys.TRAIN_LOSS,
        "train.accuracy",
        meta_keys.CLIENT_ALGORITHM,
        meta_keys.NUM_SAMPLES,
        meta_keys.FIT_SECONDS,  # the site's compute time, which the round-overhead benchmark subtracts
        meta_keys.PARAM_KEYS,  # which entries are trainable (the rest are buffers)
        meta_keys.TRAINED_ROUND,  # the server round it was trained in: a late result is refused by it
        meta_keys.FEDNOVA_TAU,  # the local update is plain SGD, so FedNova can normalise it
        meta_keys.FEDNOVA_A_NORM,
        "recorder.num_events",  # the algorithm's own meta is merged in
    }
    assert meta[meta_keys.NUM_STEPS] == 4
    assert meta[meta_keys.NUM_SAMPLES] == 32
    assert meta[meta_keys.TRAINED_ROUND] == 1  # the broadcast's server.round, echoed
    assert meta[meta_keys.CLIENT_ALGORITHM] == "recorder"
    assert meta["recorder.num_events"] == rec.events.index("on_round_end") + 1
    assert len(rec.task_losses) == 4
    assert meta[meta_keys.TRAIN_LOSS] == pytest.approx(float(np.mean(rec.task_losses)), abs=1e-6)
    assert isinstance(meta["train.accuracy"], float)
    assert 0.0 <= meta["train.accuracy"] <= 1.0
    for key in meta:
        assert meta_keys.is_namespaced(key), key
        assert key not in meta_keys.NVFLARE_RESERVED, key
    assert not set(meta) & {"scaffold_c_global", "scaffold_c_diff", "fedprox_mu"}


def test_train_loss_excludes_loss_terms():
    """train.loss reports the task loss only; the algorithm's extra terms are not folded in."""
    x, y = make_data(BATCH)
    module = make_module(lr=0.0)
    callback = FederatedAlgorithm(L2OnClassifierWeight(100.0), num_samples=BATCH, meta_source=MetaSource({}))
    make_trainer(callbacks=[callback]).fit(module, make_loader(x, y))
    with torch.no_grad():
        expected = F.cross_entropy(module.net(x), y).item()
    assert callback.last_meta[meta_keys.TRAIN_LOSS] == pytest.approx(expected, abs=1e-6)


def test_train_accuracy_is_fraction_of_correct_predictions():
    # Logistic regression that always predicts class 0 and never moves (lr = 0); 24 labels 0 and 8 labels 1.
    module = make_module(lr=0.0, arch_args={"in_features": IN_FEATURES, "hidden_sizes": ()})
    with torch.no_grad():
        module.net.classifier.weight.zero_()
        module.net.classifier.bias.zero_()
        module.net.classifier.bias[0] = 5.0
    x, _ = make_data(32)
    y = torch.tensor([0] * 24 + [1] * 8)
    rec = Recorder()
    callback = FederatedAlgorithm(rec, num_samples=32, meta_source=MetaSource({}))
    make_trainer(callbacks=[callback]).fit(module, make_loader(x, y))
    assert rec.correct_predictions / rec.num_predictions == 0.75
    assert callback.last_meta["train.accuracy"] == pytest.approx(0.75, abs=1e-6)  # macro gives 0.5


def test_train_accuracy_matches_recorded_predictions_when_labels_are_balanced_per_class():
    """Where micro and macro agree (every class seen equally often and all predicted right), the value is exact."""
    module = make_module(lr=0.0, arch_args={"in_features": IN_FEATURES, "hidden_sizes": ()})
    with torch.no_grad():
        module.net.classifier.weight.zero_()
        module.net.classifier.bias.zero_()
        module.net.classifier.weight[:, :NUM_CLASSES] = 10.0 * torch.eye(NUM_CLASSES)
    y = torch.arange(NUM_CLASSES).repeat(2)
    x = torch.zeros(len(y), IN_FEATURES)
    x[torch.arange(len(y)), y] = 1.0
    callback = FederatedAlgorithm(num_samples=len(y), meta_source=MetaSource({}))
    make_trainer(callbacks=[callback]).fit(module, make_loader(x, y, batch_size=5))
    assert callback.last_meta["train.accuracy"] == pytest.approx(1.0)


# --------------------------------------------------------------------------------------------------------------------
# the algorithm never enters the state_dict


class HoldsTensors(ClientAlgorithm):
    name = "holds_tensors"

    def __init__(self) -> None:
        self.control = torch.ones(5)
        self.reference = nn.Linear(3, 3)
        self.previous_models = [nn.Linear(2, 2)]

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        self.snapshot = copy.deepcopy(module.net)


class AlgorithmModule(ClientAlgorithm, nn.Module):
    name = "module_algorithm"

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.w = nn.Parameter(torch.zeros(2))


def test_algorithm_never_enters_state_dict_or_optimizer():
    x, y = make_data(16)
    module = make_module()
    net_keys = {f"net.{k}" for k in module.net.state_dict()}
    assert set(module.state_dict()) == net_keys
    trainer = make_trainer(callbacks=[FederatedAlgorithm(HoldsTensors(), num_samples=16, meta_source=MetaSource({}))])
    trainer.fit(module, make_loader(x, y))
    assert set(module.state_dict()) == net_keys  # no algorithm tensors, no metric states
    assert all(key.startswith("net.") for key in module.state_dict())
    assert sum(1 for _ in module.parameters()) == sum(1 for _ in module.net.parameters())
    (optimizer,) = trainer.optimizers
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in module.net.parameters()}


def test_callback_refuses_an_nn_module_as_algorithm():
    with pytest.raises(ClientAlgorithmError, match=r"nn\.Module"):
        FederatedAlgorithm(AlgorithmModule())


def test_default_algorithm_is_fedavg():
    callback = FederatedAlgorithm()
    assert type(callback.algorithm) is ClientAlgorithm
    assert callback.algorithm.name == "fedavg"


# --------------------------------------------------------------------------------------------------------------------
# a second round


@pytest.mark.parametrize("same_trainer", [True, False], ids=["same_trainer", "fresh_trainer"])
def test_second_round_resets_counters_and_restarts_the_algorithm(same_trainer: bool):
    x, y = make_data(32)
    module = make_module()
    rec = Recorder()
    source = MetaSource({"server.round": 1}, {"server.round": 2})
    callback = FederatedAlgorithm(rec, num_samples=32, meta_source=source)
    trainer = make_trainer(callbacks=[callback])
    trainer.fit(module, make_loader(x, y))
    first = dict(module.__fl_meta__)
    losses_first = list(rec.task_losses)

    if same_trainer:
        trainer.fit_loop.max_epochs += 1
    else:
        trainer = make_trainer(callbacks=[callback])
    trainer.fit(module, make_loader(x, y))
    second = module.__fl_meta__
    losses_second = rec.task_losses[len(losses_first) :]

    assert source.calls == 2
    assert rec.seen_meta == [{"server.round": 1}, {"server.round": 2}]
    assert rec.count("on_round_start") == 2
    assert rec.count("on_round_end") == 2
    assert rec.count("after_step") == 8
    assert first[meta_keys.NUM_STEPS] == 4
    assert second[meta_keys.NUM_STEPS] == 4  # not 8: the step counter restarts each round
    assert len(losses_second) == 4
    assert second[meta_keys.TRAIN_LOSS] == pytest.approx(float(np.mean(losses_second)), abs=1e-6)
    assert first[meta_keys.TRAIN_LOSS] != pytest.approx(second[meta_keys.TRAIN_LOSS], abs=1e-6)  # training moved on


# --------------------------------------------------------------------------------------------------------------------
# refusals


def fake_trainer(precision: str, num_optimizers: int = 1) -> SimpleNamespace:
    params = [nn.Parameter(torch.zeros(1))]
    return SimpleNamespace(
        precision=precision, optimizers=[torch.optim.SGD(params, lr=0.1) for _ in range(num_optimizers)]
    )


@pytest.mark.parametrize("precision", ["16-mixed", "16-true", "bf16-true", "64-true", "transformer-engine"])
def test_check_trainer_supports_refuses_unsafe_precisions(precision: str):
    with pytest.raises(ClientAlgorithmError) as info:
        check_trainer_supports(ClientAlgorithm(), fake_trainer(precision), automatic_optimization=True)
    message = str(info.value)
    assert f"'{precision}'" in message
    assert "fedavg" in message
    assert "32-true" in message and "bf16-mixed" in message  # says what to use instead


@pytest.mark.parametrize("precision", ["32-true", "32", "bf16-mixed"])
def test_check_trainer_supports_accepts_safe_setups(precision: str):
    check_trainer_supports(ClientAlgorithm(), fake_trainer(precision), automatic_optimization=True)


def test_check_trainer_supports_honours_the_algorithms_own_precisions():
    class Fp32Only(ClientAlgorithm):
        name = "fp32_only"
        supported_precisions = ("32-true",)

    with pytest.raises(ClientAlgorithmError, match=r"fp32_only.*'bf16-mixed'"):
        check_trainer_supports(Fp32Only(), fake_trainer("bf16-mixed"), automatic_optimization=True)


@pytest.mark.parametrize("num_optimizers", [0, 2])
def test_check_trainer_supports_needs_exactly_one_optimizer(num_optimizers: int):
    with pytest.raises(ClientAlgorithmError, match=rf"exactly one optimizer, got {num_optimizers}"):
        check_trainer_supports(ClientAlgorithm(), fake_trainer("32-true", num_optimizers), automatic_optimization=True)


def test_check_trainer_supports_refuses_manual_optimization_directly():
    with pytest.raises(ClientAlgorithmError, match="automatic optimization"):
        check_trainer_supports(ClientAlgorithm(), fake_trainer("32-true"), automatic_optimization=False)


def _assert_refused_before_training(module: FLClassifier, rec: Recorder, before: Mapping[str, torch.Tensor]) -> None:
    assert rec.events == []  # nothing ran: no round start, no step
    for name, value in snapshot(module).items():
        assert torch.equal(value, before[name]), name


def test_fit_refuses_bf16_true():
    x, y = make_data(16)
    module = make_module()
    rec = Recorder()
    trainer = make_trainer(
        precision="bf16-true", callbacks=[FederatedAlgorithm(rec, num_samples=16, meta_source=MetaSource({}))]
    )
    with pytest.raises(ClientAlgorithmError, match=r"precision 'bf16-true'.*fp32 master weights"):
        trainer.fit(module, make_loader(x, y))
    assert rec.events == []  # refused before the round started


def test_refused_bf16_true_leaves_weights_untouched():
    x, y = make_data(16)
    module = make_module()
    rec = Recorder()
    before = snapshot(module)
    callback = FederatedAlgorithm(rec, num_samples=16, meta_source=MetaSource({}))
    with pytest.raises(ClientAlgorithmError):
        make_trainer(precision="bf16-true", callbacks=[callback]).fit(module, make_loader(x, y))
    _assert_refused_before_training(module, rec, before)
    assert all(v.dtype == torch.float32 for v in module.state_dict().values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 AMP needs a GPU; on CPU Lightning maps it to bf16")
def test_fit_refuses_16_mixed_on_gpu():
    x, y = make_data(16)
    module = make_module()
    callback = FederatedAlgorithm(num_samples=16, meta_source=MetaSource({}))
    trainer = make_trainer(accelerator="gpu", precision="16-mixed", callbacks=[callback])
    with pytest.raises(ClientAlgorithmError, match=r"precision '16-mixed'.*GradScaler"):
        trainer.fit(module, make_loader(x, y))


def test_16_mixed_refusal_message_mentions_gradscaler():
    with pytest.raises(ClientAlgorithmError, match="GradScaler skips optimizer steps"):
        check_trainer_supports(ClientAlgorithm(), fake_trainer("16-mixed"), automatic_optimization=True)


class ManualClassifier(FLClassifier):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


def test_fit_refuses_manual_optimization():
    x, y = make_data(16)
    module = make_module(cls=ManualClassifier)
    rec = Recorder()
    before = snapshot(module)
    trainer = make_trainer(callbacks=[FederatedAlgorithm(rec, num_samples=16, meta_source=MetaSource({}))])
    with pytest.raises(ClientAlgorithmError, match="automatic optimization"):
        trainer.fit(module, make_loader(x, y))
    _assert_refused_before_training(module, rec, before)


class NeedsControls(Recorder):
    name = "needs_controls"
    required_server_meta = ("scaffold.ctrl.global", "server.round")


def test_fit_refuses_missing_server_meta_naming_site_and_key():
    x, y = make_data(16)
    module = make_module()
    rec = NeedsControls()
    before = snapshot(module)
    callback = FederatedAlgorithm(rec, num_samples=16, site="site-7", meta_source=MetaSource({"server.round": 1}))
    with pytest.raises(ClientAlgorithmError) as info:
        make_trainer(callbacks=[callback]).fit(module, make_loader(x, y))
    message = str(info.value)
    assert "site-7" in message
    assert "'scaffold.ctrl.global'" in message
    assert "'server.round'" not in message  # only what is missing is listed
    assert "needs_controls" in message
    _assert_refused_before_training(module, rec, before)


def test_fit_runs_when_required_server_meta_is_present():
    x, y = make_data(16)
    module = make_module()
    rec = NeedsControls()
    meta = {"server.round": 1, "scaffold.ctrl.global": {"net.classifier.bias": torch.zeros(NUM_CLASSES)}}
    callback = FederatedAlgorithm(rec, num_samples=16, site="site-7", meta_source=MetaSource(meta))
    make_trainer(callbacks=[callback]).fit(module, make_loader(x, y))
    assert rec.count("on_round_start") == 1
    assert callback.last_meta[meta_keys.NUM_STEPS] == 2


def test_check_server_meta_directly():
    check_server_meta(NeedsControls(), {"scaffold.ctrl.global": 0, "server.round": 1}, site="site-1")
    check_server_meta(ClientAlgorithm(), {}, site="site-1")
    with pytest.raises(ClientAlgorithmError, match=r"site-3.*'scaffold\.ctrl\.global'.*'server\.round'"):
        check_server_meta(NeedsControls(), {"scaffold_c_global": 0}, site="site-3")


# --------------------------------------------------------------------------------------------------------------------
# bf16-mixed


def test_bf16_mixed_trains_with_fp32_parameters_and_gradients():
    module, rec, callback, _, _ = fit_with_recorder(n=32, precision="bf16-mixed")
    assert rec.count("correct_gradients") == 4
    assert rec.count("after_step") == 4
    assert rec.weights_changed == [True] * 4
    assert rec.grads_present == [True] * 4
    assert rec.grad_dtypes == [{torch.float32}] * 4  # corrections see fp32 gradients
    assert torch.bfloat16 in rec.logits_dtypes  # autocast was really on
    assert all(p.dtype == torch.float32 for p in module.parameters())
    assert all(v.dtype == torch.float32 for v in module.state_dict().values())
    assert callback.last_meta[meta_keys.NUM_STEPS] == 4
    assert math.isfinite(callback.last_meta[meta_keys.TRAIN_LOSS])


# --------------------------------------------------------------------------------------------------------------------
# registry


def test_build_client_algorithm_fedavg():
    algorithm = build_client_algorithm("fedavg")
    assert isinstance(algorithm, ClientAlgorithm)
    assert algorithm.name == "fedavg"
    assert not isinstance(algorithm, nn.Module)


def test_registry_names_match_class_names():
    assert "fedavg" in CLIENT_ALGORITHMS
    for name, cls in CLIENT_ALGORITHMS.items():
        assert cls.name == name
        assert issubclass(cls, ClientAlgorithm)
        assert not issubclass(cls, nn.Module)


def test_build_client_algorithm_unknown_name_lists_valid_names():
    with pytest.raises(ClientAlgorithmError) as info:
        build_client_algorithm("fedsgd-typo")
    message = str(info.value)
    assert "'fedsgd-typo'" in message
    for name in CLIENT_ALGORITHMS:
        assert name in message


def test_build_client_algorithm_bad_kwargs():
    with pytest.raises(ClientAlgorithmError, match=r"bad hyperparameters for client algorithm 'fedavg'"):
        build_client_algorithm("fedavg", mu=0.1)


def test_build_client_algorithm_passes_hyperparameters(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(CLIENT_ALGORITHMS, AddConstantToGrad.name, AddConstantToGrad)
    algorithm = build_client_algorithm("add_const", c=0.25)
    assert isinstance(algorithm, AddConstantToGrad)
    assert algorithm.c == 0.25
    with pytest.raises(ClientAlgorithmError, match="add_const"):
        build_client_algorithm("add_const")  # missing required c
    with pytest.raises(ClientAlgorithmError, match=r"add_const.*unexpected keyword argument 'd'"):
        build_client_algorithm("add_const", c=1.0, d=2.0)


# --------------------------------------------------------------------------------------------------------------------
# evaluate_classifier


class FlagProbe(nn.Module):
    """A hand-set Linear layer that records the training flag and grad mode it was called under."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0], [-1.0, 1.0, 1.5]]))
            self.linear.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        self.seen_training: list[bool] = []
        self.seen_grad: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen_training.append(self.training)
        self.seen_grad.append(torch.is_grad_enabled())
        return self.linear(x)


EVAL_X = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, -1.0]], dtype=np.float32)
EVAL_Y = np.array([0, 1, 0, 1], dtype=np.int64)


def _numpy_reference(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    w = np.array([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0], [-1.0, 1.0, 1.5]])
    b = np.array([0.1, -0.2, 0.3])
    logits = x.astype(np.float64) @ w.T + b
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    loss = float(-log_probs[np.arange(len(y)), y].mean())
    accuracy = float((logits.argmax(axis=1) == y).mean())
    return accuracy, loss


@pytest.mark.parametrize("batch_size", [1000, 3, 1])
@pytest.mark.parametrize("training", [True, False])
def test_evaluate_classifier_matches_numpy(batch_size: int, training: bool):
    model = FlagProbe()
    model.train(training)
    result = evaluate_classifier(model, EVAL_X, EVAL_Y, num_classes=3, batch_size=batch_size)
    accuracy, loss = _numpy_reference(EVAL_X, EVAL_Y)
    # By hand: logits [1.1, 0.3, -0.7], [0.1, 1.8, 1.3], [-0.9, -0.2, 1.8], [2.1, 2.3, -1.2] -> predictions 0, 1, 2, 1
    # against labels 0, 1, 0, 1: three of four right.
    assert accuracy == 0.75
    assert set(result) == {"test_accuracy", "test_loss"}
    assert result["test_accuracy"] == pytest.approx(accuracy, abs=1e-6)
    assert result["test_loss"] == pytest.approx(loss, abs=1e-6)
    assert model.training is training  # flag restored
    assert model.seen_training and not any(model.seen_training)  # evaluated in eval mode
    assert not any(model.seen_grad)  # and without autograd
    assert len(model.seen_training) == math.ceil(len(EVAL_X) / batch_size)


def test_evaluate_classifier_takes_read_only_arrays_without_a_warning():
    x, y = EVAL_X.copy(), EVAL_Y.copy()
    x.flags.writeable = y.flags.writeable = False  # as the server's test set can come
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = evaluate_classifier(FlagProbe(), x, y, num_classes=3)
    assert result["test_accuracy"] == 0.75


def test_evaluate_classifier_restores_flag_on_submodules():
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5))
    model.train()
    evaluate_classifier(model, EVAL_X, EVAL_Y, num_classes=3)
    assert all(m.training for m in model.modules())
    model.eval()
    evaluate_classifier(model, EVAL_X, EVAL_Y, num_classes=3)
    assert not any(m.training for m in model.modules())


class Exploding(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def test_evaluate_classifier_restores_flag_when_forward_raises():
    model = Exploding()
    model.train()
    with pytest.raises(RuntimeError, match="boom"):
        evaluate_classifier(model, EVAL_X, EVAL_Y, num_classes=3)
    assert model.training
