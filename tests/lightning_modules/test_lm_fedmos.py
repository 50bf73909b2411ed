"""FedMoS client: the stochastic 1-D STORM trajectory of docs/fedmos_moon.md, FedMoS (differs from SGD by hand-derived
amounts),
the authors' variant, the proximal pull, per-round momentum, a real Lightning fit against an independent reference,
BatchNorm statistics updated once per step, refusals (bad a / mu, momentum, weight decay, clipping, accumulation)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from aggregators.contracts import meta_keys
from aggregators.registry import RULES
from jobs.build import _check_composition
from lightning_modules import FLClassifier
from lightning_modules.algorithms import ClientAlgorithm, ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.fedmos import FedMoS
from tests.helpers import fit_under, small_mlp, toy_loader

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

ETA = 0.1
A_BATCH, B_BATCH = torch.tensor([1.0]), torch.tensor([-1.0])  # f_A = 1/2 (w - 1)^2, f_B = 1/2 (w + 1)^2


class OneDim(nn.Module):
    """w in R, loss of batch c = 1/2 (w - c)^2; ``task_loss`` honours ``params`` like FLClassifier's."""

    def __init__(self, w0: float = 0.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0]))

    def task_loss(self, batch: torch.Tensor, params: Mapping[str, torch.Tensor] | None = None):
        w = self.w if params is None else params["w"]
        return (0.5 * (w - batch) ** 2).sum(), None


def drive(algorithm: ClientAlgorithm, module: OneDim, batches: list[torch.Tensor], lr: float = ETA) -> list[float]:
    """The hook order of the FederatedAlgorithm callback: on_batch, forward and backward, correct, step, after."""
    optimizer = torch.optim.SGD(module.parameters(), lr=lr)
    path = []
    for batch in batches:
        optimizer.zero_grad()
        algorithm.on_batch(module, batch)
        loss, _ = module.task_loss(batch)
        loss.backward()
        algorithm.correct_gradients(module, optimizer)
        optimizer.step()
        algorithm.after_step(module, optimizer)
        path.append(module.w.item())
    return path


def run_1d(a: float, mu: float, estimator: str = "storm", w0: float = 0.0) -> list[float]:
    algorithm, module = FedMoS(a=a, mu=mu, estimator=estimator), OneDim(w0)
    algorithm.on_round_start(module, {})
    return drive(algorithm, module, [A_BATCH, B_BATCH, A_BATCH, B_BATCH])


# --------------------------------------------------------------------------------------------------------------------
# the stochastic 1-D case of docs/fedmos_moon.md, FedMoS: batches A, B, A, B; w0 = 0, eta = 0.1, a = 0.1, mu = 0


def test_storm_trajectory_matches_the_hand_derivation_and_differs_from_sgd():
    # g_A(w) = w - 1, g_B(w) = w + 1. By hand:
    # 1 (A): d1 = g_A(0) = -1                                   -> w1 = 0.1
    # 2 (B): d2 = g_B(0.1) + 0.9 (d1 - g_B(0))   = 1.1 - 1.8    = -0.7   -> w2 = 0.17
    # 3 (A): d3 = g_A(0.17) + 0.9 (d2 - g_A(0.1)) = -0.83 + 0.18 = -0.65  -> w3 = 0.235
    # 4 (B): d4 = g_B(0.235) + 0.9 (d3 - g_B(0.17)) = 1.235 - 1.638 = -0.403 -> w4 = 0.2753
    storm = run_1d(a=0.1, mu=0.0)
    assert storm == pytest.approx([0.1, 0.17, 0.235, 0.2753], abs=1e-6)
    # SGD: 0.1, 0.1 - 0.11 = -0.01, -0.01 + 0.101 = 0.091, 0.091 - 0.1091 = -0.0181.
    sgd = drive(ClientAlgorithm(), OneDim(), [A_BATCH, B_BATCH, A_BATCH, B_BATCH])
    assert sgd == pytest.approx([0.1, -0.01, 0.091, -0.0181], abs=1e-6)
    # The hand-derived gap: equal after step 1, then 0.18, 0.144, 0.2934 (a naive "previous step's own gradient"
    # recursion gives d_t = g_t, i.e. this gap would be 0 at every step).
    gap = np.array(storm) - np.array(sgd)
    np.testing.assert_allclose(gap, [0.0, 0.18, 0.144, 0.2934], atol=1e-6)


def test_a_equal_one_is_sgd():
    assert run_1d(a=1.0, mu=0.0) == pytest.approx([0.1, -0.01, 0.091, -0.0181], abs=1e-6)


