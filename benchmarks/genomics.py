"""The genomics results table: federated algorithms vs local-only and pooled training on genotype data.

    python -m benchmarks.genomics --source 1kg --out benchmarks/results/genomics_1kg     # the committed table
    python -m benchmarks.genomics --source sim --out benchmarks/results/genomics_sim
    python -m benchmarks.genomics --grid smoke --out /tmp/gen                           # a minute: what tests run

A *cell* is (algorithm, split, seed). Federated cells are jobs built from the consortium's own classes by import
path (``examples/genomics``: ``genomics.model:SnpClassifier`` and ``genomics.data:SnpSites``), run by the round
engine with the sites' Lightning rounds in this process (`benchmarks.in_process.run_in_process`, the code
path the NVFlare jobs run). Two baselines per split and seed use the same model, optimizer and data:

- ``local``: every site trains alone on its own share for as many epochs as the federation's rounds;
- ``pooled``: one model trained on all sites' training shares together (centralised training), as many epochs.

Every model is scored on each site's validation split (per-site and mean accuracy; a local model on its own site's
split) and on a held-out test set of all populations that no site trains on (a simulation-only yardstick). For
SCAFFOLD the report also gives the norm of the global control c and the mean norm of the sites' control changes per
round. Cells are resumable and run in parallel (``benchmarks.compare.run_cells``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.compare import (
    CELL_COST,
    CountingTransport,
    add_site_gain_options,
    finish,
    personal_site_scores,
    require_rounds,
    run_cells,
    same_protocol,
    site_gain_fields,
    usable_cores,
)
from benchmarks.partition_specs import HELP as PARTITION_HELP
from benchmarks.partition_specs import argparse_partition, partition_settings
from benchmarks.site_report import CENTRAL
from benchmarks.snp_model import examples_importable

MODEL, DATA = "genomics.model:SnpClassifier", "genomics.data:SnpSites"
#: The splits of the committed table (any name of benchmarks/partition_specs.py runs: dir0.3, qty0.4, ...).
SPLITS = ("iid", "dir1.0", "dir0.1", "population")
#: Algorithm label -> JobSpec client/server settings and model overrides. FedNova's normaliser describes SGD steps
#: only, so its sites train with plain SGD (``sgd_lr``) instead of AdamW.
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"client": "fedprox", "client_args": {"mu": 0.01}},
    "scaffold": {"client": "scaffold", "server": "scaffold"},
    "feddyn": {"client": "feddyn", "server": "feddyn", "server_args": {"alpha": 0.01}},
    "fednova": {"server": "fednova", "model": {"optimizer": "sgd"}},
    "fedavgm": {"server": "fedavgm"},
    # The default with the global model fine-tuned at the site, early-stopped within 3 epochs, as the personal
    # candidate (benchmarks.compare's fedavgm_ft3).
    "fedavgm_ft3": {"server": "fedavgm", "finetune_epochs": 3},
    # The same local SGD as FedNova's, to tell the optimizer's effect from the rule's (AdamW is the consortium's).
    "fedavg_sgd": {"model": {"optimizer": "sgd"}},
    "scaffold_sgd": {"client": "scaffold", "server": "scaffold", "model": {"optimizer": "sgd"}},
}
#: ``central`` is ``pooled`` under the per-site report's name (benchmarks/site_report.py's CENTRAL): the same model,
#: its pooled-test score also given per site, so the report can set it beside the federation's global model.
BASELINES = ("local", "pooled", CENTRAL)
#: Personalization methods (docs/personalization.md; ``--grid personalization``) over FedAvg's settings; their cells
#: also score each site's personalized model (benchmarks/personalization.py). The model has no BatchNorm (LayerNorm
#: only), so FedBN has nothing to keep; Ditto's personal step is plain SGD, so it gets its own step size (snp_ditto's).
PERSONALIZATION: dict[str, dict[str, Any]] = {
    "finetune": {"finetune_epochs": 1},
    "fedper": {"local_keys": "net.head.*"},  # SnpNet's last layer
    "fedrep": {"client": "fedrep", "client_args": {"head_epochs": 1}, "local_keys": "net.head.*"},
    "ditto": {"client": "ditto", "client_args": {"lam": 0.1, "personal_lr": 0.01}},
}
#: The personalization grid's methods; ``local`` is the baseline above, every site alone.
PERSONALIZATION_GRID = ("fedavg", *PERSONALIZATION, "local")


@dataclass(frozen=True)
class Protocol:
    source: str = "1kg"
    arch: str = "mlp"
    num_sites: int = 5
    rounds: int = 30
    lr: float = 1e-3
    sgd_lr: float = 0.05
    batch_size: int = 128
    n_snps: int = 1000  # simulated cohorts
    samples_per_population: int = 250
    #: The per-site guarantee (benchmarks/site_report.py): each site's test share, what it keeps, the in-job
    #: local-only model. Defaults: none of them (the committed grids).
    site_test_fraction: float = 0.0
    keep: str = "last"
    local_baseline: bool = False
    #: Stop at a validation plateau (controllers/stopping.py); None: every round.
    stop_patience: int | None = None
    #: Keep best's margin (lightning_modules/site_choice.py); None: the job's default.
    keep_margin: float | None = None
    #: The split the sites choose on: "own" or "pooled" (the data module's pooled validation split: that share of the
    #: held-out people, the pooled test view the rest; --keep-view pooled sets `POOLED_VAL_FRACTION` when 0).
    keep_view: str = "own"
    pooled_val_fraction: float = 0.0
    #: How the sites draw their validation and test splits (the data module's ``holdout``): "random" (the grids up
    #: to v4) or "stratified" by population.
    holdout: str = "random"

    @property
    def num_classes(self) -> int:
        return 5 if self.source == "1kg" else 4

    @property
    def input_snps(self) -> int:
        return 127 if self.source == "1kg" else self.n_snps


@dataclass(frozen=True)
class Cell:
    algorithm: str
    split: str
    seed: int
    partition_seed: int | None = None  # None: the training seed draws the site data too (the committed grids)

    @property
    def key(self) -> str:
        data = "" if self.partition_seed is None else f"__d{self.partition_seed}"
        return f"{self.algorithm}__{self.split}{data}__s{self.seed}"


def site_gain_protocol(source: str) -> Protocol:
    """The per-site grids' protocol: keep best, the in-job local-only model, a 20 % test split at every site, and
    the keep margin these grids ran with (the job default until the v4 grid, which sets its own)."""
    num_sites = 5 if source == "1kg" else 4
    return Protocol(
        source=source,
        num_sites=num_sites,
        rounds=20,
        site_test_fraction=0.2,
        keep="best",
        local_baseline=True,
        keep_margin=1.645,
    )


GRIDS = {
    # The simulated cohort has 4 populations: 4 sites, so that "site = population" gives each site one.
    "table": lambda source: (
        tuple(ALGORITHMS) + BASELINES,
        tuple(SPLITS),
        (0, 1, 2),
        Protocol(source=source, num_sites=5 if source == "1kg" else 4),
    ),
    # Does each site gain from joining: benchmarks/results/personalization.md.
    "personalization": lambda source: (
        PERSONALIZATION_GRID,
        ("iid", "dir0.1", "population"),
        (0, 1, 2),
        Protocol(source=source, num_sites=5 if source == "1kg" else 4),
    ),
    # The per-site guarantee: keep best, the in-job local-only model, a 20 % test split at every site, the site data
    # fixed across training seeds (partition seed 0); qty0.4: 2 of 5 (1000 Genomes) or of 4 sites hold 50 and 150.
    "site_gain": lambda source: (
        ("fedavg", *PERSONALIZATION),
        ("iid", "dir0.1", "population", "qty0.4"),
        (0, 1, 2),
        site_gain_protocol(source),
    ),
    # The pre-registered default of the Fashion-MNIST held-out runs (benchmarks/compare.py's site_gain_v3: FedAvgM,
    # keep best, local-only model, batch 16, the stopping rule with patience 5, 40 rounds at most), carried over
    # unchanged to the genotype task and fixed here before any genomics run with it; ``central`` is the same model
    # trained centrally on all sites' training shares, as many epochs as the cap. Each site also scores on the
    # held-out people of every population (the pooled view). Settings come from the command line.
    "site_gain_v3": lambda source: (
        ("fedavgm", CENTRAL),
        ("dir0.3",),
        (0, 1, 2),
        replace(site_gain_protocol(source), rounds=40, batch_size=16, stop_patience=5),
    ),
    # The second pre-registration: v3 with keep best's margin at 1.0 standard error (benchmarks/compare.py's
    # site_gain_v4), fixed before any held-out run with it.
    "site_gain_v4": lambda source: (
        ("fedavgm", CENTRAL),
        ("dir0.5",),
        (0, 1, 2),
        replace(site_gain_protocol(source), rounds=40, batch_size=16, stop_patience=5, keep_margin=1.0),
    ),
    # The third pre-registration: v4 with the sites' validation and test splits stratified by population.
    "site_gain_v5": lambda source: (
        ("fedavgm", CENTRAL),
        ("dir0.5",),
        (0, 1, 2),
        replace(GRIDS["site_gain_v4"](source)[3], holdout="stratified"),
    ),
    "smoke": lambda source: (
        ("fedavg", "scaffold", "local", "pooled"),
        ("dir0.1",),
        (0,),
        Protocol(source=source, num_sites=3, rounds=2),
    ),
}


def model_args(protocol: Protocol, algorithm: str, seed: int) -> dict[str, Any]:
    args = {
        "arch": protocol.arch,
        "n_snps": protocol.input_snps,
        "num_classes": protocol.num_classes,
        "lr": protocol.lr,
        "seed": seed,
        **_settings(algorithm).get("model", {}),
    }
    if args.get("optimizer") == "sgd":
        args["lr"] = protocol.sgd_lr
    return args


def _settings(algorithm: str) -> dict[str, Any]:
    return {**ALGORITHMS, **PERSONALIZATION}.get(algorithm, {})


def data_args(protocol: Protocol, split: str, seed: int) -> dict[str, Any]:
    """The data module's arguments; ``seed`` draws the site data (the partition and the hold-outs)."""
    args = {
        "source": protocol.source,
        "seed": seed,
        "batch_size": protocol.batch_size,
        **partition_settings(split, genomics=True),
    }
    if protocol.source == "sim":
        args.update(n_snps=protocol.n_snps, samples_per_population=protocol.samples_per_population)
    if protocol.site_test_fraction:  # a user data module holds out its own test split (the job's is built-in only)
        args["test_fraction"] = protocol.site_test_fraction
    if protocol.pooled_val_fraction:
        args["pooled_val_fraction"] = protocol.pooled_val_fraction
    if protocol.holdout != "random":
        args["holdout"] = protocol.holdout
    return args


