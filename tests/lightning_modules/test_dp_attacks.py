"""DP-SGD against the adversary of its threat model, on the site's real round (``SiteRound.train``).

The adversary knows the job's configuration (its ``--seed`` included), the model the site received, the server's
meta and every record but one. Two attacks an independent review ran against an earlier version, whose Poisson
sample and noise came from torch's generators seeded by (job seed, site, round):

- **replay**: run the site's round again with every record, and again without the target record; the replay that
  reproduces the released model tells membership. On the job-seeded version the replay with the record was exact
  (max |difference| 0.0): an effective epsilon of infinity whatever the ledger said.
- **noise subtraction**: the server runs a dummy site of the same size with C -> 0 and sigma' C' = sigma C, so it
  draws the same noise with no signal, and subtracts it from the release: it recovered the site's noiseless clipped
  gradient sum.

Each attack runs twice: against the code as it is, where it must fail (the release differs from any replay by
about the noise scale), and against the job-seeded variant (the secret seed source replaced by the job's seed),
where it must succeed, which shows the test would have caught the old seeding.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks.in_process import site_args
from jobs.spec import JobSpec
from lightning_modules import privacy
from lightning_modules.site import build_site_round, round_seed
from lightning_modules.state_store import ClientStateStore

pytest.importorskip("opacus")

SITE, N, LR, SIGMA, CLIP = "site-1", 48, 0.1, 1.0, 1.0
META = {"server.round": 0, "server.num_rounds": 1, "server.run_id": "attack"}


def records(n: int = N, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64)


def released(
    tmp_path, name: str, x: np.ndarray, y: np.ndarray, batch_size: int, sigma: float = SIGMA, clip: float = CLIP
) -> tuple[dict[str, np.ndarray], int]:
    """The model a DP site releases after one round from the common global model, and its expected batch size."""
    spec = JobSpec(
        name="attack",
        dataset="digits",
        arch="mlp",
        lr=LR,
        batch_size=batch_size,
        dp_noise_multiplier=sigma,
        dp_max_grad_norm=clip,
    )
    args = site_args(spec)
    args.accelerator = "cpu"
    site = build_site_round(args, SITE, 0, x, y, 10, ClientStateStore(tmp_path / name, SITE))
    params, _ = site.train(0, initial_model(), META)
    expected_batch = int(len(y) * (1 / math.ceil(len(y) / batch_size)))
    return params, expected_batch


def initial_model() -> dict[str, np.ndarray]:
    """The server's global model: the same for the site and every replay."""
    from lightning_modules.classifier import FLClassifier

    return {k: v.numpy().copy() for k, v in FLClassifier(arch="mlp", init_seed=7).state_dict().items()}


def distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a))


def num_params(params: dict[str, np.ndarray]) -> int:
    return sum(v.size for v in params.values())


@pytest.fixture(params=["secret", "job-seeded"])
def seeding(request, monkeypatch) -> str:
    """``secret``: the code as it is. ``job-seeded``: every privacy draw seeded from the job's seed, as before."""
    if request.param == "job-seeded":
        monkeypatch.setattr(privacy.secret, "entropy_seed", lambda: round_seed(0, 0, 0))
    return request.param


def test_replaying_the_round_neither_reproduces_the_release_nor_tells_membership(tmp_path, seeding):
    x, y = records()
    batch = 12  # q = 1/4: 4 Poisson batches of about 12
    release, expected_batch = released(tmp_path, "site", x, y, batch)
    replay_with, _ = released(tmp_path, "with", x, y, batch)  # the adversary's replay with the target record
    replay_without, _ = released(tmp_path, "without", x[1:], y[1:], batch)  # and without it
    near_with, near_without = distance(release, replay_with), distance(release, replay_without)
    if seeding == "job-seeded":  # the attack succeeds: an exact replay, membership decided
        assert near_with == 0.0 < near_without
        return
    # Secret draws: the release differs from the replay by about two independent noise draws, sqrt(2) lr sigma C
    # sqrt(T d) / B over T = 4 steps and d parameters, and removing one record changes nothing the attack can see.
    noise_scale = LR * SIGMA * CLIP * math.sqrt(4 * num_params(release)) / expected_batch
    assert near_with > 0.5 * noise_scale
    assert abs(near_with - near_without) < 0.1 * near_with