def test_authors_variant_remembers_only_the_first_gradient():
    # d_t = g_t + 0.9^(t-1) g_1 with g_1 = -1:
    # 2: d2 = 1.1 - 0.9 = 0.2 -> w2 = 0.08; 3: d3 = -0.92 - 0.81 = -1.73 -> w3 = 0.253;
    # 4: d4 = 1.253 - 0.729 = 0.524 -> w4 = 0.2006.
    assert run_1d(a=0.1, mu=0.0, estimator="authors") == pytest.approx([0.1, 0.08, 0.253, 0.2006], abs=1e-6)


def numpy_fedmos_1d(a: float, mu: float, w0: float, targets: list[float], lr: float = ETA) -> list[float]:
    """Independent reference: STORM with the previous iterate on the current batch, then the proximal pull."""
    x, w, w_prev, d, path = w0, w0, None, None, []
    for c in targets:
        g = w - c
        d = g if d is None else g + (1 - a) * (d - (w_prev - c))
        w_prev, w = w, (1 - mu) * w - lr * d + mu * x
        path.append(w)
    return path


def test_proximal_pull_matches_the_closed_form():
    # mu = 0.5: 1: w1 = 0.1; 2: d2 = -0.7 -> w2 = 0.5 * 0.1 + 0.07 = 0.12;
    # 3: d3 = g_A(0.12) + 0.9 (d2 - g_A(0.1)) = -0.88 + 0.18 = -0.7 -> w3 = 0.06 + 0.07 = 0.13.
    path = run_1d(a=0.1, mu=0.5)
    assert path[:3] == pytest.approx([0.1, 0.12, 0.13], abs=1e-6)
    assert path == pytest.approx(numpy_fedmos_1d(0.1, 0.5, 0.0, [1, -1, 1, -1]), abs=1e-6)


def test_pull_goes_to_the_round_start_model_from_a_moved_start():
    path = run_1d(a=0.3, mu=0.2, w0=2.0)
    assert path == pytest.approx(numpy_fedmos_1d(0.3, 0.2, 2.0, [1, -1, 1, -1]), abs=1e-6)


def test_momentum_is_per_round():
    # Round 2 starts again from d_1 = g_1: its first step is plain SGD plus a zero pull (w = x at the start).
    algorithm, module = FedMoS(a=0.1, mu=0.3), OneDim()
    algorithm.on_round_start(module, {})
    drive(algorithm, module, [A_BATCH, B_BATCH])
    w_start = module.w.item()
    algorithm.on_round_start(module, {})
    assert drive(algorithm, module, [B_BATCH]) == pytest.approx([w_start - ETA * (w_start + 1)], abs=1e-6)
    assert algorithm.steps == 1


# --------------------------------------------------------------------------------------------------------------------
# hyperparameters and refusals


@pytest.mark.parametrize("a", [0, -0.1, 1.5, float("nan"), True, "0.1"])
def test_bad_a_is_rejected(a):
    with pytest.raises(ClientAlgorithmError, match="'a' must be a finite number in \\(0, 1\\]"):
        FedMoS(a=a)


@pytest.mark.parametrize("mu", [1, 1.0, -0.01, float("inf"), None])
def test_bad_mu_is_rejected(mu):
    with pytest.raises(ClientAlgorithmError, match="'mu' must be a finite number in \\[0, 1\\)"):
        FedMoS(mu=mu)


def test_defaults_meta_and_unknown_estimator():
    algorithm = build_client_algorithm("fedmos")
    assert algorithm.hparams() == {"a": 0.1, "mu": 0.001, "estimator": "storm"}
    assert algorithm.on_round_end(None) == {meta_keys.FEDMOS_A: 0.1, meta_keys.FEDMOS_MU: 0.001}
    with pytest.raises(ClientAlgorithmError, match="estimator"):
        FedMoS(estimator="plato")


@pytest.mark.parametrize("settings", [{"momentum": 0.9}, {"weight_decay": 1e-4}, {"momentum": 0.5, "nesterov": True}])
def test_optimizer_with_momentum_or_weight_decay_is_refused(settings):
    algorithm, module = FedMoS(), OneDim()
    algorithm.on_round_start(module, {})
    optimizer = torch.optim.SGD(module.parameters(), lr=ETA, **settings)
    module.task_loss(A_BATCH)[0].backward()
    with pytest.raises(ClientAlgorithmError, match="momentum=0 and weight_decay=0"):
        algorithm.correct_gradients(module, optimizer)


