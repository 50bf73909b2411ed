"""Ditto (lightning_modules/algorithms/ditto.py): the personal step in closed form, a real Lightning fit against an
independent plain-torch reference, the limits lam = 0 and large lam, state across process restarts, unreadable
state, and the refusals."""

from __future__ import annotations

import logging

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aggregators.contracts import meta_keys
from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.ditto import Ditto, ditto_step_
from lightning_modules.federated import FederatedAlgorithm
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

RUN = "run-a"


class Tiny(pl.LightningModule):
    """A bias-free linear regression (or a small MLP) with the task_loss protocol, trained with plain SGD."""

    def __init__(self, weights: torch.Tensor, lr: float = 0.1, hidden: int = 0) -> None:
        super().__init__()
        self.lr = lr
        if hidden:
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(weights.shape[1], hidden), nn.Tanh(), nn.Linear(hidden, 1))
        else:
            self.net = nn.Linear(weights.shape[1], 1, bias=False)
            with torch.no_grad():
                self.net.weight.copy_(weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)

    def task_loss(self, batch, params=None):
        x, y = batch
        out = self(x) if params is None else torch.func.functional_call(self, dict(params), (x,))
        return F.mse_loss(out, y), out

    def training_step(self, batch, batch_idx):
        return self.task_loss(batch)[0]

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def round_meta(round_num: int, confirmed: dict | None = None) -> dict:
    meta = {meta_keys.ROUND: round_num, meta_keys.RUN_ID: RUN}
    if confirmed is not None:
        meta[meta_keys.LAST_AGGREGATED] = confirmed
    return meta


def fit_round(module, algorithm, store, data, round_num=0, confirmed=None, epochs=1, batch_size=1):
    callback = FederatedAlgorithm(
        algorithm,
        site="site-1",
        state_store=store,
        num_samples=len(data),
        meta_source=lambda: round_meta(round_num, confirmed),
    )
    trainer = quiet_trainer(epochs, [callback])
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=batch_size, shuffle=False))
    return callback.last_meta


def test_personal_step_in_closed_form():
    v = {"a": torch.tensor([1.0, -2.0])}
    ditto_step_(v, {"a": torch.tensor([0.5, 0.25])}, {"a": torch.tensor([0.0, 1.0])}, {"a": 0.1}, lam=2.0)
    # v - 0.1 * (g + 2 (v - w)) = [1 - 0.1 (0.5 + 2), -2 - 0.1 (0.25 - 6)]
    torch.testing.assert_close(v["a"], torch.tensor([0.75, -1.425]), atol=1e-6, rtol=0)


def test_one_and_two_steps_by_hand(tmp_path):
    """w0 = 1, samples (x, y) = (1, 3) then (2, 0), loss (w x - y)^2, lr 0.1, lam 0.5: the global weight and v."""
    data = TensorDataset(torch.tensor([[1.0], [2.0]]), torch.tensor([3.0, 0.0]))
    module = Tiny(torch.tensor([[1.0]]), lr=0.1)
    ditto = Ditto(lam=0.5)
    fit_round(module, ditto, ClientStateStore(tmp_path, "site-1"), data)
    # step 1, batch (1, 3): grad at w = v = 1 is 2 * 1 * (1 - 3) = -4 -> w1 = 1.4; v1 = 1 - 0.1 (-4 + 0.5 * 0) = 1.4
    # step 2, batch (2, 0): grad at w1 = 2 * 2 * 2.8 = 11.2 -> w2 = 1.4 - 1.12 = 0.28
    #                       grad at v1 = 11.2, pull 0.5 * (1.4 - 1) = 0.2 -> v2 = 1.4 - 0.1 * 11.4 = 0.26
    assert module.net.weight.item() == pytest.approx(0.28, abs=1e-6)
    assert ditto.personal["net.weight"].item() == pytest.approx(0.26, abs=1e-6)


