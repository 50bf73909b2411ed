"""APFL (lightning_modules/algorithms/apfl.py): the alpha update and the mixed model in closed form, two steps of a
real Lightning fit by hand, two rounds against an independent plain-torch loop, alpha = 0 held fixed equal to FedAvg
bit for bit, hostile stored state, and the build-time refusals asked of its capabilities."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.data import TensorDataset

from jobs.spec import JobBuildError, JobSpec
from lightning_modules.algorithms import ClientAlgorithm, ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.apfl import ALPHA_ENTRY, APFL, alpha_gradient, mixed_model, next_alpha, personal_step_
from lightning_modules.local_baseline import matched_steps
from lightning_modules.privacy.dp_sgd import algorithm_problem
from lightning_modules.state_store import ClientStateStore
from tests.lightning_modules.test_lm_ditto import RUN, Tiny, fit_round


def test_the_mixture_the_alpha_gradient_and_the_steps_by_hand():
    v, w = {"a": torch.tensor([1.0, -2.0])}, {"a": torch.tensor([0.5, 1.0])}
    g = {"a": torch.tensor([0.4, -0.2])}
    # 0.25 v + 0.75 w
    torch.testing.assert_close(mixed_model(v, w, 0.25)["a"], torch.tensor([0.625, 0.25]), atol=1e-6, rtol=0)
    # <v - w, g> = 0.5 * 0.4 + (-3) * (-0.2) = 0.8
    assert alpha_gradient(v, w, g) == pytest.approx(0.8, abs=1e-6)
    assert next_alpha(0.25, 0.8, 0.1) == pytest.approx(0.17, abs=1e-6)
    assert next_alpha(0.05, 1.0, 0.1) == 0.0 and next_alpha(0.95, -1.0, 0.1) == 1.0  # clipped into [0, 1]
    personal_step_(v, g, alpha=0.25, eta=0.1)  # v - 0.1 * 0.25 * g
    torch.testing.assert_close(v["a"], torch.tensor([0.99, -1.995]), atol=1e-6, rtol=0)


def test_two_steps_by_hand(tmp_path):
    """w0 = v0 = 1, alpha0 = 0.5, lr 0.1, loss (w x - y)^2 on (1, 3) then (2, 0)."""
    data = TensorDataset(torch.tensor([[1.0], [2.0]]), torch.tensor([3.0, 0.0]))
    module = Tiny(torch.tensor([[1.0]]), lr=0.1)
    apfl = APFL(alpha=0.5)
    meta = fit_round(module, apfl, ClientStateStore(tmp_path, "site-1"), data)
    # step 1: grad at w = 1 is -4 -> w1 = 1.4; v_bar = 1, g = -4, <v - w, g> = 0 -> alpha 0.5; v1 = 1 + 0.2 = 1.2
    # step 2: grad at w1 = 4 * 2.8 = 11.2 -> w2 = 0.28; v_bar = 1.3, g = 4 * 2.6 = 10.4,
    #         <v1 - w1, g> = -0.2 * 10.4 = -2.08 -> alpha 0.5 + 0.208 = 0.708; v2 = 1.2 - 0.05 * 10.4 = 0.68
    assert module.net.weight.item() == pytest.approx(0.28, abs=1e-6)
    assert apfl.personal["net.weight"].item() == pytest.approx(0.68, abs=1e-6)
    assert apfl.site_alpha == pytest.approx(0.708, abs=1e-6) and meta["apfl.alpha"] == pytest.approx(0.708, abs=1e-6)
    # the personal model after the round: 0.708 * 0.68 + 0.292 * 0.28
    assert apfl.personal_weights(module)["net.weight"].item() == pytest.approx(0.5632, abs=1e-6)
    assert meta["apfl.personal_steps"] == 2
    assert matched_steps(meta) == 4  # the local-only baseline gets the global and the personal steps


def test_alpha_is_clipped_inside_the_fit(tmp_path):
    """The same two steps with alpha_lr 1: step 2 asks alpha = 0.5 + 2.08, which is clipped to 1 (v's step still
    used alpha 0.5), so the personal model is v2 alone."""
    data = TensorDataset(torch.tensor([[1.0], [2.0]]), torch.tensor([3.0, 0.0]))
    module = Tiny(torch.tensor([[1.0]]), lr=0.1)
    apfl = APFL(alpha=0.5, alpha_lr=1.0)
    fit_round(module, apfl, ClientStateStore(tmp_path, "site-1"), data)
    assert apfl.site_alpha == 1.0
    assert apfl.personal_weights(module)["net.weight"].item() == pytest.approx(0.68, abs=1e-6)


def reference_round(w0, v0, alpha, batches, lr, epochs, adaptive=True):
    """APFL's Algorithm 1 for one round in plain torch: SGD on w, and v, alpha through v_bar, both at iterate k."""
    w = {k: t.clone() for k, t in w0.items()}
    v = {k: t.clone() for k, t in v0.items()}

    def grad_at(params, x, y):
        leaves = {k: t.clone().requires_grad_(True) for k, t in params.items()}
        hidden = torch.tanh(x @ leaves["net.0.weight"].T + leaves["net.0.bias"])
        loss = ((hidden @ leaves["net.2.weight"].T + leaves["net.2.bias"]).squeeze(-1) - y).pow(2).mean()
        return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))

    for _ in range(epochs):
        for x, y in batches:
            gw = grad_at(w, x, y)
            gv = grad_at({k: alpha * v[k] + (1 - alpha) * w[k] for k in v}, x, y)
            d_alpha = sum(float(((v[k] - w[k]) * gv[k]).sum()) for k in v)
            w = {k: w[k] - lr * gw[k] for k in w}
            v = {k: v[k] - lr * alpha * gv[k] for k in v}
            if adaptive:
                alpha = min(1.0, max(0.0, alpha - lr * d_alpha))
    return w, v, alpha


