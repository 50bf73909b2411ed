"""Local fine-tuning (lightning_modules/finetune.py): the fine-tuned copy equals a plain-torch reference, the round
sends the same bits with and without it, its scores travel as eval.personal_*, and bad jobs are refused."""

from __future__ import annotations

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.in_process import site_args
from jobs.settings import JobBuildError
from jobs.spec import JobSpec
from lightning_modules.finetune import best_epoch, epoch_scorer, finetune_seed, finetuned_copy
from lightning_modules.site import ValidatedClassifier, build_site_round
from lightning_modules.split_scores import classifier_batches
from lightning_modules.state_store import ClientStateStore


def digits_like(n: int = 90, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.random((n, 64), dtype=np.float32), rng.integers(0, 10, n).astype(np.int64)


def test_finetuned_copy_equals_a_plain_torch_reference():
    x, y = digits_like()
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    module = ValidatedClassifier(arch="mlp", lr=0.05, momentum=0.9, weight_decay=1e-3, init_seed=4)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    seed = finetune_seed(0, 1, 2)

    def fit(trainer, copy):
        trainer.fit(copy, DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed)))

    tuned = finetuned_copy(module, 3, seed, fit, accelerator="cpu")
    # Reference: the same net, SGD with the module's settings, the same shuffled batches, 3 epochs.
    reference = ValidatedClassifier(arch="mlp", init_seed=4).net
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed))
    for _ in range(3):
        for xb, yb in loader:
            optimizer.zero_grad()
            F.cross_entropy(reference(xb), yb).backward()
            optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(tuned.net.state_dict()[key], value, atol=1e-6, rtol=0)
    for key, value in module.state_dict().items():  # the site's module is untouched
        assert torch.equal(value, before[key])


def reference_epochs(data: TensorDataset, seed: int, epochs: int) -> list[dict[str, torch.Tensor]]:
    """The plain-torch fine-tuning of the test above, its weights after every epoch."""
    reference = ValidatedClassifier(arch="mlp", init_seed=4).net
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed))
    after = []
    for _ in range(epochs):
        for xb, yb in loader:
            optimizer.zero_grad()
            F.cross_entropy(reference(xb), yb).backward()
            optimizer.step()
        after.append({k: v.clone() for k, v in reference.state_dict().items()})
    return after


def test_best_epoch_in_closed_form():
    assert best_epoch([3.0, 1.0, 2.0]) == 2
    assert best_epoch([1.0, 1.0, 0.5, 0.5]) == 3  # ties go to the earlier epoch
    assert best_epoch([float("nan"), 2.0, None]) == 2  # unscored or non-finite epochs are never chosen
    assert best_epoch([None, float("inf")]) == 2  # nothing scored: the last epoch, the copy as trained


def test_the_fine_tuned_copy_keeps_the_epoch_its_validation_prefers():
    # A toy whose validation prefers epoch 2 of 3: the copy is the epoch-2 model (the plain-torch reference after
    # two epochs), not the model after all three, and it still took all three epochs' steps.
    x, y = digits_like()
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    module = ValidatedClassifier(arch="mlp", lr=0.05, momentum=0.9, weight_decay=1e-3, init_seed=4)
    seed = finetune_seed(0, 1, 2)
    losses = iter([0.9, 0.4, 0.6])

    def fit(trainer, copy):
        trainer.fit(copy, DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed)))

    tuned = finetuned_copy(module, 3, seed, fit, accelerator="cpu", score=lambda _: next(losses))
    assert tuned.__fl_best_epoch__ == 2
    assert tuned.__fl_steps__ == 3 * -(-len(data) // 16)
    after = reference_epochs(data, seed, 3)
    for key, value in after[1].items():
        torch.testing.assert_close(tuned.net.state_dict()[key], value, atol=1e-6, rtol=0)
    assert any(not torch.allclose(after[1][key], after[2][key], atol=1e-4) for key in after[1])  # epoch 3 differs


def test_the_chosen_epoch_is_the_one_with_the_lowest_validation_loss_and_scoring_moves_nothing():
    # The real scorer (the classifier path's one forward pass): the copy is the k-epoch copy of the lowest
    # validation loss, and the copy's trajectory is the one without scoring (each k-epoch copy is a prefix of it).
    x, y = digits_like()
    vx, vy = digits_like(40, seed=1)
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    val = classifier_batches(DataLoader(TensorDataset(torch.from_numpy(vx), torch.from_numpy(vy)), batch_size=16))
    module = ValidatedClassifier(arch="mlp", lr=0.3, momentum=0.9, init_seed=4)
    seed = finetune_seed(0, 1, 2)

    def fit(trainer, copy):
        trainer.fit(copy, DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(seed)))

    score = epoch_scorer(val, None)
    plain = [finetuned_copy(module, k, seed, fit, accelerator="cpu") for k in (1, 2, 3, 4)]
    expected = best_epoch([score(copy) for copy in plain])
    tuned = finetuned_copy(module, 4, seed, fit, accelerator="cpu", score=score)
    assert tuned.__fl_best_epoch__ == expected
    for key, value in plain[expected - 1].state_dict().items():
        assert torch.equal(tuned.state_dict()[key], value)


def test_a_module_that_is_no_classifier_is_scored_by_its_validation_on_a_copy():
    module = ValidatedClassifier(arch="mlp", init_seed=4)
    seen = []

    def validate(copy):
        seen.append(copy)
        return {"val_loss": 0.25, "val_accuracy": 0.5}

    assert epoch_scorer(None, validate)(module) == 0.25
    assert seen[0] is not module  # a copy: the fine-tuning's trainer stays attached to the module
    assert epoch_scorer(None, lambda copy: {"val_error": 0.1})(module) is None  # no val_loss: no choice
    assert epoch_scorer(None, None)(module) is None