def cell_spec(cell: Cell, protocol: Protocol) -> Any:
    from jobs.spec import JobSpec

    examples_importable()
    settings = {k: v for k, v in _settings(cell.algorithm).items() if k != "model"}
    return JobSpec(
        name=cell.key,
        num_sites=protocol.num_sites,
        num_rounds=protocol.rounds,
        seed=cell.seed,
        model=MODEL,
        model_args=model_args(protocol, cell.algorithm, cell.seed),
        data=DATA,
        data_args=data_args(protocol, cell.split, data_seed(cell)),
        **settings,
        **{k: v for k, v in site_gain_fields(protocol, cell).items() if k not in BUILT_IN_ONLY},
    )


#: JobSpec fields for the built-in data only: with the consortium's data module its own arguments carry them
#: (``seed`` = the partition seed, ``test_fraction``).
BUILT_IN_ONLY = ("partition_seed", "site_test_fraction")


def data_seed(cell: Cell) -> int:
    """The seed of the cell's site data: its partition seed, or (the committed grids) its training seed."""
    return cell.seed if cell.partition_seed is None else cell.partition_seed


# --------------------------------------------------------------------------------------------------------------------
# Running cells
# --------------------------------------------------------------------------------------------------------------------
def run_cell(cell: Cell, protocol: Protocol, threads: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads)
    examples_importable()
    started = time.monotonic()
    result = _baseline(cell, protocol) if cell.algorithm in BASELINES else _federated(cell, protocol)
    return {"cell": asdict(cell), "protocol": asdict(protocol), "wall_s": time.monotonic() - started, **result}


