"""The committed jobs: one :class:`jobs.spec.JobSpec` per ``jobs/<name>/`` folder (``python -m jobs.build --presets``
regenerates them, ``--presets --check`` diffs them)."""

from __future__ import annotations

from jobs.spec import JobSpec

SNP_JOB = {
    "model": "genomics.model:SnpClassifier",
    "model_args": {"arch": "cnn_transformer", "n_snps": 127, "num_classes": 5, "lr": 1e-3},
    "data": "genomics.data:SnpSites",
    "data_args": {"source": "1kg", "split": "dirichlet", "alpha": 0.1, "batch_size": 128},
    "ship": "examples/genomics",
    "num_rounds": 10,
}

PRESETS: dict[str, JobSpec] = {
    "fedavg": JobSpec(name="fedavg"),
    "scaffold": JobSpec(name="scaffold", client="scaffold", server="scaffold"),
    "fedprox": JobSpec(name="fedprox", client="fedprox", client_args={"mu": 0.01}, server="fedavg"),
    "feddyn": JobSpec(name="feddyn", client="feddyn", server="feddyn", server_args={"alpha": 0.01}),
    "fedmos": JobSpec(
        name="fedmos",
        client="fedmos",
        client_args={"a": 0.1, "mu": 0.001},
        server="fedmos",
        server_args={"beta": 0.8, "selection": "uniform"},
    ),
    # MOON's authors train with SGD momentum 0.9 and weight decay 1e-5; with vanilla SGD the projection-head model
    # sits at chance for several rounds (docs/fedmos_moon.md).
    "moon": JobSpec(
        name="moon",
        client="moon",
        client_args={"mu": 5.0, "temperature": 0.5, "history_size": 1},
        momentum=0.9,
        weight_decay=1e-5,
    ),
    # Server rules (docs/server_rules.md): plain local SGD clients, the same data and model as above;
    # server settings picked by short measured runs (docs/server_rules.md, "Presets").
    "fedadam": JobSpec(name="fedadam", server="fedadam", server_args={"server_lr": 0.03, "tau": 0.001}),
    "fedadagrad": JobSpec(name="fedadagrad", server="fedadagrad", server_args={"server_lr": 0.02, "tau": 0.01}),
    "fedyogi": JobSpec(name="fedyogi", server="fedyogi", server_args={"server_lr": 0.03, "tau": 0.001}),
    "fednova": JobSpec(name="fednova", server="fednova", pattern="uniform_random", max_local_epochs=3),
    "fedatt": JobSpec(name="fedatt", server="fedatt", server_args={"epsilon": 1.0, "noise": 0.0001}),
    "fedadp": JobSpec(name="fedadp", server="fedadp", server_args={"alpha": 5.0}),
    # The genomics consortium (docs/genomics.md): its own cnn_transformer and data module by import path, shipped in
    # the job (custom/genomics/); 1000 Genomes panel, Dirichlet 0.1 over super-populations, AdamW.
    "snp_scaffold": JobSpec(name="snp_scaffold", client="scaffold", server="scaffold", **SNP_JOB),
    "snp_fedavg": JobSpec(name="snp_fedavg", **SNP_JOB),
    # Attack-adaptive aggregation (docs/robustness.md): the shipped LeNet-5 attention checkpoint, 10 sites.
    "attack_adaptive": JobSpec(
        name="attack_adaptive",
        server="attack_adaptive",
        server_args={"attention_model_path": "checkpoints/attention_lenet5.pt"},
        num_sites=10,
    ),
}