def reference_round(w0, v0, batches, lr, lam, epochs):
    """Ditto's Algorithm 1 for one round in plain torch: local SGD on w from w0, and on v the step
    v - lr * (grad F(v) + lam * (v - w0)) on the same batches."""
    w = {k: t.clone().requires_grad_(True) for k, t in w0.items()}
    v = {k: t.clone().requires_grad_(True) for k, t in v0.items()}

    def loss_at(params, x, y):
        hidden = torch.tanh(x @ params["net.0.weight"].T + params["net.0.bias"])
        return ((hidden @ params["net.2.weight"].T + params["net.2.bias"]).squeeze(-1) - y).pow(2).mean()

    for _ in range(epochs):
        for x, y in batches:
            gw = torch.autograd.grad(loss_at(w, x, y), list(w.values()))
            gv = torch.autograd.grad(loss_at(v, x, y), list(v.values()))
            with torch.no_grad():
                for p, g in zip(w.values(), gw, strict=True):
                    p -= lr * g
                for (k, p), g in zip(v.items(), gv, strict=True):
                    p -= lr * (g + lam * (p - w0[k]))
    return {k: t.detach() for k, t in w.items()}, {k: t.detach() for k, t in v.items()}


@pytest.mark.parametrize("lam", [0.0, 0.1, 2.0])
def test_two_rounds_match_a_plain_torch_reference(tmp_path, lam):
    torch.manual_seed(1)
    x, y = torch.randn(12, 3), torch.randn(12)
    data = TensorDataset(x, y)
    batches = [(x[i : i + 4], y[i : i + 4]) for i in range(0, 12, 4)]
    module = Tiny(torch.zeros(1, 3), lr=0.05, hidden=4)
    store = ClientStateStore(tmp_path, "site-1")
    w0 = {k: t.detach().clone() for k, t in module.state_dict().items()}
    v_ref = w0
    for round_num in range(2):
        received = {k: t.detach().clone() for k, t in module.state_dict().items()}
        ditto = Ditto(lam=lam)  # a new object per round: the state comes back from the store, as under -t 1
        confirmed = {"site-1": round_num - 1} if round_num else None
        fit_round(module, ditto, store, data, round_num, confirmed, epochs=2, batch_size=4)
        w_ref, v_ref = reference_round(received, v_ref, batches, 0.05, lam, epochs=2)
        for key in w_ref:
            torch.testing.assert_close(module.state_dict()[key], w_ref[key], atol=1e-6, rtol=0)
            torch.testing.assert_close(ditto.personal[key], v_ref[key], atol=1e-6, rtol=0)
    if lam == 0.0:  # local-only SGD on v from the first received model: in round 1 it is the global model's path
        assert not torch.equal(v_ref["net.0.weight"], w0["net.0.weight"])


def test_large_lam_keeps_v_near_the_received_model(tmp_path):
    torch.manual_seed(2)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16))
    module = Tiny(torch.zeros(1, 3), lr=0.05, hidden=4)
    received = {k: t.detach().clone() for k, t in module.state_dict().items()}
    ditto = Ditto(lam=19.0)  # lr * lam = 0.95: v is pulled almost all the way back every step
    fit_round(module, ditto, ClientStateStore(tmp_path, "site-1"), data, epochs=3, batch_size=4)

    def distance(params):
        return sum(float((params[k] - received[k]).norm() ** 2) for k in received) ** 0.5

    assert distance(ditto.personal) < 0.5 * distance(module.state_dict())


def test_personal_model_survives_a_process_restart_and_waits_for_confirmation(tmp_path):
    data = TensorDataset(torch.randn(8, 3), torch.randn(8))
    module = Tiny(torch.zeros(1, 3), lr=0.05, hidden=4)
    fit_round(module, first := Ditto(lam=0.1), ClientStateStore(tmp_path, "site-1"), data, batch_size=4)
    saved = {k: t.clone() for k, t in first.personal.items()}
    # A new process: new algorithm and store objects. The server confirms round 0 was aggregated: v_i comes back.
    second = Ditto(lam=0.1)
    second.bind("site-1", ClientStateStore(tmp_path, "site-1"))
    second.on_round_start(module, round_meta(1, {"site-1": 0}))
    for key, value in saved.items():
        assert torch.equal(second.personal[key], value)
    # Had the server not aggregated round 0, the site would start again from the received model.
    fit_round(module, Ditto(lam=0.1), ClientStateStore(tmp_path / "b", "site-1"), data, batch_size=4)
    third = Ditto(lam=0.1)
    third.bind("site-1", ClientStateStore(tmp_path / "b", "site-1"))
    third.on_round_start(module, round_meta(1, {}))
    for key, p in module.state_dict().items():
        assert torch.equal(third.personal[key], p.float())