def _federated(cell: Cell, protocol: Protocol) -> dict[str, Any]:
    from benchmarks.in_process import quiet_lightning, run_in_process

    spec = cell_spec(cell, protocol)
    counters: list[CountingTransport] = []

    def counted(transport: Any) -> CountingTransport:
        counters.append(CountingTransport(transport))
        return counters[0]

    with tempfile.TemporaryDirectory(prefix="fedalg_genomics_") as state_root, quiet_lightning():
        run = run_in_process(spec, Path(state_root), run_id=cell.key, wrap_transport=counted)
        require_rounds(run.rounds, protocol.rounds)
        personal = _personal_scores(cell, protocol, spec, Path(state_root), run)
    rounds = run.rounds
    curve = [r.get("site_eval", {}).get("val_accuracy", {}).get("mean", float("nan")) for r in rounds]
    final = {site: scores["val_accuracy"] for site, scores in run.final_site_scores.items()}
    module = _module(protocol, cell.algorithm, cell.seed)
    module.load_state_dict({k: _tensor(v) for k, v in run.params.items()})
    return {
        "curve": [*curve[1:], _weighted_mean(final, _site_sizes(cell, protocol))],  # after rounds 1 .. R
        "site_val_accuracy": final,
        "test_accuracy": _test_accuracy(module, cell, protocol),
        "control_global_norm": [r.get("rule_diagnostics", {}).get("scaffold.ctrl.global_norm") for r in rounds],
        "control_diff_norm": [_mean_site_meta(r, "scaffold.ctrl.diff_norm") for r in rounds],
        "control_local_norm": [_site_meta(r, "scaffold.ctrl.local_norm") for r in rounds],  # runaway check per site
        "traffic": counters[0].rounds if counters else [],  # bytes per round (benchmarks.compare.CountingTransport)
        **personal,
    }


