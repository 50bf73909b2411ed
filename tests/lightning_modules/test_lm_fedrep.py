"""FedRep (lightning_modules/algorithms/fedrep.py): head phase with the body frozen, then body phase with the head
frozen, the head kept at the site and never sent.

- closed form (1e-6) on a one-weight body and one-weight head, one sample, plain SGD;
- an independent plain-torch reference of Algorithm 1 with a fresh optimizer per phase (SGD with momentum, AdamW
  with weight decay) equals the callback's single fit with one optimizer, which is what the docstring claims;
- the head survives between rounds in the site's state store and never travels;
- build-time refusals: no head to be found, FedNova.
"""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from aggregators.contracts import meta_keys
from jobs.build import JobBuildError, JobSpec
from lightning_modules.algorithms import build_client_algorithm
from lightning_modules.algorithms.base import ClientAlgorithmError
from lightning_modules.algorithms.fedrep import FedRep, frozen_names, phase_of
from lightning_modules.federated import FederatedAlgorithm
from lightning_modules.personalization.partial_sharing import local_entries_for
from lightning_modules.site import LocalExchange
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

HEAD = "head.weight,head.bias"


class TwoPart(pl.LightningModule):
    """Body Linear(d_in, d_rep) and head Linear(d_rep, 1), squared error; optimizer chosen by name."""

    def __init__(self, d_in: int = 3, d_rep: int = 2, optimizer: str = "sgd", bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Linear(d_in, d_rep, bias=bias)
        self.head = nn.Linear(d_rep, 1, bias=bias)
        self.optimizer_name = optimizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return 0.5 * F.mse_loss(self(x), y, reduction="sum")

    def configure_optimizers(self):
        return make_optimizer(self.optimizer_name, self.parameters())


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    if name == "momentum":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)
    return torch.optim.SGD(params, lr=0.1)


def meta(round_num: int = 0, **extra) -> dict:
    return {meta_keys.ROUND: round_num, meta_keys.RUN_ID: "run", **extra}


def fit_round(module, dataset, store, *, head_epochs, epochs=1, round_num=0, batch_size=4, local_keys=HEAD):
    """One FedRep round of ``module`` from its own current weights, as a site runs it; returns what is sent."""
    callback = FederatedAlgorithm(
        FedRep(head_epochs=head_epochs),
        site="site-1",
        state_store=store,
        meta_source=lambda: meta(round_num),
        local_keys=local_keys,
    )
    exchange = LocalExchange({k: v.detach().numpy().copy() for k, v in module.state_dict().items()})
    trainer = quiet_trainer(epochs, [callback, exchange])
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    return exchange.result, callback.last_meta


def test_phases_and_frozen_sets():
    assert [phase_of(e, 2) for e in range(4)] == ["head", "head", "body", "body"]
    names, head = ["b.w", "h.w", "h.b"], frozenset({"h.w", "h.b"})
    assert frozen_names("head", names, head) == ["b.w"]
    assert frozen_names("body", names, head) == ["h.w", "h.b"]


def test_closed_form_one_weight_body_and_head(tmp_path):
    """y_hat = h * (phi * x), loss (y_hat - y)^2 / 2, one sample, SGD lr 0.1, one head epoch then one body epoch:
    h' = h - lr (h phi x - y) phi x, then phi' = phi - lr (h' phi x - y) h' x."""
    module = TwoPart(d_in=1, d_rep=1, bias=False)
    with torch.no_grad():
        module.body.weight.fill_(0.5)
        module.head.weight.fill_(2.0)
    x, y, lr, phi, h = 3.0, 1.0, 0.1, 0.5, 2.0
    h1 = h - lr * (h * phi * x - y) * phi * x
    phi1 = phi - lr * (h1 * phi * x - y) * h1 * x
    dataset = torch.utils.data.TensorDataset(torch.tensor([[x]]), torch.tensor([[y]]))
    sent, sent_meta = fit_round(
        module, dataset, ClientStateStore(tmp_path, "site-1"), head_epochs=1, local_keys="head.weight"
    )
    assert module.head.weight.item() == pytest.approx(h1, abs=1e-6)
    assert module.body.weight.item() == pytest.approx(phi1, abs=1e-6)
    assert set(sent) == {"body.weight"} and sent["body.weight"].item() == pytest.approx(phi1, abs=1e-6)
    assert sent_meta[meta_keys.PARAM_KEYS] == ["body.weight"] and sent_meta[meta_keys.NUM_STEPS] == 2


