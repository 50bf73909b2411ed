"""Client algorithms on a user's own LightningModule through the FederatedAlgorithm callback.

- With SGD the callback path gives bit for bit what FLClassifier gives (same net, data and seed).
- With AdamW, FedProx, FedDyn and SCAFFOLD match an independent plain-torch loop of their update rules.
- Modules that lack what an algorithm needs are refused at set-up with what to add.
"""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules import FederatedAlgorithm, FLClassifier
from lightning_modules.algorithms import CLIENT_ALGORITHMS, build_client_algorithm
from lightning_modules.algorithms.base import ClientAlgorithmError
from lightning_modules.federated import adds_loss_terms, algorithm_loss
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

LR, MU, ALPHA, C = 0.05, 0.1, 0.2, 0.1
N, BATCH = 48, 16


class UserModule(pl.LightningModule):
    """A user's module: its own layout, loss and optimizer; nothing from the bundle."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.optimizer_name = optimizer

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.body(x), y)

    def configure_optimizers(self):
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        return torch.optim.SGD(self.parameters(), lr=LR)


def data() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.rand(N, 64, generator=generator), torch.arange(N) % 10)


def server_meta() -> dict:
    control = {name: np.full(tuple(p.shape), C, np.float32) for name, p in UserModule().named_parameters()}
    return {
        meta_keys.ROUND: 0,
        meta_keys.RUN_ID: "run",
        meta_keys.SCAFFOLD_CTRL_GLOBAL: control,
        meta_keys.FEDDYN_ALPHA: ALPHA,
    }


def trainer(callback: pl.Callback, **kwargs) -> pl.Trainer:
    return quiet_trainer(1, [callback], **kwargs)


def fit_user(tmp_path, name: str, optimizer: str = "sgd", args=None, meta=None) -> tuple[UserModule, dict]:
    module = UserModule(optimizer)
    callback = FederatedAlgorithm(
        name,
        algorithm_args=args,
        site="site-1",
        state_store=ClientStateStore(tmp_path, "site-1"),
        meta_source=lambda: meta or server_meta(),
    )
    torch.manual_seed(2)
    trainer(callback).fit(module, torch.utils.data.DataLoader(data(), batch_size=BATCH))
    return module, callback.last_meta


#: FLClassifier's MLP keys (under ``net.``) for the user module's keys (under ``body.``).
KEYS = {
    "body.0.weight": "net.hidden.0.weight",
    "body.0.bias": "net.hidden.0.bias",
    "body.2.weight": "net.classifier.weight",
    "body.2.bias": "net.classifier.bias",
}


@pytest.mark.parametrize(("name", "args"), [("fedavg", {}), ("scaffold", {}), ("fedprox", {"mu": MU}), ("feddyn", {})])
def test_with_sgd_the_callback_path_equals_fl_classifier_bit_for_bit(tmp_path, name, args):
    user, user_meta = fit_user(tmp_path / "user", name, args=args)
    classifier = FLClassifier(arch="mlp", lr=LR, arch_args={"hidden_sizes": (32,)})
    classifier.load_state_dict({KEYS[k]: v for k, v in UserModule().state_dict().items()})
    algorithm = build_client_algorithm(name, **args)
    algorithm.bind("site-1", ClientStateStore(tmp_path / "classifier", "site-1"))
    meta = server_meta()
    meta[meta_keys.SCAFFOLD_CTRL_GLOBAL] = {KEYS[k]: v for k, v in meta[meta_keys.SCAFFOLD_CTRL_GLOBAL].items()}
    callback = FederatedAlgorithm(algorithm, num_samples=N, site="site-1", meta_source=lambda: meta)
    torch.manual_seed(2)
    trainer(callback).fit(classifier, torch.utils.data.DataLoader(data(), batch_size=BATCH))
    trained = classifier.state_dict()
    for key, value in user.state_dict().items():
        torch.testing.assert_close(value, trained[KEYS[key]], atol=0, rtol=0)
    assert user_meta[meta_keys.NUM_STEPS] == callback.last_meta[meta_keys.NUM_STEPS] == N // BATCH
    assert user_meta[meta_keys.NUM_SAMPLES] == N
    assert user_meta[meta_keys.TRAIN_LOSS] == pytest.approx(callback.last_meta[meta_keys.TRAIN_LOSS], abs=1e-6)
    for key in (meta_keys.FEDNOVA_TAU, meta_keys.FEDNOVA_A_NORM):
        assert user_meta.get(key) == callback.last_meta.get(key)


def reference_adamw(pull: float, after_step_shift: float = 0.0) -> tuple[dict, float]:
    """Plain torch: AdamW on cross-entropy + a gradient pull ``pull * (w - w0)``, then ``w -= lr * shift``."""
    module = UserModule("adamw")
    start = {k: v.detach().clone() for k, v in module.named_parameters()}
    optimizer = module.configure_optimizers()
    torch.manual_seed(2)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH, shuffle=False)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(module.body(x), y).backward()
        with torch.no_grad():
            for name, p in module.named_parameters():
                # grad + pull * w - pull * w0, rounded as the algorithms do: Adam divides by sqrt(v), so a rounding
                # difference on a near-zero gradient entry becomes a visible difference in the step.
                p.grad.add_(p, alpha=pull).add_(start[name], alpha=-pull)
        optimizer.step()
        with torch.no_grad():
            for p in module.parameters():
                p -= LR * after_step_shift
    return {k: v.detach() for k, v in module.named_parameters()}, len(loader) * LR


@pytest.mark.parametrize(("name", "args", "pull"), [("fedprox", {"mu": MU}, MU), ("feddyn", {}, ALPHA)])
def test_gradient_terms_with_adamw_match_an_independent_loop(tmp_path, name, args, pull):
    module, meta = fit_user(tmp_path, name, "adamw", args)
    expected, _ = reference_adamw(pull)
    for key, value in module.named_parameters():
        torch.testing.assert_close(value.detach(), expected[key], atol=1e-6, rtol=0)
    assert meta_keys.FEDNOVA_TAU not in meta  # FedNova cannot describe an AdamW step: no report, the server refuses


def test_scaffold_with_adamw_matches_an_independent_loop_and_its_option_ii_control(tmp_path):
    # The paper's displacement estimator, selected explicitly: AdamW's default is the gradients estimator
    # (tests/lightning_modules/test_lm_scaffold_adaptive.py).
    module, meta = fit_user(tmp_path, "scaffold", "adamw", {"estimator": "displacement"})
    # c = 0.1 everywhere, c_i = 0: every step is followed by y <- y - lr * (c - c_i).
    expected, lr_sum = reference_adamw(0.0, after_step_shift=C)
    start = dict(UserModule().named_parameters())
    for key, value in module.named_parameters():
        torch.testing.assert_close(value.detach(), expected[key], atol=1e-6, rtol=0)
        # Option II: c_i+ = c_i - c + (x - y) / (sum of lr); the diff sent is c_i+ - c_i.
        diff = (start[key].detach() - expected[key]) / lr_sum - C
        np.testing.assert_allclose(meta[meta_keys.SCAFFOLD_CTRL_DIFF][key], diff.numpy(), atol=1e-5)


def test_a_module_without_task_loss_is_refused_for_fedmos_with_what_to_add(tmp_path):
    with pytest.raises(ClientAlgorithmError, match=r"site-1: client algorithm 'fedmos' needs .*task_loss\(batch"):
        fit_user(tmp_path, "fedmos")


def test_moon_without_the_loss_hook_is_refused_with_what_to_add(tmp_path):
    with pytest.raises(ClientAlgorithmError, match=r"'moon' needs the module UserModule to have an attribute net"):
        fit_user(tmp_path, "moon")


class MoonUserModule(UserModule):
    """A user module with a MOON-ready network but a training_step that forgets the contrastive term."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_modules.models import build_model

        self.net = build_model("mlp", num_classes=10, projection_dim=8)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)