def _personal_scores(cell: Cell, protocol: Protocol, spec: Any, state_root: Path, run: Any) -> dict[str, Any]:
    """A personalization cell's per-site scores: the sites' test-split report (with a test split) or the
    validation-split scores; none for the table's other algorithms."""
    if protocol.site_test_fraction:
        from benchmarks.compare import test_split_scores

        return test_split_scores(run, functools.partial(_split_sizes, cell, protocol))
    return personal_site_scores(spec, state_root, run.params) if cell.algorithm in PERSONALIZATION_GRID else {}


def _split_sizes(cell: Cell, protocol: Protocol) -> dict[str, dict[str, int]]:
    """Per site: the data module's training, validation and (where the module has a per-site one) test samples."""
    sizes = {}
    for name, data in _data_modules(cell, protocol).items():
        sizes[name] = {"train": len(data.train), "val": len(data.val)}
        if protocol.site_test_fraction:  # else data.test is the pooled benchmark set, no site's test split
            sizes[name]["test"] = len(data.test)
    return sizes


def _baseline(cell: Cell, protocol: Protocol) -> dict[str, Any]:
    import torch
    from torch.utils.data import ConcatDataset, DataLoader

    from benchmarks.in_process import quiet_lightning

    sites = _data_modules(cell, protocol)
    scores, tests = {}, []
    with quiet_lightning():
        if cell.algorithm == "local":
            for name, data in sites.items():
                torch.manual_seed(cell.seed)
                module = _train(protocol, cell, data.train_dataloader())
                scores[name] = _accuracy(module, data.val)
                tests.append(_test_accuracy(module, cell, protocol))
        else:
            torch.manual_seed(cell.seed)
            pooled = ConcatDataset([data.train for data in sites.values()])
            chosen = ChosenEpoch(sites)
            loader = DataLoader(pooled, batch_size=protocol.batch_size, shuffle=True)
            module = _train(protocol, cell, loader, chosen if cell.algorithm == CENTRAL else None)
            scores = {name: _accuracy(module, data.val) for name, data in sites.items()}
            tests.append(_test_accuracy(module, cell, protocol))
    local_only = {"site_personal": scores} if cell.algorithm == "local" else {}  # the personalization baseline
    if cell.algorithm == CENTRAL:  # one model, scored on the one pooled test set: the same score at every site
        views = {"global": tests[0], "best_global": chosen.pooled_accuracy}
        local_only = {"site_pooled_test": {view: dict.fromkeys(sites, value) for view, value in views.items()}}
    return {"site_val_accuracy": scores, "test_accuracy": float(np.mean(tests)), **local_only}


