"""MOON on a user's module trained with AdamW, through the FederatedAlgorithm callback, against an independent
plain-torch loop: the contrastive term written out here (cosine similarities, log-sum-exp), the frozen global and
previous local networks, AdamW stepping on cross-entropy + mu * l_con."""

from __future__ import annotations

import copy

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules import FederatedAlgorithm
from lightning_modules.algorithms.base import RUN_ID_KEY
from lightning_modules.federated import algorithm_loss
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

LR, MU, TAU = 0.01, 2.0, 0.5
N, BATCH, IN, CLASSES = 64, 16, 12, 4
SITE, RUN = "site-1", "run-a"


class MoonNet(nn.Module):
    """features -> projection head (z, what MOON contrasts) -> classifier."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.features = nn.Sequential(nn.Linear(IN, 16), nn.ReLU())
        self.projection = nn.Linear(16, 8)
        self.classifier = nn.Linear(8, CLASSES)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.features(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.embed(x))


class MoonUser(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = MoonNet(seed=0)

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        return F.cross_entropy(logits, y) + algorithm_loss(self, batch, logits)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)


def loader() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(N, IN, generator=generator), torch.arange(N) % CLASSES)
    return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)


def previous_local_model() -> dict[str, torch.Tensor]:
    """The site's model of an earlier round (another init): a negative that differs from the global model, so the
    contrastive term has a gradient (with the global model as its own negative it has none)."""
    return {k: v.detach().clone() for k, v in MoonNet(seed=7).state_dict().items()}


def fit_through_the_callback(tmp_path) -> tuple[MoonUser, dict]:
    store = ClientStateStore(tmp_path, SITE)
    store.save("moon", {RUN_ID_KEY: RUN, "models": [previous_local_model()]}, round_num=0)  # committed history
    meta = {meta_keys.ROUND: 1, meta_keys.RUN_ID: RUN}
    callback = FederatedAlgorithm(
        "moon", algorithm_args={"mu": MU, "temperature": TAU}, site=SITE, state_store=store, meta_source=lambda: meta
    )
    module = MoonUser()
    trainer = quiet_trainer(1, [callback])
    trainer.fit(module, loader())
    return module, callback.last_meta


def reference(mu: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch: AdamW on CE + mu * -log(e^{s+/tau} / (e^{s+/tau} + e^{s-/tau})), s = cosine similarity of z to
    the frozen global (s+) and previous local (s-) networks' z."""
    model = MoonUser()
    global_net = copy.deepcopy(model.net).eval().requires_grad_(False)
    previous = MoonNet(seed=1).eval().requires_grad_(False)
    previous.load_state_dict(previous_local_model())
    optimizer = model.configure_optimizers()
    task_losses = []
    for x, y in loader():
        optimizer.zero_grad()
        z = model.net.embed(x)
        task = F.cross_entropy(model.net.classifier(z), y)
        with torch.no_grad():
            z_global, z_previous = global_net.embed(x), previous.embed(x)
        positive = F.cosine_similarity(z, z_global, dim=1) / TAU
        negative = F.cosine_similarity(z, z_previous, dim=1) / TAU
        l_con = (torch.logsumexp(torch.stack([positive, negative]), dim=0) - positive).mean()
        (task + mu * l_con).backward()
        optimizer.step()
        task_losses.append(float(task.detach()))
    return {k: v.detach() for k, v in model.named_parameters()}, task_losses


def test_moon_with_adamw_matches_an_independent_loop(tmp_path):
    module, meta = fit_through_the_callback(tmp_path)
    expected, task_losses = reference(MU)
    for key, value in module.named_parameters():
        torch.testing.assert_close(value.detach(), expected[key], atol=1e-6, rtol=0)
    assert meta[meta_keys.MOON_HISTORY_MODELS] == 1 and meta[meta_keys.MOON_NUM_NEGATIVES] == 1
    assert meta[meta_keys.NUM_STEPS] == N // BATCH
    # The round's loss is the task loss alone (MOON's term is taken out of it).
    assert meta[meta_keys.TRAIN_LOSS] == pytest.approx(sum(task_losses) / len(task_losses), abs=1e-6)
    # The comparison has teeth: without the contrastive term the weights end elsewhere.
    without_moon, _ = reference(0.0)
    assert max(float((expected[k] - without_moon[k]).abs().max()) for k in expected) > 1e-4
