"""Which model a site keeps (lightning_modules/site_choice.py, kept_model.py, split_scores.py): the rules in closed
form, the one-pass scorer against Lightning's validate, the Trainer-free local-only training against Lightning's fit,
and a site over rounds (early-stopped own model, the kept model never below it on validation, the own model kept
means a gain of exactly 0, the received model never kept under partial sharing, even where it wins on validation)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from aggregators.contracts import meta_keys
from benchmarks.in_process import initial_params, quiet_lightning, site_rounds
from jobs.build import JobSpec
from jobs.settings import JobBuildError
from lightning_modules.local_baseline import plain_fit
from lightning_modules.personal_scores import own_random_stream, single_process_trainer, validation_scores
from lightning_modules.site import ValidatedClassifier
from lightning_modules.site_choice import (
    DEFAULT_MARGIN,
    Candidate,
    beats,
    early_stopped,
    keep,
    mixture_scores,
    paired_mean_se,
    scores_from_tables,
)
from lightning_modules.split_scores import classifier_batches, model_tables


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def candidate(kind: str, val_losses: list[float], round_num: int = 0) -> Candidate:
    """A candidate whose per-sample validation losses are ``val_losses`` (log p = -loss; all right)."""
    log_prob = -np.asarray(val_losses, dtype=np.float64)
    table = np.stack([log_prob, log_prob - 10], axis=1)
    scores = scores_from_tables({"val": table}, {"val": np.zeros(len(log_prob), int)})
    return Candidate(kind, round_num, scores)


# -- the rules, in closed form ---------------------------------------------------------------------------------------
def test_the_mixture_is_the_weighted_average_of_probabilities() -> None:
    own = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]]))
    fed = np.log(np.array([[0.2, 0.6, 0.2], [0.3, 0.3, 0.4]]))
    mixed = mixture_scores({"val": own}, {"val": fed}, 0.25)["val"]
    first = [0.75 * 0.7 + 0.25 * 0.2, 0.75 * 0.2 + 0.25 * 0.6, 0.75 * 0.1 + 0.25 * 0.2]
    second = [0.75 * 0.1 + 0.25 * 0.3, 0.75 * 0.1 + 0.25 * 0.3, 0.75 * 0.8 + 0.25 * 0.4]
    by_hand = np.log(np.array([first, second]))
    np.testing.assert_allclose(mixed, by_hand, atol=1e-12)
    scores = scores_from_tables({"val": mixed}, {"val": np.array([1, 2])})
    assert scores.loss("val") == pytest.approx(-(math.log(0.3) + math.log(0.7)) / 2, abs=1e-12)
    assert scores.accuracy("val") == 0.5  # sample 0: arg-max is class 0 (0.575), not 1
    with pytest.raises(ValueError):
        mixture_scores({"val": own}, {"val": fed}, 1.0)
    confident = np.array([[-1e4, 0.0]])  # log-space: a model sure of the wrong class does not underflow to -inf
    assert np.isfinite(mixture_scores({"v": confident}, {"v": np.array([[0.0, -1e4]])}, 0.5)["v"]).all()


def test_beats_is_a_one_sided_paired_test_on_validation_loss() -> None:
    own = candidate("local", [1.0, 1.0, 1.0, 1.0])
    better = candidate("global", [0.5, 0.7, 0.6, 0.8])  # d = -0.5, -0.3, -0.4, -0.2: mean -0.35
    mean, se = paired_mean_se(-better.scores.log_prob["val"], -own.scores.log_prob["val"])
    sd = math.sqrt(((0.15**2) + (0.05**2) + (0.05**2) + (0.15**2)) / 3)
    assert (mean, se) == (pytest.approx(-0.35, abs=1e-12), pytest.approx(sd / 2, abs=1e-12))
    assert beats(better, own, margin=1.645)  # -0.35 + 1.645 * 0.0645 < 0
    noisy = candidate("global", [0.0, 2.0, 0.0, 1.6])  # mean d = -0.1, se 0.5: lower, but within the noise
    assert beats(noisy, own, margin=0) and not beats(noisy, own, margin=1.645)
    assert not beats(own, own, margin=0)  # equal is not better


def test_the_default_margin_still_refuses_a_challenger_within_the_noise() -> None:
    # The default moved from 1.645 to 1.0 standard errors (site_choice.DEFAULT_MARGIN): a challenger 1.6 SE better
    # on validation now replaces the own model, one lower on the mean but within its noise (0.2 SE, the winner's
    # curse among many candidates) still does not; with no margin at all it would.
    own = candidate("local", [1.0, 1.0, 1.0, 1.0])
    d = np.array([-0.3, -0.1, -0.2, 0.08])  # mean -0.13, se 0.0810: 1.60 SE
    moderate = candidate("global", list(1.0 + d))
    mean, se = paired_mean_se(-moderate.scores.log_prob["val"], -own.scores.log_prob["val"])
    assert mean == pytest.approx(-0.13, abs=1e-12) and 1.0 < -mean / se < 1.645
    assert DEFAULT_MARGIN == 1.0 and beats(moderate, own, DEFAULT_MARGIN) and not beats(moderate, own, 1.645)
    noisy = candidate("global", [0.0, 2.0, 0.0, 1.6])  # mean d = -0.1, se 0.5
    assert not beats(noisy, own, DEFAULT_MARGIN) and beats(noisy, own, 0)
    assert keep(own, [noisy], DEFAULT_MARGIN) is own and keep(own, [noisy, moderate], DEFAULT_MARGIN) is moderate


def test_early_stopping_keeps_the_incumbent_unless_strictly_lower() -> None:
    first, same, lower = candidate("local", [1.0], 1), candidate("local", [1.0], 2), candidate("local", [0.9], 3)
    assert early_stopped(None, first) is first
    assert early_stopped(first, same) is first  # a tie keeps the earlier round
    assert early_stopped(first, lower) is lower
    assert early_stopped(candidate("local", [math.nan], 0), first) is first


def test_keep_takes_the_best_challenger_only_when_it_beats_the_own_model() -> None:
    own = candidate("local", [1.0, 1.0, 1.0, 1.0])
    clear = candidate("mixture", [0.5, 0.7, 0.6, 0.8])
    noisy = candidate("global", [0.0, 2.0, 0.0, 1.6])  # mean 0.9: lower than own's 1.0, but within the noise
    assert keep(own, [noisy, clear], margin=1.645) is clear  # clear has the lowest mean (0.65) and beats own
    assert keep(own, [noisy], margin=1.645) is own  # the best challenger does not beat own: own
    assert keep(own, [noisy], margin=0) is noisy
    assert keep(None, [noisy, clear], margin=1.645) is clear  # no own model: the best, no margin
    tie = candidate("personal", [0.5, 0.7, 0.6, 0.8])
    assert keep(own, [clear, tie], margin=0) is clear  # ties go to the earlier challenger
    assert keep(own, [candidate("global", [math.nan] * 4)], margin=0) is own


def test_with_no_margin_and_one_round_the_rule_is_the_plain_arg_min_ties_to_the_own_model() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        losses = rng.choice([0.5, 0.6, 0.7], size=(3, 5))
        own, *others = (candidate(k, list(v)) for k, v in zip(("local", "global", "personal"), losses, strict=True))
        kept = keep(own, others, margin=0)
        best = min(c.val_loss for c in (own, *others))
        assert kept.val_loss == pytest.approx(best, abs=1e-12)
        assert kept is own or own.val_loss > best + 1e-12  # ties (to the last bit of a sum's order) stay with own


# -- the scorer and the Trainer-free training against Lightning --------------------------------------------------------
def data(n: int = 90, seed: int = 0) -> torch.utils.data.TensorDataset:
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(n, 64)).astype(np.float32))
    return torch.utils.data.TensorDataset(x, torch.from_numpy(rng.integers(0, 10, n)))


def test_the_one_pass_scorer_equals_lightnings_validate() -> None:
    module = ValidatedClassifier(arch="mlp", num_classes=10, init_seed=1)
    loader = torch.utils.data.DataLoader(data(), batch_size=32)  # batches of 32, 32, 26: the weighted mean matters
    tables = model_tables(module, {"val": classifier_batches(loader)})
    mine = scores_from_tables(tables, {"val": classifier_batches(loader).labels})
    lightning = validation_scores(module, single_process_trainer("32-true", "cpu"), dataloaders=loader)
    assert mine.loss("val") == pytest.approx(lightning["val_loss"], abs=1e-6)
    assert mine.accuracy("val") == pytest.approx(lightning["val_accuracy"], abs=1e-6)
    assert classifier_batches(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.rand(4, 2)))) is None


def test_the_trainer_free_local_training_takes_lightnings_steps_bit_for_bit() -> None:
    def make() -> ValidatedClassifier:
        return ValidatedClassifier(arch="mlp", num_classes=10, init_seed=3, lr=0.05, momentum=0.9)

    plain, lightning = make(), make()
    with own_random_stream(7):  # 13 steps over batches of 32 of 90 samples: crosses epochs, reshuffles
        assert plain_fit(plain, torch.utils.data.DataLoader(data(), 32, shuffle=True), 13) == 13
    with own_random_stream(7):
        trainer = single_process_trainer("32-true", "cpu", epochs=-1, steps=13)
        trainer.fit(lightning, train_dataloaders=torch.utils.data.DataLoader(data(), 32, shuffle=True))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, lightning.state_dict()[key]), key


# -- a site over rounds ----------------------------------------------------------------------------------------------
SPLIT = JobSpec(
    name="sc", dataset="digits", arch="mlp", num_rounds=4, batch_size=32, lr=0.1, max_train_samples=600,
    site_val_fraction=0.2, site_test_fraction=0.2, local_baseline=True, keep="best", site_pooled_test=200,
)  # fmt: skip
#: SPLIT choosing on the pooled view (tests/lightning_modules/test_lm_pooled_choice.py): the 100 published test images
#: after the pooled view's 200.
POOLED_CHOICE = {"keep_view": "pooled", "site_pooled_val": 100}


def rounds_of_one_site(spec: JobSpec, tmp_path, rounds: int = 4) -> list[dict]:
    """Rounds of site-1 that receives the initial model every round (the server is not the point here)."""
    site = site_rounds(spec, tmp_path)["site-1"]
    start = initial_params(spec)
    sent = []
    for r in range(rounds):
        _, meta = site.train(r, start, {meta_keys.ROUND: r, meta_keys.RUN_ID: "run", meta_keys.NUM_ROUNDS: rounds})
        sent.append(meta)
    return sent


def test_over_rounds_the_own_model_is_early_stopped_and_the_kept_one_never_worse_on_validation(tmp_path) -> None:
    sent = rounds_of_one_site(SPLIT, tmp_path)
    history = [m["eval.local_last_val_loss"] for m in sent]
    for r, m in enumerate(sent):
        best_round = int(np.argmin(history[: r + 1]))  # first of equal values: the earlier round stays
        assert m["eval.local_round"] == best_round and m["eval.local_val_loss"] == history[best_round]
        assert m["eval.local_test_accuracy"] == sent[best_round]["eval.local_last_test_accuracy"]
        assert m["eval.kept_val_loss"] <= m["eval.local_val_loss"]
        if m["eval.kept_own"]:  # the own model kept: its gain is 0 by construction, on both views
            assert m["eval.kept_minus_local_test_accuracy"] == 0
            assert m["eval.kept_minus_local_pooled_test_accuracy"] == 0
            assert m["eval.kept_test_accuracy"] == m["eval.local_test_accuracy"]
        assert {"eval.kept_pooled_test_accuracy", "eval.local_pooled_test_accuracy"} <= set(m)


def eye_splits() -> dict:
    """Validation and test splits of 30 one-hot inputs of 3 classes, labelled by their hot entry."""
    x = torch.eye(3).repeat(10, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.argmax(dim=1)), batch_size=8)
    return {"val": classifier_batches(loader), "test": classifier_batches(loader)}


def scaled_identity(scale: float) -> torch.nn.Module:
    """A 3-class classifier of `eye_splits`: perfect and sure for a large ``scale``, uniform (knows nothing) at 0."""
    layer = torch.nn.Linear(3, 3, bias=False)
    torch.nn.init.eye_(layer.weight)
    layer.weight.data.mul_(scale)
    return layer


def test_a_received_model_that_wins_on_validation_is_still_never_kept_when_no_site_could_use_it(tmp_path) -> None:
    # The hostile case: the received model scores best on validation (here a perfect classifier, the site's own and
    # personal models know nothing), yet under partial sharing it carries the server's copy of the site's head, so
    # keeping it (alone or in a mixture) is keeping a model the site never runs. With the rule off it is kept.
    from lightning_modules.kept_model import KeptModel
    from lightning_modules.state_store import ClientStateStore

    splits = eye_splits()

    models = {"global": scaled_identity(20.0), "personal": scaled_identity(0.0), "local": scaled_identity(0.0)}
    for eligible, where in ((True, "on"), (False, "off")):
        store = ClientStateStore(tmp_path / where, "site-1")
        meta = KeptModel(store, splits, margin=1.645).round(models, 0, "run", True, eligible_global=eligible)
        kept = ClientStateStore(tmp_path / where, "site-1").latest("kept_model").state
        if eligible:  # the attack works when the received model is offered: it (or a mixture with it) is kept
            assert kept["kind"] in ("global", "mixture") and meta["eval.kept_test_accuracy"] == 1.0
        else:
            assert kept["kind"] == "local" and meta["eval.kept_own"] == 1.0
            assert meta["eval.kept_minus_local_test_accuracy"] == 0.0
            assert meta["eval.global_test_accuracy"] == 1.0  # still scored and reported


def test_the_site_round_offers_the_received_model_only_without_partial_sharing(tmp_path) -> None:
    for spec, eligible in ((SPLIT, True), (dataclasses.replace(SPLIT, local_keys="net.classifier.*"), False)):
        site = site_rounds(spec, tmp_path / str(eligible))["site-1"]
        site.train(0, initial_params(SPLIT), {meta_keys.ROUND: 0, meta_keys.RUN_ID: "run", meta_keys.NUM_ROUNDS: 1})
        assert site.round_callback.candidates.global_eligible is eligible


def test_without_a_personal_model_the_personal_candidate_is_the_model_the_site_sends(tmp_path) -> None:
    # FedAvg has no personal model: its candidate is the round's trained model (the received global model after the
    # site's local epochs). Its validation loss, computed here independently from the weights the site sends, must be
    # the one reported: a candidate built from the received model, or none at all, fails this.
    site = site_rounds(SPLIT, tmp_path)["site-1"]
    start = initial_params(SPLIT)
    sent, meta = site.train(0, start, {meta_keys.ROUND: 0, meta_keys.RUN_ID: "run", meta_keys.NUM_ROUNDS: 1})
    module = ValidatedClassifier(arch="mlp", num_classes=10)
    module.load_state_dict({key: torch.as_tensor(np.asarray(value)) for key, value in sent.items()})
    module.eval()
    val = site.round_callback.candidates.splits["val"]
    with torch.no_grad():
        logits = torch.cat([module(x) for x in val.inputs]).double()
    expected = torch.nn.functional.cross_entropy(logits, torch.from_numpy(val.labels)).item()
    assert meta["eval.personal_val_loss"] == pytest.approx(expected, abs=1e-6)
    assert meta["eval.personal_val_loss"] != pytest.approx(meta["eval.global_val_loss"], abs=1e-3)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"keep_margin": -1.0}, "keep_margin must be"),
        # keep_view pooled (POOLED_CHOICE) needs both sides chosen, a pooled validation split apart from the pooled view
        ({**POOLED_CHOICE, "keep": "last"}, "keep_view 'pooled' needs keep best and local_baseline"),
        ({**POOLED_CHOICE, "local_baseline": False, "finetune_epochs": 1}, "needs keep best and local_baseline"),
        ({**POOLED_CHOICE, "site_pooled_val": 0}, "keep_view 'pooled' with the built-in data needs site_pooled_val"),
        ({**POOLED_CHOICE, "site_pooled_test": 0}, "site_pooled_val needs site_pooled_test"),
        ({**POOLED_CHOICE, "site_pooled_val": 200}, "site_pooled_test 200 \\+ site_pooled_val 200 = 400 published"),
        ({"site_pooled_val": 100}, "site_pooled_val 100 is the split keep_view 'pooled' chooses on"),
        ({**POOLED_CHOICE, "keep_metric": "val_accuracy"}, "keep_view 'pooled' chooses on the validation loss"),
    ],
)
def test_bad_choice_settings_are_refused_in_one_line(changes, message) -> None:
    with pytest.raises(JobBuildError, match=message) as refusal:
        dataclasses.replace(SPLIT, **changes)
    assert "\n" not in str(refusal.value)


def test_a_pooled_view_with_a_users_data_module_is_refused() -> None:
    with pytest.raises(JobBuildError, match="pooled view is the built-in dataset's published test set") as refusal:
        JobSpec(name="u", model="genomics.model:SnpClassifier", data="genomics.data:SnpSites", site_pooled_test=10,
                local_baseline=True)  # fmt: skip
    assert "\n" not in str(refusal.value)


def test_the_offline_replay_of_recorded_tables_reports_what_the_site_reported(tmp_path, monkeypatch) -> None:
    # benchmarks/keep_rule_study.py replays keep rules on the tables a site records: with the shipped rule it must
    # give the site's own reports round by round (kept/own test accuracy, kept validation loss, own model kept), or
    # the rule comparisons it prints describe some other site.
    from benchmarks.keep_rule_study import RULES, replay_site, site_rounds
    from lightning_modules.kept_model import RECORD_ENV

    monkeypatch.setenv(RECORD_ENV, str(tmp_path / "tables"))
    sent = rounds_of_one_site(SPLIT, tmp_path / "ws")
    recorded = site_rounds(tmp_path / "tables" / "run")
    assert list(recorded) == ["site-1"] and len(recorded["site-1"]) == len(sent)
    replayed = replay_site(recorded["site-1"], RULES["margin=1.645"])
    for meta, row in zip(sent, replayed, strict=True):
        assert row["kept_test"] == pytest.approx(meta["eval.kept_test_accuracy"], abs=1e-12)
        assert row["own_test"] == pytest.approx(meta["eval.local_test_accuracy"], abs=1e-12)
        assert row["kept_pooled"] == pytest.approx(meta["eval.kept_pooled_test_accuracy"], abs=1e-12)
        assert row["kept_val_loss"] == pytest.approx(meta["eval.kept_val_loss"], abs=1e-6)
        assert row["kept_own"] == meta["eval.kept_own"]


def test_a_kept_model_kept_again_is_not_rewritten_and_a_restarted_site_still_finds_it(tmp_path, monkeypatch) -> None:
    # Round 0 keeps the received model (a perfect classifier); rounds 1-2 offer only models that know nothing, so the
    # stored one is kept again and the site writes nothing (round 2 in a new store and chooser: a restarted site);
    # round 3 offers a new perfect model, which must be written. Every report and every stored model must be what a
    # site that rewrites its kept model every round has: a skipped write that lost the model, or a stale one kept
    # after a change, fails this.
    from lightning_modules import kept_model
    from lightning_modules.cross_site import submission
    from lightning_modules.kept_model import KEPT_STORE, KeptModel
    from lightning_modules.state_store import ClientStateStore

    splits = eye_splits()

    know_nothing = {"global": scaled_identity(0.0), "personal": scaled_identity(0.0), "local": scaled_identity(0.0)}
    offers = [
        {**know_nothing, "global": scaled_identity(20.0)},
        know_nothing,
        know_nothing,
        {**know_nothing, "personal": scaled_identity(30.0)},
    ]

    def run(root, written: list) -> tuple[list, list]:
        metas, kept = [], []
        for r, models in enumerate(offers):
            store = ClientStateStore(root, "site-1")  # a new store and chooser every round: a restarted site
            save = store.save
            store.save = lambda name, state, r=r, save=save, **kw: (written.append((r, name)), save(name, state, **kw))[
                1
            ]
            metas.append(KeptModel(store, splits, margin=1.645).round(models, r, "run", True))
            kept.append(submission(ClientStateStore(root, "site-1"), "run", "site-1")[0])
        return metas, kept

    written: list = []
    metas, kept = run(tmp_path / "skip", written)
    assert [r for r, name in written if name == KEPT_STORE] == [0, 3]
    assert [(m["eval.kept_candidate"], m["eval.kept_round"]) for m in metas] == [(0, 0), (0, 0), (0, 0), (1, 3)]
    assert torch.equal(kept[2]["kept/weight"], 20.0 * torch.eye(3)) and metas[2]["eval.kept_test_accuracy"] == 1.0
    monkeypatch.setattr(kept_model, "already_stored", lambda *_: False)  # the site before: a write every round
    always: list = []
    metas_always, kept_always = run(tmp_path / "always", always)
    assert [r for r, name in always if name == KEPT_STORE] == [0, 1, 2, 3]
    assert metas == metas_always
    for mine, theirs in zip(kept, kept_always, strict=True):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_genomics_models_local_training_without_a_trainer_takes_lightnings_steps_bit_for_bit(monkeypatch) -> None:
    # The user-module path: the consortium's model (dropout on: the forward draws random numbers) on its data
    # module, whose on_after_batch_transfer widens int8 genotype batches. 20 steps of batch 16 cross an epoch.
    from jobs.presets import EXAMPLES
    from lightning_modules.local_baseline import DataModuleBatches

    monkeypatch.syspath_prepend(str(EXAMPLES))
    from genomics.data import SnpSites
    from genomics.model import SnpClassifier

    data = SnpSites(site="site-2", num_sites=5, source="1kg", split="iid", batch_size=16, test_fraction=0.2)
    data.setup("fit")
    assert len(data.train_dataloader()) < 20

    def make() -> SnpClassifier:
        return SnpClassifier(arch="mlp", n_snps=127, num_classes=5, lr=1e-3, dropout=0.3, seed=4)

    plain, lightning = make(), make()
    with own_random_stream(11):
        assert plain_fit(plain, DataModuleBatches(data), 20) == 20
    with own_random_stream(11):
        # The local-only model's Trainer skips the validation loop after each epoch: creating the validation
        # loader's iterator draws from the generator, so with it the shuffles and dropout after it would differ.
        trainer = single_process_trainer("32-true", "cpu", epochs=-1, steps=20, validate=False)
        trainer.fit(lightning, datamodule=data)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, lightning.state_dict()[key]), key


def test_a_batch_hook_that_lightning_would_call_keeps_the_local_model_on_a_trainer() -> None:
    from lightning_modules.local_baseline import datamodule_batches

    class Data(pl.LightningDataModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader(data(), batch_size=32)

    class Moved(Data):
        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            return batch

    class Hooked(ValidatedClassifier):
        def on_before_batch_transfer(self, batch, dataloader_idx):
            return batch

    batches = datamodule_batches(Data(), ValidatedClassifier)
    assert batches is not None and sum(len(x) for x, _ in batches()) == 90
    assert datamodule_batches(Data(), Hooked) is None
    assert datamodule_batches(Moved(), ValidatedClassifier) is None


class ShiftedData(pl.LightningDataModule):
    """Raw inputs 100 above what the model is meant to see; the data module's on_before_batch_transfer removes the
    offset (the hook the site's scorer once skipped: it applied on_after_batch_transfer only)."""

    def val_dataloader(self):
        x, y = data(40, seed=3).tensors
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x + 100.0, y), batch_size=16)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return [batch[0] - 100.0, batch[1]]


