"""Choosing on a pooled validation view (``keep_view pooled``): both the site's own early-stopped model and
its kept model are chosen on a pooled validation split instead of the site's own, the reports stay on the test and
pooled test views; ``keep_view own`` (the default) is the old choice bit for bit. The pooled validation split never
overlaps the pooled test view (built-in data, the genomics example), and bad settings are refused in one line."""

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
from lightning_modules.site_choice import Candidate, early_stopped, keep, scores_from_tables
from lightning_modules.split_scores import classifier_batches
from tests.lightning_modules.test_lm_site_choice import POOLED_CHOICE, SPLIT, rounds_of_one_site, scaled_identity

POOLED = dataclasses.replace(SPLIT, **POOLED_CHOICE)


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def two_views(kind: str, own_val: float, pooled_val: float, round_num: int = 0) -> Candidate:
    """A candidate whose every validation sample has loss ``own_val`` on the site's own split and ``pooled_val`` on
    the pooled one (4 samples each, 2 classes, label 0)."""

    def table(loss: float) -> np.ndarray:
        p = math.exp(-loss)
        return np.log(np.tile([p, 1 - p], (4, 1)))

    labels = {"val": np.zeros(4, int), "pooled_val": np.zeros(4, int)}
    scores = scores_from_tables({"val": table(own_val), "pooled_val": table(pooled_val)}, labels)
    return Candidate(kind, round_num, scores)


# -- (b) the rules on the pooled view, in closed form ---------------------------------------------------------------
def test_a_candidate_best_on_pooled_validation_but_worse_on_its_own_is_kept_only_when_choosing_on_pooled() -> None:
    own = two_views("local", own_val=0.1, pooled_val=2.0)
    fed = two_views("global", own_val=0.5, pooled_val=0.3)
    assert keep(own, [fed], margin=1.0) is own  # the default: the site's own validation split
    assert keep(own, [fed], margin=1.0, split="val") is own
    assert keep(own, [fed], margin=1.0, split="pooled_val") is fed
    # The reverse: better on its own split, worse on the pooled one, stays out under pooled.
    assert keep(own, [two_views("global", 0.05, 2.5)], margin=0.0, split="pooled_val") is own
    assert keep(own, [two_views("global", 0.05, 2.5)], margin=0.0) is not own


def test_the_own_model_is_early_stopped_on_the_view_the_site_chooses_on() -> None:
    first = two_views("local", own_val=0.2, pooled_val=1.5, round_num=0)
    later = two_views("local", own_val=0.4, pooled_val=1.0, round_num=1)  # worse on its own split, better pooled
    assert early_stopped(first, later) is first
    assert early_stopped(first, later, split="pooled_val") is later
    assert early_stopped(later, first, split="pooled_val") is later


def skewed_splits() -> dict:
    """The site's own validation split holds class 0 only (12 one-hot inputs); the pooled one all 3 classes (12)."""
    own = torch.eye(3)[[0] * 12]
    pooled = torch.eye(3).repeat(4, 1)

    def batches(x: torch.Tensor):
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.argmax(dim=1)), batch_size=5)
        return classifier_batches(loader)

    return {"val": batches(own), "test": batches(own), "pooled": batches(pooled), "pooled_val": batches(pooled)}


def always_zero() -> torch.nn.Module:
    """The own model of a site that saw class 0 only: logits (10, 0, 0) whatever the input."""
    layer = torch.nn.Linear(3, 3)
    torch.nn.init.zeros_(layer.weight)
    layer.bias.data = torch.tensor([10.0, 0.0, 0.0])
    return layer