def test_moon_refuses_a_training_step_without_its_loss_term_after_the_first_step(tmp_path):
    module = MoonUserModule()
    callback = FederatedAlgorithm(
        "moon",
        site="site-1",
        state_store=ClientStateStore(tmp_path, "site-1"),
        meta_source=lambda: {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r"},
    )
    with pytest.raises(ClientAlgorithmError, match=r"training_step must return loss \+ .*algorithm_loss"):
        trainer(callback).fit(module, torch.utils.data.DataLoader(data(), batch_size=BATCH))


def test_sample_count_defaults_to_the_dataset_and_meta_is_namespaced(tmp_path):
    _, meta = fit_user(tmp_path, "fedavg")
    assert meta[meta_keys.NUM_SAMPLES] == N and meta[meta_keys.CLIENT_ALGORITHM] == "fedavg"
    assert meta[meta_keys.PARAM_KEYS] == ["body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"]
    assert all(meta_keys.is_namespaced(key) for key in meta)


class PlainModule(pl.LightningModule):
    """A user's module written without the bundle's classifier: the same network, SGD, and only the protocols."""

    def __init__(self, arch_args) -> None:
        super().__init__()
        self.net = FLClassifier(arch="mlp", arch_args=arch_args, init_seed=0).net

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def task_loss(self, batch, params=None):
        x, y = batch
        logits = self.net(x) if params is None else torch.func.functional_call(self, dict(params), (x,))
        return F.cross_entropy(logits, y), logits

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        loss, logits = self.task_loss(batch)
        return loss + algorithm_loss(self, batch, logits)


@pytest.mark.parametrize("name", sorted(CLIENT_ALGORITHMS))
def test_every_algorithm_on_a_plain_module_equals_the_built_in_classifier(tmp_path, name):
    """The built-in FLClassifier vs a plain user module with the same network, both with the algorithm attached as
    the callback: the same weights bit for bit and the same meta (the classifier adds its training accuracy)."""
    arch_args = dict(CLIENT_ALGORITHMS[name].default_arch_args)
    meta = {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r", meta_keys.SCAFFOLD_CTRL_GLOBAL: {}, meta_keys.FEDDYN_ALPHA: 0.1}
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)

    built_in = FLClassifier(arch="mlp", lr=LR, arch_args=arch_args, init_seed=0)
    algorithm = build_client_algorithm(name)
    algorithm.bind("site-1", ClientStateStore(tmp_path / "a", "site-1"))
    reference = FederatedAlgorithm(algorithm, num_samples=N, site="site-1", meta_source=lambda: meta)
    torch.manual_seed(2)
    trainer(reference).fit(built_in, loader)

    attached = PlainModule(arch_args)
    callback = FederatedAlgorithm(
        name, site="site-1", state_store=ClientStateStore(tmp_path / "b", "site-1"), meta_source=lambda: meta
    )
    torch.manual_seed(2)
    trainer(callback).fit(attached, loader)

    for key, value in built_in.state_dict().items():
        torch.testing.assert_close(attached.state_dict()[key], value, atol=0, rtol=0)
    expected = {k: v for k, v in reference.last_meta.items() if k not in (meta_keys.FIT_SECONDS, "train.accuracy")}
    got = {k: v for k, v in callback.last_meta.items() if k != meta_keys.FIT_SECONDS}
    assert set(got) == set(expected)
    for key, value in expected.items():
        if isinstance(value, dict):
            for inner, array in value.items():
                np.testing.assert_array_equal(got[key][inner], array)
        elif key == meta_keys.TRAIN_LOSS:
            assert got[key] == pytest.approx(value, abs=1e-6)
        else:
            assert got[key] == value, key


class TaskLossOnlyModule(PlainModule):
    """A user module with task_loss and a training_step that returns the task loss alone (no algorithm_loss)."""

    def training_step(self, batch, batch_idx):
        return self.task_loss(batch)[0]


def test_fedmos_trains_a_module_whose_training_step_has_no_algorithm_loss(tmp_path):
    """FedMoS adds no loss term (it takes its batch from the callback's on_batch), so a module with task_loss but
    without algorithm_loss in training_step trains, bit for bit as one that adds the (zero) algorithm_loss."""
    assert not adds_loss_terms(build_client_algorithm("fedmos")) and adds_loss_terms(build_client_algorithm("moon"))
    meta = {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r"}
    fitted = {}
    for module in (TaskLossOnlyModule({}), PlainModule({})):
        callback = FederatedAlgorithm("fedmos", site="site-1", meta_source=lambda: meta)
        torch.manual_seed(2)
        trainer(callback).fit(module, torch.utils.data.DataLoader(data(), batch_size=BATCH))
        assert callback.last_meta[meta_keys.NUM_STEPS] == N // BATCH
        fitted[type(module).__name__] = module.state_dict()
    start = PlainModule({}).state_dict()
    for key, value in fitted["PlainModule"].items():
        torch.testing.assert_close(fitted["TaskLossOnlyModule"][key], value, atol=0, rtol=0)
        assert not torch.equal(value, start[key])  # it trained


def test_a_per_run_store_keeps_state_under_the_servers_run_id_across_jobs(tmp_path):
    """Sites keep state per federated run, not per NVFlare job: a job resumed under a new job id but the same run
    id (the server's checkpoint keeps it) reads the state of the run it continues; another run starts afresh."""

    def scaffold_round(run_id: str, round_num: int) -> FederatedAlgorithm:
        store = ClientStateStore(tmp_path, "site-1", per_run=True)  # a new process: a new store object
        meta = {**server_meta(), meta_keys.RUN_ID: run_id, meta_keys.ROUND: round_num}
        callback = FederatedAlgorithm("scaffold", site="site-1", state_store=store, meta_source=lambda: meta)
        trainer(callback).fit(UserModule(), torch.utils.data.DataLoader(data(), batch_size=BATCH))
        return callback

    scaffold_round("run-a", 0)
    first = ClientStateStore(tmp_path / "run-a", "site-1").latest("scaffold")
    assert first is not None and first.round_num == 0
    resumed = scaffold_round("run-a", 1)  # the same run, continued by a resumed job
    assert resumed.algorithm.state_store.root == tmp_path / "run-a"
    assert ClientStateStore(tmp_path / "run-a", "site-1").load("scaffold").round_num == 0  # round 0 committed
    scaffold_round("run-b", 0)
    assert ClientStateStore(tmp_path / "run-b", "site-1").latest("scaffold").round_num == 0
    assert not (tmp_path / "site-1").exists()  # nothing outside a run's folder