def site(tmp_path, finetune_epochs: int, client: str = "fedavg"):
    spec = JobSpec(
        name="ft", dataset="digits", arch="mlp", site_val_fraction=0.2, finetune_epochs=finetune_epochs, client=client
    )
    args = site_args(spec)
    args.accelerator = "cpu"
    x, y = digits_like()
    return build_site_round(args, "site-1", 0, x, y, 10, ClientStateStore(tmp_path, "site-1"))


def test_the_sent_model_is_bit_identical_with_and_without_finetuning(tmp_path):
    plain, tuned = site(tmp_path / "a", 0), site(tmp_path / "b", 2)
    global_params = {k: v.numpy().copy() for k, v in plain.module.state_dict().items()}
    for round_num in range(2):
        meta = {"server.round": round_num, "server.run_id": "r"}
        params_a, meta_a = plain.train(round_num, global_params, meta)
        params_b, meta_b = tuned.train(round_num, global_params, meta)
        for key, value in params_a.items():
            np.testing.assert_array_equal(params_b[key], value)
        assert meta_a["eval.val_accuracy"] == meta_b["eval.val_accuracy"]
        assert not any(key.startswith("eval.personal_") for key in meta_a)
        assert {"eval.personal_val_accuracy", "eval.personal_val_loss"} <= set(meta_b)
        assert meta_b["eval.finetune_best_epoch"] in (1.0, 2.0)
        global_params = params_a


def test_the_local_only_model_is_matched_to_every_fine_tuning_epoch_taken(tmp_path, monkeypatch):
    # Early stopping keeps epoch 1..K, but the site trained all K: the local-only model gets all K epochs' steps.
    from lightning_modules.local_baseline import LocalBaseline

    taken = []
    train = LocalBaseline.train
    monkeypatch.setattr(
        LocalBaseline,
        "train",
        lambda self, r, run, steps, seed: taken.append(steps) or train(self, r, run, steps, seed),
    )
    spec = JobSpec(
        name="ft", dataset="digits", arch="mlp", site_val_fraction=0.2, finetune_epochs=3, local_baseline=True
    )
    args = site_args(spec)
    args.accelerator = "cpu"
    x, y = digits_like()
    site_round = build_site_round(args, "site-1", 0, x, y, 10, ClientStateStore(tmp_path, "site-1"))
    params = {k: v.numpy().copy() for k, v in site_round.module.state_dict().items()}
    _, sent = site_round.train(0, params, {"server.round": 0, "server.run_id": "r"})
    per_epoch = -(-len(site_round.dataset) // spec.batch_size)
    assert taken == [sent["train.num_steps"] + 3 * per_epoch]
    assert sent["eval.finetune_best_epoch"] in (1.0, 2.0, 3.0)


def test_a_user_module_fine_tunes_early_stopped_too(tmp_path, monkeypatch):
    from jobs.presets import EXAMPLES
    from lightning_modules.own_model import UserSite

    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = JobSpec(
        name="snp", model="genomics.model:SnpClassifier", ship=str(EXAMPLES / "genomics"), num_sites=2,
        model_args={"arch": "mlp", "n_snps": 127, "num_classes": 5, "lr": 1e-3}, data="genomics.data:SnpSites",
        data_args={"source": "1kg", "split": "iid", "batch_size": 256}, finetune_epochs=3,
    )  # fmt: skip
    site_user = UserSite(site_args(spec), "site-1", ClientStateStore(tmp_path, "site-1"))
    tuned = site_user.finetune(0)
    assert site_user._finetune_val  # the classifier path's batches, read once
    assert tuned.__fl_best_epoch__ in (1, 2, 3)
    assert site_user.callback._personal_eval["eval.finetune_best_epoch"] == tuned.__fl_best_epoch__


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"finetune_epochs": -1}, "finetune_epochs must be an integer >= 0"),
        ({"finetune_epochs": 2}, "needs a validation split"),
        ({"finetune_epochs": 2, "site_val_fraction": 0.2, "client": "ditto"}, "Ditto's v_i is already"),
    ],
)
def test_bad_finetuning_jobs_are_refused_at_build_time(settings, words):
    with pytest.raises(JobBuildError, match=words):
        JobSpec(name="bad", **settings)


def test_finetuning_a_user_model_needs_its_validation_split():
    with pytest.raises(JobBuildError, match="defines no val_dataloader"):
        JobSpec(
            name="bad",
            model="tests.lightning_modules.test_lm_finetune:NoValModule",
            data="tests.lightning_modules.test_lm_finetune:NoValData",
            finetune_epochs=1,
        )


@pytest.mark.parametrize("settings", [{"client": "ditto"}, {"client": "fedrep"}, {"local_keys": "net.classifier.*"}])
def test_every_personal_method_with_a_user_model_needs_its_validation_split(settings):
    # The user's data module is the split: the refusal names what it lacks, the same line for every personal method.
    with pytest.raises(JobBuildError, match=r"makes a personal model .*defines no val_dataloader\(\)$"):
        JobSpec(
            name="bad",
            model="tests.lightning_modules.test_lm_finetune:NoValModule",
            data="tests.lightning_modules.test_lm_finetune:NoValData",
            **settings,
        )


class NoValModule(ValidatedClassifier):
    pass


class NoValData(pl.LightningDataModule):
    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.zeros(4, 64), torch.zeros(4, dtype=torch.long)))