def test_unreadable_state_restarts_from_the_received_model_with_a_warning(tmp_path, caplog):
    module = Tiny(torch.zeros(1, 3), hidden=4)
    store = ClientStateStore(tmp_path, "site-1")
    store.path("ditto").parent.mkdir(parents=True)
    store.path("ditto").write_bytes(b"not a state file")
    ditto = Ditto()
    ditto.bind("site-1", store)
    with caplog.at_level(logging.WARNING):
        ditto.on_round_start(module, round_meta(3))
    assert "site-1" in caplog.text and "net.0.weight" in caplog.text and "cannot be used" in caplog.text
    for key, p in module.state_dict().items():
        assert torch.equal(ditto.personal[key], p.float())


def test_missing_or_misshaped_entries_restart_alone(tmp_path, caplog):
    module = Tiny(torch.zeros(1, 3), hidden=4)
    store = ClientStateStore(tmp_path, "site-1")
    kept = torch.full((4, 3), 7.0)
    store.save("ditto", {"net.0.weight": kept, "net.0.bias": torch.zeros(5), "__run_id__": RUN}, round_num=0)
    ditto = Ditto()
    ditto.bind("site-1", store)
    with caplog.at_level(logging.WARNING):
        ditto.on_round_start(module, round_meta(1))
    warning = caplog.text
    assert "site-1" in warning and "net.0.bias" in warning and "net.2.weight" in warning
    assert "'net.0.weight'" not in warning
    assert torch.equal(ditto.personal["net.0.weight"], kept)
    assert torch.equal(ditto.personal["net.0.bias"], module.net[0].bias.detach())


def test_sent_meta_and_the_global_part_is_fedavg(tmp_path):
    data = TensorDataset(torch.randn(8, 3), torch.randn(8))
    plain, with_ditto = Tiny(torch.zeros(1, 3), hidden=4), Tiny(torch.zeros(1, 3), hidden=4)
    fit_round(plain, build_client_algorithm("fedavg"), None, data, batch_size=4)
    meta = fit_round(with_ditto, Ditto(lam=1.0), ClientStateStore(tmp_path, "site-1"), data, batch_size=4)
    for key, value in plain.state_dict().items():  # the sent model is FedAvg's local training, bit for bit
        assert torch.equal(with_ditto.state_dict()[key], value)
    assert meta["ditto.lam"] == 1.0 and meta["ditto.personal_steps"] == 2


def test_fedprox_global_part_pulls_the_global_model(tmp_path):
    ditto = Ditto(lam=0.1, global_client="fedprox", mu=0.5)
    assert ditto.proximal_coefficient() == 0.5 and ditto.local_update == "proximal"
    meta = fit_round(
        Tiny(torch.zeros(1, 3), hidden=4),
        ditto,
        ClientStateStore(tmp_path, "site-1"),
        TensorDataset(torch.randn(8, 3), torch.randn(8)),
        batch_size=4,
    )
    assert meta["fedprox.mu"] == 0.5


@pytest.mark.parametrize(
    "args, words",
    [
        ({"lam": -0.1}, "'lam' must be"),
        ({"personal_lr": 0.0}, "'personal_lr' must be"),
        ({"global_client": "scaffold"}, "SCAFFOLD exchanges control variates"),
        ({"global_client": "moon"}, "two algorithms in one callback"),
        ({"mu": 0.1}, "global_client 'fedprox'"),
    ],
)
def test_bad_hyperparameters_are_refused_with_the_reason(args, words):
    with pytest.raises(ClientAlgorithmError, match="ditto") as info:
        build_client_algorithm("ditto", **args)
    assert words in str(info.value)


def test_ditto_is_refused_under_ddp():
    from lightning_modules.federated import distributed_refusal

    assert "DDP" in distributed_refusal(Ditto())