def test_subtracting_a_dummy_sites_noise_does_not_recover_the_clipped_gradient_sum(tmp_path, seeding):
    # One step at q = 1 (batch >= n): release = x - lr (S + noise) / B, S the sum of the clipped gradients.
    x, y = records()
    release, _ = released(tmp_path, "site", x, y, N, sigma=2.0)
    clean, _ = released(tmp_path, "clean", x, y, N, sigma=0.0)  # x - lr S / B: what the attacker is after
    # The server's dummy site: the same size, no signal (C' tiny), the same noise std sigma' C' = sigma C.
    tiny = 1e-9
    dummy, _ = released(tmp_path, "dummy", np.zeros_like(x), np.zeros_like(y), N, sigma=2.0 / tiny, clip=tiny)
    start = initial_model()
    # release - dummy + x = x - lr (S + noise - noise') / B: the clean step when the two noises are the same draw.
    estimate = {k: release[k].astype(np.float64) - dummy[k] + start[k] for k in release}
    error = distance(estimate, clean) / distance(clean, start)
    if seeding == "job-seeded":  # the attack succeeds: the noiseless step, up to float rounding
        assert error < 1e-3
    else:  # the noise (norm about sqrt(2 d) sigma C lr / B) swamps the step (norm at most lr C n / B)
        assert error > 1.0


def overfitted_loss_attack_auc(trained_on: slice) -> float:
    """The loss attack's AUC, records 0-39 as members and 40-79 as non-members, against a net that memorised the
    random labels of ``trained_on``."""
    from benchmarks.privacy import attack_metrics

    torch.manual_seed(0)
    x, y = torch.randn(120, 20), torch.randint(0, 10, (120,))  # random labels: nothing to learn but the records
    net = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-2)
    for _ in range(300):
        optimizer.zero_grad()
        F.cross_entropy(net(x[trained_on]), y[trained_on]).backward()
        optimizer.step()
    with torch.no_grad():
        scores = -F.cross_entropy(net(x[:80]), y[:80], reduction="none").numpy()  # low loss: member
    return attack_metrics(scores, np.arange(80) < 40)["auc"]


def test_the_membership_attack_detects_leakage_on_an_overfitted_model():
    """The attack code has power: a model that memorised its records gives them a far lower loss ..."""
    assert overfitted_loss_attack_auc(slice(0, 40)) > 0.95
    # ... and no false alarm: the same model trained on other records does not tell the two halves apart.
    assert 0.3 < overfitted_loss_attack_auc(slice(80, 120)) < 0.7


def test_a_poisson_loader_the_job_can_replay_is_refused(tmp_path):
    """A user's own DPDataLoader over a seeded generator (or torch's global one) would be replayable: refused."""
    from opacus.data_loader import DPDataLoader

    from lightning_modules.privacy.dp_sgd import _sampler_problem, poisson_data_module, poisson_loader

    x, y = records()
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(dataset, batch_size=12)
    for generator in (torch.Generator().manual_seed(0), None):
        seeded = DPDataLoader.from_data_loader(loader, generator=generator)
        problem = _sampler_problem(seeded.batch_sampler)
        assert problem and "replay" in problem and "poisson_loader" in problem
    assert _sampler_problem(poisson_loader(loader).batch_sampler) is None

    class Data(torch.nn.Module):  # a user's data module, reduced to what the wrapper calls
        def train_dataloader(self):
            return loader

    wrapped = poisson_data_module(Data())  # a user model's site under DP trains on this
    assert _sampler_problem(wrapped.train_dataloader().batch_sampler) is None
