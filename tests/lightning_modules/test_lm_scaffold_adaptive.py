"""SCAFFOLD with adaptive optimizers: the gradients estimator of c_i+, the correction inside Adam's moments, and the
choice by optimizer ("auto"), against hand computations and plain-torch reference loops."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from aggregators.contracts import meta_keys
from jobs import build
from lightning_modules import FederatedAlgorithm
from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.scaffold import resolve_correction, resolve_estimator
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

LRS = [0.1, 0.05, 0.02, 0.08]  # a schedule: the estimators must weight by the rates actually applied
RNG = np.random.default_rng(3)
INPUTS = RNG.normal(size=(len(LRS), 5, 3)).astype(np.float32)  # one batch of 5 samples per step
TARGETS = RNG.normal(size=(len(LRS), 5, 2)).astype(np.float32)
W0 = RNG.normal(size=(2, 3)).astype(np.float32)
B0 = RNG.normal(size=2).astype(np.float32)
C_GLOBAL = {"weight": RNG.normal(size=(2, 3)).astype(np.float32), "bias": RNG.normal(size=2).astype(np.float32)}


def linear() -> nn.Linear:
    module = nn.Linear(3, 2)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(W0))
        module.bias.copy_(torch.from_numpy(B0))
    return module


def loss_of(module: nn.Module, step: int, scale: float = 1.0) -> torch.Tensor:
    """scale * 0.5 * mean over the batch of ||W u + b - t||^2."""
    residual = module(torch.from_numpy(INPUTS[step])) - torch.from_numpy(TARGETS[step])
    return scale * 0.5 * (residual**2).sum(dim=1).mean()


def make(folder, **hparams):
    algorithm = build_client_algorithm("scaffold", **hparams)
    algorithm.bind("site-1", ClientStateStore(folder, "site-1"))
    return algorithm


def meta(control=None, round_num=0):
    return {meta_keys.SCAFFOLD_CTRL_GLOBAL: control or {}, meta_keys.ROUND: round_num, meta_keys.RUN_ID: "run"}


def local_round(algorithm, optimizer_cls, control=None, round_num=0, scale=1.0, **optimizer_args):
    """The hooks in the order the FederatedAlgorithm callback drives them, over LRS; returns module, optimizer, diff."""
    module = linear()
    optimizer = optimizer_cls(module.parameters(), lr=LRS[0], **optimizer_args)
    algorithm.on_round_start(module, meta(control, round_num))
    for step, lr in enumerate(LRS):
        optimizer.param_groups[0]["lr"] = lr
        optimizer.zero_grad()
        loss_of(module, step, scale).backward()
        algorithm.correct_gradients(module, optimizer)
        optimizer.step()
        algorithm.after_step(module, optimizer)
    diff = algorithm.on_round_end(module)[meta_keys.SCAFFOLD_CTRL_DIFF]
    return module, optimizer, diff


def numpy_gradients(w, b, step):
    """d/dW and d/db of 0.5 * mean ||W u + b - t||^2, by hand."""
    residual = INPUTS[step].astype(np.float64) @ w.T + b - TARGETS[step]
    return residual.T @ INPUTS[step] / len(residual), residual.mean(axis=0)


# -- the identity under plain SGD -----------------------------------------------------------------------------------
@pytest.mark.parametrize("correction", ["step", "grad"])
def test_under_plain_sgd_both_estimators_give_the_same_control_over_two_rounds(tmp_path, correction):
    """(x - y) / sum eta_k = sum eta_k (g_k + c - c_i) / sum eta_k: Option II's c_i+ is the lr-weighted mean of the
    raw gradients. Round 2 starts from each site's own stored c_i and a nonzero c."""
    diffs, weights = {}, {}
    for estimator in ("displacement", "gradients"):
        folder = tmp_path / estimator
        _, _, first = local_round(make(folder, estimator=estimator, correction=correction), torch.optim.SGD)
        module, _, second = local_round(
            make(folder, estimator=estimator, correction=correction), torch.optim.SGD, C_GLOBAL, round_num=1
        )
        diffs[estimator], weights[estimator] = (first, second), module.weight.detach().numpy()
    for round_index in range(2):
        for name in ("weight", "bias"):
            np.testing.assert_allclose(
                diffs["gradients"][round_index][name], diffs["displacement"][round_index][name], atol=1e-6, rtol=0
            )
    np.testing.assert_allclose(weights["gradients"], weights["displacement"], atol=1e-6, rtol=0)


def test_the_gradients_control_is_the_lr_weighted_mean_of_the_raw_gradients_under_sgd(tmp_path):
    _, _, diff = local_round(make(tmp_path, estimator="gradients"), torch.optim.SGD, C_GLOBAL)
    w, b = W0.astype(np.float64), B0.astype(np.float64)
    sum_w, sum_b = np.zeros_like(w), np.zeros_like(b)
    for step, lr in enumerate(LRS):
        grad_w, grad_b = numpy_gradients(w, b, step)
        sum_w, sum_b = sum_w + lr * grad_w, sum_b + lr * grad_b
        w, b = w - lr * (grad_w + C_GLOBAL["weight"]), b - lr * (grad_b + C_GLOBAL["bias"])  # c_i = 0
    np.testing.assert_allclose(diff["weight"], sum_w / sum(LRS), atol=1e-6, rtol=0)
    np.testing.assert_allclose(diff["bias"], sum_b / sum(LRS), atol=1e-6, rtol=0)


