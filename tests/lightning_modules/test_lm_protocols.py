"""What client algorithms and server rules need from a user's module and optimizer (lightning_modules/protocols.py):

- the needs are read from declarations on the algorithm classes, never from their registered names;
- a site whose optimizer a FedNova server cannot describe (Adam/AdamW, Nesterov, ...) is refused when the round
  starts, naming the site and the optimizer, instead of silently leaving out its report;
- ``configure_optimizers()`` is read without a trainer in every form Lightning accepts, or skipped when it needs one.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from aggregators.contracts import meta_keys
from aggregators.registry import RULES
from lightning_modules import FederatedAlgorithm
from lightning_modules.algorithms import ClientAlgorithm, ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.fedmos import FedMoS
from lightning_modules.federated import distributed_refusal
from lightning_modules.protocols import (
    configured_optimizer,
    describe,
    module_problem,
    needs_plain_sgd,
    needs_representation,
    needs_sgd_report,
    needs_task_loss,
    optimizer_problem,
)
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

LR, N, BATCH = 0.05, 32, 8


class Plain(pl.LightningModule):
    """A user's module with nothing but a network, a loss and the optimizer it is given."""

    def __init__(self, make_optimizer: Any = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 3)
        self.make_optimizer = make_optimizer or (lambda params: torch.optim.SGD(params, lr=LR))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        return self.make_optimizer(self.parameters())


def fit(module: pl.LightningModule, algorithm: ClientAlgorithm | str, rule: str, tmp_path) -> dict:
    meta = {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r", meta_keys.AGGREGATION_RULE: rule}
    callback = FederatedAlgorithm(
        algorithm, site="site-1", state_store=ClientStateStore(tmp_path, "site-1"), meta_source=lambda: meta
    )
    data = torch.utils.data.TensorDataset(torch.rand(N, 6), torch.arange(N) % 3)
    trainer = quiet_trainer(1, [callback])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=BATCH))
    return callback.last_meta


# --------------------------------------------------------------------------------------------------------------------
# declarations, not names


class Declares(ClientAlgorithm):
    """An algorithm of the user's own, registered nowhere, that declares what it needs."""

    name: ClassVar[str] = "mine"
    needs_task_loss: ClassVar[bool] = True
    needs_representation: ClassVar[bool] = True
    needs_plain_sgd: ClassVar[bool] = True


class FedMoSWithoutTaskLoss(FedMoS):
    """A FedMoS variant that declares it does not need task_loss: the declaration wins over what FedMoS is."""

    needs_task_loss: ClassVar[bool] = False


def test_an_algorithm_of_any_name_gets_the_checks_it_declares(tmp_path):
    algorithm = Declares()
    assert needs_task_loss(algorithm) and needs_representation(algorithm) and needs_plain_sgd(algorithm)
    assert "'mine' needs the module Plain to define task_loss(batch" in module_problem(algorithm, Plain())
    assert "'mine' takes extra gradient passes" in distributed_refusal(algorithm)
    with pytest.raises(ClientAlgorithmError, match=r"site-1: client algorithm 'mine' needs the module Plain to define"):
        fit(Plain(), algorithm, "fedavg", tmp_path)


def test_a_declaration_overrides_the_class_it_derives_from():
    assert needs_task_loss(FedMoS()) and not needs_task_loss(FedMoSWithoutTaskLoss())
    assert needs_plain_sgd(FedMoSWithoutTaskLoss())  # still applies its update as one plain SGD step


@pytest.mark.parametrize(
    ("name", "args", "task_loss", "representation", "plain_sgd"),
    [
        ("fedavg", {}, False, False, False),
        ("fedmos", {}, True, False, True),
        ("scaffold", {}, False, False, False),
        ("scaffold", {"option": "I"}, True, False, False),
        ("moon", {}, False, True, False),
    ],
)
def test_the_bundles_algorithms_need_what_docs_own_model_md_says(name, args, task_loss, representation, plain_sgd):
    algorithm = build_client_algorithm(name, **args)
    assert needs_task_loss(algorithm) == task_loss
    assert needs_representation(algorithm) == representation
    assert needs_plain_sgd(algorithm) == plain_sgd


def test_moon_names_what_the_network_lacks():
    class NoProjection(Plain):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(6, 3)
            self.net.embed = self.net.forward
            self.net.projection = None

    assert module_problem(build_client_algorithm("moon"), Plain()).endswith("no attribute net that is an nn.Module")
    assert "net.projection is missing or None" in module_problem(build_client_algorithm("moon"), NoProjection())


# --------------------------------------------------------------------------------------------------------------------
# FedNova at the site


