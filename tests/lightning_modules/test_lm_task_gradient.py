"""task_gradient, the one helper for the task loss and its gradient at other weights: a closed-form linear model,
buffers untouched, dropout off, zeros outside the graph, the trainer's precision context."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_modules.algorithms import ClientAlgorithmError
from lightning_modules.algorithms.task_gradient import task_gradient

X = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
Y = torch.tensor([1.0, 0.0])
W, B = torch.tensor([[0.5, -1.0]]), torch.tensor([0.25])
# Loss 1/2 mean((w.x + b - y)^2). Residuals at (W, B): 0.5 - 2 + 0.25 - 1 = -2.25 and 1.5 + 1 + 0.25 - 0 = 2.75;
# loss = 1/2 (5.0625 + 7.5625) / 2 = 3.15625; dL/dw = mean(r x) = ((-2.25, -4.5) + (8.25, -2.75)) / 2 = (3, -3.625);
# dL/db = mean(r) = 0.25.
LOSS, GRAD_W, GRAD_B = 3.15625, torch.tensor([[3.0, -3.625]]), torch.tensor([0.25])


class Linear(nn.Module):
    """A linear regression behind a dropout layer (p = 0.5: on, it would change the gradient), with buffers the
    forward changes (BatchNorm statistics of the input, a call counter) and a parameter outside the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout = nn.Dropout(0.5)
        self.fc = nn.Linear(2, 1)
        self.bn = nn.BatchNorm1d(2, affine=False)
        self.unused = nn.Parameter(torch.ones(3))
        self.register_buffer("calls", torch.zeros(()))
        self.precision_seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        self.bn(x)  # updates the running statistics in training mode; its output is not used
        return self.fc(self.dropout(x)).squeeze(-1)

    def task_loss(self, batch, params: Mapping[str, torch.Tensor] | None = None):
        self.precision_seen.append(torch.is_autocast_enabled("cpu"))
        x, y = batch
        pred = self(x) if params is None else torch.func.functional_call(self, dict(params), (x,))
        return 0.5 * ((pred - y) ** 2).mean(), pred


def at_weights(w: torch.Tensor, b: torch.Tensor) -> Linear:
    module = Linear()
    with torch.no_grad():
        module.fc.weight.copy_(w)
        module.fc.bias.copy_(b)
    return module.train()


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.named_buffers()}


def assert_closed_form(loss: torch.Tensor, grads: Mapping[str, torch.Tensor]) -> None:
    assert float(loss) == pytest.approx(LOSS, abs=1e-6)
    torch.testing.assert_close(grads["fc.weight"], GRAD_W, atol=1e-6, rtol=0)
    torch.testing.assert_close(grads["fc.bias"], GRAD_B, atol=1e-6, rtol=0)
    assert {g.dtype for g in grads.values()} == {torch.float32}


def test_the_gradient_at_given_weights_is_the_hand_derived_one_and_the_module_is_untouched():
    module = at_weights(torch.tensor([[2.0, 3.0]]), torch.tensor([-1.0]))  # its own weights: elsewhere
    before, own = buffers(module), {n: p.detach().clone() for n, p in module.named_parameters()}
    params = {"fc.weight": W.clone(), "fc.bias": B.clone(), "unused": torch.ones(3)}
    loss, grads = task_gradient(module, (X, Y), params)
    assert_closed_form(loss, grads)
    assert set(grads) == set(params)
    torch.testing.assert_close(grads["unused"], torch.zeros(3), atol=0, rtol=0)  # outside the graph: zeros
    for name, value in buffers(module).items():  # BatchNorm statistics and the counter: as they were
        torch.testing.assert_close(value, before[name], atol=0, rtol=0)
    for name, p in module.named_parameters():  # its weights and .grad: untouched
        torch.testing.assert_close(p.detach(), own[name], atol=0, rtol=0)
        assert p.grad is None
    assert not params["fc.weight"].requires_grad  # the caller's tensors stay plain
    assert module.dropout.training and module.bn.training  # dropout back on after the pass


def test_the_gradient_at_the_modules_own_weights_and_a_subset_of_names():
    module = at_weights(W, B)
    before = buffers(module)
    loss, grads = task_gradient(module, (X, Y))
    assert_closed_form(loss, grads)
    assert set(grads) == {"fc.weight", "fc.bias", "unused"}
    torch.testing.assert_close(grads["unused"], torch.zeros(3), atol=0, rtol=0)
    assert all(torch.equal(value, before[name]) for name, value in buffers(module).items())
    _, only_bias = task_gradient(module, (X, Y), names=["fc.bias"])
    assert set(only_bias) == {"fc.bias"}
    torch.testing.assert_close(only_bias["fc.bias"], GRAD_B, atol=1e-6, rtol=0)


def test_dropout_is_off_during_the_pass_and_draws_no_random_numbers():
    # Dropout p = 0.5 on the two inputs would scale or drop them: the closed form holds only with dropout off.
    module = at_weights(W, B)
    torch.manual_seed(0)
    for _ in range(3):
        torch.testing.assert_close(task_gradient(module, (X, Y))[1]["fc.weight"], GRAD_W, atol=1e-6, rtol=0)
    after_passes = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), after_passes)  # the passes drew nothing: the training's masks are unchanged
    assert module.dropout.training


class RecordingPrecision:
    """A stand-in for Lightning's precision plugin: its forward context is CPU autocast in bfloat16."""

    def __init__(self) -> None:
        self.entered = 0

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        self.entered += 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield


def test_the_pass_runs_in_the_trainers_precision_context_and_returns_fp32():
    module = at_weights(W, B)
    task_gradient(module, (X, Y))
    assert module.precision_seen == [False]  # no trainer: no context
    plugin = RecordingPrecision()
    module._trainer = SimpleNamespace(precision_plugin=plugin)
    _, grads = task_gradient(module, (X, Y), {"fc.weight": W.clone(), "fc.bias": B.clone()})
    assert plugin.entered == 1 and module.precision_seen[-1] is True
    assert {g.dtype for g in grads.values()} == {torch.float32}
    torch.testing.assert_close(grads["fc.weight"], GRAD_W, atol=0.05, rtol=0)  # bf16 numerics, same gradient


def test_an_unknown_name_is_refused_by_name():
    with pytest.raises(ClientAlgorithmError, match=r"'fc\.gain' is no parameter of the module"):
        task_gradient(at_weights(W, B), (X, Y), names=["fc.gain"])
    with pytest.raises(ClientAlgorithmError, match=r"'fc\.gain' is no entry of params"):
        task_gradient(at_weights(W, B), (X, Y), {"fc.weight": W}, names=["fc.gain"])
