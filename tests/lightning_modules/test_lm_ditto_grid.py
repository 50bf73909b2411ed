"""Ditto at several strengths (``lam_grid``, lightning_modules/algorithms/ditto.py): a grid of one is today's Ditto
bit for bit, each lam of a grid trains the v_i that Ditto with that lam alone trains, the site keeps the lam its
validation prefers (either way round), the cost is counted, and bad grids are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from jobs.build import main
from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm
from lightning_modules.algorithms.ditto import Ditto
from lightning_modules.federated import FederatedAlgorithm
from lightning_modules.local_baseline import matched_steps
from lightning_modules.personalization.strength import preferred
from lightning_modules.state_store import ClientStateStore
from tests.helpers import quiet_trainer
from tests.lightning_modules.test_lm_ditto import Tiny, fit_round, round_meta


def two_rounds(tmp_path, make, data, epochs=2):
    """Two rounds of one site, a new algorithm object per round (state from the store, as under -t 1)."""
    module = Tiny(torch.zeros(1, 3), lr=0.05, hidden=4)
    store = ClientStateStore(tmp_path, "site-1")
    metas, algorithms = [], []
    for round_num in range(2):
        algorithms.append(make())
        confirmed = {"site-1": round_num - 1} if round_num else None
        metas.append(fit_round(module, algorithms[-1], store, data, round_num, confirmed, epochs=epochs, batch_size=4))
    return module, algorithms[-1], metas, store


def data(seed=1, n=12):
    torch.manual_seed(seed)
    return TensorDataset(torch.randn(n, 3), torch.randn(n))


def test_a_grid_of_one_is_todays_ditto_bit_for_bit(tmp_path):
    plain = two_rounds(tmp_path / "a", lambda: Ditto(lam=0.5), data())
    grid = two_rounds(tmp_path / "b", lambda: Ditto(lam=0.5, lam_grid=[0.5]), data())
    for key, value in plain[0].state_dict().items():  # the sent model
        assert torch.equal(grid[0].state_dict()[key], value)
    for key, value in plain[1].personal.items():  # v_i
        assert torch.equal(grid[1].personal[key], value)
    untimed = [
        [{k: v for k, v in meta.items() if k != "train.fit_seconds"} for meta in run[2]] for run in (plain, grid)
    ]
    assert untimed[0] == untimed[1]  # the sent meta, wall seconds aside
    stored_a, stored_b = plain[3].load("ditto").state, grid[3].load("ditto").state
    assert stored_a.keys() == stored_b.keys()  # the same state file entries
    for key, value in stored_a.items():
        assert torch.equal(stored_b[key], value) if isinstance(value, torch.Tensor) else stored_b[key] == value


def test_each_lam_of_a_grid_trains_what_ditto_with_that_lam_alone_trains(tmp_path):
    grid = two_rounds(tmp_path / "grid", lambda: Ditto(lam=0.1, lam_grid=[0.1, 2.0, 0.01]), data())
    for lam in (0.1, 2.0, 0.01):
        alone = two_rounds(tmp_path / str(lam), lambda lam=lam: Ditto(lam=lam), data())
        for key, value in alone[1].personal.items():  # through the state store and back, round 1 included
            assert torch.equal(grid[1].personals[lam][key], value)
        for key, value in alone[0].state_dict().items():  # the sent model does not depend on the grid
            assert torch.equal(grid[0].state_dict()[key], value)
    assert not torch.equal(grid[1].personals[0.01]["net.0.weight"], grid[1].personals[2.0]["net.0.weight"])
    # Three personal steps per training step; the local-only model's matched compute counts them all.
    meta = grid[2][-1]
    assert meta["ditto.personal_steps"] == 3 * meta["train.num_steps"]
    assert matched_steps(meta) == 4 * meta["train.num_steps"]


def mse_scorer(val: TensorDataset):
    x, y = val.tensors

    def score(module, weights):
        with torch.no_grad():
            out = torch.func.functional_call(module, {k: v.to(torch.float32) for k, v in weights.items()}, (x,))
        return {"val_loss": float(F.mse_loss(out, y))}

    return score


@pytest.mark.parametrize("target, chosen", [("site", 0.001), ("zero", 10.0)])
def test_the_site_keeps_the_lam_its_validation_prefers(tmp_path, target, chosen):
    # The site's data follow y = x . a; the received model is 0 (it predicts 0). lam 0.001 trains v_i nearly
    # alone (fits a), lam 10 holds it near the received model (lr * lam = 0.5). A validation split drawn like the
    # site's data prefers lam 0.001; one whose targets are 0 prefers lam 10: the choice follows validation, not
    # the grid's order.
    torch.manual_seed(0)
    a = torch.tensor([2.0, -1.0, 0.5])
    x, vx = torch.randn(32, 3), torch.randn(16, 3)
    train = TensorDataset(x, x @ a)
    val = TensorDataset(vx, vx @ a if target == "site" else torch.zeros(16))
    module = Tiny(torch.zeros(1, 3), lr=0.05)
    ditto = Ditto(lam=0.001, lam_grid=[0.001, 10.0])
    callback = FederatedAlgorithm(
        ditto, site="site-1", state_store=ClientStateStore(tmp_path, "site-1"), num_samples=32,
        meta_source=lambda: round_meta(0),
    )  # fmt: skip
    callback.personal_scorer = mse_scorer(val)
    quiet_trainer(3, [callback]).fit(module, train_dataloaders=torch.utils.data.DataLoader(train, batch_size=4))
    meta = callback.last_meta
    assert meta["eval.ditto_best_lam"] == chosen
    assert ditto.personal_weights(module) is ditto.personals[chosen]  # the personal candidate of keep best
    losses = {lam: mse_scorer(val)(module, v)["val_loss"] for lam, v in ditto.personals.items()}
    assert meta["eval.personal_val_loss"] == losses[chosen] == min(losses.values())
    assert max(losses.values()) > 2 * min(losses.values())  # clearly better


def test_preferred_in_closed_form():
    scores = {0.1: {"val_loss": 0.5}, 1.0: {"val_loss": 0.25}, 2.0: {"val_loss": 0.25}}
    assert preferred(scores, "val_loss", True) == 1.0  # ties go to the earlier lam
    assert preferred(scores, "val_loss", False) == 0.1
    assert preferred({0.1: {"val_loss": float("nan")}, 1.0: {}, 2.0: {"val_loss": 3.0}}, "val_loss", True) == 2.0
    assert preferred({0.1: {}, 1.0: {}}, "val_loss", True) == 0.1  # nothing scored: the first


@pytest.mark.parametrize(
    "args, words",
    [
        ({"lam_grid": []}, "'lam_grid' must be a non-empty list"),
        ({"lam_grid": [0.1, 0.0]}, "'lam_grid' must be a non-empty list of distinct finite numbers > 0"),
        ({"lam_grid": [0.1, -1.0]}, "'lam_grid' must be"),
        ({"lam_grid": [0.1, 0.1]}, "'lam_grid' must be"),
        ({"lam_grid": 0.1}, "'lam_grid' must be"),
        ({"lam_grid": [0.1, "1"]}, "'lam_grid' must be"),
        ({"lam_grid": [0.1, float("inf")]}, "'lam_grid' must be"),
        ({"lam_grid": [0.01, 1.0]}, "'lam' must be one of lam_grid [0.01, 1.0]"),
    ],
)
def test_bad_grids_are_refused_in_one_line(args, words):
    with pytest.raises(ClientAlgorithmError, match="ditto") as info:
        build_client_algorithm("ditto", **args)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_grid_under_dp_is_refused_in_one_line(tmp_path, capsys):
    dp = ["--dp-noise-multiplier", "1.0", "--dp-max-grad-norm", "1.0"]
    argv = [*dp, "--client", "ditto", "--client-args", '{"lam_grid":[0.1,1]}', "--site-val-fraction", "0.2"]
    out = tmp_path / "jobs"
    assert main(["--output-dir", str(out), "--name", "grid", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "client 'ditto' cannot run under DP-SGD" in err
    assert not out.exists()


def test_a_built_in_site_reports_its_lam_and_offers_that_v_i_to_keep_best(tmp_path):
    import numpy as np

    from benchmarks.in_process import site_args
    from jobs.spec import JobSpec
    from lightning_modules.site import build_site_round

    spec = JobSpec(
        name="dg", dataset="digits", arch="mlp", client="ditto", client_args={"lam_grid": [0.01, 0.1, 1.0]},
        site_val_fraction=0.2, site_test_fraction=0.2, local_baseline=True, keep="best",
    )  # fmt: skip
    args = site_args(spec)
    args.accelerator = "cpu"
    rng = np.random.default_rng(0)
    x, y = rng.random((120, 64), dtype=np.float32), rng.integers(0, 10, 120).astype(np.int64)
    site_round = build_site_round(args, "site-1", 0, x, y, 10, ClientStateStore(tmp_path, "site-1"))
    params = {k: v.numpy().copy() for k, v in site_round.module.state_dict().items()}
    _, sent = site_round.train(0, params, round_meta(0))
    ditto = site_round.round_callback.algorithm
    assert sent["eval.ditto_best_lam"] in (0.01, 0.1, 1.0)
    assert ditto.personal is ditto.personals[sent["eval.ditto_best_lam"]]
    assert sent["ditto.personal_steps"] == 3 * sent["train.num_steps"]
    assert {"eval.personal_test_accuracy", "eval.kept_candidate"} <= set(sent)