def reference_fedrep(module: TwoPart, dataset, optimizer: str, head_epochs: int, body_epochs: int) -> dict:
    """Algorithm 1 of the paper written directly: a fresh optimizer over the head for tau_h epochs, then a fresh one
    over the body for tau_phi epochs, each epoch over the batches in order."""
    head = [module.head.weight, module.head.bias]
    body = [module.body.weight, module.body.bias]
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=False)
    for params, epochs in ((head, head_epochs), (body, body_epochs)):
        opt = make_optimizer(optimizer, params)
        for _ in range(epochs):
            for x, y in loader:
                opt.zero_grad()
                (0.5 * F.mse_loss(module(x), y, reduction="sum")).backward()
                opt.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adamw"])
def test_matches_a_plain_torch_reference_with_a_fresh_optimizer_per_phase(tmp_path, optimizer):
    generator = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(12, 3, generator=generator), torch.randn(12, 1, generator=generator)
    )
    expected = reference_fedrep(TwoPart(optimizer=optimizer), dataset, optimizer, head_epochs=3, body_epochs=2)
    module = TwoPart(optimizer=optimizer)
    sent, _ = fit_round(module, dataset, ClientStateStore(tmp_path, "site-1"), head_epochs=3, epochs=2)
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, expected[key], atol=1e-6, rtol=0)
    assert set(sent) == {"body.weight", "body.bias"}


def test_head_persists_at_the_site_and_the_body_comes_from_the_server(tmp_path):
    store = ClientStateStore(tmp_path, "site-1")
    generator = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(8, 3, generator=generator), torch.randn(8, 1, generator=generator)
    )
    module = TwoPart()
    fit_round(module, dataset, store, head_epochs=1)
    trained_head = module.head.weight.detach().clone()
    # Next round: the server sends the initial model's head (it never changes it); the site loads its own.
    fresh = TwoPart()
    algorithm = FedRep(head_epochs=1)
    algorithm.bind("site-1", store)
    entries = local_entries_for(algorithm, fresh, HEAD)
    assert entries.restore(fresh, meta(1, **{meta_keys.LAST_AGGREGATED: {"site-1": 0}})) == "stored"
    torch.testing.assert_close(fresh.head.weight, trained_head)
    assert not torch.equal(fresh.head.weight, TwoPart().head.weight)


def test_a_module_without_a_head_is_refused_at_the_site():
    class NoHead(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = nn.Linear(2, 1)

    with pytest.raises(ClientAlgorithmError, match="site-1: client algorithm 'fedrep' needs a head"):
        algorithm = build_client_algorithm("fedrep")
        algorithm.bind("site-1", None)
        local_entries_for(algorithm, NoHead(), None)


def test_builder_takes_the_declared_head_of_the_builtin_model():
    spec = JobSpec(name="rep", client="fedrep", dataset="digits", arch="mlp", site_val_fraction=0.1)
    assert spec.local_keys == "net.classifier.bias,net.classifier.weight"


def test_builder_refuses_fedrep_with_fednova():
    with pytest.raises(JobBuildError, match="FedNova"):
        JobSpec(name="rep", client="fedrep", server="fednova", dataset="digits", arch="mlp")


def test_head_epochs_is_checked():
    with pytest.raises(JobBuildError, match="head_epochs"):
        JobSpec(name="rep", client="fedrep", client_args={"head_epochs": 0}, dataset="digits", arch="mlp")


def test_no_optimizer_moves_a_frozen_part():
    module = TwoPart(optimizer="adamw")
    algorithm = FedRep(head_epochs=1)
    module.__fl_local_keys__ = frozenset({"head.weight", "head.bias"})
    algorithm.on_round_start(module, meta())
    before = {k: v.clone() for k, v in module.state_dict().items()}
    optimizer = module.configure_optimizers()
    module(torch.ones(2, 3)).sum().backward()
    algorithm.correct_gradients(module, optimizer)  # epoch 0: head phase
    optimizer.step()
    after = module.state_dict()
    assert torch.equal(after["body.weight"], before["body.weight"]) and torch.equal(
        after["body.bias"], before["body.bias"]
    )
    assert not torch.equal(after["head.weight"], before["head.weight"])
    assert np.isfinite(after["head.weight"].numpy()).all()
