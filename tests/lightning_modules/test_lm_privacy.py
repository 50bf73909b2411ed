"""DP-SGD at a site (lightning_modules/privacy/): closed-form checks of the clipping, the noise and the accountant,
and the ledger across process restarts (docs/privacy.md)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

pytest.importorskip("opacus")

from aggregators.contracts import meta_keys
from lightning_modules.federated import FederatedAlgorithm
from lightning_modules.privacy import PrivacyConfig
from lightning_modules.privacy.accountant import Segment, epsilon, noise_for_budget
from lightning_modules.privacy.dp_sgd import DPSGD, PrivacyBudgetExhausted, poisson_loader
from lightning_modules.privacy.ledger import LEDGER_NAME, LedgerError
from lightning_modules.privacy.release import RELEASED, SITE_SCORES, release, status_of, unaccounted_keys
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer

SITE, RUN = "site-1", "run-a"


# -- the accountant against an independent computation ---------------------------------------------------------------
def sampled_gaussian_rdp(q: float, sigma: float, alpha: int) -> float:
    """RDP of one step of the Poisson-sampled Gaussian at integer order alpha (Mironov, Talwar, Zhang 2019):
    log(sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 sigma^2))) / (alpha - 1), in log space."""
    terms = [
        math.lgamma(alpha + 1)
        - math.lgamma(k + 1)
        - math.lgamma(alpha - k + 1)
        + (alpha - k) * math.log1p(-q)
        + k * math.log(q)
        + (k * k - k) / (2 * sigma**2)
        for k in range(alpha + 1)
    ]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


def independent_epsilon(segments: list[tuple[float, float, int]], delta: float, orders: list[int]) -> float:
    """Balle et al. 2020's conversion of the summed RDP, minimised over the orders."""
    best = math.inf
    for a in orders:
        rdp = sum(steps * sampled_gaussian_rdp(q, sigma, a) for q, sigma, steps in segments)
        best = min(best, rdp + math.log1p(-1 / a) - (math.log(delta) + math.log(a)) / (a - 1))
    return best


@pytest.mark.parametrize(
    "segments",
    [[(0.01, 1.1, 1000)], [(0.05, 0.8, 300)], [(0.1, 2.0, 40), (0.02, 1.0, 500)]],
)
def test_epsilon_matches_an_independent_rdp_computation(segments):
    orders = list(range(2, 64))
    ours = epsilon([Segment(*s) for s in segments], 1e-5, orders=orders)
    assert ours == pytest.approx(independent_epsilon(segments, 1e-5, orders), rel=1e-6)


def test_reference_point_and_edge_cases():
    # q = 0.01, sigma = 1.1, T = 1000, delta = 1e-5: RDP epsilon 1.71 (Opacus's RDPAccountant, measured)
    assert epsilon([Segment(0.01, 1.1, 1000)], 1e-5) == pytest.approx(1.71, abs=0.005)
    assert epsilon([], 1e-5) == 0.0
    assert epsilon([Segment(0.1, 0.0, 3)], 1e-5) == math.inf
    # segments compose: two halves give what the whole gives
    whole = epsilon([Segment(0.02, 1.0, 400)], 1e-5)
    assert epsilon([Segment(0.02, 1.0, 150), Segment(0.02, 1.0, 250)], 1e-5) == pytest.approx(whole, rel=1e-12)


def test_noise_for_budget_is_the_smallest_sigma_within_the_budget():
    sigma = noise_for_budget(3.0, 1e-5, 0.05, 600, tolerance=1e-4)
    assert epsilon([Segment(0.05, sigma, 600)], 1e-5) <= 3.0
    assert epsilon([Segment(0.05, sigma * (1 - 2e-4), 600)], 1e-5) > 3.0
    with pytest.raises(ValueError, match="no noise multiplier"):
        noise_for_budget(1e-6, 1e-5, 1.0, 10_000)


# -- DP-SGD inside a Lightning fit -----------------------------------------------------------------------------------
class Linear(pl.LightningModule):
    def __init__(self, d_in: int = 5, d_out: int = 3, lr: float = 0.5, zero_loss: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(d_in, d_out)
        self.lr, self.zero_loss = lr, zero_loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.layer(x), y)
        return 0.0 * loss if self.zero_loss else loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data(n: int = 8, d_in: int = 5, d_out: int = 3, seed: int = 1) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, d_in, generator=g) * 3, torch.randint(0, d_out, (n,), generator=g)
    )


