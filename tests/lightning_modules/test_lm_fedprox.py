"""FedProx client: the closed form of docs/algorithms.md, FedProx, hook path == explicit squared-norm loss, mu = 0 is
FedAvg
bit for bit (real Lightning fits), buffers untouched, meta, composition and bad mu."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from aggregators.contracts import meta_keys
from aggregators.registry import RULES
from jobs.build import PRESETS, JobSpec, _check_composition
from lightning_modules.algorithms import ClientAlgorithm, ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.fedprox import FedProx
from tests.helpers import Quadratic, fit_under, small_mlp, toy_loader, weights

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*precision=.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

ETA = 0.1
IN_FEATURES, NUM_CLASSES = 12, 4


def prox_steps(algorithm: ClientAlgorithm, module: Quadratic, target: float, steps: int) -> list[float]:
    """Drive the hooks as the FederatedAlgorithm callback does, on F(w) = 1/2 (w - target)^2."""
    optimizer = torch.optim.SGD([module.w], lr=ETA)
    path = []
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * (module.w - target) ** 2).sum().backward()
        algorithm.correct_gradients(module, optimizer)
        optimizer.step()
        algorithm.after_step(module, optimizer)
        path.append(module.w.item())
    return path


def numpy_prox_path(w0: float, w_t: float, target: float, mu: float, lr: float, steps: int) -> list[float]:
    """Independent reference: w <- w - lr * (grad F(w) + mu * (w - w_t)), the gradient of the squared prox term."""
    w, path = w0, []
    for _ in range(steps):
        w = w - lr * ((w - target) + mu * (w - w_t))
        path.append(w)
    return path


# --------------------------------------------------------------------------------------------------------------------
# closed form and the hooks alone


def test_closed_form_two_sgd_steps():
    # docs/algorithms.md, FedProx: F(w) = 1/2 (w - 1)^2, w_t = 0, eta = 0.1, mu = 1.
    # Step 1 at w = w_t: the prox gradient is exactly 0 -> w = 0 - 0.1 * (-1) = 0.1.
    # Step 2: grad = (0.1 - 1) + 1 * 0.1 = -0.8 -> w = 0.1 + 0.08 = 0.18.
    algorithm = FedProx(mu=1.0)
    module = Quadratic(0.0)
    algorithm.on_round_start(module, {})
    path = prox_steps(algorithm, module, target=1.0, steps=2)
    assert path == pytest.approx([0.1, 0.18], abs=1e-6)
    assert path == pytest.approx(numpy_prox_path(0.0, 0.0, 1.0, mu=1.0, lr=ETA, steps=2), abs=1e-6)


def test_longer_path_from_a_moved_start_matches_the_reference():
    # Round starts at w_t = -0.5; six steps towards target 2 with mu = 0.3.
    algorithm = FedProx(mu=0.3)
    module = Quadratic(-0.5)
    algorithm.on_round_start(module, {})
    path = prox_steps(algorithm, module, target=2.0, steps=6)
    assert path == pytest.approx(numpy_prox_path(-0.5, -0.5, 2.0, mu=0.3, lr=ETA, steps=6), abs=1e-6)


def test_no_nan_at_the_anchor_and_first_gradient_is_the_task_gradient():
    algorithm = FedProx(mu=5.0)
    module = Quadratic(0.25)
    algorithm.on_round_start(module, {})
    module.w.grad = torch.tensor([-0.75])
    algorithm.correct_gradients(module, torch.optim.SGD([module.w], lr=ETA))
    assert torch.isfinite(module.w.grad).all()
    assert module.w.grad.item() == -0.75  # w == w_t: the squared term has zero gradient (no sqrt, no NaN)


def test_buffers_and_frozen_parameters_are_untouched():
    algorithm = FedProx(mu=1.0)
    module = Quadratic(0.0)
    algorithm.on_round_start(module, {})
    assert set(algorithm.anchor) == {"w"}
    prox_steps(algorithm, module, target=1.0, steps=3)
    assert module.running_mean.item() == 7.0
    assert module.frozen.item() == 2.0 and module.frozen.grad is None


def test_anchor_is_a_detached_fp32_copy_retaken_every_round():
    algorithm = FedProx(mu=1.0)
    module = Quadratic(0.5).to(torch.bfloat16)
    module.w.data = module.w.data.float()  # bf16-mixed keeps fp32 master weights
    algorithm.on_round_start(module, {})
    assert algorithm.anchor["w"].dtype == torch.float32 and not algorithm.anchor["w"].requires_grad
    module.w.data.fill_(3.0)  # training moves the weights; the snapshot must not follow
    assert algorithm.anchor["w"].item() == 0.5
    algorithm.on_round_start(module, {})  # next round: the newly received model
    assert algorithm.anchor["w"].item() == 3.0


def test_low_precision_gradients_get_the_term_in_their_own_dtype():
    algorithm = FedProx(mu=2.0)
    module = Quadratic(1.0).to(torch.bfloat16)
    algorithm.on_round_start(module, {})
    module.w.data.fill_(1.5)
    module.w.grad = torch.tensor([0.25], dtype=torch.bfloat16)
    algorithm.correct_gradients(module, torch.optim.SGD([module.w], lr=ETA))
    assert module.w.grad.dtype == torch.bfloat16
    assert module.w.grad.item() == 0.25 + 2.0 * 0.5


def test_round_end_reports_mu_under_a_namespaced_key():
    algorithm = build_client_algorithm("fedprox", mu=0.2)
    algorithm.on_round_start(Quadratic(0.0), {})
    meta = algorithm.on_round_end(Quadratic(0.0))
    assert meta == {meta_keys.FEDPROX_MU: 0.2} and meta_keys.FEDPROX_MU == "fedprox.mu"
    assert meta_keys.is_namespaced(meta_keys.FEDPROX_MU) and "fedprox_mu" not in meta


def test_default_mu_and_hparams():
    algorithm = build_client_algorithm("fedprox")
    assert isinstance(algorithm, FedProx) and algorithm.mu == 0.01 and algorithm.hparams() == {"mu": 0.01}
    assert FedProx(mu=1).mu == 1.0 and FedProx(mu=0).mu == 0.0


@pytest.mark.parametrize("mu", [-0.1, math.nan, math.inf, -math.inf, "0.1", True, None, [0.1]])
def test_bad_mu_is_rejected_by_name(mu):
    with pytest.raises(ClientAlgorithmError, match=r"fedprox: hyperparameter 'mu'"):
        build_client_algorithm("fedprox", mu=mu)


def test_unknown_hyperparameter_is_rejected():
    with pytest.raises(ClientAlgorithmError, match="bad hyperparameters for client algorithm 'fedprox'"):
        build_client_algorithm("fedprox", mu=0.1, alpha=0.1)


def test_composes_with_the_fedavg_rule_and_has_a_preset():
    _check_composition(FedProx, RULES["fedavg"])  # no server rule of its own: FedAvg is FedProx's server
    assert FedProx.required_server_meta == ()
    spec = PRESETS["fedprox"]
    assert (spec.client, spec.server, spec.client_args) == ("fedprox", "fedavg", {"mu": 0.01})
    shared = {f.name for f in fields(JobSpec)} - {"name", "client", "client_args", "server", "server_args"}
    assert all(getattr(spec, f) == getattr(PRESETS["fedavg"], f) for f in shared)  # same data, model and training


# --------------------------------------------------------------------------------------------------------------------
# real Lightning fits of FLClassifier


class ExplicitProxLoss(ClientAlgorithm):
    """Test-only reference: (mu/2) * ||w - w_t||^2 written as a loss term and differentiated by autograd."""

    name = "explicit_prox"

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        self.w_t = {n: p.detach().clone() for n, p in module.named_parameters()}

    def loss_terms(self, module: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor:
        return 0.5 * self.mu * sum(((p - self.w_t[n]) ** 2).sum() for n, p in module.named_parameters())


def fit(algorithm: ClientAlgorithm, *, momentum: float = 0.0, weight_decay: float = 0.0, epochs: int = 2, **kw):
    """Two epochs of FLClassifier (mlp) on 40 random samples, shuffled by a fixed generator; returns the module."""
    loader = toy_loader(IN_FEATURES, NUM_CLASSES)
    torch.manual_seed(0)
    module = small_mlp(IN_FEATURES, NUM_CLASSES, momentum=momentum, weight_decay=weight_decay)
    return fit_under(algorithm, module, loader, {meta_keys.ROUND: 0}, max_epochs=epochs, **kw)


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 1e-2)])
def test_mu_zero_is_fedavg_bit_for_bit(momentum, weight_decay):
    fedavg = weights(fit(ClientAlgorithm(), momentum=momentum, weight_decay=weight_decay))
    prox0 = weights(fit(FedProx(mu=0.0), momentum=momentum, weight_decay=weight_decay))
    assert set(fedavg) == set(prox0)
    assert all(torch.equal(fedavg[k], prox0[k]) for k in fedavg)
    # The same set-up with mu > 0 really takes another path (the hook is live in this fit).
    prox = weights(fit(FedProx(mu=0.5), momentum=momentum, weight_decay=weight_decay))
    assert not all(torch.equal(fedavg[k], prox[k]) for k in fedavg)


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 1e-2)])
def test_hook_path_equals_the_explicit_squared_norm_loss(momentum, weight_decay):
    mu = 0.7
    hook = weights(fit(FedProx(mu=mu), momentum=momentum, weight_decay=weight_decay))
    explicit = weights(fit(ExplicitProxLoss(mu), momentum=momentum, weight_decay=weight_decay))
    fedavg = weights(fit(ClientAlgorithm(), momentum=momentum, weight_decay=weight_decay))
    for key in hook:
        torch.testing.assert_close(hook[key], explicit[key], atol=1e-6, rtol=0)
    # ... and the comparison can tell the prox term apart from plain local training.
    assert max((hook[k] - fedavg[k]).abs().max().item() for k in hook) > 1e-3


def test_fit_reports_mu_and_keeps_an_fp32_anchor_under_bf16_mixed():
    algorithm = FedProx(mu=0.1)
    module = fit(algorithm, epochs=1, precision="bf16-mixed")
    assert module.__fl_meta__[meta_keys.FEDPROX_MU] == 0.1
    assert {a.dtype for a in algorithm.anchor.values()} == {torch.float32}
    assert set(algorithm.anchor) == {n for n, p in module.named_parameters() if p.requires_grad}
    assert all(np.isfinite(v.float().numpy()).all() for v in weights(module).values())
