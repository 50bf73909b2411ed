"""MOON client: closed-form contrastive losses, the projection-head model, frozen models (eval, no grad, never in the
state_dict or the optimizer), the first-round negative, history FIFO order and persistence across fresh objects
(process restarts), bad history files, a real Lightning fit against an explicit second-forward reference,
composition and the job export."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aggregators.contracts import meta_keys
from aggregators.registry import RULES
from jobs.build import PRESETS, JobBuildError, JobSpec, _check_composition, export_job, model_arch_args
from lightning_modules import FLClassifier
from lightning_modules.algorithms import ClientAlgorithm, ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.moon import Moon, contrastive_loss
from lightning_modules.models import build_model
from lightning_modules.state_store import ClientStateStore, StateStoreError
from tests.helpers import fit_under, toy_loader, weights

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers.*"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*"),
]

IN_FEATURES, NUM_CLASSES, PROJ = 12, 4, 8
SITE, RUN = "site-1", "run-a"


# --------------------------------------------------------------------------------------------------------------------
# the contrastive loss in closed form


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_identical_embeddings_give_log_of_one_plus_the_number_of_negatives():
    z = t([1.0, 2.0, 3.0])
    assert contrastive_loss(z, z, [z], 0.5).item() == pytest.approx(math.log(2), abs=1e-12)
    assert contrastive_loss(z, z, [z, z, z], 0.5).item() == pytest.approx(math.log(4), abs=1e-12)


def test_orthogonal_negative_and_temperature():
    # sim+ = 1, sim- = 0: -log(e^{1/tau} / (e^{1/tau} + 1)) = log(1 + e^{-1/tau}).
    z, neg = t([3.0, 0.0]), t([0.0, 5.0])
    assert contrastive_loss(z, z, [neg], 0.5).item() == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-12)
    assert contrastive_loss(z, z, [neg], 1.0).item() == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-12)
    # A negative pointing the other way (sim = -1) and a positive orthogonal to z (sim = 0), tau = 0.5.
    expected = -math.log(1 / (1 + math.exp(-2)))
    assert contrastive_loss(z, neg, [-z], 0.5).item() == pytest.approx(expected, abs=1e-12)


def test_batch_mean_matches_an_independent_numpy_computation():
    rng = np.random.default_rng(0)
    z, zg, n1, n2 = (rng.standard_normal((5, 7)) for _ in range(4))

    def cos(a, b):
        return np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    logits = np.stack([cos(z, zg), cos(z, n1), cos(z, n2)], axis=1) / 0.5
    expected = np.mean(-logits[:, 0] + np.log(np.exp(logits).sum(axis=1)))
    got = contrastive_loss(*(torch.from_numpy(a) for a in (z, zg)), [torch.from_numpy(n1), torch.from_numpy(n2)], 0.5)
    assert got.item() == pytest.approx(expected, abs=1e-10)


# --------------------------------------------------------------------------------------------------------------------
# the model: projection head on features(), classifier on the projection


def test_projection_head_model_layout():
    model = build_model("lenet5", projection_dim=256)
    x = torch.randn(3, 1, 28, 28)
    h = model.features(x)
    assert model.projection[0].in_features == 84 and model.projection[0].out_features == 84
    assert isinstance(model.projection[1], nn.ReLU) and model.projection[2].out_features == 256
    assert model.classifier.in_features == 256
    torch.testing.assert_close(model(x), model.classifier(model.projection(h)))
    assert model.embed(x).shape == (3, 256)
    assert {"projection.0.weight", "projection.2.bias", "classifier.weight"} <= set(model.state_dict())
    plain = build_model("lenet5")
    assert plain.projection is None and "projection.0.weight" not in plain.state_dict()
    torch.testing.assert_close(plain.embed(x), plain.features(x))


def test_moon_preset_threads_the_head_to_every_side():
    spec = PRESETS["moon"]
    assert spec.client == "moon" and spec.server == "fedavg"
    assert model_arch_args(spec) == {"projection_dim": 256}
    assert model_arch_args(JobSpec(name="m", client="moon", arch_args={"projection_dim": 64})) == {"projection_dim": 64}
    _check_composition(Moon, RULES["fedavg"])


def test_exported_job_builds_the_head_on_clients_server_model_and_evaluator(tmp_path):
    job = export_job(JobSpec(name="m", client="moon", arch_args={"projection_dim": 64}), tmp_path)
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    components = {c["id"]: c for c in server["components"]}
    assert components["persistor"]["args"]["model"]["args"]["arch_args"] == {"projection_dim": 64}
    assert components["evaluator"]["args"]["arch_args"] == {"projection_dim": 64}
    client = (job / "app" / "config" / "config_fed_client.json").read_text()
    assert '--arch-args {\\"projection_dim\\":64}' in client
    # A job without model arguments exports no arch_args anywhere (older jobs are unchanged).
    plain = export_job(JobSpec(name="p"), tmp_path)
    assert "arch_args" not in (plain / "app" / "config" / "config_fed_server.json").read_text()
    assert "--arch-args" not in (plain / "app" / "config" / "config_fed_client.json").read_text()


def test_bad_arch_args_fail_at_build_time():
    with pytest.raises(JobBuildError, match="projection_dim"):
        JobSpec(name="m", client="moon", arch_args={"projection_dim": 0})
    with pytest.raises(JobBuildError, match="cannot be built"):
        JobSpec(name="m", arch_args={"no_such_arg": 1})


# --------------------------------------------------------------------------------------------------------------------
# frozen models, first round, history (hooks driven directly)


def make_module(projection_dim: int | None = PROJ, seed: int = 11) -> FLClassifier:
    arch_args: dict[str, Any] = {"in_features": IN_FEATURES, "hidden_sizes": (16,)}
    if projection_dim is not None:
        arch_args["projection_dim"] = projection_dim
    return FLClassifier(arch="mlp", num_classes=NUM_CLASSES, arch_args=arch_args, lr=0.2, init_seed=seed)


def bound(algorithm: Moon, root, site: str = SITE) -> Moon:
    algorithm.bind(site, ClientStateStore(root, site))
    return algorithm


def meta(round_num: int, run: str = RUN) -> dict[str, Any]:
    return {meta_keys.ROUND: round_num, meta_keys.RUN_ID: run}


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(8, IN_FEATURES, generator=gen), torch.randint(0, NUM_CLASSES, (8,), generator=gen)


def train_steps(module: FLClassifier, algorithm: Moon, steps: int = 3) -> list[float]:
    """The hook order of the callback path: task forward (captures z), loss_terms, backward, SGD step."""
    optimizer = torch.optim.SGD(module.net.parameters(), lr=0.2)
    terms = []
    for i in range(steps):
        optimizer.zero_grad()
        loss, logits = module.task_loss(batch(i))
        term = algorithm.loss_terms(module, batch(i), logits)
        (loss + term).backward()
        optimizer.step()
        terms.append(term.item())
    return terms


def test_frozen_models_are_eval_no_grad_and_never_registered(tmp_path):
    module = make_module()
    module.train()
    keys_before = set(module.state_dict())
    algorithm = bound(Moon(history_size=2), tmp_path)
    algorithm.on_round_start(module, meta(0))
    frozen = [algorithm.global_model, *algorithm.negatives]
    for model in frozen:
        assert not model.training and all(not p.requires_grad for p in model.parameters())
        assert not model._forward_hooks and not model.projection._forward_hooks
    assert set(module.state_dict()) == keys_before
    frozen_ids = {id(p) for model in frozen for p in model.parameters()}
    assert not frozen_ids & {id(p) for p in module.parameters()}
    optimizer = module.configure_optimizers()
    assert not frozen_ids & {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert all(not any(m is f for f in frozen) for m in module.modules())
    train_steps(module, algorithm)
    assert all(p.grad is None for model in frozen for p in model.parameters())
    algorithm.on_round_end(module)
    assert set(module.state_dict()) == keys_before and not module.net.projection._forward_hooks


def test_first_round_negative_is_the_received_model_so_the_term_is_mu_log2(tmp_path):
    # Positive and negative are the same frozen model: sim+ = sim- at every step, l_con = log 2 (never zero).
    module = make_module()
    algorithm = bound(Moon(mu=5.0), tmp_path)
    algorithm.on_round_start(module, meta(0))
    assert algorithm.negatives == [algorithm.global_model]
    terms = train_steps(module, algorithm)
    assert terms == pytest.approx([5.0 * math.log(2)] * 3, abs=1e-5)
    sent = algorithm.on_round_end(module)
    assert sent[meta_keys.MOON_NUM_NEGATIVES] == 1 and sent[meta_keys.MOON_HISTORY_MODELS] == 0


def stored_history(root, site: str = SITE) -> list[dict[str, torch.Tensor]]:
    return ClientStateStore(root, site).latest("moon").state["models"]


def test_history_is_fifo_and_persists_across_fresh_objects(tmp_path):
    module = make_module()
    trained = []
    for round_num in range(3):
        algorithm = bound(Moon(history_size=2), tmp_path)  # a fresh object each round: a new process
        algorithm.on_round_start(module, meta(round_num))
        negatives = [{k: v.clone() for k, v in n.state_dict().items()} for n in algorithm.negatives]
        if round_num == 0:
            assert len(negatives) == 1
        else:  # the negatives are the stored previous local models, oldest first
            assert len(negatives) == min(round_num, 2)
            for negative, expected in zip(negatives, trained[-2:], strict=True):
                assert all(torch.equal(negative[k], expected[k]) for k in expected)
        train_steps(module, algorithm)
        algorithm.on_round_end(module)
        trained.append({k: v.detach().clone() for k, v in module.net.state_dict().items()})
        history = stored_history(tmp_path)
        assert len(history) == min(round_num + 1, 2)
        for stored, expected in zip(history, trained[-2:], strict=True):
            assert all(torch.equal(stored[k], expected[k]) for k in expected)


def test_a_diverged_local_model_never_enters_the_history(tmp_path):
    """A round whose local model went NaN is refused by name; the committed history of the earlier round stays the
    one the next round reads (one bad round must not poison the site's negatives for the rest of the job)."""
    module = make_module()
    algorithm = bound(Moon(history_size=2), tmp_path)
    algorithm.on_round_start(module, meta(0))
    train_steps(module, algorithm)
    algorithm.on_round_end(module)
    good = stored_history(tmp_path)
    algorithm = bound(Moon(history_size=2), tmp_path)
    algorithm.on_round_start(module, meta(1))  # commits round 0's history (no confirmation map: committed)
    with torch.no_grad():
        module.net.classifier.weight[0, 0] = float("nan")
    with pytest.raises(ClientAlgorithmError, match=rf"{SITE}: moon refuses to save non-finite state for \['classifier"):
        algorithm.on_round_end(module)
    history = stored_history(tmp_path)
    assert len(history) == len(good) and all(torch.equal(history[0][k], good[0][k]) for k in good[0])


def test_history_is_per_site(tmp_path):
    module = make_module()
    for site in ("site-1", "site-2"):
        algorithm = bound(Moon(), tmp_path, site)
        algorithm.on_round_start(module, meta(0))
        train_steps(module, algorithm, steps=1 if site == "site-1" else 2)
        algorithm.on_round_end(module)
    a, b = stored_history(tmp_path, "site-1")[0], stored_history(tmp_path, "site-2")[0]
    assert not torch.equal(a["classifier.weight"], b["classifier.weight"])


def test_history_of_another_run_is_ignored_with_a_warning(tmp_path, caplog):
    module = make_module()
    algorithm = bound(Moon(), tmp_path)
    algorithm.on_round_start(module, meta(0, run="old"))
    train_steps(module, algorithm, steps=1)
    algorithm.on_round_end(module)
    algorithm = bound(Moon(), tmp_path)
    with caplog.at_level(logging.WARNING):
        algorithm.on_round_start(module, meta(1, run="new"))
    assert "another run" in caplog.text
    assert algorithm.negatives == [algorithm.global_model]


def test_corrupt_history_is_an_error_or_a_reset_with_a_warning(tmp_path, caplog):
    module = make_module()
    algorithm = bound(Moon(), tmp_path)
    algorithm.on_round_start(module, meta(0))
    algorithm.on_round_end(module)
    ClientStateStore(tmp_path, SITE).settle_all(1, None)  # round 1 starts: the history is committed
    path = ClientStateStore(tmp_path, SITE).path("moon")
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StateStoreError, match=r"site-1.*checksum"):
        bound(Moon(), tmp_path).on_round_start(module, meta(1))
    algorithm = bound(Moon(on_bad_history="reset"), tmp_path)
    with caplog.at_level(logging.WARNING):
        algorithm.on_round_start(module, meta(1))
    assert "DISCARDING the MOON history" in caplog.text and "checksum" in caplog.text
    assert algorithm.negatives == [algorithm.global_model]