def round_meta(round_num: int, num_rounds: int = 3, aggregated: bool = False) -> dict[str, Any]:
    meta = {meta_keys.ROUND: round_num, meta_keys.NUM_ROUNDS: num_rounds, meta_keys.RUN_ID: RUN}
    if aggregated:
        meta[meta_keys.LAST_AGGREGATED] = {SITE: round_num - 1}
    return meta


def fit(
    module: pl.LightningModule,
    dataset,
    privacy: DPSGD | None,
    meta: dict[str, Any],
    batch_size: int,
    epochs: int = 1,
    precision: str = "32-true",
) -> dict[str, Any]:
    """One round as a site runs it: the algorithm callback (with DP-SGD), a Poisson loader when private."""
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)
    if privacy is not None:
        loader = poisson_loader(loader)
    store = privacy.state_store if privacy is not None else None
    callback = FederatedAlgorithm("fedavg", site=SITE, state_store=store, meta_source=lambda: meta, privacy=privacy)
    trainer = quiet_trainer(epochs, [callback], precision=precision)
    trainer.fit(module, train_dataloaders=loader)
    return callback.last_meta


def dpsgd(tmp_path, sigma: float | None = 0.0, clip: float = 1e6, target: float | None = None) -> DPSGD:
    config = PrivacyConfig(max_grad_norm=clip, noise_multiplier=sigma, target_epsilon=target)
    return DPSGD(config, SITE, ClientStateStore(tmp_path, SITE, per_run=True))


def per_sample_gradients(module: Linear, dataset) -> list[torch.Tensor]:
    """Each sample's gradient of its own loss, flattened over all parameters (a loop, no Opacus)."""
    grads = []
    for x, y in dataset:
        module.zero_grad()
        nn.functional.cross_entropy(module.layer(x[None]), y[None]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in module.parameters()]))
    return grads


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def test_without_noise_and_clipping_the_weights_equal_non_private_training(tmp_path):
    # q = 1 (one batch of all n samples per step): Opacus's division by the expected batch size n is the mean.
    dataset = data()
    private, plain = Linear(), Linear()
    fit(private, dataset, dpsgd(tmp_path), round_meta(0), batch_size=len(dataset), epochs=3)
    fit(plain, dataset, None, round_meta(0), batch_size=len(dataset), epochs=3)
    assert torch.allclose(flat(private), flat(plain), atol=1e-6, rtol=0)
    assert not torch.equal(flat(plain), flat(Linear()))


def test_every_per_sample_gradient_is_clipped_to_c(tmp_path):
    dataset, clip = data(), 0.05
    module, reference = Linear(), Linear()
    grads = per_sample_gradients(reference, dataset)
    assert min(float(g.norm()) for g in grads) > clip  # every sample is clipped
    clipped = torch.stack([g * min(1.0, clip / (float(g.norm()) + 1e-6)) for g in grads])
    expected = flat(Linear()) - module.lr * clipped.sum(0) / len(dataset)
    fit(module, dataset, dpsgd(tmp_path, clip=clip), round_meta(0), batch_size=len(dataset))
    assert torch.allclose(flat(module), expected, atol=1e-6, rtol=0)


def test_noise_std_is_sigma_c_over_the_expected_batch_size(tmp_path):
    # A loss with zero gradient: the step is -lr * N(0, sigma^2 C^2) / B on every coordinate.
    sigma, clip, n, width = 2.0, 3.0, 16, 300
    dataset = data(n=n, d_in=width, d_out=width)
    module = Linear(d_in=width, d_out=width, lr=1.0, zero_loss=True)
    before = flat(module)
    fit(module, dataset, dpsgd(tmp_path, sigma=sigma, clip=clip), round_meta(0), batch_size=n)
    noise = (before - flat(module)).numpy()
    assert noise.size > 90_000  # relative standard error of the std: 1 / sqrt(2 * size) < 0.25 %
    assert float(noise.std()) == pytest.approx(sigma * clip / n, rel=0.015)
    assert abs(float(noise.mean())) < 5 * sigma * clip / n / math.sqrt(noise.size)