class ChosenEpoch:
    """The central model's counterpart of the global model a federated job delivers (controllers/model_selection.py):
    of the initial model and the model after every epoch, the one with the lowest unweighted mean over the sites of
    its validation loss, and its accuracy on the pooled test people. Scoring is a forward pass without dropout and
    without random draws, so the training is the same with or without it (`_epoch_callback` calls `score`)."""

    def __init__(self, sites: Mapping[str, Any]) -> None:
        self.sites = dict(sites)
        self.loss, self.pooled_accuracy, self.epoch = math.inf, float("nan"), -1

    def score(self, module: Any, epoch: int) -> None:
        was_training = module.training
        loss = float(np.mean([_loss(module, data.val) for data in self.sites.values()]))
        if loss < self.loss:
            pooled = next(iter(self.sites.values())).pooled
            self.loss, self.pooled_accuracy, self.epoch = loss, _accuracy(module, pooled), epoch
        module.train(was_training)


def _epoch_callback(chosen: ChosenEpoch) -> Any:
    """The Lightning callback that has ``chosen`` score the initial model (epoch 0) and the model after every epoch
    (pytorch_lightning is imported only when training)."""
    import pytorch_lightning as pl

    class ScoreEpochs(pl.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            chosen.score(module, 0)

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            chosen.score(module, trainer.current_epoch + 1)

    return ScoreEpochs()


def _train(protocol: Protocol, cell: Cell, loader: Any, chosen: ChosenEpoch | None = None) -> Any:
    import pytorch_lightning as pl

    module = _module(protocol, "fedavg", cell.seed)
    trainer = pl.Trainer(
        max_epochs=protocol.rounds,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[] if chosen is None else [_epoch_callback(chosen)],
    )
    trainer.fit(module, train_dataloaders=loader)
    return module


@functools.lru_cache(maxsize=8)
def _data_modules_cached(protocol: Protocol, split: str, seed: int) -> dict[str, Any]:
    from genomics.data import SnpSites

    args = data_args(protocol, split, seed)
    return {
        f"site-{i + 1}": SnpSites(site=f"site-{i + 1}", num_sites=protocol.num_sites, **args)
        for i in range(protocol.num_sites)
    }


def _data_modules(cell: Cell, protocol: Protocol) -> dict[str, Any]:
    return _data_modules_cached(protocol, cell.split, data_seed(cell))


def _site_sizes(cell: Cell, protocol: Protocol) -> dict[str, int]:
    return {name: len(data.train) for name, data in _data_modules(cell, protocol).items()}


def _module(protocol: Protocol, algorithm: str, seed: int) -> Any:
    from genomics.model import SnpClassifier

    return SnpClassifier(**model_args(protocol, algorithm, seed))


def _tensor(value: Any) -> Any:
    import torch

    return torch.as_tensor(np.array(value, copy=True))


def _accuracy(module: Any, dataset: Any) -> float:
    import torch

    states, labels = dataset.tensors
    module.eval()
    with torch.no_grad():
        return float((module(states).argmax(dim=1) == labels).float().mean())


def _loss(module: Any, dataset: Any) -> float:
    """Mean cross-entropy of ``module`` on ``dataset`` (eval mode; the caller restores the mode)."""
    import torch

    states, labels = dataset.tensors
    module.eval()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(module(states), labels))


def _test_accuracy(module: Any, cell: Cell, protocol: Protocol) -> float:
    """Accuracy on the held-out people of every population (a site's own test split is not this set)."""
    return _accuracy(module, next(iter(_data_modules(cell, protocol).values())).pooled)


def _weighted_mean(values: Mapping[str, float], weights: Mapping[str, int]) -> float:
    total = sum(weights[s] for s in values)
    return float(sum(values[s] * weights[s] for s in values) / total) if total else float("nan")


def _site_meta(record: Mapping[str, Any], key: str) -> dict[str, float]:
    return {site: float(meta[key]) for site, meta in sorted(record.get("site_meta", {}).items()) if key in meta}


def _mean_site_meta(record: Mapping[str, Any], key: str) -> float | None:
    values = list(_site_meta(record, key).values())
    return float(np.mean(values)) if values else None