def test_history_of_another_architecture_is_an_error(tmp_path):
    algorithm = bound(Moon(), tmp_path)
    algorithm.on_round_start(make_module(projection_dim=16), meta(0))
    algorithm.on_round_end(make_module(projection_dim=16))
    with pytest.raises(ClientAlgorithmError, match=r"site-1: the MOON history in .* does not match this model"):
        bound(Moon(), tmp_path).on_round_start(make_module(projection_dim=PROJ), meta(1))


def test_history_of_another_run_and_architecture_is_ignored_not_an_error(tmp_path, caplog):
    """The run id is checked before the shapes, as for SCAFFOLD and FedDyn: a reused workspace is a fresh start."""
    algorithm = bound(Moon(), tmp_path)
    algorithm.on_round_start(make_module(projection_dim=16), meta(0, run="old"))
    algorithm.on_round_end(make_module(projection_dim=16))
    algorithm = bound(Moon(), tmp_path)
    with caplog.at_level(logging.WARNING):
        algorithm.on_round_start(make_module(projection_dim=PROJ), meta(1, run="new"))
    assert "another run" in caplog.text
    assert algorithm.negatives == [algorithm.global_model]


def test_a_model_without_projection_head_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ClientAlgorithmError, match="projection_dim"):
        bound(Moon(), tmp_path).on_round_start(make_module(projection_dim=None), meta(0))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mu": -1}, "'mu'"),
        ({"mu": float("nan")}, "'mu'"),
        ({"temperature": 0}, "temperature"),
        ({"history_size": 0}, "history_size"),
        ({"history_size": 1.5}, "history_size"),
        ({"on_bad_history": "ignore"}, "on_bad_history"),
    ],
)
def test_bad_hyperparameters_are_rejected(kwargs, match):
    with pytest.raises(ClientAlgorithmError, match=match):
        Moon(**kwargs)