def test_the_site_keeps_the_model_that_wins_on_the_pooled_view_only_when_it_chooses_there(tmp_path) -> None:
    # The own model is sure of class 0, the site's only class: on its own validation split it is best (loss
    # log(1 + 2 e^-10)), so "own" keeps it. The global model (logits 3 on the true class) loses there (log(1 + 2 e^-3))
    # but wins on the pooled view, where the own model pays 10 on two thirds of the samples: "pooled" keeps it.
    from lightning_modules.kept_model import KeptModel
    from lightning_modules.state_store import ClientStateStore

    models = {"global": scaled_identity(3.0), "personal": scaled_identity(0.0), "local": always_zero()}
    sure, global_loss = math.log1p(2 * math.exp(-10)), math.log1p(2 * math.exp(-3))
    own_view = KeptModel(ClientStateStore(tmp_path / "own", "site-1"), skewed_splits(), 1.0).round(
        models, 0, "run", True
    )
    pooled = KeptModel(ClientStateStore(tmp_path / "pooled", "site-1"), skewed_splits(), 1.0, select="pooled_val")
    pooled_view = pooled.round(models, 0, "run", True)
    assert own_view["eval.kept_own"] == 1.0 and own_view["eval.kept_val_loss"] == pytest.approx(sure, abs=1e-6)
    assert pooled_view["eval.kept_own"] == 0.0 and pooled_view["eval.kept_candidate"] == 0.0  # global
    assert pooled_view["eval.kept_pooled_val_loss"] == pytest.approx(global_loss, abs=1e-6)
    assert pooled_view["eval.kept_val_loss"] == pytest.approx(global_loss, abs=1e-6)  # reported, not chosen on
    assert pooled_view["eval.kept_pooled_test_accuracy"] == 1.0 and own_view["eval.kept_pooled_test_accuracy"] == (
        pytest.approx(1 / 3, abs=1e-12)
    )
    assert pooled_view["eval.kept_on_pooled_val"] == 1.0 and "eval.kept_on_pooled_val" not in own_view
    kept = ClientStateStore(tmp_path / "pooled", "site-1").latest("kept_model").state
    assert kept["kind"] == "global"


def test_the_stopping_rule_reads_the_score_the_kept_model_is_chosen_on() -> None:
    from controllers.stopping import plateau_metric

    both = {"kept_pooled_val_loss": {}, "kept_val_loss": {}, "val_loss": {}}
    assert plateau_metric(both) == "kept_pooled_val_loss"
    assert plateau_metric({"kept_val_loss": {}, "val_loss": {}}) == "kept_val_loss"  # keep_view own: as before


# -- (a) keep_view own: the old choice bit for bit ----------------------------------------------------------------
def test_choosing_on_the_own_view_ignores_a_pooled_validation_split_bit_for_bit(tmp_path) -> None:
    # A pooled validation split the site holds must not move the "own" choice: every report but the pooled_val
    # scores themselves, and the stored models, equal a site without the split.
    from lightning_modules.kept_model import KeptModel
    from lightning_modules.state_store import ClientStateStore

    with_split, without = skewed_splits(), skewed_splits()
    del without["pooled_val"]
    models = {"global": scaled_identity(3.0), "personal": scaled_identity(0.0), "local": always_zero()}
    metas, stores = [], []
    for name, splits in (("with", with_split), ("without", without)):
        store = ClientStateStore(tmp_path / name, "site-1")
        metas.append(KeptModel(store, splits, 1.0).round(models, 0, "run", True))
        stores.append(store.latest("kept_model").state)
    assert {k: v for k, v in metas[0].items() if "pooled_val" not in k} == metas[1]
    assert stores[0]["kind"] == stores[1]["kind"] == "local"


def test_a_default_job_reads_no_pooled_validation_split_and_chooses_on_its_own(tmp_path) -> None:
    site = site_rounds(SPLIT, tmp_path)["site-1"]
    site.train(0, initial_params(SPLIT), {meta_keys.ROUND: 0, meta_keys.RUN_ID: "run", meta_keys.NUM_ROUNDS: 1})
    candidates = site.round_callback.candidates
    assert candidates.select == "val" and "pooled_val" not in candidates.splits


def test_a_built_in_site_choosing_on_the_pooled_view_chooses_on_its_pooled_validation_split(tmp_path) -> None:
    sent = rounds_of_one_site(POOLED, tmp_path, rounds=3)
    history = [m["eval.local_last_pooled_val_loss"] for m in sent]
    for r, m in enumerate(sent):
        best_round = int(np.argmin(history[: r + 1]))  # the own model, early-stopped on the pooled view
        assert m["eval.local_round"] == best_round and m["eval.local_pooled_val_loss"] == history[best_round]
        assert m["eval.kept_pooled_val_loss"] <= m["eval.local_pooled_val_loss"]
        assert m["eval.kept_on_pooled_val"] == 1.0
        assert {"eval.kept_test_accuracy", "eval.kept_pooled_test_accuracy", "eval.local_test_accuracy"} <= set(m)