def test_the_ledger_counts_every_step_across_process_restarts(tmp_path):
    dataset, sigma = data(n=40), 1.3
    steps_per_round = 5  # batch 8 of 40: q = 1/5, 5 batches an epoch
    for round_num in range(3):  # a fresh module, callback, DPSGD and store each round: a process per round
        meta = fit(
            Linear(),
            dataset,
            dpsgd(tmp_path, sigma=sigma, clip=1.0),
            round_meta(round_num, aggregated=round_num > 0),
            8,
        )
        total = steps_per_round * (round_num + 1)
        assert meta[meta_keys.PRIVACY_STEPS] == total
        assert meta[meta_keys.PRIVACY_SAMPLE_RATE] == pytest.approx(0.2)
        assert meta[meta_keys.PRIVACY_NOISE_MULTIPLIER] == sigma
        assert meta[meta_keys.PRIVACY_DELTA] == 1e-5
        assert meta[meta_keys.PRIVACY_EPSILON] == pytest.approx(epsilon([Segment(0.2, sigma, total)], 1e-5), rel=1e-12)
    # withheld: the training loss (computed on the data outside DP), listed by name
    assert meta_keys.TRAIN_LOSS not in meta and meta[meta_keys.PRIVACY_WITHHELD] == [meta_keys.TRAIN_LOSS]
    assert meta[meta_keys.NUM_SAMPLES] == 40  # stated public


def test_a_missing_or_corrupt_ledger_stops_the_site_and_never_restarts_at_zero(tmp_path):
    dataset = data(n=40)
    fit(Linear(), dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(0), 8)
    store = ClientStateStore(tmp_path, SITE, per_run=True)
    store.use_run(RUN)
    ledger_file = store.path(LEDGER_NAME)
    raw = ledger_file.read_bytes()
    ledger_file.write_bytes(raw[:-3] + b"xyz")
    with pytest.raises(
        LedgerError, match=r"site-1: privacy ledger .* is corrupt .* never|site-1: privacy ledger .*corrupt"
    ):
        fit(Linear(), dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(1, aggregated=True), 8)
    ledger_file.unlink()
    with pytest.raises(LedgerError, match=r"site-1: privacy ledger .* is missing although the server received"):
        fit(Linear(), dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(1, aggregated=True), 8)
    assert not ledger_file.exists()  # nothing was written: the count was not restarted


def test_a_ledger_restored_from_an_old_backup_stops_the_site(tmp_path):
    """The stale-ledger attack: the site's ledger is backed up after round 0, round 1 trains and releases, then the
    backup is restored (as a site does after losing its disk). Without the server's record the old ledger is taken
    and the site reports the epsilon of 10 steps after releasing 15; with it (the server broadcasts each site's last
    ``privacy.steps``) the site stops before training and writes nothing."""
    dataset = data(n=40)
    store = ClientStateStore(tmp_path, SITE, per_run=True)
    store.use_run(RUN)
    fit(Linear(), dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(0), 8)
    backup = store.path(LEDGER_NAME).read_bytes()
    released = fit(Linear(), dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(1, aggregated=True), 8)
    assert released[meta_keys.PRIVACY_STEPS] == 10
    store.path(LEDGER_NAME).write_bytes(backup)  # restored: 5 steps
    server = {**round_meta(2, aggregated=True), meta_keys.RELEASED_STEPS: {SITE: released[meta_keys.PRIVACY_STEPS]}}
    with pytest.raises(LedgerError, match=r"site-1: privacy ledger .* is stale: it holds 5 DP-SGD steps .* after 10"):
        fit(Linear(), dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), server, 8)
    assert store.path(LEDGER_NAME).read_bytes() == backup  # nothing trained, nothing written
    # The attack without the server's record: the stale ledger is accepted and under-reports (10 of 15 steps).
    fooled = fit(Linear(), dataset, dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(2, aggregated=True), 8)
    assert fooled[meta_keys.PRIVACY_STEPS] == 10 and fooled[meta_keys.PRIVACY_EPSILON] < epsilon(
        [Segment(0.2, 1.0, 15)], 1e-5
    )


def test_a_site_whose_next_round_would_exceed_the_budget_stops(tmp_path):
    dataset, sigma = data(n=40), 1.0
    one_round = epsilon([Segment(0.2, sigma, 5)], 1e-5)
    two_rounds = epsilon([Segment(0.2, sigma, 10)], 1e-5)
    target = (one_round + two_rounds) / 2
    meta = fit(Linear(), dataset, dpsgd(tmp_path, sigma=sigma, clip=1.0, target=target), round_meta(0), 8)
    assert meta[meta_keys.PRIVACY_EPSILON] == pytest.approx(one_round)
    with pytest.raises(PrivacyBudgetExhausted, match=r"site-1: privacy budget: .* > dp_target_epsilon .* stops"):
        fit(Linear(), dataset, dpsgd(tmp_path, sigma=sigma, clip=1.0, target=target), round_meta(1, aggregated=True), 8)
    store = ClientStateStore(tmp_path, SITE, per_run=True)
    store.use_run(RUN)
    assert store.load(LEDGER_NAME).state["segments"] == [[0.2, sigma, 5]]  # the refused round spent nothing


