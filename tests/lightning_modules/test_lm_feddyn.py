"""FedDyn client (and client + server rule together): closed forms of docs/algorithms.md, FedDyn, agreement with an
independent
numpy reference written in the paper's form, H_k persisted across restarts and runs, hook path == the authors'
explicit loss in a real Lightning fit, alpha_k weighting, bad meta and hyperparameters."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from aggregators.contracts import meta_keys
from aggregators.feddyn import FedDyn as FedDynRule
from aggregators.registry import RULES
from aggregators.types import ClientUpdate, RoundContext
from jobs.build import PRESETS, JobBuildError, JobSpec, _check_composition
from lightning_modules import FederatedAlgorithm, FLClassifier
from lightning_modules.algorithms import CLIENT_ALGORITHMS, ClientAlgorithm, ClientAlgorithmError
from lightning_modules.algorithms.base import RUN_ID_KEY
from lightning_modules.algorithms.feddyn import FedDyn
from lightning_modules.state_store import ClientStateStore, StateStoreError
from tests.helpers import Quadratic, fit_under, small_mlp, toy_loader, weights

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

ETA, K = 0.1, 3
DATA_AND_MODEL_FIELDS = {f.name for f in fields(JobSpec)} - {"name", "client", "client_args", "server", "server_args"}
# docs/algorithms.md, FedDyn: L_k = h_k/2 (theta - a_k)^2 with h = (1, 3), a = (0, 4); alpha = 1; m = |P| = 2.
CURVATURE = {"site-1": 1.0, "site-2": 3.0, "site-3": 2.0}
TARGET = {"site-1": 0.0, "site-2": 4.0, "site-3": -1.0}


def make(tmp_path, site: str = "site-1", **hparams: Any) -> FedDyn:
    algorithm = CLIENT_ALGORITHMS["feddyn"](**hparams)
    algorithm.bind(site, ClientStateStore(tmp_path, site))
    return algorithm


def meta(alpha: Any = 1.0, round_num: int = 0, run_id: str = "run-a") -> dict[str, Any]:
    return {meta_keys.FEDDYN_ALPHA: alpha, meta_keys.ROUND: round_num, meta_keys.RUN_ID: run_id}


def local_round(algorithm: FedDyn, w0: float, site: str, server_meta: Mapping[str, Any], steps: int = K):
    """Drive the hooks as the FederatedAlgorithm callback does (backward, correction, step) on L_k of ``site``."""
    module = Quadratic(w0)
    optimizer = torch.optim.SGD(module.parameters(), lr=ETA)
    algorithm.on_round_start(module, server_meta)
    for _ in range(steps):
        optimizer.zero_grad()
        (0.5 * CURVATURE[site] * (module.w - TARGET[site]) ** 2).sum().backward()
        algorithm.correct_gradients(module, optimizer)
        optimizer.step()
        algorithm.after_step(module, optimizer)
    return module, algorithm.on_round_end(module)


def stored_h(tmp_path, site: str) -> float:
    return ClientStateStore(tmp_path, site).latest("feddyn").state["w"].item()


def paper_feddyn(participants: Sequence[Sequence[str]], alpha: float, m: int, steps: int):
    """Independent reference in the PAPER's form (Algorithm 1): per-client grad L_k(theta_k^{t-1}) and server h.

    Local problem solved by ``steps`` SGD steps on L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2;
    g_k <- g_k - alpha (theta_k - theta^{t-1});  h <- h - alpha/m sum_P (theta_k - theta^{t-1});
    theta <- mean_P theta_k - h / alpha.
    """
    theta, h, g = 0.0, 0.0, dict.fromkeys(CURVATURE, 0.0)
    history = []
    for chosen in participants:
        local = {}
        for k in chosen:
            x = theta
            for _ in range(steps):
                x -= ETA * (CURVATURE[k] * (x - TARGET[k]) - g[k] + alpha * (x - theta))
            local[k] = x
        for k in chosen:
            g[k] -= alpha * (local[k] - theta)
        h -= alpha / m * sum(local[k] - theta for k in chosen)
        theta = float(np.mean([local[k] for k in chosen])) - h / alpha
        history.append((theta, local, dict(g)))
    return history


def run_federation(tmp_path, participants: Sequence[Sequence[str]], alpha: float, population: int, steps: int = K):
    """Client hooks (a fresh FedDyn object per client-round: only the state store links rounds) + the server rule."""
    rule = FedDynRule(alpha=alpha)
    context_sites = tuple(sorted(CURVATURE))[:population]
    global_params = {"w": np.zeros(1, np.float32), "running_mean": np.array([7.0], np.float32)}
    state = rule.init_state(global_params)
    history = []
    for round_num, chosen in enumerate(participants):
        broadcast = {**rule.broadcast_meta(state), meta_keys.ROUND: round_num, meta_keys.RUN_ID: "run-a"}
        updates, local = [], {}
        for site in chosen:
            module, out = local_round(make(tmp_path, site), float(global_params["w"][0]), site, broadcast, steps)
            local[site] = module.w.item()
            params = {k: v.detach().numpy().copy() for k, v in module.state_dict().items() if k != "frozen"}
            updates.append(ClientUpdate(site=site, params=params, num_samples=10, meta=out))
            assert rule.update_problems(updates[-1], global_params, state) == []
        context = RoundContext(round_num=round_num, num_rounds=len(participants), population=context_sites)
        result = rule.aggregate(global_params, updates, state, context)
        global_params, state = result.params, result.state
        history.append((float(global_params["w"][0]), local))
    return history, state


# --------------------------------------------------------------------------------------------------------------------
# closed forms


def test_first_round_closed_form(tmp_path):
    # site-2 (h = 3, a = 4) from theta_server = 0 with H = 0, alpha = 1: gradient 3(t - 4) + t = 4t - 12.
    # t = 1.2, 1.92, 2.352; H = 0 + 2.352.
    module, out = local_round(make(tmp_path, "site-2"), 0.0, "site-2", meta())
    assert module.w.item() == pytest.approx(2.352, abs=1e-6)
    assert stored_h(tmp_path, "site-2") == pytest.approx(2.352, abs=1e-6)
    assert out == {meta_keys.FEDDYN_ALPHA_K: 1.0, meta_keys.FEDDYN_PARAM_KEYS: ["w"]}
    assert module.running_mean.item() == 7.0 and module.frozen.item() == 2.0


def test_exact_local_minimisation_reaches_the_global_optimum_in_one_round(tmp_path):
    # By hand (docs/algorithms.md, FedDyn, exact local minimisation, alpha = 1, m = |P| = 2):
    # round 1: theta_1 = argmin t^2/2 + t^2/2 = 0; theta_2 = argmin 3/2 (t-4)^2 + t^2/2 = 3;
    #          h = -1/2 (0 + 3) = -1.5; theta = 1.5 + 1.5 = 3 (= the optimum (1*0 + 3*4)/4 of the sum).
    # round 2: g = (0, -3); theta_1 = argmin t^2/2 + (t-3)^2/2 = 1.5; theta_2 = argmin 3/2(t-4)^2 + 3t + (t-3)^2/2 = 3;
    #          h = -1.5 - 1/2 (1.5 - 3 + 0) = -0.75; theta = 2.25 + 0.75 = 3.
    # 300 SGD steps solve each local problem to ~1e-20 (contraction 0.8 and 0.6 per step).
    history, _ = run_federation(tmp_path, [["site-1", "site-2"]] * 2, alpha=1.0, population=2, steps=300)
    (theta1, local1), (theta2, local2) = history
    assert local1["site-1"] == pytest.approx(0.0, abs=1e-6) and local1["site-2"] == pytest.approx(3.0, abs=1e-6)
    assert theta1 == pytest.approx(3.0, abs=1e-6)
    assert local2["site-1"] == pytest.approx(1.5, abs=1e-6) and local2["site-2"] == pytest.approx(3.0, abs=1e-6)
    assert theta2 == pytest.approx(3.0, abs=1e-6)
    assert stored_h(tmp_path, "site-1") == pytest.approx(-1.5, abs=1e-6)  # 0 + (1.5 - 3) = -g_1 / alpha
    assert stored_h(tmp_path, "site-2") == pytest.approx(3.0, abs=1e-6)  # 3 + (3 - 3)


def test_sgd_rounds_match_the_paper_form_reference(tmp_path):
    # The closed-form set-up above with inexact local solves (K = 3 SGD steps), three rounds.
    participants = [["site-1", "site-2"]] * 3
    history, _ = run_federation(tmp_path, participants, alpha=1.0, population=2)
    reference = paper_feddyn(participants, alpha=1.0, m=2, steps=K)
    for (theta, local), (ref_theta, ref_local, _) in zip(history, reference, strict=True):
        assert theta == pytest.approx(ref_theta, abs=1e-5)
        assert local == pytest.approx(ref_local, abs=1e-5)
    # H_k = -g_k / alpha: the client's displacement sum is the paper's gradient state.
    for site in ("site-1", "site-2"):
        assert stored_h(tmp_path, site) == pytest.approx(-reference[-1][2][site], abs=1e-5)
    # Round 1 by hand: site-1 stays at 0 (its optimum is the start), site-2 reaches 2.352; theta = 1.176 + 2.352/2.
    assert history[0][0] == pytest.approx(2.352, abs=1e-6)


def test_partial_participation_with_stale_clients_matches_the_reference(tmp_path):
    # Three sites, two per round; sites that sit a round out keep their H_k, and m = 3 (not |P| = 2).
    participants = [["site-1", "site-2"], ["site-2", "site-3"], ["site-1", "site-3"], ["site-1", "site-2"]]
    history, state = run_federation(tmp_path, participants, alpha=0.5, population=3)
    reference = paper_feddyn(participants, alpha=0.5, m=3, steps=K)
    for (theta, local), (ref_theta, ref_local, _) in zip(history, reference, strict=True):
        assert theta == pytest.approx(ref_theta, abs=1e-5)
        assert local == pytest.approx(ref_local, abs=1e-5)
    # The server's running sum is the sum of every site's H_k, participants or not.
    assert state["h_sum"]["w"][0] == pytest.approx(sum(stored_h(tmp_path, s) for s in CURVATURE), abs=1e-5)
    # Dividing by |P| = 2 instead of m = 3 is a different algorithm, which the reference tells apart.
    wrong = paper_feddyn(participants, alpha=0.5, m=2, steps=K)
    assert abs(wrong[-1][0] - reference[-1][0]) > 1e-2


def test_the_double_counted_linear_term_is_a_different_trajectory():
    # Plato's strategy form adds alpha <w, H - w_g> AND alpha/2 ||w - w_g||^2: gradient grad L + alpha (w - 2 w_g + H).
    # Starting from w_g != 0 it differs from the reference the tests above pin, so those tests would catch it.
    def step_path(double: bool) -> float:
        w_g, h_k, x = 1.5, 0.4, 1.5
        for _ in range(K):
            x -= ETA * (3.0 * (x - 4.0) + (x - (2 if double else 1) * w_g + h_k))
        return x

    assert abs(step_path(True) - step_path(False)) > 1e-2


# --------------------------------------------------------------------------------------------------------------------
# the hooks one by one


def test_gradient_is_task_gradient_plus_alpha_times_displacement_plus_h(tmp_path):
    ClientStateStore(tmp_path, "site-1").save("feddyn", {"w": torch.tensor([0.5]), RUN_ID_KEY: "run-a"}, round_num=0)
    algorithm = make(tmp_path)
    module = Quadratic(1.0)
    algorithm.on_round_start(module, meta(alpha=2.0, round_num=1))
    module.w.data.fill_(1.25)
    module.w.grad = torch.tensor([0.3])
    algorithm.correct_gradients(module, torch.optim.SGD(module.parameters(), lr=ETA))
    assert module.w.grad.item() == pytest.approx(0.3 + 2.0 * ((1.25 - 1.0) + 0.5), abs=1e-7)
    assert module.frozen.grad is None
    # A parameter without a task gradient in this step still feels the regulariser.
    module.w.grad = None
    algorithm.correct_gradients(module, torch.optim.SGD(module.parameters(), lr=ETA))
    assert module.w.grad.item() == pytest.approx(2.0 * 0.75, abs=1e-7)


def test_h_survives_a_process_restart_and_non_participation(tmp_path):
    local_round(make(tmp_path, "site-2"), 0.0, "site-2", meta(round_num=0))
    # Rounds 1 and 2 happen without site-2; round 3 is a new process that only has the state file.
    fresh = make(tmp_path, "site-2")
    module, _ = local_round(fresh, 1.0, "site-2", meta(round_num=3))
    x = 1.0
    for _ in range(K):
        x -= ETA * (3.0 * (x - 4.0) + ((x - 1.0) + 2.352))
    assert module.w.item() == pytest.approx(x, abs=1e-5)
    assert stored_h(tmp_path, "site-2") == pytest.approx(2.352 + (x - 1.0), abs=1e-5)


def test_state_from_another_run_is_discarded_with_a_warning(tmp_path, caplog):
    local_round(make(tmp_path), 0.5, "site-1", meta(run_id="old"))
    algorithm = make(tmp_path)
    algorithm.on_round_start(Quadratic(0.0), meta(run_id="new", round_num=1))
    assert algorithm.h_local["w"].item() == 0.0
    assert "another run" in caplog.text


def test_state_of_another_run_is_ignored_whatever_its_shapes(tmp_path):
    """The run id is checked before the shapes: a reused workspace with another model is a fresh start."""
    store = ClientStateStore(tmp_path, "site-1")
    store.save("feddyn", {"w": torch.zeros(5), "__run_id__": "old-run"}, round_num=3)
    algorithm = make(tmp_path)
    algorithm.on_round_start(Quadratic(0.0), meta(run_id="new-run"))
    assert algorithm.h_local["w"].shape == (1,) and algorithm.h_local["w"].item() == 0.0
    store.save("feddyn", {"w": torch.zeros(5), "__run_id__": "new-run"}, round_num=3)
    with pytest.raises(StateStoreError):
        make(tmp_path).on_round_start(Quadratic(0.0), meta(run_id="new-run"))


def test_corrupt_state_is_an_error_not_a_silent_reset(tmp_path):
    local_round(make(tmp_path), 0.5, "site-1", meta())
    path = ClientStateStore(tmp_path, "site-1").pending_path("feddyn")  # committed when round 1 starts
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StateStoreError):
        make(tmp_path).on_round_start(Quadratic(0.0), meta(round_num=1))


def test_state_is_fp32_and_covers_trainable_parameters_only(tmp_path):
    module = Quadratic(0.0).to(torch.bfloat16)
    module.w.data = module.w.data.float()  # bf16-mixed keeps fp32 master weights
    algorithm = make(tmp_path)
    algorithm.on_round_start(module, meta())
    assert set(algorithm.h_local) == set(algorithm.offset) == {"w"}
    assert algorithm.h_local["w"].dtype == algorithm.offset["w"].dtype == torch.float32
    algorithm.on_round_end(module)
    state = ClientStateStore(tmp_path, "site-1").latest("feddyn").state
    assert set(state) == {"w", RUN_ID_KEY} and state["w"].dtype == torch.float32


def test_no_state_store_is_an_error():
    algorithm = FedDyn()
    with pytest.raises(ClientAlgorithmError, match="local: feddyn has no state store"):
        algorithm.on_round_start(Quadratic(0.0), meta())


@pytest.mark.parametrize("alpha", [0, -1.0, math.nan, math.inf, "0.1", True, None, [1.0]])
def test_bad_server_alpha_names_the_site_and_key(tmp_path, alpha):
    with pytest.raises(ClientAlgorithmError, match=r"site-1: 'feddyn.alpha' must be"):
        make(tmp_path).on_round_start(Quadratic(0.0), meta(alpha=alpha))


def test_a_diverged_round_never_saves_a_non_finite_h(tmp_path):
    algorithm = make(tmp_path)
    module = Quadratic(0.5)
    algorithm.on_round_start(module, meta())
    with torch.no_grad():
        module.w.fill_(float("inf"))
    with pytest.raises(ClientAlgorithmError, match=r"site-1: feddyn refuses to save non-finite state for \['w'\]"):
        algorithm.on_round_end(module)
    assert ClientStateStore(tmp_path, "site-1").latest("feddyn") is None  # nothing written, nothing committed


def test_missing_server_alpha_is_reported_before_training(tmp_path):
    module = FLClassifier(arch="mlp", num_classes=2, arch_args={"in_features": 3, "hidden_sizes": ()})
    callback = FederatedAlgorithm(make(tmp_path), num_samples=8, meta_source=lambda: {meta_keys.ROUND: 0})
    data = TensorDataset(torch.zeros(8, 3), torch.zeros(8, dtype=torch.long))
    trainer = pl.Trainer(max_epochs=1, logger=False, enable_progress_bar=False, callbacks=[callback])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(ClientAlgorithmError, match=r"site-1: .*'feddyn' needs server meta \['feddyn.alpha'\]"):
        trainer.fit(module, DataLoader(data, batch_size=4))
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())


class WithTrainer(Quadratic):
    """A module whose trainer exposes a training set of ``n`` samples (what alpha_weighting='samples' reads)."""

    def __init__(self, w0: float, n: int) -> None:
        super().__init__(w0)
        loader = DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=4)
        self.trainer = type("T", (), {"train_dataloader": loader})()


def test_sample_weighted_alpha_k(tmp_path):
    # w_k = n_k m / sum_j n_j = 10 * 4 / 80 = 0.5 -> alpha_k = alpha / 0.5 = 0.6.
    algorithm = make(tmp_path, alpha_weighting="samples", population_size=4, total_samples=80)
    module = WithTrainer(0.0, n=10)
    algorithm.on_round_start(module, meta(alpha=0.3))
    assert algorithm.alpha_k == pytest.approx(0.6)
    module.w.data.fill_(1.0)
    module.w.grad = torch.zeros(1)
    algorithm.correct_gradients(module, torch.optim.SGD(module.parameters(), lr=ETA))
    assert module.w.grad.item() == pytest.approx(0.6)
    assert algorithm.on_round_end(module)[meta_keys.FEDDYN_ALPHA_K] == pytest.approx(0.6)


def test_population_total_smaller_than_the_site_count_is_refused(tmp_path):
    algorithm = make(tmp_path, alpha_weighting="samples", population_size=4, total_samples=9)
    with pytest.raises(ClientAlgorithmError, match=r"site-1: .*'total_samples' \(9\) must be at least .*\(10\)"):
        algorithm.on_round_start(WithTrainer(0.0, n=10), meta())
    # Equal is allowed: a population of one site holding every sample.
    algorithm = make(tmp_path, alpha_weighting="samples", population_size=1, total_samples=10)
    algorithm.on_round_start(WithTrainer(0.0, n=10), meta(alpha=0.3))
    assert algorithm.alpha_k == pytest.approx(0.3)


def test_sample_weighting_without_a_sized_training_set_is_an_error(tmp_path):
    algorithm = make(tmp_path, alpha_weighting="samples", population_size=4, total_samples=80)
    with pytest.raises(ClientAlgorithmError, match=r"site-1: .*size of the training set"):
        algorithm.on_round_start(Quadratic(0.0), meta())


@pytest.mark.parametrize(
    ("hparams", "message"),
    [
        ({"alpha_weighting": "data"}, "hyperparameter 'alpha_weighting' must be one of"),
        ({"alpha_weighting": "samples", "total_samples": 100}, "'population_size' must be a positive integer"),
        ({"alpha_weighting": "samples", "population_size": 3}, "'total_samples' must be a positive integer"),
        ({"alpha_weighting": "samples", "population_size": 0, "total_samples": 9}, "'population_size'"),
        ({"alpha_weighting": "samples", "population_size": 3, "total_samples": 9.5}, "'total_samples'"),
        ({"population_size": 3}, "only with alpha_weighting='samples'"),
    ],
)
def test_bad_hyperparameters(hparams, message):
    with pytest.raises(ClientAlgorithmError, match=f"feddyn: .*{message}"):
        FedDyn(**hparams)


def test_composition_needs_the_feddyn_rule_on_both_sides():
    _check_composition(FedDyn, RULES["feddyn"])
    with pytest.raises(JobBuildError, match=r"needs \['feddyn\.alpha'\] from the server"):
        _check_composition(FedDyn, RULES["fedavg"])
    with pytest.raises(JobBuildError, match="server rule 'feddyn' needs"):
        _check_composition(CLIENT_ALGORITHMS["fedavg"], RULES["feddyn"])
    spec = PRESETS["feddyn"]
    assert (spec.client, spec.server, spec.server_args) == ("feddyn", "feddyn", {"alpha": 0.01})
    assert all(getattr(spec, f) == getattr(PRESETS["fedavg"], f) for f in DATA_AND_MODEL_FIELDS)


# --------------------------------------------------------------------------------------------------------------------
# a real Lightning fit of FLClassifier


IN_FEATURES, NUM_CLASSES = 12, 4


class AuthorsExplicitLoss(ClientAlgorithm):
    """Test-only reference, the authors' form: alpha <theta, H - theta_s> + alpha/2 ||theta||^2 as a loss term."""

    name = "authors_feddyn"

    def __init__(self, alpha: float, h: Mapping[str, torch.Tensor]) -> None:
        self.alpha, self.h = alpha, h

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        self.theta_s = {n: p.detach().clone() for n, p in module.named_parameters()}

    def loss_terms(self, module: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor:
        total = 0.0
        for n, p in module.named_parameters():
            total = total + self.alpha * (p * (self.h[n] - self.theta_s[n])).sum() + 0.5 * self.alpha * (p**2).sum()
        return total


def fit(
    algorithm: ClientAlgorithm, server_meta: Mapping[str, Any], momentum: float, weight_decay: float, **trainer_kw: Any
):
    loader = toy_loader(IN_FEATURES, NUM_CLASSES)
    module = small_mlp(IN_FEATURES, NUM_CLASSES, momentum=momentum, weight_decay=weight_decay)
    theta_s = weights(module)
    return fit_under(algorithm, module, loader, server_meta, max_epochs=2, **trainer_kw), theta_s


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.0, 0.0), (0.9, 1e-2)])
def test_hook_path_equals_the_authors_explicit_loss_in_a_lightning_fit(tmp_path, momentum, weight_decay):
    alpha = 0.3
    gen = torch.Generator().manual_seed(7)
    template = FLClassifier(
        arch="mlp", num_classes=NUM_CLASSES, arch_args={"in_features": IN_FEATURES, "hidden_sizes": (16,)}
    )
    h0 = {n: 0.1 * torch.randn(p.shape, generator=gen) for n, p in template.named_parameters()}
    ClientStateStore(tmp_path, "site-1").save("feddyn", {**h0, RUN_ID_KEY: "run-a"}, round_num=0)
    server_meta = meta(alpha=alpha, round_num=1)

    hook, theta_s = fit(make(tmp_path), server_meta, momentum, weight_decay)
    explicit, _ = fit(AuthorsExplicitLoss(alpha, h0), server_meta, momentum, weight_decay)
    fedavg, _ = fit(ClientAlgorithm(), server_meta, momentum, weight_decay)
    hook_w, explicit_w, fedavg_w = (m.state_dict() for m in (hook, explicit, fedavg))
    for key in hook_w:
        torch.testing.assert_close(hook_w[key], explicit_w[key], atol=1e-6, rtol=0)
    assert max((hook_w[k] - fedavg_w[k]).abs().max().item() for k in hook_w) > 1e-3
    # H_k after the round = H_k before + (theta_k - theta_server), trainable parameters only.
    state = ClientStateStore(tmp_path, "site-1").latest("feddyn").state
    assert set(state) - {RUN_ID_KEY} == set(h0)
    for name in h0:
        torch.testing.assert_close(state[name], h0[name] + hook_w[name] - theta_s[name], atol=1e-6, rtol=0)
    assert hook.__fl_meta__[meta_keys.FEDDYN_PARAM_KEYS] == list(h0)
    assert hook.__fl_meta__[meta_keys.FEDDYN_ALPHA_K] == alpha


@pytest.mark.filterwarnings("ignore:.*precision=.*")
def test_bf16_mixed_fit_keeps_fp32_state(tmp_path):
    module, theta_s = fit(make(tmp_path), meta(alpha=0.1), 0.0, 0.0, precision="bf16-mixed")
    state = ClientStateStore(tmp_path, "site-1").latest("feddyn").state
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert set(state) - {RUN_ID_KEY} == trainable
    assert {state[n].dtype for n in trainable} == {torch.float32}
    for name in trainable:  # H_k = theta_k - theta_server exactly, from the fp32 master weights
        torch.testing.assert_close(state[name], module.state_dict()[name] - theta_s[name], atol=0, rtol=0)