def test_two_rounds_match_a_plain_torch_reference_across_a_restart(tmp_path):
    torch.manual_seed(1)
    x, y = torch.randn(12, 3), torch.randn(12)
    data, batches = TensorDataset(x, y), [(x[i : i + 4], y[i : i + 4]) for i in range(0, 12, 4)]
    module = Tiny(torch.zeros(1, 3), lr=0.05, hidden=4)
    store = ClientStateStore(tmp_path, "site-1")
    v_ref, alpha_ref = {k: t.detach().clone() for k, t in module.state_dict().items()}, 0.3
    for round_num in range(2):
        received = {k: t.detach().clone() for k, t in module.state_dict().items()}
        apfl = APFL(alpha=0.3)  # a new object per round: v and alpha come back from the store, as under -t 1
        confirmed = {"site-1": round_num - 1} if round_num else None
        fit_round(module, apfl, store, data, round_num, confirmed, epochs=2, batch_size=4)
        w_ref, v_ref, alpha_ref = reference_round(received, v_ref, alpha_ref, batches, 0.05, epochs=2)
        assert apfl.site_alpha == pytest.approx(alpha_ref, abs=1e-6)
        for key in w_ref:
            torch.testing.assert_close(module.state_dict()[key], w_ref[key], atol=1e-6, rtol=0)
            torch.testing.assert_close(apfl.personal[key], v_ref[key], atol=1e-6, rtol=0)
    assert alpha_ref != pytest.approx(0.3, abs=1e-3)  # alpha did adapt: the test above compares a moving value


def test_alpha_zero_held_fixed_is_fedavg_bit_for_bit(tmp_path):
    torch.manual_seed(3)
    data = TensorDataset(torch.randn(12, 3), torch.randn(12))
    plain = Tiny(torch.zeros(1, 3), lr=0.05, hidden=4)
    mixed = copy.deepcopy(plain)
    fedavg_meta = fit_round(plain, ClientAlgorithm(), ClientStateStore(tmp_path / "a", "site-1"), data, batch_size=4)
    apfl = APFL(alpha=0.0, adaptive=False)
    apfl_meta = fit_round(mixed, apfl, ClientStateStore(tmp_path / "b", "site-1"), data, batch_size=4)
    for key, value in plain.state_dict().items():
        assert torch.equal(mixed.state_dict()[key], value), key  # the model sent
        assert torch.equal(apfl.personal_weights(mixed)[key], value), key  # the personal model: v_bar = w
    assert apfl_meta["train.num_steps"] == fedavg_meta["train.num_steps"] and apfl_meta["apfl.alpha"] == 0.0


def stored_state(store, module, alpha):
    state = {k: t.detach().clone() for k, t in module.state_dict().items()}
    state[ALPHA_ENTRY] = torch.tensor(alpha)
    state["__run_id__"] = RUN
    store.save("apfl", state, round_num=0)


def test_a_stored_alpha_outside_the_unit_interval_is_clipped_and_a_nan_one_restarts(tmp_path, caplog):
    data = TensorDataset(torch.randn(4, 3), torch.randn(4))
    for bad, start in ((7.0, 1.0), (float("nan"), 0.25)):
        module = Tiny(torch.zeros(1, 3), lr=0.0)  # lr 0: nothing moves, alpha stays as loaded
        store = ClientStateStore(tmp_path / str(bad), "site-1")
        stored_state(store, module, bad)
        apfl = APFL(alpha=0.25, personal_lr=1e-9, alpha_lr=1e-9)
        fit_round(module, apfl, store, data, round_num=1, batch_size=4)
        assert apfl.site_alpha == pytest.approx(start, abs=1e-6)
    assert "<alpha>" in caplog.text and "site-1" in caplog.text  # the NaN entry restarted, by name


@pytest.mark.parametrize(
    "args, words",
    [
        ({"alpha": 1.5}, "hyperparameter 'alpha' must be"),
        ({"adaptive": False, "alpha_lr": 0.1}, "alpha_lr"),
        ({"personal_lr": 0.0}, "personal_lr"),
    ],
)
def test_bad_hyperparameters_are_one_line(args, words):
    with pytest.raises(ClientAlgorithmError, match=words) as info:
        build_client_algorithm("apfl", **args)
    assert "\n" not in str(info.value)


def test_finetuning_beside_apfl_is_refused_by_capability_in_one_line():
    with pytest.raises(JobBuildError, match="finetune_epochs 1 with client 'apfl': APFL's mixture") as info:
        JobSpec(name="bad", client="apfl", finetune_epochs=1, site_val_fraction=0.2)
    assert "\n" not in str(info.value) and "choose one" in str(info.value)


def test_apfl_is_refused_under_dp_sgd_by_its_own_declaration():
    assert "cannot run under DP-SGD: APFL trains v_i and alpha" in algorithm_problem(APFL())


def test_several_lrs_without_personal_lr_are_refused_by_name():
    from lightning_modules.algorithms.apfl import single_lr

    w = torch.nn.Parameter(torch.zeros(1))
    b = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [w], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    with pytest.raises(ClientAlgorithmError, match=r"site-1: apfl .* personal_lr"):
        single_lr(optimizer, "site-1")