def test_defaults():
    assert build_client_algorithm("moon").hparams() == {"mu": 5.0, "temperature": 0.5, "history_size": 1}


# --------------------------------------------------------------------------------------------------------------------
# real Lightning fits


class ExplicitMoon(ClientAlgorithm):
    """Test-only reference: recomputes z with a second forward of the trained model (no hook)."""

    name = "explicit_moon"

    def __init__(self, mu: float, negatives: list[Mapping[str, torch.Tensor]]) -> None:
        self.mu, self.negative_states = mu, negatives

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        self.models = []
        for state in [module.net.state_dict(), *self.negative_states]:
            model = build_model("mlp", num_classes=NUM_CLASSES, in_features=IN_FEATURES, hidden_sizes=(16,))
            model.add_projection_head(PROJ)
            model.load_state_dict(state)
            self.models.append(model.eval())

    def loss_terms(self, module: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor:
        x = batch[0]
        z = module.net.embed(x)
        with torch.no_grad():
            zg, *negs = [model.embed(x) for model in self.models]
        pos = F.cosine_similarity(z, zg, dim=-1)
        all_sims = torch.stack([pos, *(F.cosine_similarity(z, n, dim=-1) for n in negs)], dim=1) / 0.5
        return self.mu * (torch.logsumexp(all_sims, dim=1) - all_sims[:, 0]).mean()


def fit(module: FLClassifier, algorithm: ClientAlgorithm, round_num: int = 0, **trainer_kw: Any) -> FLClassifier:
    return fit_under(algorithm, module, toy_loader(IN_FEATURES, NUM_CLASSES), meta(round_num), site=SITE, **trainer_kw)


def test_fit_matches_an_explicit_second_forward_reference_in_round_two(tmp_path):
    # Round 1 trains and stores the local model; round 2 starts from another "global" model, so the positive and
    # the negative differ and the contrastive gradient is live.
    first = fit(make_module(), bound(Moon(mu=2.0), tmp_path))
    previous_local = {k: v.clone() for k, v in first.net.state_dict().items()}
    hook_path = fit(make_module(seed=12), bound(Moon(mu=2.0), tmp_path), round_num=1)
    explicit = fit(make_module(seed=12), ExplicitMoon(2.0, [previous_local]))
    plain = fit(make_module(seed=12), ClientAlgorithm())
    got, want, base = weights(hook_path), weights(explicit), weights(plain)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0)
    assert max((got[k] - base[k]).abs().max().item() for k in base) > 1e-3
    assert hook_path.__fl_meta__[meta_keys.MOON_NUM_NEGATIVES] == 1
    assert hook_path.__fl_meta__[meta_keys.MOON_HISTORY_MODELS] == 1
    assert set(hook_path.__fl_meta__) >= {meta_keys.MOON_MU, meta_keys.MOON_TEMPERATURE}


def test_mu_zero_is_fedavg_bit_for_bit(tmp_path):
    moon = weights(fit(make_module(), bound(Moon(mu=0.0), tmp_path)))
    plain = weights(fit(make_module(), ClientAlgorithm()))
    assert all(torch.equal(moon[k], plain[k]) for k in plain)


def test_bf16_mixed_fit_stores_an_fp32_history(tmp_path):
    fit(make_module(), bound(Moon(), tmp_path), precision="bf16-mixed")
    (model,) = stored_history(tmp_path)
    assert {v.dtype for v in model.values()} == {torch.float32}