def test_a_target_epsilon_calibrates_sigma_for_the_planned_rounds(tmp_path):
    dataset, rounds, target = data(n=40), 3, 4.0
    for round_num in range(rounds):
        meta = fit(
            Linear(),
            dataset,
            dpsgd(tmp_path, sigma=None, clip=1.0, target=target),
            round_meta(round_num, rounds, round_num > 0),
            8,
        )
    assert meta[meta_keys.PRIVACY_STEPS] == 15
    assert target * 0.99 < meta[meta_keys.PRIVACY_EPSILON] <= target
    # The site tells the server its budget and what a fourth round (5 more steps) would reach: over the budget.
    sigma = meta[meta_keys.PRIVACY_NOISE_MULTIPLIER]
    assert meta[meta_keys.PRIVACY_TARGET_EPSILON] == target
    assert meta[meta_keys.PRIVACY_NEXT_EPSILON] == pytest.approx(epsilon([Segment(0.2, sigma, 20)], 1e-5), rel=1e-12)
    assert meta[meta_keys.PRIVACY_NEXT_EPSILON] > target


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_precisions(tmp_path, precision):
    meta = fit(Linear(), data(n=40), dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(0), 8, precision=precision)
    assert meta[meta_keys.PRIVACY_STEPS] == 5


def test_a_round_without_poisson_sampling_is_refused(tmp_path):
    from lightning_modules.algorithms.errors import ClientAlgorithmError

    module, privacy = Linear(), dpsgd(tmp_path, sigma=1.0, clip=1.0)
    loader = torch.utils.data.DataLoader(data(), batch_size=4)
    callback = FederatedAlgorithm("fedavg", site=SITE, meta_source=lambda: round_meta(0), privacy=privacy)
    trainer = pl.Trainer(
        max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False, accelerator="cpu"
    )
    with pytest.raises(ClientAlgorithmError, match="site-1: DP-SGD needs Poisson sampling"):
        trainer.fit(module, train_dataloaders=loader)


# -- what leaves a site ----------------------------------------------------------------------------------------------
def test_every_meta_key_the_bundle_sends_has_a_status():
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    sent = {value for name, value in vars(meta_keys).items() if name.isupper() and isinstance(value, str)}
    sent -= {meta_keys.ROUND, meta_keys.NUM_ROUNDS, meta_keys.AGGREGATION_RULE, meta_keys.RUN_ID}
    sent -= {meta_keys.LAST_AGGREGATED, meta_keys.LAST_RELEASED, meta_keys.RELEASED_STEPS}  # server -> client
    sent -= {meta_keys.SCAFFOLD_CTRL_GLOBAL}
    sent -= {meta_keys.FEDDYN_ALPHA}
    sent |= {key for cls in CLIENT_ALGORITHMS.values() for key in cls.sent_meta}
    unknown = sorted(key for key in sent if status_of(key).pattern == "*")
    assert unknown == [], f"add these keys to lightning_modules/privacy/release.py RELEASED: {unknown}"


def test_release_withholds_unprotected_statistics():
    meta = {
        meta_keys.NUM_SAMPLES: 10,
        meta_keys.TRAIN_LOSS: 0.3,
        meta_keys.TRAIN_ACCURACY: 0.9,
        "eval.val_accuracy": 0.8,
        meta_keys.SCAFFOLD_CTRL_DIFF: {},
        "mine.statistic": 1.0,
    }
    kept, withheld = release(meta)
    assert set(kept) == {meta_keys.NUM_SAMPLES, meta_keys.SCAFFOLD_CTRL_DIFF}
    assert withheld == sorted([meta_keys.TRAIN_LOSS, meta_keys.TRAIN_ACCURACY, "eval.val_accuracy", "mine.statistic"])
    assert RELEASED[-1].pattern == "*" and RELEASED[-1].status == "withheld"


def test_the_round_record_carries_privacy_per_site():
    from aggregators.types import ClientUpdate
    from controllers.engine import site_metrics

    update = ClientUpdate(
        site=SITE,
        params={},
        num_samples=4,
        meta={meta_keys.PRIVACY_EPSILON: 1.5, meta_keys.PRIVACY_STEPS: 7, meta_keys.PRIVACY_WITHHELD: ["train.loss"]},
    )
    assert site_metrics([update])["privacy"] == {SITE: {"epsilon": 1.5, "steps": 7}}
    assert "privacy" not in site_metrics([ClientUpdate(site=SITE, params={}, num_samples=4, meta={})])