class Doubled(ValidatedClassifier):
    """The module's own on_after_batch_transfer (Lightning calls it: the data module does not override that one)."""

    def __init__(self) -> None:
        super().__init__(arch="mlp", num_classes=10, init_seed=1)
        self.seen: list[torch.Tensor] = []

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return [batch[0] * 2.0, batch[1]]

    def validation_step(self, batch, batch_idx):
        self.seen.append(batch[0])
        return super().validation_step(batch, batch_idx)


def test_the_batch_transform_is_what_lightnings_loops_hand_a_step() -> None:
    from lightning_modules.local_baseline import batch_transform

    data_module, module = ShiftedData(), Doubled()
    single_process_trainer("32-true", "cpu").validate(module, datamodule=data_module, verbose=False)
    transform = batch_transform(data_module, module)
    mine = [transform(batch)[0] for batch in data_module.val_dataloader()]
    assert len(mine) == len(module.seen) == 3
    assert all(torch.equal(a, b) for a, b in zip(mine, module.seen, strict=True))
    x = data(40, seed=3).tensors[0]
    assert torch.allclose(torch.cat(mine), 2.0 * x, atol=1e-4)  # both hooks, in Lightning's order
    assert batch_transform(pl.LightningDataModule(), ValidatedClassifier(arch="mlp", num_classes=10)) is None


def test_a_user_sites_scored_splits_go_through_the_data_modules_before_transfer_hook() -> None:
    from types import SimpleNamespace

    from lightning_modules.own_model import UserSite

    site = SimpleNamespace(data=ShiftedData(), module=ValidatedClassifier(arch="mlp", num_classes=10, init_seed=1))
    splits = UserSite.classifier_splits(site, with_test=False)
    x = data(40, seed=3).tensors[0]
    assert torch.allclose(torch.cat(splits["val"].inputs), x, atol=1e-4)  # not x + 100