# -- (c) the pooled validation and pooled test sets never overlap --------------------------------------------------
def test_the_built_in_pooled_validation_split_is_the_next_published_test_images_after_the_pooled_test_ones() -> None:
    from data_prep import SiteDataConfig
    from data_prep.sites import test_split
    from lightning_modules.site import pooled_test_set, pooled_val_set

    x, y = test_split(SiteDataConfig.from_namespace(POOLED))
    test, val = pooled_test_set(POOLED), pooled_val_set(POOLED)
    n, m = POOLED.site_pooled_test, POOLED.site_pooled_val
    assert len(test) == n and len(val) == m
    np.testing.assert_array_equal(test.tensors[0].numpy(), np.asarray(x[:n], dtype=np.float32))
    np.testing.assert_array_equal(val.tensors[0].numpy(), np.asarray(x[n : n + m], dtype=np.float32))
    np.testing.assert_array_equal(val.tensors[1].numpy(), np.asarray(y[n : n + m]))
    assert pooled_val_set(SPLIT) is None


def test_the_genomics_example_splits_its_held_out_people_into_disjoint_pooled_validation_and_test_parts() -> None:
    from genomics.data import SnpSites

    plain = SnpSites(site="site-1", num_sites=3)
    split = SnpSites(site="site-1", num_sites=3, pooled_val_fraction=0.5)
    assert plain.pooled_val_dataloader() is None  # off by default: the pooled test view is every held-out person
    held_out = np.sort(plain.pooled_people)
    val, test = split.pooled_val_people, split.pooled_people
    assert len(np.intersect1d(val, test)) == 0 and len(val) > 0 and len(test) > 0
    np.testing.assert_array_equal(np.sort(np.concatenate([val, test])), held_out)
    again = SnpSites(site="site-2", num_sites=3, pooled_val_fraction=0.5)  # the same people at every site
    np.testing.assert_array_equal(again.pooled_val_people, val)
    assert len(split.pooled_val_dataloader().dataset) == len(val)
    assert len(split.pooled_test_dataloader().dataset) == len(test)
    assert len(plain.pooled_test_dataloader().dataset) == len(held_out)


# -- (d) refusals (the settings': test_lm_site_choice.test_bad_choice_settings_are_refused_in_one_line) ---------


def test_a_users_pooled_validation_split_cannot_come_from_the_built_in_data() -> None:
    with pytest.raises(JobBuildError, match="--site-pooled-val 10 has no effect with --model") as refusal:
        JobSpec(name="u", model="genomics.model:SnpClassifier", data="genomics.data:SnpSites", site_pooled_val=10,
                local_baseline=True)  # fmt: skip
    assert "\n" not in str(refusal.value)


def test_a_users_data_module_without_the_pooled_validation_hook_is_refused_naming_the_site_and_the_hook(
    tmp_path,
) -> None:
    from lightning_modules.own_model import UserCodeError, UserSite

    class Args:  # what the site reads of the job
        model, model_args = "genomics.model:SnpClassifier", '{"n_snps": 127, "num_classes": 5}'
        data, data_args, data_site_arg = "genomics.data:SnpSites", "{}", None
        client, client_args, local_keys = "fedavg", "{}", None
        num_sites, seed, precision, accelerator = 3, 0, "32-true", "cpu"
        keep, keep_metric, keep_margin, local_baseline, keep_view = "best", "val_loss", 1.0, True, "pooled"
        finetune_epochs = 0

    from lightning_modules.state_store import ClientStateStore

    with pytest.raises(UserCodeError) as refusal:  # the example's hook returns None without pooled_val_fraction
        site = UserSite(Args, "site-2", ClientStateStore(tmp_path, "site-2"))
        site.candidates(site.state_store).split_source()
    text = str(refusal.value)
    assert "\n" not in text and text.startswith("site-2: ") and "pooled_val_dataloader()" in text


def _without_the_hook():
    from genomics.data import SnpSites

    return type("NoPooledVal", (SnpSites,), {"pooled_val_dataloader": None})


NoPooledVal = None  # built on first use (the genomics example is importable once the tests' conftest ran)


def test_a_users_data_module_without_the_hook_is_refused_at_build_time(monkeypatch) -> None:
    import sys

    monkeypatch.setattr(sys.modules[__name__], "NoPooledVal", _without_the_hook())  # the job names it by path
    spec = {"model": "genomics.model:SnpClassifier", "model_args": {"n_snps": 127, "num_classes": 5}}
    spec.update(data_args={"test_fraction": 0.2}, keep="best", local_baseline=True, keep_view="pooled")
    with pytest.raises(JobBuildError, match="defines no pooled_val_dataloader") as refusal:
        JobSpec(name="u", data=f"{__name__}:NoPooledVal", **spec)
    assert "\n" not in str(refusal.value)
    assert JobSpec(name="u", data="genomics.data:SnpSites", **spec).keep_view == "pooled"  # the example has it
