"""SCAFFOLD client: closed-form local rounds on 1-D quadratics, Option I/II, controls persisted across restarts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.scaffold import Scaffold
from lightning_modules.state_store import ClientStateStore, StateStoreError

ETA, K = 0.1, 3


class Quadratic(nn.Module):
    """f(w) = h/2 (w - a)^2 with one scalar parameter, plus a BatchNorm-like buffer that must never be touched."""

    def __init__(self, w0: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([w0]))
        self.register_buffer("running_mean", torch.tensor([7.0]))


def local_round(algorithm, w0, h, a, meta, lrs=None, momentum=0.0):
    """Drive the hooks the way the FederatedAlgorithm callback does: backward, correct_gradients, step, after_step."""
    module = Quadratic(w0)
    optimizer = torch.optim.SGD(module.parameters(), lr=ETA, momentum=momentum)
    algorithm.on_round_start(module, meta)
    for step in range(K):
        if lrs is not None:
            optimizer.param_groups[0]["lr"] = lrs[step]
        optimizer.zero_grad()
        loss = 0.5 * h * (module.w - a) ** 2
        loss.sum().backward()
        algorithm.correct_gradients(module, optimizer)
        optimizer.step()
        algorithm.after_step(module, optimizer)
    out = algorithm.on_round_end(module)
    return module, out[meta_keys.SCAFFOLD_CTRL_DIFF]["w"]


def numpy_scaffold_round(w0, h, a, c, ci, lrs):
    """Independent reference: y <- y - eta_k (g(y) - c_i + c); c_i+ = c_i - c + (x - y) / sum eta_k."""
    y = w0
    for lr in lrs:
        y = y - lr * (h * (y - a) - ci + c)
    return y, ci - c + (w0 - y) / sum(lrs)


def make(tmp_path, site="site-1", **hparams) -> Scaffold:
    algorithm = build_client_algorithm("scaffold", **hparams)
    algorithm.bind(site, ClientStateStore(tmp_path, site))
    return algorithm


def meta(c=None, round_num=0, run_id="run-a"):
    control = {} if c is None else {"w": np.array([c], dtype=np.float32)}
    return {meta_keys.SCAFFOLD_CTRL_GLOBAL: control, meta_keys.ROUND: round_num, meta_keys.RUN_ID: run_id}


def test_first_round_closed_form(tmp_path):
    # h = 3, a = 4, x = 0, c = c_i = 0: y = 1.2, 2.04, 2.628; c_i+ = (0 - 2.628) / 0.3 = -8.76 (mean gradient).
    module, diff = local_round(make(tmp_path), 0.0, 3.0, 4.0, meta())
    assert module.w.item() == pytest.approx(2.628, abs=1e-6)
    assert diff[0] == pytest.approx(-8.76, abs=1e-5)
    assert module.running_mean.item() == 7.0


@pytest.mark.parametrize("correction", ["step", "grad"])
def test_second_round_uses_the_persisted_control_with_the_right_sign(tmp_path, correction):
    algorithm = make(tmp_path, correction=correction)
    local_round(algorithm, 0.0, 3.0, 4.0, meta(round_num=0))
    # Round 2: server x = 1.314, c = -4.38 (two-site example); this site's c_i = -8.76 comes from disk.
    fresh = make(tmp_path, correction=correction)  # a new process: only the state file carries c_i
    module, diff = local_round(fresh, 1.314, 3.0, 4.0, meta(c=-4.38, round_num=1))
    y, c_new = numpy_scaffold_round(1.314, 3.0, 4.0, c=-4.38, ci=-8.76, lrs=[ETA] * K)
    assert module.w.item() == pytest.approx(y, abs=1e-5)
    assert diff[0] == pytest.approx(c_new - (-8.76), abs=1e-4)


def test_a_learning_rate_schedule_uses_the_rates_actually_applied(tmp_path):
    lrs = [0.1, 0.05, 0.02]
    module, diff = local_round(make(tmp_path), 0.5, 1.0, 2.0, meta(c=0.3), lrs=lrs)
    y, c_new = numpy_scaffold_round(0.5, 1.0, 2.0, c=0.3, ci=0.0, lrs=lrs)
    assert module.w.item() == pytest.approx(y, abs=1e-6)
    assert diff[0] == pytest.approx(c_new, abs=1e-5)


def test_option_ii_equals_mean_uncorrected_gradient_for_vanilla_sgd(tmp_path):
    # With c = c_i = 0 the local path is plain SGD and (x - y)/(K eta) is the mean of its gradients.
    _, diff = local_round(make(tmp_path), 1.0, 2.0, -1.0, meta())
    ys = [1.0]
    for _ in range(K):
        ys.append(ys[-1] - ETA * 2.0 * (ys[-1] + 1.0))
    assert diff[0] == pytest.approx(np.mean([2.0 * (y + 1.0) for y in ys[:-1]]), abs=1e-5)


def test_option_i_sends_the_gradient_at_the_received_model(tmp_path):
    algorithm = make(tmp_path, option="I")
    data = torch.tensor([[1.0], [3.0]])

    class Tiny(Quadratic):
        trainer = type(
            "T",
            (),
            {
                "train_dataloader": torch.utils.data.DataLoader(
                    torch.utils.data.TensorDataset(data, torch.zeros(2)), batch_size=1
                )
            },
        )()
        device = torch.device("cpu")

        def task_loss(self, batch):
            x, _ = batch
            return (0.5 * (self.w - x) ** 2).mean(), None

    module = Tiny(0.0)
    algorithm.on_round_start(module, meta())
    module.w.data.fill_(5.0)  # training moves the weights; Option I must not care
    algorithm.steps, algorithm.lr_sum = 1, {"w": ETA}
    diff = algorithm.on_round_end(module)[meta_keys.SCAFFOLD_CTRL_DIFF]["w"]
    assert diff[0] == pytest.approx(-2.0, abs=1e-6)  # mean over samples of (0 - x) = -(1 + 3)/2


def test_controls_are_fp32_and_cover_trainable_parameters_only(tmp_path):
    module = Quadratic(0.0).to(torch.bfloat16)
    module.w.data = module.w.data.float()  # bf16-mixed keeps fp32 master weights
    algorithm = make(tmp_path)
    algorithm.on_round_start(module, meta())
    assert set(algorithm.c_local) == {"w"} and algorithm.c_local["w"].dtype == torch.float32
    assert algorithm.x["w"].dtype == torch.float32


def test_state_from_another_run_is_discarded_with_a_warning(tmp_path, caplog):
    local_round(make(tmp_path), 0.0, 3.0, 4.0, meta(run_id="old"))
    algorithm = make(tmp_path)
    algorithm.on_round_start(Quadratic(0.0), meta(run_id="new", round_num=1))
    assert algorithm.c_local["w"].item() == 0.0
    assert "another run" in caplog.text


def test_corrupt_state_is_an_error_not_a_silent_reset(tmp_path):
    local_round(make(tmp_path), 0.0, 3.0, 4.0, meta())
    path = ClientStateStore(tmp_path, "site-1").pending_path("scaffold")  # committed when round 1 starts
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(StateStoreError):
        make(tmp_path).on_round_start(Quadratic(0.0), meta(round_num=1))


@pytest.mark.parametrize(
    ("control", "message"),
    [
        ({"v": np.zeros(1, np.float32)}, "does not match this model's trainable parameters"),
        ({"w": np.zeros(2, np.float32)}, "has shape"),
        ("zeros", "must be a dict"),
    ],
)
def test_bad_global_control_names_the_site(tmp_path, control, message):
    bad = {**meta(), meta_keys.SCAFFOLD_CTRL_GLOBAL: control}
    with pytest.raises(ClientAlgorithmError, match=f"site-1: .*{message}"):
        make(tmp_path).on_round_start(Quadratic(0.0), bad)


def test_no_step_taken_is_an_error(tmp_path):
    algorithm = make(tmp_path)
    module = Quadratic(0.0)
    algorithm.on_round_start(module, meta())
    with pytest.raises(ClientAlgorithmError, match="optimizer steps"):
        algorithm.on_round_end(module)


def test_bad_hyperparameters():
    with pytest.raises(ClientAlgorithmError, match="option"):
        build_client_algorithm("scaffold", option="III")
    with pytest.raises(ClientAlgorithmError, match="correction"):
        build_client_algorithm("scaffold", correction="sideways")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_global_control_is_refused_by_key_and_never_reaches_c_i(tmp_path, bad):
    local_round(make(tmp_path), 0.0, 3.0, 4.0, meta())  # a committed c_i
    store = ClientStateStore(tmp_path, "site-1")
    before = store.latest("scaffold").state["w"].clone()
    with pytest.raises(ClientAlgorithmError, match=r"site-1: 'scaffold.ctrl.global': entry 'w' contains NaN or Inf"):
        make(tmp_path).on_round_start(Quadratic(0.0), meta(c=bad, round_num=1))
    torch.testing.assert_close(store.latest("scaffold").state["w"], before, atol=0, rtol=0)


def test_a_diverged_round_saves_no_non_finite_state(tmp_path):
    local_round(make(tmp_path), 0.0, 3.0, 4.0, meta())
    store = ClientStateStore(tmp_path, "site-1")
    before = store.latest("scaffold").state["w"].clone()
    with pytest.raises(ClientAlgorithmError, match=r"site-1: scaffold refuses to save non-finite state for \['w'\]"):
        local_round(make(tmp_path), 0.0, 3.0e38, 4.0, meta(round_num=1))  # the gradient overflows to inf
    torch.testing.assert_close(store.latest("scaffold").state["w"], before, atol=0, rtol=0)


def test_a_state_file_of_another_run_is_ignored_whatever_its_shapes(tmp_path):
    """The run id is checked before the shapes: a reused workspace with another model is a fresh start, not an error."""
    store = ClientStateStore(tmp_path, "site-1")
    store.save("scaffold", {"w": torch.zeros(5), "__run_id__": "old-run"}, round_num=3)
    algorithm = make(tmp_path)
    algorithm.on_round_start(Quadratic(0.0), meta(run_id="new-run"))
    assert algorithm.c_local["w"].shape == (1,) and algorithm.c_local["w"].item() == 0.0
    store.save("scaffold", {"w": torch.zeros(5), "__run_id__": "new-run"}, round_num=3)
    with pytest.raises(StateStoreError):
        make(tmp_path).on_round_start(Quadratic(0.0), meta(run_id="new-run"))


def test_option_ii_from_the_correction_is_bit_identical_to_the_papers_form():
    from lightning_modules.algorithms.scaffold import option_ii_control, option_ii_from_correction

    generator = torch.Generator().manual_seed(5)
    c_local, c_global, x, y = ({"w": torch.randn(1000, generator=generator) * s} for s in (1e-3, 7.0, 1.0, 1.0))
    lr_sum = {"w": 0.37}
    correction = {"w": c_global["w"] - c_local["w"]}
    paper = option_ii_control(c_local, c_global, x, y, lr_sum)["w"]
    assert torch.equal(option_ii_from_correction(correction, x, y, lr_sum)["w"], paper)
    # c_i+ = c_i - c + (x - y) / sum(lr) on one coordinate by hand
    one = option_ii_control(
        {"w": torch.tensor([0.5])},
        {"w": torch.tensor([0.25])},
        {"w": torch.tensor([1.0])},
        {"w": torch.tensor([0.5])},
        {"w": 0.25},
    )
    assert float(one["w"]) == pytest.approx(0.5 - 0.25 + 0.5 / 0.25, abs=1e-6)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({meta_keys.ROUND: float("nan")}, r"'server.round' must be an integer >= 0, got nan"),
        ({meta_keys.ROUND: 1, meta_keys.LAST_AGGREGATED: {"site-1": -1}}, r"'server.last_aggregated' must map site"),
        ({meta_keys.ROUND: 1, meta_keys.LAST_AGGREGATED: [0]}, r"'server.last_aggregated' must be a dict"),
    ],
)
def test_a_malformed_round_index_or_confirmation_is_refused_by_key_and_the_pending_state_is_kept(
    tmp_path, bad, message
):
    # Round 0 leaves its new c_i pending; a round meta that means nothing must neither commit nor discard it.
    local_round(make(tmp_path), 0.0, 3.0, 4.0, meta())
    pending = sorted(p.name for p in tmp_path.rglob("*.pending"))
    assert pending
    with pytest.raises(ClientAlgorithmError, match=rf"site-1: scaffold refuses the server's round meta \({message}"):
        make(tmp_path).on_round_start(Quadratic(0.0), {**meta(round_num=1), **bad})
    assert sorted(p.name for p in tmp_path.rglob("*.pending")) == pending