def test_only_rules_that_normalise_by_the_fednova_report_need_one():
    assert needs_sgd_report(RULES["fednova"])
    assert not any(needs_sgd_report(RULES[name]) for name in ("fedavg", "scaffold", "feddyn", "fedyogi"))


@pytest.mark.parametrize(
    ("make_optimizer", "named"),
    [
        (lambda p: torch.optim.AdamW(p, lr=LR), "AdamW"),
        (lambda p: torch.optim.Adam(p, lr=LR), "Adam"),
        (lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9, nesterov=True), "SGD with nesterov=True"),
    ],
)
def test_a_site_whose_optimizer_fednova_cannot_describe_is_refused_when_the_round_starts(
    tmp_path, make_optimizer, named
):
    module = Plain(make_optimizer)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    message = rf"site-1: server rule 'fednova': FedNova's normalisation describes SGD steps \(a_i\); {named} cannot"
    with pytest.raises(ClientAlgorithmError, match=message):
        fit(module, "fedavg", "fednova", tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # not a single step was taken


def test_sgd_with_momentum_reports_to_fednova_and_adamw_trains_under_other_rules(tmp_path):
    meta = fit(Plain(lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9)), "fedprox", "fednova", tmp_path / "a")
    assert meta[meta_keys.FEDNOVA_TAU] == N // BATCH and meta[meta_keys.FEDNOVA_A_NORM] > N // BATCH
    meta = fit(Plain(lambda p: torch.optim.AdamW(p, lr=LR)), "fedavg", "fedavg", tmp_path / "b")
    assert meta[meta_keys.NUM_STEPS] == N // BATCH and meta_keys.FEDNOVA_TAU not in meta


class PlainSgdOnly(ClientAlgorithm):
    name: ClassVar[str] = "sgd_only"
    needs_plain_sgd: ClassVar[bool] = True


def test_a_plain_sgd_algorithm_refuses_an_adaptive_optimizer_when_the_round_starts(tmp_path):
    adamw = Plain(lambda p: torch.optim.AdamW(p, lr=LR))
    with pytest.raises(ClientAlgorithmError, match=r"site-1: client algorithm 'sgd_only' applies .* got AdamW"):
        fit(adamw, PlainSgdOnly(), "fedavg", tmp_path)


@pytest.mark.parametrize(
    ("optimizer", "problem"),
    [
        (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR), None),
        (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR, momentum=0.9, weight_decay=1e-4), None),
        (
            torch.optim.SGD(
                [{"params": [nn.Parameter(torch.zeros(1))], "lr": 0.1}, {"params": [nn.Parameter(torch.zeros(1))]}],
                lr=LR,
            ),
            "SGD with different learning rates per param group",
        ),
        (torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=LR, maximize=True), "SGD with maximize=True"),
    ],
)
def test_fednova_describes_sgd_with_momentum_and_weight_decay_only(optimizer, problem):
    found = optimizer_problem(build_client_algorithm("fedavg"), RULES["fednova"], optimizer)
    assert (found is None) if problem is None else (problem in found and describe(optimizer) == problem)


# --------------------------------------------------------------------------------------------------------------------
# configure_optimizers without a trainer


class NeedsTrainer(Plain):
    def configure_optimizers(self):
        steps = self.trainer.estimated_stepping_batches  # not attached to a trainer: RuntimeError
        return torch.optim.AdamW(self.parameters(), lr=LR / steps)


def _opt(p):
    return torch.optim.AdamW(p, lr=LR)


@pytest.mark.parametrize(
    ("configured", "found"),
    [
        (lambda m: _opt(m.parameters()), "AdamW"),
        (lambda m: [_opt(m.parameters())], "AdamW"),
        (lambda m: {"optimizer": _opt(m.parameters()), "monitor": "val_loss"}, "AdamW"),
        (lambda m: ([o := _opt(m.parameters())], [torch.optim.lr_scheduler.StepLR(o, 1)]), "AdamW"),
        (lambda m: [_opt(m.parameters()), torch.optim.SGD(m.parameters(), lr=LR)], None),  # two: not one to check
        (lambda m: None, None),
    ],
)
def test_the_optimizer_is_read_in_every_form_lightning_accepts(configured, found):
    module = Plain()
    module.configure_optimizers = lambda: configured(module)
    optimizer = configured_optimizer(module)
    assert (optimizer is None) if found is None else type(optimizer).__name__ == found


def test_a_configure_optimizers_that_needs_the_trainer_is_left_to_the_site():
    assert configured_optimizer(NeedsTrainer()) is None
