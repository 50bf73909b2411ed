"""The committed jobs: one `jobs.spec.JobSpec` per ``jobs/<name>/`` folder (``python -m jobs.build --presets``
regenerates them, ``--presets --check`` diffs them).

Each preset is validated when it is first used, not when this module is imported: validating a job with a user
model imports that model's package, and importing the builder must not need it (or torch).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from jobs.spec import JobSpec

#: The example packages' folders, named absolutely (tests and benchmarks ship them from here). The presets ship
#: none of them: the bundle installs ``genomics`` and ``genomics_consortium`` (pyproject.toml), so every site that
#: installs it imports them, and the committed snp_* jobs carry no copy.
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SNP_JOB = {
    "model": "genomics.model:SnpClassifier",
    "model_args": {"arch": "cnn_transformer", "n_snps": 127, "num_classes": 5, "lr": 1e-3},
    "data": "genomics.data:SnpSites",
    "data_args": {"source": "1kg", "split": "dirichlet", "alpha": 0.1, "batch_size": 128},
    "num_rounds": 10,
}

#: What every personal preset carries so that each site can tell whether joining helped it (docs/personalization.md,
#: "Does joining help my site?"): a validation split to select on, a disjoint test split to report on, the
#: compute-matched local-only model, and keep best. `python -m controllers.report` then prints per site the global,
#: personal and local-only test scores and the kept one's gain over training alone.
PERSONAL_SPLITS: dict[str, Any] = {
    "site_val_fraction": 0.1,
    "site_test_fraction": 0.1,
    "keep": "best",
    "local_baseline": True,
    # The documented stopping rule (controllers/stopping.py): the job ends when no site's kept model improved on
    # validation for 5 rounds; --num-rounds is the cap.
    "stop_patience": 5,
}

PRESET_SETTINGS: dict[str, dict[str, Any]] = {
    "fedavg": dict(),
    "scaffold": dict(client="scaffold", server="scaffold"),
    "fedprox": dict(client="fedprox", client_args={"mu": 0.01}, server="fedavg"),
    "feddyn": dict(client="feddyn", server="feddyn", server_args={"alpha": 0.01}),
    "fedmos": dict(
        client="fedmos",
        client_args={"a": 0.1, "mu": 0.001},
        server="fedmos",
        server_args={"beta": 0.8, "selection": "uniform"},
    ),
    # MOON's authors train with SGD momentum 0.9 and weight decay 1e-5; with vanilla SGD the projection-head model
    # sits at chance for several rounds (docs/fedmos_moon.md).
    "moon": dict(
        client="moon",
        client_args={"mu": 5.0, "temperature": 0.5, "history_size": 1},
        momentum=0.9,
        weight_decay=1e-5,
    ),
    # Personal models scored at the sites (docs/personalization.md): local fine-tuning of the received FedAvg model
    # (1 epoch) and Ditto (lam 0.1, inside the paper's sweep). Like every personal preset (`PERSONAL_SPLITS`), each
    # site holds out 10 % of its shard to validate on and another 10 % to test on, trains a local-only model and keeps
    # the best of global, personal and local-only, so its report shows all three per site. Not tuned.
    "finetune": dict(finetune_epochs=1, **PERSONAL_SPLITS),
    "ditto": dict(client="ditto", client_args={"lam": 0.1}, **PERSONAL_SPLITS),
    # The genomics consortium with Ditto: the model trains with AdamW (lr 1e-3); the personal step is plain SGD, so it
    # gets its own step size (not tuned). The data module holds out the splits (its val_fraction 0.2, test 0.1).
    "snp_ditto": dict(
        client="ditto",
        client_args={"lam": 0.1, "personal_lr": 0.01},
        **{**SNP_JOB, "data_args": {**SNP_JOB["data_args"], "test_fraction": 0.1}},
        keep="best",
        local_baseline=True,
        stop_patience=5,
    ),
    # Where joining pays (benchmarks/results/site_gain.md): 2 small sites (50 and 150 images before the splits) beside
    # 2 large ones, IID labels; the pre-registered default of the held-out runs (FedAvg clients, server momentum 0.9,
    # batch 16, keep best with the local-only model, the stopping rule), each site also scoring 1,000 published test
    # images (the pooled "next patient" view). Splits of 20 % each: a 50-image site keeps 10 to test on.
    "small_sites": dict(
        server="fedavgm",
        scheme="small_sites",
        alpha=0.5,
        num_sites=4,
        max_train_samples=4000,
        batch_size=16,
        num_rounds=20,
        site_val_fraction=0.2,
        site_test_fraction=0.2,
        keep="best",
        local_baseline=True,
        stop_patience=5,
        site_pooled_test=1000,
    ),
    # Server rules (docs/server_rules.md): plain local SGD clients, the same data and model as above;
    # server settings picked by short measured runs (docs/server_rules.md, "Presets").
    "fedadam": dict(server="fedadam", server_args={"server_lr": 0.03, "tau": 0.001}),
    "fedadagrad": dict(server="fedadagrad", server_args={"server_lr": 0.02, "tau": 0.01}),
    "fedyogi": dict(server="fedyogi", server_args={"server_lr": 0.03, "tau": 0.001}),
    "fednova": dict(server="fednova", pattern="uniform_random", max_local_epochs=3),
    "fedatt": dict(server="fedatt", server_args={"epsilon": 1.0, "noise": 0.0001}),
    "fedadp": dict(server="fedadp", server_args={"alpha": 5.0}),
    # The genomics consortium (docs/genomics.md): its own cnn_transformer and data module by import path, installed
    # with the bundle (not copied into the job); 1000 Genomes panel, Dirichlet 0.1 over super-populations, AdamW.
    "snp_scaffold": dict(client="scaffold", server="scaffold", **SNP_JOB),
    "snp_fedavg": dict(**SNP_JOB),
    # A model in the consortium's own architecture (examples/genomics_consortium: per-haploblock embeddings, Conv1d +
    # BatchNorm1d, transformer encoder, focal loss, AdamW with cosine warm restarts) on the same data module, both
    # installed with the bundle; FedAvg, whose clients are correct with AdamW as they are. Not tuned.
    "snp_consortium": dict(
        model="genomics_consortium.model:HaploblockClassifier",
        model_args={"n_snps": 127, "num_classes": 5},
        data=SNP_JOB["data"],
        data_args=SNP_JOB["data_args"],
        num_rounds=10,
    ),
    # Partial sharing (docs/personalization.md): FedBN keeps every BatchNorm entry at its site (the small BatchNorm
    # CNN), FedRep keeps the classifier head (the model's declared head) and trains it 2 epochs before each body epoch
    # (the paper's 10 was chosen on its datasets; 2 keeps the example short, not tuned). Splits, local-only model and
    # keep best as every personal preset.
    "fedbn": dict(arch="bn_cnn", local_keys="batchnorm", **PERSONAL_SPLITS),
    "fedrep": dict(client="fedrep", client_args={"head_epochs": 2}, **PERSONAL_SPLITS),
    # Sample-level DP-SGD at every site (docs/privacy.md): C = 1, delta = 1e-5, each site's sigma calibrated so that
    # the planned rounds spend epsilon 8; the genomics job uses the model's DP-SGD-ready attention (nn.Linear layers,
    # the position embedding in a module of its own). Not tuned.
    "fedavg_dp": dict(dp_target_epsilon=8.0, dp_max_grad_norm=1.0),
    "snp_scaffold_dp": dict(
        client="scaffold",
        server="scaffold",
        **{**SNP_JOB, "model_args": {**SNP_JOB["model_args"], "attention": "linear"}},
        dp_target_epsilon=8.0,
        dp_max_grad_norm=1.0,
    ),
    # Secure aggregation (docs/deployment.md, "Secure aggregation (HE)"): FedAvg through NVFlare's HE components, for
    # kits provisioned with HEBuilder (make poc POC_JOB=jobs/fedavg_he); not for the simulator.
    "fedavg_he": dict(secure_aggregation="he"),
    # Attack-adaptive aggregation (docs/robustness.md): the shipped LeNet-5 attention checkpoint, 10 sites.
    "attack_adaptive": dict(
        server="attack_adaptive",
        server_args={"attention_model_path": "checkpoints/attention_lenet5.pt"},
        num_sites=10,
    ),
}


class Presets(Mapping[str, JobSpec]):
    """The presets by name; each `JobSpec` is built (and validated) on first access."""

    def __init__(self, settings: Mapping[str, Mapping[str, Any]]) -> None:
        self._settings = dict(settings)
        self._built: dict[str, JobSpec] = {}

    def __getitem__(self, name: str) -> JobSpec:
        if name not in self._built:
            self._built[name] = JobSpec(name=name, **self._settings[name])
        return self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._settings)

    def __len__(self) -> int:
        return len(self._settings)

    def with_builtin_model(self) -> list[str]:
        """The presets of the bundle's own model and datasets (the ones a comparison grid can re-run in the simulator:
        not the HE job, which needs provisioned kits)."""
        return [
            name
            for name, settings in self._settings.items()
            if "model" not in settings and settings.get("secure_aggregation", "none") != "he"
        ]


PRESETS = Presets(PRESET_SETTINGS)