# -- AdamW ----------------------------------------------------------------------------------------------------------
def numpy_adamw_round(c_minus_ci, betas=(0.9, 0.999), eps=1e-8, decay=0.01):
    """Independent reference: AdamW (Loshchilov & Hutter; torch's defaults) on g_k + (c - c_i), and
    c_i+ = sum eta_k g_k / sum eta_k over the raw g_k."""
    params = [W0.astype(np.float64), B0.astype(np.float64)]
    keys = ("weight", "bias")
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    weighted = [np.zeros_like(p) for p in params]
    for step, lr in enumerate(LRS):
        raw = numpy_gradients(*params, step)
        for i, key in enumerate(keys):
            weighted[i] += lr * raw[i]
            corrected = raw[i] + c_minus_ci[key]
            m[i] = betas[0] * m[i] + (1 - betas[0]) * corrected
            v[i] = betas[1] * v[i] + (1 - betas[1]) * corrected**2
            m_hat, v_hat = m[i] / (1 - betas[0] ** (step + 1)), v[i] / (1 - betas[1] ** (step + 1))
            params[i] = params[i] * (1 - lr * decay) - lr * m_hat / (np.sqrt(v_hat) + eps)
    controls = {key: weighted[i] / sum(LRS) for i, key in enumerate(keys)}
    return dict(zip(keys, params, strict=True)), controls


def test_the_gradients_estimator_under_adamw_equals_a_numpy_computation(tmp_path):
    module, _, diff = local_round(make(tmp_path), torch.optim.AdamW, C_GLOBAL, weight_decay=0.01)  # "auto"
    weights, controls = numpy_adamw_round(C_GLOBAL)  # c_i = 0 in the first round: c - c_i = c
    for name in ("weight", "bias"):
        np.testing.assert_allclose(diff[name], controls[name], atol=1e-6, rtol=0)
        np.testing.assert_allclose(getattr(module, name).detach().numpy(), weights[name], atol=1e-6, rtol=0)


def test_the_correction_enters_adams_moments_as_a_plain_torch_loop_adding_it_to_the_gradient(tmp_path):
    module, optimizer, _ = local_round(make(tmp_path), torch.optim.AdamW, C_GLOBAL, weight_decay=0.01)
    reference = linear()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LRS[0], weight_decay=0.01)
    for step, lr in enumerate(LRS):
        reference_optimizer.param_groups[0]["lr"] = lr
        reference_optimizer.zero_grad()
        loss_of(reference, step).backward()
        for name, p in reference.named_parameters():
            p.grad.add_(torch.from_numpy(C_GLOBAL[name]))
        reference_optimizer.step()
    for (name, p), q in zip(module.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][moment], reference_optimizer.state[q][moment]), (name, moment)
    after_step, _, _ = local_round(make(tmp_path / "step", correction="step"), torch.optim.AdamW, C_GLOBAL)
    assert not torch.allclose(after_step.weight, module.weight)  # the post-step correction is another algorithm


def test_under_adam_the_gradients_control_is_in_gradient_units_and_the_displacement_is_not(tmp_path, caplog):
    """Adam is invariant to the loss's scale, so the displacement (x - y) / sum eta stays about one unit per weight
    when the gradients are 1000 times smaller; the gradients estimator scales with them (the issue's ||c|| of
    163-614 against about 2)."""
    _, _, gradients = local_round(make(tmp_path / "g"), torch.optim.Adam, scale=1e-3)
    with caplog.at_level(logging.WARNING):
        _, _, displacement = local_round(make(tmp_path / "d", estimator="displacement"), torch.optim.Adam, scale=1e-3)
    _, controls = numpy_adamw_round({"weight": 0.0, "bias": 0.0}, decay=0.0)
    # The same path to Adam's eps (1e-8 against sqrt(v) of about 1e-3 moves it by about 1e-5 relative).
    np.testing.assert_allclose(gradients["weight"], 1e-3 * controls["weight"], atol=1e-7, rtol=0)
    assert np.abs(gradients["weight"]).max() < 1e-2 < 0.3 < np.abs(displacement["weight"]).min()
    assert "estimator='displacement' with Adam: c_i then measures the optimizer's steps" in caplog.text