# --------------------------------------------------------------------------------------------------------------------
# Client memory per site
# --------------------------------------------------------------------------------------------------------------------
MEMORY_ALGORITHMS = ("fedavg", "fedprox", "feddyn", "scaffold")


def memory_rows(protocol: Protocol) -> list[list[str]]:
    """Per algorithm: what a site holds beyond its model during a round (tensors reachable from the client
    algorithm once every step is taken, shared storages once) and what it writes to disk (its state file), in units
    of the model's parameter bytes. One round of site-1 with the server's first broadcast, as the sites run it."""
    from aggregators.compose import compose
    from aggregators.registry import build_rule
    from benchmarks.client_algorithms import algorithm_state_bytes
    from benchmarks.in_process import initial_params, quiet_lightning, site_rounds
    from controllers.engine import RoundEngine
    from jobs.spec import companion_rules

    rows = []
    for algorithm in MEMORY_ALGORITHMS:
        spec = cell_spec(Cell(algorithm, "iid", 0), replace(protocol, rounds=1))
        rule = compose(build_rule(spec.server, **dict(spec.server_args)), companion_rules(spec))
        params = initial_params(spec)
        meta = RoundEngine(rule, num_rounds=1).broadcast_meta(0, rule.init_state(params), "memory")
        with tempfile.TemporaryDirectory(prefix="fedalg_memory_") as root, quiet_lightning():
            site = site_rounds(spec, Path(root))["site-1"]
            held = _state_bytes_at_round_end(site, params, meta, algorithm_state_bytes)
            on_disk = sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())
        model = sum(p.numel() * p.element_size() for p in site.module.parameters())
        rows.append([algorithm, f"{model / 1e6:.3f}", f"{held / model:.2f}x", f"{on_disk / model:.2f}x"])
    return rows


def _state_bytes_at_round_end(site: Any, params: Any, meta: Any, measure: Any) -> int:
    """Train one round; the algorithm's tensors when its round ends (every step taken: the state at its largest)."""
    client, peak = site.callback.algorithm, []
    end_round = client.on_round_end

    def measured_end(module: Any) -> dict[str, Any]:
        peak.append(measure(client, exclude=list(module.parameters())))
        return end_round(module)

    client.on_round_end = measured_end
    site.train(0, params, meta)
    return peak[0]


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------
def _mean_sd(values: Sequence[float]) -> str:
    values = [v for v in values if v is not None and np.isfinite(v)]
    if not values:
        return "–"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.1f} ± {100 * sd:.1f}"


def load_cells(out: Path) -> dict[tuple[str, str], list[dict[str, Any]]]:
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for path in sorted((out / "cells").glob("*.json")):
        result = json.loads(path.read_text())
        grouped[(result["cell"]["algorithm"], result["cell"]["split"])].append(result)
    return grouped


def summary_rows(grouped: Mapping[tuple[str, str], list[dict[str, Any]]], split: str) -> list[list[str]]:
    order = [*ALGORITHMS, *BASELINES]
    rows = []
    for algorithm in sorted({a for a, s in grouped if s == split}, key=order.index):
        results = grouped[(algorithm, split)]
        site_means = [statistics.fmean(r["site_val_accuracy"].values()) for r in results]
        worst = [min(r["site_val_accuracy"].values()) for r in results]
        early = [r["curve"][min(4, len(r["curve"]) - 1)] for r in results if r.get("curve")]
        rows.append(
            [
                algorithm,
                str(len(results)),
                _mean_sd([r["test_accuracy"] for r in results]),
                _mean_sd(site_means),
                _mean_sd(worst),
                _mean_sd(early) if early else "–",
            ]
        )
    return rows


def per_site_table(grouped: Mapping[tuple[str, str], list[dict[str, Any]]], split: str) -> list[str]:
    results = {a: rs for (a, s), rs in grouped.items() if s == split}
    sites = sorted({site for rs in results.values() for r in rs for site in r["site_val_accuracy"]})
    lines = ["| algorithm | " + " | ".join(sites) + " |", "|---" * (len(sites) + 1) + "|"]
    order = [*ALGORITHMS, *BASELINES]
    for algorithm in sorted(results, key=order.index):
        cells = [_mean_sd([r["site_val_accuracy"].get(site) for r in results[algorithm]]) for site in sites]
        lines.append(f"| {algorithm} | " + " | ".join(cells) + " |")
    return lines


