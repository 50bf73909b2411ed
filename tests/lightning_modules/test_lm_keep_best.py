"""--local-baseline and --keep best at a site: the pure rules in closed form, the site round (compute matched, the
result it sends untouched, the kept model stored), restart and replay of the local-only model, DP-SGD's release
rule, and the build-time refusals. Digits with the MLP: tiny and offline."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from benchmarks.in_process import initial_params, quiet_lightning, site_rounds
from jobs.build import JobSpec
from jobs.settings import JobBuildError
from lightning_modules.federated import CANDIDATE_SECONDS
from lightning_modules.keep_best import KEPT_STORE, choose, paired_difference
from lightning_modules.local_baseline import STORE_NAME, LocalBaseline, matched_steps
from lightning_modules.site import ValidatedClassifier
from lightning_modules.state_store import ClientStateStore

BASE = JobSpec(name="kb", dataset="digits", arch="mlp", num_rounds=2, batch_size=32, lr=0.1)
SPLIT = dataclasses.replace(BASE, site_val_fraction=0.2, site_test_fraction=0.2)


def meta(round_num: int, run: str = "r") -> dict:
    return {meta_keys.ROUND: round_num, meta_keys.RUN_ID: run}


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


# -- the rules ---------------------------------------------------------------------------------------------------
def test_choose_keeps_the_best_validation_score_and_gives_ties_to_the_global_model() -> None:
    assert choose({"global": 1.0, "personal": 0.9, "local": 0.95}, "val_loss") == "personal"
    assert choose({"global": 1.0, "personal": 1.0, "local": 1.0}, "val_loss") == "global"  # ties: joining stays
    assert choose({"global": 0.5, "local": 0.5}, "val_accuracy") == "global"
    assert choose({"global": 0.5, "local": 0.6}, "val_accuracy") == "local"  # accuracy: higher is better
    assert choose({"global": 1.0, "personal": math.nan, "local": None}, "val_loss") == "global"  # never a NaN
    assert choose({"global": math.nan, "local": 2.0}, "val_loss") == "local"  # a finite score beats a NaN
    with pytest.raises(ValueError):
        choose({"local": 1.0}, "val_loss")


def test_paired_difference_in_closed_form() -> None:
    kept, local = np.array([1, 1, 0, 0, 1]), np.array([1, 0, 0, 1, 0])  # d = 0, 1, 0, -1, 1
    mean, se = paired_difference(kept, local)
    assert mean == pytest.approx(0.2, abs=1e-12)
    assert se == pytest.approx(math.sqrt(2.8 / 4) / math.sqrt(5), abs=1e-12)  # sd (n - 1) / sqrt(n)
    assert paired_difference(kept, kept) == (0.0, 0.0)
    with pytest.raises(ValueError):
        paired_difference(kept, local[:4])


def test_matched_steps_counts_every_step_the_sites_training_took() -> None:
    assert matched_steps({meta_keys.NUM_STEPS: 9}) == 9
    assert matched_steps({meta_keys.NUM_STEPS: 9, "ditto.personal_steps": 9}, extra_steps=3) == 21


# -- the site round ------------------------------------------------------------------------------------------------
def test_a_site_keeps_the_best_on_validation_stores_it_and_sends_the_same_result(tmp_path, monkeypatch) -> None:
    steps: list[int] = []
    train = LocalBaseline.train
    monkeypatch.setattr(LocalBaseline, "train", lambda self, *a: steps.append(a[2]) or train(self, *a))
    ditto = dataclasses.replace(SPLIT, client="ditto", client_args={"lam": 0.1}, max_train_samples=600)
    spec = dataclasses.replace(ditto, local_baseline=True, keep="best")
    start = initial_params(spec)
    sent_plain, meta_plain = site_rounds(ditto, tmp_path / "plain")["site-1"].train(0, start, meta(0))
    site = site_rounds(spec, tmp_path)["site-1"]
    initial = site.round_callback.candidates.local.make_module().state_dict()  # the server's initial model
    assert all(np.array_equal(initial[k].numpy(), start[k]) for k in start)
    params, sent = site.train(0, start, meta(0))
    # The candidates change nothing the site sends: the same bits and the same meta, plus eval.* scores only.
    assert all(np.array_equal(sent_plain[k], params[k]) for k in sent_plain)
    common = set(meta_plain) - {meta_keys.FIT_SECONDS, CANDIDATE_SECONDS}
    assert {k: meta_plain[k] for k in common} == {k: sent[k] for k in common}
    added = set(sent) - set(meta_plain) - {CANDIDATE_SECONDS}  # + the candidates' seconds, apart from the fit's
    assert added and all(k.startswith("eval.") for k in added)  # the site-evaluation release rule covers them
    assert steps == [sent[meta_keys.NUM_STEPS] * 2]  # compute matched: Ditto's fit steps and as many personal steps
    # One round: the own model is this round's local-only model; the kept one is the best on validation among it,
    # the received and personal models and their mixtures, if it beats the own model (site_choice.keep).
    names = ("global", "personal", "local", "mixture")
    kept = names[int(sent["eval.kept_candidate"])]
    val = {n: sent[f"eval.{n}_val_loss"] for n in ("global", "personal")}
    assert sent["eval.local_val_loss"] == sent["eval.local_last_val_loss"] and sent["eval.local_round"] == 0
    assert sent["eval.kept_val_loss"] <= min(sent["eval.local_val_loss"], *val.values()) + 1e-12
    if kept in val:
        assert sent["eval.kept_test_accuracy"] == sent[f"eval.{kept}_test_accuracy"]
    assert {"eval.global_test_loss", "eval.personal_test_accuracy", "eval.local_test_accuracy"} <= set(sent)
    store = ClientStateStore(tmp_path, "site-1")
    stored = store.latest(KEPT_STORE).state
    assert stored["kind"] == kept
    if kept == "local":
        local = store.latest(STORE_NAME).state
        assert all(torch.equal(stored["state"][k], local[k]) for k in local if k != "__run_id__")
    assert sent["eval.kept_minus_local_test_accuracy_se"] >= 0


def test_the_local_model_survives_a_restart_and_a_replayed_round_starts_from_the_state_before_it(tmp_path) -> None:
    def make() -> ValidatedClassifier:
        return ValidatedClassifier(arch="mlp", lr=0.1, init_seed=0)

    x, y = torch.rand(64, 64), torch.arange(64) % 10
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16, shuffle=True)

    def baseline() -> LocalBaseline:  # a new object per round: a process per round
        return LocalBaseline(
            "site-1", ClientStateStore(tmp_path, "site-1"), make, lambda t, m: t.fit(m, loader), accelerator="cpu"
        )

    first = baseline().train(0, "run", 3, seed=1).state_dict()
    again = baseline().start(1, "run").state_dict()  # restart: round 1 starts where round 0 ended
    assert all(torch.equal(first[k], again[k]) for k in first)
    second = baseline().train(1, "run", 3, seed=2).state_dict()
    replay = baseline().start(1, "run").state_dict()  # round 1 again: from round 0's state, not round 1's
    assert all(torch.equal(first[k], replay[k]) for k in first) and not torch.equal(
        first["net.classifier.weight"], second["net.classifier.weight"]
    )
    fresh = baseline().start(2, "another-run").state_dict()  # another run starts from the initial model
    assert all(torch.equal(make().state_dict()[k], fresh[k]) for k in fresh)


@pytest.mark.parametrize("released", [False, True])
def test_under_dp_sgd_the_local_and_kept_scores_stay_at_the_site_unless_released(tmp_path, released) -> None:
    pytest.importorskip("opacus")
    spec = dataclasses.replace(
        SPLIT, max_train_samples=300, local_baseline=True, keep="best", dp_noise_multiplier=1.0, dp_max_grad_norm=1.0,
        dp_release_site_scores=released,
    )  # fmt: skip
    site = site_rounds(spec, tmp_path)["site-1"]
    _, sent = site.train(0, initial_params(spec), {**meta(0), meta_keys.NUM_ROUNDS: 2})
    ours = {"eval.local_val_loss", "eval.local_test_accuracy", "eval.kept_test_accuracy", "eval.kept_candidate"}
    if released:
        assert ours <= set(sent) and ours <= set(sent[meta_keys.PRIVACY_UNACCOUNTED])
    else:
        assert not ours & set(sent) and ours <= set(sent[meta_keys.PRIVACY_WITHHELD])


# -- build-time refusals ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"keep": "best", "local_baseline": True, "site_test_fraction": 0.0},
            "keep best .*no test split: set site_test",
        ),
        ({"keep": "best", "local_baseline": True, "site_val_fraction": 0.0}, "no validation split: set site_val"),
        ({"keep": "best"}, "global model as the only candidate"),
        ({"keep": "best", "local_baseline": True, "keep_metric": "val_f1"}, "keep_metric 'val_f1': the built-in"),
        ({"keep_metric": "val_accuracy"}, "keep_metric 'val_accuracy' selects for --keep best only"),
    ],
)
def test_bad_candidate_settings_are_refused_in_one_line(changes, message) -> None:
    with pytest.raises(JobBuildError, match=message) as refusal:
        dataclasses.replace(SPLIT, **changes)
    assert "\n" not in str(refusal.value)


def test_a_local_baseline_without_any_split_is_refused() -> None:
    with pytest.raises(JobBuildError, match="local_baseline needs a split"):
        dataclasses.replace(BASE, local_baseline=True)
    assert dataclasses.replace(BASE, local_baseline=True, site_val_fraction=0.2).local_baseline  # validation only: ok


def test_a_user_module_reports_its_own_metric_names_and_an_unlogged_keep_metric_is_named(tmp_path, monkeypatch) -> None:
    from jobs.presets import EXAMPLES
    from lightning_modules.algorithms.base import ClientAlgorithmError
    from lightning_modules.keep_best import SiteCandidates

    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = JobSpec(
        name="snp", model="genomics.model:SnpClassifier", ship=str(EXAMPLES / "genomics"), num_sites=2,
        model_args={"arch": "mlp", "n_snps": 127, "num_classes": 5, "lr": 1e-3}, data="genomics.data:SnpSites",
        data_args={"source": "1kg", "split": "iid", "batch_size": 256, "test_fraction": 0.2},
        local_baseline=True, keep="best", keep_metric="val_accuracy",
    )  # fmt: skip
    from benchmarks.in_process import site_args
    from lightning_modules.own_model import UserSite

    site = UserSite(site_args(spec), "site-1", ClientStateStore(tmp_path, "site-1"))  # one site: the slow part
    _, sent = site.train(0, initial_params(spec), meta(0))
    assert {"eval.global_test_accuracy", "eval.local_test_loss", "eval.kept_val_accuracy"} <= set(sent)
    kept = ("global", "personal", "local")[int(sent["eval.kept_candidate"])]
    assert sent["eval.kept_test_accuracy"] == sent[f"eval.{kept}_test_accuracy"]
    assert "eval.kept_minus_local_test_accuracy" in sent  # (states, label) batches: per-sample correctness works
    candidates = SiteCandidates("site-1", 0, 0, "best", "val_f1")
    with pytest.raises(
        ClientAlgorithmError, match=r"site-1: keep best selects on validation metric 'val_f1'.*\['val_loss'\]"
    ):
        candidates._keep({"global": None}, {}, {"eval.val_loss": 1.0, "eval.local_val_loss": 2.0}, 0, "r")


def test_a_user_data_module_with_a_pooled_test_set_gets_the_next_patient_view(tmp_path, monkeypatch) -> None:
    """The genomics example's data module offers its held-out people of every population through the optional
    ``pooled_test_dataloader`` hook: every candidate is scored on it beside the site's own test split, and the kept
    model's pooled score is its candidate's (before the hook, a user module had no pooled view at all)."""
    from jobs.presets import EXAMPLES

    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = JobSpec(
        name="snp", model="genomics.model:SnpClassifier", ship=str(EXAMPLES / "genomics"), num_sites=3,
        model_args={"arch": "mlp", "n_snps": 127, "num_classes": 5, "lr": 1e-3}, data="genomics.data:SnpSites",
        data_args={"source": "1kg", "split": "dirichlet", "alpha": 0.3, "batch_size": 256, "test_fraction": 0.2},
        local_baseline=True, keep="best",
    )  # fmt: skip
    from benchmarks.in_process import site_args
    from lightning_modules.kept_model import KINDS
    from lightning_modules.own_model import UserSite

    site = UserSite(site_args(spec), "site-2", ClientStateStore(tmp_path, "site-2"))
    pooled = site.data.pooled_test_dataloader()
    own_test = site.data.test_dataloader()
    assert len(pooled.dataset) > 2 * len(own_test.dataset)  # every population's held-out people, not the site's
    _, sent = site.train(0, initial_params(spec), meta(0))
    views = {f"eval.{name}_pooled_test_accuracy" for name in ("global", "local", "kept")}
    assert views <= set(sent)
    kept = KINDS[int(sent["eval.kept_candidate"])]
    name = "local" if kept == "local" else kept
    if name in ("global", "local"):
        assert sent["eval.kept_pooled_test_accuracy"] == sent[f"eval.{name}_pooled_test_accuracy"]