def test_the_displacement_estimator_stays_selectable_under_adamw_and_is_todays_option_ii(tmp_path):
    module, _, diff = local_round(make(tmp_path, estimator="displacement"), torch.optim.AdamW, C_GLOBAL)
    reference = linear()
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LRS[0])
    for step, lr in enumerate(LRS):  # today's default: the normal step, then y <- y - eta_k (c - c_i)
        reference_optimizer.param_groups[0]["lr"] = lr
        reference_optimizer.zero_grad()
        loss_of(reference, step).backward()
        reference_optimizer.step()
        with torch.no_grad():
            for name, p in reference.named_parameters():
                p.sub_(lr * torch.from_numpy(C_GLOBAL[name]))
    for name, p in reference.named_parameters():
        torch.testing.assert_close(getattr(module, name), p, atol=1e-7, rtol=0)
        expected = (getattr(linear(), name) - p).detach().numpy() / sum(LRS) - C_GLOBAL[name]
        np.testing.assert_allclose(diff[name], expected, atol=1e-5, rtol=0)


# -- the choice by optimizer ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("optimizer_cls", "args", "estimator"),
    [
        (torch.optim.SGD, {}, "displacement"),
        (torch.optim.SGD, {"momentum": 0.9}, "displacement"),  # today's behaviour for every SGD
        (torch.optim.Adam, {}, "gradients"),
        (torch.optim.AdamW, {}, "gradients"),
        (torch.optim.Adagrad, {}, "gradients"),
        (torch.optim.RMSprop, {}, "gradients"),
    ],
)
def test_auto_picks_the_estimator_and_the_correction_by_optimizer(optimizer_cls, args, estimator):
    optimizer = optimizer_cls(linear().parameters(), lr=0.1, **args)
    assert resolve_estimator("auto", optimizer) == estimator
    assert resolve_correction("auto", estimator) == ("grad" if estimator == "gradients" else "step")
    assert resolve_estimator("displacement", optimizer) == "displacement"
    assert resolve_correction("step", "gradients") == "step"


def test_under_sgd_the_default_is_bit_identical_to_todays_displacement_and_post_step_correction(tmp_path):
    default, _, default_diff = local_round(make(tmp_path / "a"), torch.optim.SGD, C_GLOBAL, momentum=0.9)
    explicit, _, explicit_diff = local_round(
        make(tmp_path / "b", estimator="displacement", correction="step"), torch.optim.SGD, C_GLOBAL, momentum=0.9
    )
    assert torch.equal(default.weight, explicit.weight) and torch.equal(default.bias, explicit.bias)
    assert all(np.array_equal(default_diff[name], explicit_diff[name]) for name in ("weight", "bias"))


def test_option_i_takes_no_estimator_and_an_unknown_one_is_refused():
    with pytest.raises(ClientAlgorithmError, match=r"scaffold: hyperparameter 'estimator' must be 'auto' with option"):
        build_client_algorithm("scaffold", option="I", estimator="gradients")
    with pytest.raises(ClientAlgorithmError, match=r"'estimator' must be one of \['auto', 'gradients', 'displacement'"):
        build_client_algorithm("scaffold", estimator="adam")


def test_a_bad_estimator_is_refused_at_build_time_in_one_line_and_nothing_is_written(tmp_path, capsys):
    argv = ["--client", "scaffold", "--server", "scaffold", "--client-args", '{"estimator": "adam"}']
    assert build.main([*argv, "--name", "bad", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "'estimator' must be one of ['auto', 'gradients', 'displacement']" in err and "'adam'" in err
    assert not any(tmp_path.iterdir())


# -- inside a Lightning fit -----------------------------------------------------------------------------------------
class AdamWModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = linear()

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        return 0.5 * ((self.net(inputs) - targets) ** 2).sum(dim=1).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class RawGradients(pl.Callback):
    """Placed before FederatedAlgorithm: sees each step's gradient before SCAFFOLD adds c - c_i."""

    def __init__(self) -> None:
        self.seen: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen.append({name: p.grad.detach().clone() for name, p in pl_module.named_parameters()})


def test_in_a_fit_with_adamw_and_gradient_clipping_the_control_is_the_mean_unclipped_gradient(tmp_path):
    """The gradients estimator's control does not depend on what clipping does to the step, so clipping is allowed
    with it (the displacement estimator refuses correction='grad' with clipping)."""
    torch.manual_seed(0)
    module, recorder = AdamWModule(), RawGradients()
    algorithm = make(tmp_path)
    control = {f"net.{name}": value for name, value in C_GLOBAL.items()}
    callback = FederatedAlgorithm(algorithm, num_samples=20, site="site-1", meta_source=lambda: meta(control))
    data = torch.utils.data.TensorDataset(
        torch.from_numpy(INPUTS.reshape(-1, 3)), torch.from_numpy(TARGETS.reshape(-1, 2))
    )
    trainer = quiet_trainer(1, [recorder, callback], gradient_clip_val=0.01)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=5))
    assert (algorithm.used_estimator, algorithm.used_correction) == ("gradients", "grad") and len(recorder.seen) == 4
    diff = callback.last_meta[meta_keys.SCAFFOLD_CTRL_DIFF]
    for name in control:
        mean = torch.stack([seen[name] for seen in recorder.seen]).mean(dim=0)  # constant lr: the plain mean
        np.testing.assert_allclose(diff[name], mean.numpy(), atol=1e-6, rtol=0)