def plot_curves(grouped: Mapping[tuple[str, str], list[dict[str, Any]]], splits: Sequence[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(splits), figsize=(4.2 * len(splits), 3.4), squeeze=False, sharey=True)
    for ax, split in zip(axes[0], splits, strict=True):
        for (algorithm, s), results in sorted(grouped.items()):
            curves = [r["curve"] for r in results if s == split and r.get("curve")]
            if not curves:
                continue
            curves_arr = np.array(curves, dtype=float)
            x = np.arange(1, curves_arr.shape[1] + 1)
            ax.plot(x, curves_arr.mean(axis=0), label=algorithm)
            ax.fill_between(x, curves_arr.min(axis=0), curves_arr.max(axis=0), alpha=0.15)
        ax.set_title(split)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean site validation accuracy")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_controls(grouped: Mapping[tuple[str, str], list[dict[str, Any]]], splits: Sequence[str], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    drawn = False
    for split in splits:
        for r in grouped.get(("scaffold", split), [])[:1]:
            norms = [v for v in r.get("control_global_norm", []) if v is not None]
            diffs = [v for v in r.get("control_diff_norm", []) if v is not None]
            if norms:
                line = ax.plot(range(1, len(norms) + 1), norms, label=f"||c|| {split}")[0]
                ax.plot(range(1, len(diffs) + 1), diffs, "--", color=line.get_color(), label=f"mean ||Δc_i|| {split}")
                drawn = True
    if drawn:
        ax.set_xlabel("round")
        ax.set_yscale("log")
        ax.set_title("SCAFFOLD control variates (seed 0)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


#: Protocol fields that only the simulated cohort uses (the 1000 Genomes panel has 127 SNPs and its own people).
SIMULATION_ONLY = ("n_snps", "samples_per_population")


def write_report(out: Path, command: str) -> Path:
    grouped = load_cells(out)
    protocol = json.loads((out / "protocol.json").read_text())
    if protocol["source"] != "sim":  # the simulation's cohort settings mean nothing for the real panel
        protocol = {k: v for k, v in protocol.items() if k not in SIMULATION_ONLY}
    ran = {split for _, split in grouped}
    splits = [s for s in SPLITS if s in ran] + sorted(ran - set(SPLITS))
    lines = [
        f"# Genomics: federated algorithms vs local-only and pooled training ({protocol['source']})",
        "",
        f"Command: `{command}`",
        "",
        f"Protocol: {json.dumps(protocol)}. Accuracies in %, mean ± standard deviation over the seeds (column `n`).",
        "`test`: the final model on a held-out 20 % of all populations that no site trains on; `sites`: mean of the",
        "sites' validation accuracies (a local model on its own site); `worst site`: the lowest site; `round 5`:",
        "the federated model's mean site validation accuracy after 5 rounds. Differences within the seed spread",
        "are ties.",
        "",
    ]
    for split in splits:
        lines += [f"## {split}", "", "| algorithm | n | test | sites | worst site | round 5 |", "|---" * 6 + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in summary_rows(grouped, split)]
        lines += ["", "Per site (validation accuracy):", "", *per_site_table(grouped, split), ""]
    plot_curves(grouped, splits, out / "curves.png")
    lines += ["![mean site validation accuracy per round](curves.png)", ""]
    if plot_controls(grouped, splits, out / "scaffold_controls.png"):
        lines += ["![SCAFFOLD control norms](scaffold_controls.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    protocol, cells = grid_from_args(args)
    if args.memory:
        rows = memory_rows(protocol)
        print(f"client memory per site, {protocol.arch} on {protocol.source} (x = times the model's parameter bytes)")
        print("| algorithm | model MB | held by the algorithm during a round | state file |\n|---|---|---|---|")
        print("\n".join("| " + " | ".join(row) + " |" for row in rows))
        return 0
    failed: list[str] = []
    if not args.report_only:
        (args.out / "cells").mkdir(parents=True, exist_ok=True)
        same_protocol(args.out / "protocol.json", protocol)
        cells.sort(key=lambda cell: -CELL_COST.get(cell.algorithm, 1.0))  # the longest first (benchmarks.compare)
        failed = run_cells(cells, functools.partial(run_cell, protocol=protocol), args.out / "cells", args.workers)
    return finish(report_writer(args.grid, protocol), args.out, "benchmarks.genomics", argv, failed)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.genomics", description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("1kg", "sim"), default="1kg", help="genotype source (default: 1kg)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="table", help="which grid (default: table)")
    parser.add_argument("--out", type=Path, required=True, help="folder for cells/, report.md and the plots")
    parser.add_argument(
        "--algorithms", nargs="+", choices=[*ALGORITHMS, *PERSONALIZATION, *BASELINES], help="run only these"
    )
    parser.add_argument(
        "--splits", nargs="+", type=argparse_partition(genomics=True), help=f"override the splits: {GENOMICS_HELP}"
    )
    add_site_gain_options(parser)
    parser.add_argument("--samples-per-population", type=int, help="override the simulated cohort's size")
    parser.add_argument("--seeds", type=int, help="number of training seeds (0 .. n-1)")
    parser.add_argument("--arch", choices=("mlp", "cnn_transformer"), help="override the model")
    parser.add_argument("--rounds", type=int, help="override the rounds")
    parser.add_argument("--lr", type=float, help="override the AdamW learning rate")
    parser.add_argument("--workers", type=int, default=usable_cores(), help="cells run at once (default: cores)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from finished cells")
    parser.add_argument("--memory", action="store_true", help="only print the client memory per site and exit")
    return parser


#: Protocol fields the command line overrides.
OVERRIDES = (
    "arch",
    "rounds",
    "lr",
    "num_sites",
    "samples_per_population",
    "keep",
    "local_baseline",
    "site_test_fraction",
    "stop_patience",
    "keep_margin",
    "keep_view",
)
#: The share of the held-out people that --keep-view pooled chooses on when the protocol names none.
POOLED_VAL_FRACTION = 0.5
#: Grids whose site data are fixed across training seeds by default (the others: the committed grids' rule).
#: The per-site grids: their site data fixed across the training seeds (partition seed 0).
SITE_GAIN_GRIDS = ("site_gain", "site_gain_v3", "site_gain_v4", "site_gain_v5")
PARTITION_SEEDS: dict[str, tuple[int | None, ...]] = dict.fromkeys(SITE_GAIN_GRIDS, (0,))
GENOMICS_HELP = PARTITION_HELP.replace(
    ", C<k> (#C=k label skew, every site k labels), C<k>nb (#C=k as NIID-Bench deals it)",
    ", population (site = population)",
)


def grid_from_args(args: argparse.Namespace) -> tuple[Protocol, list[Cell]]:
    """The named grid's protocol with the command line's overrides, and its cells."""
    algorithms, splits, seeds, protocol = GRIDS[args.grid](args.source)
    protocol = replace(protocol, **{k: getattr(args, k) for k in OVERRIDES if getattr(args, k) is not None})
    if protocol.keep_view == "pooled" and not protocol.pooled_val_fraction:
        protocol = replace(protocol, pooled_val_fraction=POOLED_VAL_FRACTION)
    data_seeds = tuple(range(args.partition_seeds)) if args.partition_seeds else PARTITION_SEEDS.get(args.grid, (None,))
    cells = [
        Cell(a, s, seed, data)
        for s in (args.splits or splits)
        for data in data_seeds
        for a in (args.algorithms or algorithms)
        for seed in (range(args.seeds) if args.seeds else seeds)
    ]
    return protocol, cells


def report_writer(grid: str, protocol: Protocol) -> Any:
    """The personalization grids' report (benchmarks/personalization.py; site_gain: its per-site test-split page),
    or the genomics table's."""
    if grid not in ("personalization", *SITE_GAIN_GRIDS):
        return write_report
    from benchmarks.personalization import write_folder_report

    title = "1000 Genomes" if protocol.source == "1kg" else "simulated cohort"
    return functools.partial(
        write_folder_report, methods={"fedavg": {}, **PERSONALIZATION}, dataset=f"genomics ({title})"
    )


if __name__ == "__main__":
    raise SystemExit(main())
