"""FedNova: the client normaliser ||a_i||_1 against closed forms and torch's SGD, and the server step."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from aggregators.fedavg import fedavg_params
from aggregators.fednova import normalizer_l1
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext
from lightning_modules.algorithms import build_client_algorithm
from lightning_modules.federated import fednova_meta, sgd_step_settings

CONTEXT = RoundContext(round_num=0, num_rounds=3, population=("site-1", "site-2", "site-3"))
TAU, A_NORM = meta_keys.FEDNOVA_TAU, meta_keys.FEDNOVA_A_NORM


@pytest.mark.parametrize(
    ("lrs", "momentum", "mu", "expected"),
    [
        ([0.1] * 5, 0.0, 0.0, 5.0),  # vanilla: tau
        ([0.1] * 3, 0.5, 0.0, 4.25),  # docs/server_rules.md, FedNova: momentum 0.5, tau 3
        ([0.1] * 4, 0.5, 0.0, 6.125),
        ([0.1] * 4, 0.0, 1.0, 3.439),  # proximal, eta * mu = 0.1, tau 4
        ([0.1, 0.05, 0.05], 0.0, 0.0, 2.0),  # lrs that change within the round count as eta_k / eta_0
    ],
)
def test_normaliser_reproduces_the_closed_forms(lrs, momentum, mu, expected):
    assert normalizer_l1(lrs, momentum=momentum, mu=mu) == pytest.approx(expected, abs=1e-9)


def _torch_normaliser(lrs, momentum, dampening, mu):
    """sum_j a_j measured with torch.optim.SGD itself: coordinate j receives a unit gradient only at step j, and the
    proximal gradient mu * (w - w0) is added to every step's gradient (FedProx's correct_gradients)."""
    tau = len(lrs)
    w = torch.zeros(tau, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.SGD([w], lr=lrs[0], momentum=momentum, dampening=dampening)
    for k, lr in enumerate(lrs):
        optimizer.param_groups[0]["lr"] = lr
        grad = torch.zeros(tau, dtype=torch.float64)
        grad[k] = 1.0
        w.grad = grad + mu * w.detach()
        optimizer.step()
    return float((-w.detach() / lrs[0]).abs().sum())


@pytest.mark.parametrize(
    ("momentum", "dampening", "mu"), [(0.9, 0.0, 0.0), (0.9, 0.3, 0.0), (0.5, 0.0, 0.8), (0, 0, 2.0)]
)
def test_normaliser_matches_torch_sgd_with_momentum_dampening_and_a_proximal_term(momentum, dampening, mu):
    lrs = [0.1, 0.1, 0.08, 0.08, 0.05, 0.05, 0.05]
    expected = _torch_normaliser(lrs, momentum, dampening, mu)
    assert normalizer_l1(lrs, momentum=momentum, dampening=dampening, mu=mu) == pytest.approx(expected, rel=1e-9)


def test_client_meta_uses_the_optimizers_settings_and_the_algorithms_mu():
    p = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.5)
    steps = [sgd_step_settings(sgd)] * 3
    assert fednova_meta(build_client_algorithm("fedavg"), steps) == {TAU: 3, A_NORM: pytest.approx(4.25)}
    prox = fednova_meta(
        build_client_algorithm("fedprox", mu=1.0), [sgd_step_settings(torch.optim.SGD([p], lr=0.1))] * 4
    )
    assert prox == {TAU: 4, A_NORM: pytest.approx(3.439)}
    # What the normaliser does not model is not reported (a FedNova server then rejects the site by name).
    assert sgd_step_settings(torch.optim.SGD([p], lr=0.1, momentum=0.9, nesterov=True)) is None
    assert sgd_step_settings(torch.optim.Adam([p])) is None
    assert fednova_meta(build_client_algorithm("fedavg"), [steps[0], None]) == {}
    assert fednova_meta(build_client_algorithm("scaffold"), steps) == {}


def _update(site, w, n, tau, a_norm, extra=None):
    params = {"w": np.array(w, dtype=np.float32), **(extra or {})}
    return ClientUpdate(site=site, params=params, num_samples=n, meta={TAU: tau, A_NORM: a_norm})


X0 = {"w": np.array([0.0, 1.0], dtype=np.float32)}


def test_two_clients_closed_form():
    # d_1 = x - y_1 = (0.4, 0), a_1 = 2; d_2 = (0.9, 0.3), a_2 = 3; p = (1/4, 3/4).
    # tau_eff = 1/4 * 2 + 3/4 * 3 = 2.75; sum p d/a = (0.25*0.2 + 0.75*0.3, 0.75*0.1) = (0.275, 0.075).
    updates = [_update("site-1", [-0.4, 1.0], 1, 2, 2.0), _update("site-2", [-0.9, 0.7], 3, 3, 3.0)]
    rule = build_rule("fednova")
    result = rule.aggregate(X0, updates, rule.init_state(X0), CONTEXT)
    np.testing.assert_allclose(result.params["w"], [-2.75 * 0.275, 1.0 - 2.75 * 0.075], atol=1e-6)
    # FedAvg would give x - sum p d = (-0.775, 0.775): FedNova weights the 2-step client more.
    steps = build_rule("fednova", tau_eff="steps")
    same = steps.aggregate(X0, updates, steps.init_state(X0), CONTEXT)
    np.testing.assert_allclose(same.params["w"], result.params["w"], atol=1e-7)  # vanilla: a_i = tau_i


def test_equal_steps_vanilla_is_fedavg():
    extra = {"count": np.array(3, dtype=np.int64)}
    x0 = {**X0, "count": np.array(2, dtype=np.int64)}
    updates = [
        _update("site-1", [0.3, 0.1], 10, 5, 5.0, {"count": np.array(7, np.int64)}),
        _update("site-2", [-0.5, 2.0], 30, 5, 5.0, extra),
    ]
    rule = build_rule("fednova")
    result = rule.aggregate(x0, updates, rule.init_state(x0), CONTEXT)
    expected = fedavg_params(x0, updates)
    np.testing.assert_allclose(result.params["w"], expected["w"], atol=1e-7)
    assert result.params["count"] == expected["count"] == 4 and result.params["count"].dtype == np.int64


def test_server_momentum_accumulates_the_normalised_step():
    rule = build_rule("fednova", server_momentum=0.5)
    state = rule.init_state(X0)
    x = X0
    steps = []
    for target in ([-0.2, 1.0], [-0.2, 1.0]):
        y = np.array(target, np.float32) + (x["w"] - X0["w"])  # every client moves by the same delta each round
        result = rule.aggregate(x, [_update("site-1", y, 1, 4, 4.0)], state, CONTEXT)
        steps.append(x["w"] - result.params["w"])
        x, state = result.params, result.state
    np.testing.assert_allclose(steps[0], [0.2, 0.0], atol=1e-7)
    np.testing.assert_allclose(steps[1], [0.2 + 0.5 * 0.2, 0.0], atol=1e-7)  # b = 0.5 * b + g
    assert state["momentum"]["w"].dtype == np.float32


def test_order_invariance_and_inputs_untouched():
    updates = [_update(f"site-{i}", [0.1 * i, -0.2 * i], i, i + 1, 1.5 * i) for i in range(1, 4)]
    snapshot = copy.deepcopy(updates)
    rule = build_rule("fednova")
    a = rule.aggregate(X0, updates, rule.init_state(X0), CONTEXT)
    b = rule.aggregate(X0, updates[::-1], rule.init_state(X0), CONTEXT)
    np.testing.assert_array_equal(a.params["w"], b.params["w"])
    for u, saved in zip(updates, snapshot, strict=True):
        np.testing.assert_array_equal(u.params["w"], saved.params["w"])
    assert X0["w"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {TAU: 3},
        {TAU: 0, A_NORM: 1.0},
        {TAU: 3, A_NORM: float("nan")},
        {TAU: 3, A_NORM: -1.0},
        {TAU: 2.5, A_NORM: 2},
    ],
)
def test_missing_or_bad_fednova_meta_rejects_the_site(meta):
    rule = build_rule("fednova")
    update = ClientUpdate("site-9", {"w": np.zeros(2, np.float32)}, 1, meta)
    assert rule.update_problems(update, X0, rule.init_state(X0))
    with pytest.raises(AggregationError, match="site-9"):
        rule.aggregate(X0, [update], rule.init_state(X0), CONTEXT)


def test_uniform_random_pattern_draws_seeded_epochs_in_two_to_max_per_site_and_round():
    from jobs.client import build_parser
    from lightning_modules.site import local_epochs

    args = build_parser().parse_args(["--pattern", "uniform_random", "--max-local-epochs", "4", "--seed", "3"])
    draws = [[local_epochs(args, site, r) for r in range(40)] for site in range(3)]
    assert {e for row in draws for e in row} == {2, 3, 4}  # both ends included
    assert draws == [[local_epochs(args, site, r) for r in range(40)] for site in range(3)]  # reproducible
    assert draws[0] != draws[1]  # per site
    constant = build_parser().parse_args(["--epochs", "5"])
    assert {local_epochs(constant, 0, r) for r in range(5)} == {5}


def test_job_spec_validates_the_pattern():
    from jobs.build import JobBuildError, JobSpec, client_script_args

    spec = JobSpec(name="nova", server="fednova", pattern="uniform_random", max_local_epochs=3)
    assert "--pattern uniform_random --max-local-epochs 3" in client_script_args(spec)
    assert "--pattern" not in client_script_args(JobSpec(name="plain"))
    with pytest.raises(JobBuildError, match="unknown pattern"):
        JobSpec(name="bad", pattern="random")
    with pytest.raises(JobBuildError, match="max_local_epochs must be at least 2"):
        JobSpec(name="bad", pattern="uniform_random", max_local_epochs=1)


def test_bad_hyperparameters():
    with pytest.raises(AggregationError, match="tau_eff"):
        build_rule("fednova", tau_eff="epochs")
    with pytest.raises(AggregationError, match="server_momentum"):
        build_rule("fednova", server_momentum=1.0)