def test_fedmos_composes_with_fedavg_and_fedmos_rules():
    _check_composition(FedMoS, RULES["fedavg"])
    _check_composition(FedMoS, RULES["fedmos"])


# --------------------------------------------------------------------------------------------------------------------
# real Lightning fits of FLClassifier

IN_FEATURES, NUM_CLASSES, LR = 12, 4, 0.2


def make_loader() -> DataLoader:
    return toy_loader(IN_FEATURES, NUM_CLASSES)


def make_module(**kw: Any) -> FLClassifier:
    return small_mlp(IN_FEATURES, NUM_CLASSES, lr=LR, **kw)


def fit(module: FLClassifier, algorithm: ClientAlgorithm, **trainer_kw: Any) -> FLClassifier:
    return fit_under(algorithm, module, make_loader(), {meta_keys.ROUND: 0}, **trainer_kw)


def reference_fit(a: float, mu: float) -> dict[str, torch.Tensor]:
    """Independent reference on a plain copy of the network: explicit STORM recursion with autograd."""
    net = make_module().net
    names = [n for n, _ in net.named_parameters()]
    w = {n: p.detach().clone() for n, p in net.named_parameters()}
    x, w_prev, d = dict(w), None, None

    def grad_at(params: dict[str, torch.Tensor], xb: torch.Tensor, yb: torch.Tensor) -> dict[str, torch.Tensor]:
        leaves = {n: t.clone().requires_grad_(True) for n, t in params.items()}
        loss = F.cross_entropy(torch.func.functional_call(net, leaves, (xb,)), yb)
        return dict(zip(names, torch.autograd.grad(loss, [leaves[n] for n in names]), strict=True))

    for xb, yb in make_loader():
        g = grad_at(w, xb, yb)
        if d is None:
            d = g
        else:
            g_prev = grad_at(w_prev, xb, yb)
            d = {n: g[n] + (1 - a) * (d[n] - g_prev[n]) for n in names}
        w_prev = w
        w = {n: (1 - mu) * w[n] - LR * d[n] + mu * x[n] for n in names}
    return {f"net.{n}": t for n, t in w.items()}


def test_lightning_fit_matches_an_independent_reference():
    a, mu = 0.2, 0.05
    module = fit(make_module(), FedMoS(a=a, mu=mu))
    expected = reference_fit(a, mu)
    got = {k: v.detach() for k, v in module.state_dict().items()}
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=0)
    # ... and the comparison separates FedMoS from plain SGD on this data.
    sgd = fit(make_module(), ClientAlgorithm()).state_dict()
    assert max((sgd[k] - expected[k]).abs().max().item() for k in expected) > 1e-3
    assert module.__fl_meta__[meta_keys.FEDMOS_A] == a
    assert module.__fl_meta__[meta_keys.NUM_STEPS] == 5


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(IN_FEATURES, 8)
        self.bn = nn.BatchNorm1d(8)
        self.classifier = nn.Linear(8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.bn(self.fc(x))))


def test_batchnorm_statistics_are_updated_once_per_step():
    module = make_module()
    module.net = BatchNormNet()
    algorithm = FedMoS()
    fit(module, algorithm)
    assert algorithm.steps == 5
    assert int(module.net.bn.num_batches_tracked) == 5  # the second pass runs on copies of the buffers


def test_state_is_fp32_trainable_only_and_bf16_mixed_runs():
    algorithm = FedMoS(a=0.5, mu=0.01)
    module = fit(make_module(), algorithm, precision="bf16-mixed")
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    for state in (algorithm.x, algorithm.d, algorithm.prev):
        assert set(state) == trainable
        assert {t.dtype for t in state.values()} == {torch.float32}
    assert all(torch.isfinite(v).all() for v in module.state_dict().values())


@pytest.mark.parametrize(
    ("module_kw", "trainer_kw", "match"),
    [
        ({"momentum": 0.9}, {}, "momentum=0 and weight_decay=0"),
        ({"weight_decay": 1e-3}, {}, "momentum=0 and weight_decay=0"),
        ({}, {"gradient_clip_val": 1.0}, "gradient clipping"),
        ({}, {"accumulate_grad_batches": 2}, "accumulate_grad_batches=1"),
    ],
)
def test_fit_refuses_settings_that_change_the_update(module_kw, trainer_kw, match):
    with pytest.raises(ClientAlgorithmError, match=match):
        fit(make_module(**module_kw), FedMoS(), **trainer_kw)
