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
from lightning_modules.finetune import finetune_seed, finetuned_copy
from lightning_modules.site import ValidatedClassifier, build_site_round
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
        global_params = params_a


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