def test_the_report_shows_epsilon_per_site_per_round():
    from controllers.report import privacy_table

    records = [
        {"stage": "initial"},
        {
            "stage": "round",
            "round": 0,
            "privacy": {"site-1": {"epsilon": 1.5, "delta": 1e-5}, "site-2": {"epsilon": 2.25, "delta": 1e-5}},
        },
        {"stage": "round", "round": 1, "privacy": {"site-1": {"epsilon": 2.0, "delta": 1e-5}}},
    ]
    assert privacy_table(records).splitlines() == [
        "epsilon per site (delta 1e-05):",
        "round    site-1    site-2",
        "    1    1.5000    2.2500",
        "    2    2.0000         -",
    ]
    assert privacy_table([{"stage": "round", "round": 0}]) is None


def test_an_empty_poisson_batch_takes_a_noise_only_step_in_the_built_in_classifier(tmp_path):
    # Poisson sampling at q = 1/4 over 4 records leaves a batch empty with probability 0.32: the built-in classifier
    # must return a zero loss the backward runs through (the DP step still adds its noise) and leave its metrics.
    from lightning_modules.classifier import FLClassifier

    module = FLClassifier(arch="mlp", init_seed=0)
    empty = (torch.zeros(0, 64), torch.zeros(0, dtype=torch.int64))
    loss = module.training_step(empty, 0)
    assert float(loss) == 0.0 and loss.requires_grad
    loss.backward()
    assert all(p.grad is not None and not p.grad.abs().sum() for p in module.parameters())
    assert math.isnan(module.fl_round_metrics()["loss"])  # nothing was measured
    # A whole private round over many empty batches (12 steps at q = 1/4) finishes with finite weights.
    x, y = torch.rand(4, 64), torch.randint(0, 10, (4,))
    fit(module, torch.utils.data.TensorDataset(x, y), dpsgd(tmp_path, sigma=1.0, clip=1.0), round_meta(0), 1, 3)
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_site_scores_leave_a_dp_site_only_when_the_job_releases_them_unaccounted():
    meta = {meta_keys.NUM_SAMPLES: 10, "eval.val_accuracy": 0.8, meta_keys.TRAIN_LOSS: 0.3}
    kept, withheld = release(meta, [SITE_SCORES])
    assert set(kept) == {meta_keys.NUM_SAMPLES, "eval.val_accuracy"} and withheld == [meta_keys.TRAIN_LOSS]
    assert unaccounted_keys(kept) == ["eval.val_accuracy"]


@pytest.mark.parametrize("released", [False, True])
def test_a_dp_site_keeps_its_validation_scores_unless_the_job_names_the_unaccounted_release(tmp_path, released):
    from benchmarks.in_process import site_args
    from jobs.spec import JobSpec
    from lightning_modules.classifier import FLClassifier
    from lightning_modules.site import build_site_round

    spec = JobSpec(
        name="scores",
        dataset="digits",
        arch="mlp",
        site_val_fraction=0.25,
        dp_noise_multiplier=1.0,
        dp_max_grad_norm=1.0,
        dp_release_site_scores=released,
    )
    args = site_args(spec)
    args.accelerator = "cpu"
    x, y = np.random.default_rng(0).random((40, 64), dtype=np.float32), np.arange(40) % 10
    site = build_site_round(args, SITE, 0, x, y, 10, ClientStateStore(tmp_path, SITE))
    start = {k: v.numpy().copy() for k, v in FLClassifier(arch="mlp", init_seed=0).state_dict().items()}
    _, meta = site.train(0, start, round_meta(0))
    scores = sorted(key for key in meta if key.startswith("eval."))
    if released:
        assert scores and meta[meta_keys.PRIVACY_UNACCOUNTED] == scores
    else:
        assert scores == [] and meta_keys.PRIVACY_UNACCOUNTED not in meta
        assert {"eval.val_accuracy", "eval.val_loss"} <= set(meta[meta_keys.PRIVACY_WITHHELD])


def test_releasing_site_scores_without_dp_is_refused_at_build_time():
    from jobs.settings import JobBuildError
    from jobs.spec import JobSpec

    with pytest.raises(JobBuildError, match="dp_release_site_scores is set but DP-SGD is off"):
        JobSpec(name="scores", dataset="digits", arch="mlp", dp_release_site_scores=True)


def test_the_server_records_which_final_scores_a_dp_site_withheld():
    from types import SimpleNamespace

    from controllers.fedalg_controller import withheld_scores

    assert withheld_scores(SimpleNamespace(meta={meta_keys.PRIVACY_WITHHELD: ["val_accuracy"]})) == ["val_accuracy"]
    assert withheld_scores(SimpleNamespace(meta=None)) == () == withheld_scores(SimpleNamespace())
