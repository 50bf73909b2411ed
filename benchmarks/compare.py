"""The comparison harness: every algorithm on the same non-IID splits, several seeds, one command, one report.

    python -m benchmarks.compare --out runs/compare                  # the headline grid (hours on a 2-core CPU)
    python -m benchmarks.compare --grid smoke --out /tmp/cmp          # a minute: what the tests run
    python -m benchmarks.compare --out runs/compare --report-only     # rewrite report.md + plots from finished cells

A *cell* is one federation: (algorithm, partition, participation, seed). Every cell is a `jobs.spec.JobSpec`
run by `benchmarks.in_process.run_in_process`, i.e. the round engine the NVFlare controller drives and the
Lightning site round the client script runs (``tests/e2e/test_e2e_engine_equivalence.py`` checks that the two give
bit-identical global models), without NVFlare's processes and polling. Cells run in parallel on every core, each
finished cell is written to ``<out>/cells/<cell>.json`` at once and never recomputed (kill and rerun to resume), and
a progress bar shows the ETA.

``report.md`` (with PNGs beside it) gives per partition and participation, over seeds: test accuracy over rounds
(mean and a min-max band), final and best accuracy (mean ± standard deviation), rounds to reach the target
accuracy, the spread of the sites' local training losses, the worst site's local training accuracy, bytes sent per
site per round (model and algorithm meta, both directions), client state on disk per site, and wall time per round.
A difference smaller than the seed spread is reported as a tie with the best.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.partition_specs import HELP as PARTITION_HELP
from benchmarks.partition_specs import argparse_partition, partition_settings
from benchmarks.site_report import CENTRAL
from benchmarks.site_stats import ranking_notes

#: Algorithms by label: the committed job's client and server settings (jobs/presets.py) unless given here.
#: FedAvgM and the robust rules run with FedAvg clients; robust rules assume one Byzantine site.
EXTRA_ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavgm": {"server": "fedavgm"},  # eta = 1, server momentum 0.9 (the rule's defaults)
    "median": {"server": "median"},
    "trimmed_mean": {"server": "trimmed_mean", "server_args": {"beta": 0.1}},
    "krum": {"server": "krum", "server_args": {"num_byzantine": 1, "num_selected": 1}},
    # SCAFFOLD's model average weighted by sample counts, as FedAvg's (the paper's rule is uniform).
    "scaffold_samples": {"client": "scaffold", "server": "scaffold", "server_args": {"weighting": "samples"}},
    # SCAFFOLD with the paper's Option I control (the full local gradient at the global model).
    "scaffold_option1": {"client": "scaffold", "client_args": {"option": "I"}, "server": "scaffold"},
    # FedNova with the same local epochs at every site (NIID-Bench's setting: only the data sizes differ).
    "fednova_equal_epochs": {"server": "fednova"},
}
#: Settings copied from a preset: what defines the algorithm, not the data or the protocol.
ALGORITHM_FIELDS = (
    "client",
    "client_args",
    "server",
    "server_args",
    "momentum",
    "weight_decay",
    "pattern",
    "max_local_epochs",
)


@dataclass(frozen=True)
class Protocol:
    """Everything a cell shares with the other cells of its grid (data size, model, local work, rounds)."""

    dataset: str = "fashion_mnist"
    arch: str = "lenet5"
    num_sites: int = 10
    rounds: int = 30
    max_train_samples: int | None = 12000
    test_samples: int = 2000
    epochs: int = 1
    batch_size: int = 64
    lr: float = 0.05
    target_accuracy: float = 0.7
    #: The local optimizer for every algorithm of the grid; None keeps each algorithm's own (its preset's).
    momentum: float | None = None
    weight_decay: float | None = None
    #: Share of every site's shard held out as its validation split; > 0 makes it a personalization grid: its
    #: algorithms are PERSONALIZATION_METHODS plus the local-only baseline, scored per site
    #: (benchmarks/personalization.py).
    site_val_fraction: float = 0.0
    #: Share of every site's shard held out as its TEST split (reporting only); > 0 makes the cells read the sites'
    #: test-split scores of every candidate model (benchmarks/site_report.py).
    site_test_fraction: float = 0.0
    #: What each site keeps: "last" (the method's model) or "best" (the candidate best on its validation split).
    keep: str = "last"
    #: Every site trains its own compute-matched local-only model inside the job (never sent).
    local_baseline: bool = False
    #: The "next patient" view: every site also scores its candidates on the first n published test images.
    site_pooled_test: int = 0
    #: Stop at a validation plateau after this many rounds without improvement (controllers/stopping.py);
    #: None: every round.
    stop_patience: int | None = None
    #: Keep best's margin (lightning_modules/site_choice.py); None: the job's default.
    keep_margin: float | None = None
    #: The split the sites choose on: "own" (their validation splits) or "pooled" (the site_pooled_val published test
    #: images after the pooled view's; lightning_modules/site_choice.py); the command line's --keep-view pooled sets
    #: site_pooled_val to `POOLED_VAL_IMAGES` when the protocol has none.
    keep_view: str = "own"
    site_pooled_val: int = 0
    #: How the sites draw their validation and test splits (data_prep/splits.py): "random" (the grids up to v4) or
    #: "stratified" by label.
    site_holdout: str = "random"


#: The pooled validation split of --keep-view pooled when the protocol names none: 1,000 published test images.
POOLED_VAL_IMAGES = 1000


@dataclass(frozen=True)
class Grid:
    algorithms: tuple[str, ...]
    partitions: tuple[str, ...]
    participations: tuple[float, ...]  # share of sites per round
    seeds: tuple[int, ...]
    protocol: Protocol
    #: Seeds of the site data, a factor apart from the training seeds; None: the training seed draws the data too
    #: (the committed grids, whose seeds varied partition and training together).
    partition_seeds: tuple[int | None, ...] = (None,)


def _all_algorithms() -> tuple[str, ...]:
    from jobs.presets import PRESETS

    return (*PRESETS.with_builtin_model(), *EXTRA_ALGORITHMS)


#: NIID-Bench (Li et al., ICDE 2022) on Fashion-MNIST as Flower's niid_bench baseline runs it: simple CNN, 10 sites all
#: participating, batch 64, SGD lr 0.01 momentum 0.9 weight decay 1e-5, FedProx mu = 0.01, metric the best test
#: accuracy over rounds. Its full protocol (60k samples, 50 rounds x 10 local epochs) is the default here; the
#: committed results ran a reduced one, stated in benchmarks/results/niid_bench.md.
NIID_BENCH = Protocol(
    arch="simple_cnn",
    rounds=50,
    max_train_samples=None,
    test_samples=10000,
    epochs=10,
    lr=0.01,
    momentum=0.9,
    weight_decay=1e-5,
)

#: Personalization methods (docs/personalization.md) by label: JobSpec settings over plain FedAvg on the grid's model;
#: the grid adds the local-only baseline (benchmarks.personalization.LOCAL). FedBN needs BatchNorm, so its cells run
#: the built-in bn_cnn (LeNet-5 with a BatchNorm after each convolution) whatever the protocol's model.
PERSONALIZATION_METHODS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "finetune": {"finetune_epochs": 1},
    "fedper": {"local_keys": "net.classifier.*"},
    "fedbn": {"arch": "bn_cnn", "local_keys": "batchnorm"},
    "fedrep": {"client": "fedrep", "client_args": {"head_epochs": 1}},
    "ditto": {"client": "ditto", "client_args": {"lam": 0.1}},
    # Each site's own strength, chosen on its validation split every round: fine-tuning early-stopped within 3
    # epochs, and Ditto's v_i at three lams (the paper's sweep, 0.1 the job's nominal one).
    "finetune_es3": {"finetune_epochs": 3},
    "ditto_grid": {"client": "ditto", "client_args": {"lam": 0.1, "lam_grid": [0.01, 0.1, 1.0]}},
    # FedAvg clients with server momentum 0.9 at eta = 1 (Hsu et al. 2019): the server-optimizer row of a grid.
    "fedavgm": {"server": "fedavgm"},
    # The default with a stronger personal candidate: the received global model fine-tuned at the site, early-stopped
    # on its validation split within 3 epochs, in place of the round's trained model (the local-only model's matched
    # steps count the fine-tuning too).
    "fedavgm_ft3": {"server": "fedavgm", "finetune_epochs": 3},
    # The default with Ditto at the sites as the personal candidate, each site's strength chosen on its validation
    # split every round (the ditto_grid lams): v_i is trained on the site's data with a pull of strength lam to the
    # global model, an interpolation in weight space between a model of the site's own and the federated one.
    "fedavgm_ditto": {
        "server": "fedavgm",
        "client": "ditto",
        "client_args": {"lam": 0.1, "lam_grid": [0.01, 0.1, 1.0]},
    },
    # The same model trained centrally: one site holding the same number of samples, IID (the sites' union in
    # distribution), the same optimizer, epochs and rounds; its global model on the pooled test set is the ceiling the
    # federation's global model is read against.
    CENTRAL: {"num_sites": 1, "scheme": "iid"},
}

#: The per-site guarantee's methods (docs/personalization.md), each run with keep best and the local baseline.
SITE_GAIN_METHODS = ("fedavg", "finetune", "fedper", "fedbn", "fedrep", "ditto")
SITE_GAIN = Protocol(
    rounds=20,
    max_train_samples=6000,
    test_samples=1000,
    site_val_fraction=0.2,
    site_test_fraction=0.2,
    keep="best",
    local_baseline=True,
    site_pooled_test=1000,
    # The margin these grids ran with (the job default until v4): their commands reproduce their pages.
    keep_margin=1.645,
)
#: The pre-registered protocol of the held-out runs after the tuning study (benchmarks/results/site_gain.md, "Training
#: that converges"): server momentum (the fedavgm method), batch 16 (4x the local steps of batch 64 on the same
#: epoch), the stopping rule with patience 5, 40 rounds at most; every site scores on 1,000 pooled test images.
SITE_GAIN_V3 = replace(SITE_GAIN, rounds=40, batch_size=16, stop_patience=5)
#: The second pre-registration (benchmarks/results/site_gain.md, "Keep margin"): v3 unchanged but for keep best's
#: margin, 1.0 standard error instead of 1.645, chosen by replaying recorded tables of four tuning settings.
SITE_GAIN_V4 = replace(SITE_GAIN_V3, keep_margin=1.0)
#: The third pre-registration (benchmarks/results/site_gain.md, "Stratified hold-outs"): v4 unchanged but for the
#: sites' validation and test splits, stratified by label (the same sizes).
SITE_GAIN_V5 = replace(SITE_GAIN_V4, site_holdout="stratified")
#: Relative cost of a cell by method (measured: ditto and fedrep train twice per round, fedbn's model is larger):
#: the pool starts the longest cells first, so on many cores the grid does not end waiting for one late long cell.
CELL_COST = {"ditto": 3.5, "fedrep": 4.0, "fedbn": 3.5, "finetune": 2.5, "fedper": 2.5}

GRIDS = {
    "headline": lambda: Grid(_all_algorithms(), ("dir0.1", "C2"), (1.0, 0.5), (0, 1, 2), Protocol()),
    "niid_bench": lambda: Grid(
        ("fedavg", "scaffold", "fedprox", "fednova_equal_epochs"),
        ("iid", "dir0.5", "C3nb", "C2nb", "C1"),
        (1.0,),
        (42,),
        NIID_BENCH,
    ),
    # Does each site gain from joining: the reduced protocol of benchmarks/results/personalization.md.
    "personalization": lambda: Grid(
        ("local", "fedavg", "finetune", "ditto", "fedper", "fedrep", "fedbn"),  # cheapest first: a cut run has a table
        ("dir0.1", "C2"),
        (1.0,),
        (0, 1, 2),
        Protocol(rounds=20, max_train_samples=6000, test_samples=1000, site_val_fraction=0.2),
    ),
    "personalization_smoke": lambda: Grid(
        ("fedavg", "finetune", "fedper", "ditto", "local"),
        ("dir0.1",),
        (1.0,),
        (0, 1),
        Protocol(
            dataset="digits",
            arch="mlp",
            num_sites=3,
            rounds=2,
            max_train_samples=300,
            test_samples=200,
            site_val_fraction=0.2,
        ),
    ),
    # The per-site guarantee (every site keeps its best candidate and reports it against its own local-only model on
    # a test split): the committed personalization protocol plus a 20 % test split, keep best, the in-job local-only
    # baseline, the site data fixed across the training seeds (partition seed 0). 10 sites; the 7-site Dirichlet 0.3
    # setting is --num-sites 7 --partitions dir0.3 (another folder: the protocol differs).
    "site_gain": lambda: Grid(SITE_GAIN_METHODS, ("dir0.1", "C2", "qty0.3"), (1.0,), (0, 1, 2), SITE_GAIN, (0,)),
    # The pre-registered default (fedavgm) beside the same model trained centrally (central), on settings given on
    # the command line (--partitions, --num-sites, --max-train-samples).
    "site_gain_v3": lambda: Grid(("fedavgm", CENTRAL), ("dir0.15",), (1.0,), (0, 1, 2), SITE_GAIN_V3, (0,)),
    "site_gain_v4": lambda: Grid(("fedavgm", CENTRAL), ("dir0.2",), (1.0,), (0, 1, 2), SITE_GAIN_V4, (0,)),
    "site_gain_v5": lambda: Grid(("fedavgm", CENTRAL), ("dir0.2",), (1.0,), (0, 1, 2), SITE_GAIN_V5, (0,)),
    "site_gain_smoke": lambda: Grid(
        ("fedavgm", "fedrep"),  # the default and the earlier default: what tests/benchmarks runs end to end
        ("dir0.3",),
        (1.0,),
        (0, 1),
        replace(
            SITE_GAIN, dataset="digits", arch="mlp", num_sites=3, rounds=2, max_train_samples=300, test_samples=200
        ),
        (0,),
    ),
    "smoke": lambda: Grid(
        ("fedavg", "scaffold"),
        ("dir0.1",),
        (1.0,),
        (0, 1),
        Protocol(dataset="digits", arch="mlp", num_sites=3, rounds=2, max_train_samples=300, test_samples=200),
    ),
}


@dataclass(frozen=True)
class Cell:
    algorithm: str
    partition: str
    participation: float
    seed: int
    partition_seed: int | None = None  # None: the training seed draws the site data too

    @property
    def key(self) -> str:
        data = "" if self.partition_seed is None else f"__d{self.partition_seed}"
        return f"{self.algorithm}__{self.partition}{data}__p{self.participation:g}__s{self.seed}"


def algorithm_settings(algorithm: str, protocol: Protocol | None = None) -> dict[str, Any]:
    """The JobSpec fields that make ``algorithm`` (a preset name or one of `EXTRA_ALGORITHMS`; in a
    personalization grid one of `PERSONALIZATION_METHODS` or ``local``, which runs FedAvg's settings)."""
    from jobs.presets import PRESETS

    if protocol is not None and protocol.site_val_fraction:
        if algorithm == "local":
            return {}
        if algorithm not in PERSONALIZATION_METHODS:
            known = [*PERSONALIZATION_METHODS, "local"]
            raise SystemExit(f"error: unknown personalization method {algorithm!r}; choose from {known}")
        return dict(PERSONALIZATION_METHODS[algorithm])
    if algorithm in EXTRA_ALGORITHMS:
        return dict(EXTRA_ALGORITHMS[algorithm])
    if algorithm not in PRESETS:
        known = sorted([*PRESETS, *EXTRA_ALGORITHMS])
        raise SystemExit(f"error: unknown algorithm {algorithm!r}; choose from {known}")
    preset = PRESETS[algorithm]
    settings = {name: getattr(preset, name) for name in ALGORITHM_FIELDS}
    if preset.site_val_fraction:  # a personal method (Ditto) is refused without the validation split it scores on
        settings["site_val_fraction"] = preset.site_val_fraction
    return settings


def cell_spec(cell: Cell, protocol: Protocol) -> Any:
    """The job of one cell: the algorithm's settings on the grid's data, model and protocol."""
    from jobs.spec import JobSpec

    settings = algorithm_settings(cell.algorithm, protocol)
    if cell.algorithm == "attack_adaptive" and protocol.arch != "lenet5":
        raise SystemExit("error: attack_adaptive ships an attention checkpoint for lenet5 only")
    participation = None if cell.participation >= 1 else cell.participation
    for name in ("momentum", "weight_decay"):
        if getattr(protocol, name) is not None:
            settings[name] = getattr(protocol, name)
    fields = dict(
        name=cell.key,
        dataset=protocol.dataset,
        arch=protocol.arch,
        num_sites=protocol.num_sites,
        num_rounds=protocol.rounds,
        max_train_samples=protocol.max_train_samples,
        max_test_samples=protocol.test_samples,
        epochs=protocol.epochs,
        batch_size=protocol.batch_size,
        lr=protocol.lr,
        seed=cell.seed,
        clients_per_round=participation,
        site_val_fraction=protocol.site_val_fraction,
        **partition_settings(cell.partition),
        **site_gain_fields(protocol, cell),
    )
    return JobSpec(**{**fields, **settings})


def site_gain_fields(protocol: Protocol, cell: Cell) -> dict[str, Any]:
    """The JobSpec fields of the per-site guarantee, only where they differ from the defaults (a grid that uses
    none of them builds the same jobs as before they existed)."""
    fields: dict[str, Any] = {}
    if cell.partition_seed is not None:
        fields["partition_seed"] = cell.partition_seed
    if protocol.site_test_fraction:
        fields["site_test_fraction"] = protocol.site_test_fraction
    if getattr(protocol, "site_holdout", "random") != "random":  # the genomics protocol's data module holds out
        fields["site_holdout"] = protocol.site_holdout
    if protocol.keep != "last":
        fields["keep"] = protocol.keep
    if protocol.local_baseline:
        fields["local_baseline"] = True
    if getattr(protocol, "site_pooled_test", 0):  # the genomics harness's protocol has no pooled view
        fields["site_pooled_test"] = protocol.site_pooled_test
    if protocol.stop_patience is not None:  # both harnesses' protocols have it
        fields["stop_patience"] = protocol.stop_patience
    if getattr(protocol, "keep_margin", None) is not None:
        fields["keep_margin"] = protocol.keep_margin
    if getattr(protocol, "keep_view", "own") != "own":
        fields["keep_view"] = protocol.keep_view
    if getattr(protocol, "site_pooled_val", 0):  # the genomics harness's data module holds its own
        fields["site_pooled_val"] = protocol.site_pooled_val
    return fields  # an algorithm's own model (FedBN's bn_cnn) over the protocol's


# --------------------------------------------------------------------------------------------------------------------
# Running cells
# --------------------------------------------------------------------------------------------------------------------
def meta_bytes(meta: Mapping[str, Any]) -> int:
    """Bytes of the arrays in a meta dict (nested dicts of arrays included); scalars are not counted."""
    total = 0
    for value in meta.values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, Mapping):
            total += meta_bytes(value)
        elif isinstance(value, list | tuple) and value and isinstance(value[0], np.ndarray):
            total += sum(v.nbytes for v in value)
    return total


class CountingTransport:
    """Counts what each round sends: model and algorithm meta, down to every target and back from every site."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rounds: list[dict[str, int]] = []

    def train(self, round_num: int, targets: Sequence[str], params: Any, meta: Mapping[str, Any]) -> Any:
        results = self.inner.train(round_num, targets, params, meta)
        model = sum(np.asarray(v).nbytes for v in params.values())
        self.rounds.append(
            {
                "sites": len(targets),
                "model_down": model,
                "meta_down": meta_bytes(meta),
                "model_up": sum(sum(np.asarray(v).nbytes for v in r.params.values()) for r in results),
                "meta_up": sum(meta_bytes(r.meta) for r in results),
            }
        )
        return results


def run_cell(cell: Cell, protocol: Protocol, threads: int) -> dict[str, Any]:
    """One federation; the JSON-able result written to ``cells/<key>.json``."""
    import torch

    from benchmarks.in_process import quiet_lightning, run_in_process

    torch.set_num_threads(threads)
    spec = cell_spec(cell, protocol)
    if protocol.site_val_fraction and cell.algorithm == "local":
        return local_only_cell(cell, protocol, spec)
    counters: list[CountingTransport] = []

    def wrap(transport: Any) -> CountingTransport:
        counters.append(CountingTransport(transport))
        return counters[0]

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedalg_compare_") as state_root, quiet_lightning():
        run = run_in_process(spec, Path(state_root), run_id=cell.key, wrap_transport=wrap)
        state_bytes = sum(p.stat().st_size for p in Path(state_root).rglob("*") if p.is_file())
        require_rounds(run.rounds, protocol.rounds)
        scores = cell_site_scores(spec, Path(state_root), run) if protocol.site_val_fraction else {}
    return {
        "cell": asdict(cell),
        "protocol": asdict(protocol),
        "records": run.records,
        "traffic": counters[0].rounds,
        "client_state_bytes_per_site": state_bytes / protocol.num_sites,
        "wall_s": time.monotonic() - started,
        **scores,
    }


def cell_site_scores(spec: Any, state_root: Path, run: Any) -> dict[str, Any]:
    """A personalization cell's per-site scores: with a test split, what the sites reported on it after the last
    round (`test_split_scores`); without, the validation-split scores below."""
    if not getattr(spec, "site_test_fraction", 0):
        return personal_site_scores(spec, state_root, run.params)
    return test_split_scores(run, functools.partial(builtin_site_sizes, spec))


def test_split_scores(run: Any, sizes: Callable[[], dict[str, dict[str, int]]]) -> dict[str, Any]:
    """What the sites reported on their test splits after the last round (every candidate, the kept one), with
    their split sizes (``sizes()``); a run whose sites reported no local-only or kept test score fails its cell."""
    from benchmarks.site_report import best_global_scores, cell_scores, test_metrics_record

    scores = cell_scores(test_metrics_record(run.records))
    if not scores["site_test"].get("local") or not scores["site_test"].get("kept"):
        raise MissingSiteScores(
            "the sites reported no eval.local_test_accuracy / eval.kept_test_accuracy after the last round: this "
            "grid needs jobs with a test split, --local-baseline and --keep"
        )
    best = best_global_scores(run.records)  # the global model the job delivers (chosen on validation)
    if best:
        scores["site_pooled_test"]["best_global"] = best
    return {**scores, "site_sizes": sizes()}


class MissingSiteScores(RuntimeError):
    """A per-site cell whose sites did not report the test-split scores its report needs (the cell fails)."""


def builtin_site_sizes(spec: Any) -> dict[str, dict[str, int]]:
    """Per built-in site: its training, validation and test samples (the shard and the seeded hold-outs)."""
    from benchmarks.in_process import site_args
    from data_prep import SiteDataConfig
    from data_prep.sites import partition_sites
    from data_prep.splits import holdout_size

    _, parts = partition_sites(SiteDataConfig.from_namespace(site_args(spec)))
    sizes = {}
    for i, part in enumerate(parts):
        val = holdout_size(len(part), spec.site_val_fraction)
        test = holdout_size(len(part), spec.site_test_fraction, val)
        sizes[f"site-{i + 1}"] = {"train": len(part) - val - test, "val": val, "test": test}
    return sizes


def personal_site_scores(spec: Any, state_root: Path, final: Any) -> dict[str, Any]:
    """A personalization cell's per-site scores of the final global and the personalized model."""
    from benchmarks.personalization import site_scores

    scores = site_scores(spec, state_root, final)
    return {"site_global": scores["global"], "site_personal": scores["personal"]}


def local_only_cell(cell: Cell, protocol: Protocol, spec: Any) -> dict[str, Any]:
    """The local-only baseline of a personalization grid: every site alone for the federation's total local epochs
    (benchmarks.personalization.local_only_scores); no federation, no round records."""
    from benchmarks.in_process import quiet_lightning
    from benchmarks.personalization import local_only_scores

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedalg_local_") as state_root, quiet_lightning():
        scores = local_only_scores(spec, Path(state_root))
    return {
        "cell": asdict(cell),
        "protocol": asdict(protocol),
        "site_personal": scores,
        "wall_s": time.monotonic() - started,
    }


class IncompleteFederation(RuntimeError):
    """A federation that recorded fewer rounds than planned, or no round that aggregated: its cell fails (the harness
    exits 1 naming it)."""


def require_rounds(rounds: Sequence[Any], planned: int) -> None:
    """A table cell must come from the rounds it claims: fewer round records than planned is an error, and so are
    rounds none of which updated the global model (the round engine records failed rounds too, so such a federation
    would report the initial model's flat curve). Some failed rounds are not an error: a federation under attack
    may reject every result of a round. The check is the one made of simulator runs
    (`aggregators.contracts.run_records.completion_problems`); a federation its stopping rule ended
    (``--stop-patience``) has all its rounds."""
    from aggregators.contracts.run_records import (  # here: the harness's own imports stay its own
        completion_problems,
        stop_note,
    )

    if len(rounds) < planned and stop_note(rounds) is None:  # the stopping rule's end is a finished run
        raise IncompleteFederation(f"{len(rounds)} round record(s) of {planned} planned")
    problems = completion_problems(rounds) if rounds else []  # no rounds planned: nothing can have failed
    if problems:
        raise IncompleteFederation("; ".join(problems))


def write_json(path: Path, value: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, default=float))
    tmp.replace(path)  # atomic: a killed run never leaves a half-written cell behind


def same_protocol(path: Path, protocol: Any, option: str = "--out") -> None:
    """Finished cells are reused only under the protocol they ran with (fields added later count at their default);
    ``option`` is the command-line option that names another folder."""
    if path.exists() and _saved_protocol(path, type(protocol)) != protocol:
        raise SystemExit(
            f"error: {path.parent} holds cells of another protocol ({path.read_text()}); use another {option}"
        )
    write_json(path, asdict(protocol))


def _saved_protocol(path: Path, kind: type) -> Any:
    """The protocol in ``path``, or None when it has fields ``kind`` no longer has (cells of an older harness)."""
    try:
        return kind(**json.loads(path.read_text()))
    except TypeError:
        return None


def run_grid(grid: Grid, out: Path, workers: int) -> list[str]:
    """Run every cell not yet in ``out/cells``; returns the keys of cells that failed (with the reason printed)."""
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    same_protocol(out / "protocol.json", grid.protocol)
    cells = [
        Cell(a, p, share, s, d)
        for p in grid.partitions
        for d in grid.partition_seeds
        for share in grid.participations
        for a in grid.algorithms
        for s in grid.seeds
    ]
    for cell in cells:
        cell_spec(cell, grid.protocol)  # refuse a bad grid before hours of work
    cells.sort(key=lambda cell: -CELL_COST.get(cell.algorithm, 1.0))  # stable: the grid's order within a cost
    return run_cells(cells, functools.partial(run_cell, protocol=grid.protocol), cells_dir, workers)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's share, not the host's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


def run_cells(cells: Sequence[Any], run: Callable[..., dict[str, Any]], cells_dir: Path, workers: int) -> list[str]:
    """Run every cell (anything with a ``key``) whose ``cells_dir/<key>.json`` does not exist yet, ``workers`` at a
    time, with a progress bar; ``run(cell, threads=...)`` must be picklable (a module-level function or a partial of
    one). Returns the keys of cells that failed (with the reason printed)."""
    from tqdm import tqdm

    todo = [c for c in cells if not (cells_dir / f"{c.key}.json").exists()]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} already done, {len(todo)} to run on {workers} worker(s)")
    failed: list[str] = []
    threads = max(1, usable_cores() // workers)

    def finish(cell: Any, outcome: Callable[[], dict[str, Any]], bar: Any) -> None:
        try:
            write_json(cells_dir / f"{cell.key}.json", outcome())
        except Exception as exc:  # one broken cell must not cost the others
            failed.append(cell.key)
            tqdm.write(f"cell {cell.key} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        bar.update(1)

    with tqdm(total=len(todo), unit="cell") as bar:
        if workers == 1:  # in this process: no pool to start
            for cell in todo:
                finish(cell, lambda cell=cell: run(cell, threads=threads), bar)
            return failed
        # spawn, not fork: a forked child of a process that already ran torch's OpenMP threads can hang.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            futures = {pool.submit(run, c, threads=threads): c for c in todo}
            for future in as_completed(futures):
                finish(futures[future], future.result, bar)
    return failed


# --------------------------------------------------------------------------------------------------------------------
# Summaries
# --------------------------------------------------------------------------------------------------------------------
@dataclass
class Summary:
    """One (algorithm, partition, participation) over its seeds."""

    algorithm: str
    seeds: int
    curves: np.ndarray  # seeds x (rounds + 1): accuracy of the initial model, then after every round
    final: tuple[float, float]  # mean, std
    best: tuple[float, float]
    rounds_to_target: float | None  # mean over the seeds that reached it
    reached: int  # seeds that reached the target
    loss_spread: float  # std of the sites' training losses within a round, mean over rounds and seeds
    worst_site_train_acc: float  # lowest site training accuracy in the last round, mean over seeds
    bytes_per_site_round: float
    meta_share: float  # share of those bytes that is algorithm meta
    state_bytes_per_site: float
    wall_per_round: float
    failed_rounds: int
    late_gain: float = math.nan  # accuracy points gained in the last LATE_WINDOW rounds (see late_gain)
    late_mean: tuple[float, float] = (math.nan, math.nan)  # mean accuracy of the last LATE_WINDOW rounds: mean, std


#: Rounds over which the report measures whether a curve has flattened.
LATE_WINDOW = 10


def late_gain(curves: np.ndarray, window: int = LATE_WINDOW) -> float:
    """Accuracy points the curves still gain at the end: the mean accuracy of the last ``window`` rounds minus that
    of the ``window`` rounds before, averaged over seeds (rows); nan when the run is shorter than two windows."""
    rounds = curves[:, 1:]  # column 0 is the initial model
    if rounds.shape[1] < 2 * window:
        return math.nan
    last, before = rounds[:, -window:], rounds[:, -2 * window : -window]
    return float(100 * np.mean(np.nanmean(last, axis=1) - np.nanmean(before, axis=1)))


def late_mean(curves: np.ndarray, window: int = LATE_WINDOW) -> tuple[float, float]:
    """Mean and std over seeds of each seed's mean accuracy in its last ``window`` rounds: the end point without the
    round-to-round oscillation that the final round alone carries (nan when the run is shorter than ``window``)."""
    rounds = curves[:, 1:]
    if rounds.shape[1] < window:
        return math.nan, math.nan
    return mean_std(np.nanmean(rounds[:, -window:], axis=1))


def flattened(summary: Summary) -> bool:
    """A curve has flattened when its late gain is within the seeds' spread of the final accuracy."""
    return not math.isnan(summary.late_gain) and abs(summary.late_gain) <= 100 * summary.final[1]


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    values = list(values)
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def summarise(algorithm: str, results: Sequence[Mapping[str, Any]], target: float) -> Summary:
    curves, to_target, spreads, worst, traffic, meta, walls, failed = [], [], [], [], [], [], [], 0
    for result in results:
        records = result["records"]
        accuracy = [r.get("test_accuracy", math.nan) for r in records]
        curves.append(accuracy)
        hit = next((i for i, a in enumerate(accuracy) if a >= target), None)
        if hit is not None:
            to_target.append(hit)
        rounds = [r for r in records if r["stage"] == "round"]
        failed += sum(r["status"] != "aggregated" for r in rounds)
        losses = [[v for v in r["site_train_loss"].values() if v is not None] for r in rounds]
        with np.errstate(invalid="ignore", over="ignore"):  # a diverged site's inf loss: the spread is non-finite
            spreads += [float(np.std(x)) for x in losses if len(x) > 1]
        last_acc = [m.get("train.accuracy") for m in rounds[-1]["site_meta"].values()] if rounds else []
        worst.append(min((a for a in last_acc if a is not None), default=math.nan))
        for t in result["traffic"]:
            sent = t["model_down"] + t["meta_down"] + t["model_up"] + t["meta_up"]
            traffic.append(sent / max(1, t["sites"]))
            meta.append((t["meta_down"] + t["meta_up"]) / max(1, sent))
        walls += [r["elapsed_s"] for r in rounds]
    curves_array = np.array(curves, dtype=float)
    return Summary(
        algorithm=algorithm,
        seeds=len(results),
        curves=curves_array,
        final=mean_std(curves_array[:, -1]),
        best=mean_std(np.nanmax(curves_array[:, 1:], axis=1)),
        rounds_to_target=float(np.mean(to_target)) if to_target else None,
        reached=len(to_target),
        loss_spread=float(np.mean(spreads)) if spreads else math.nan,
        worst_site_train_acc=float(np.nanmean(worst)) if worst else math.nan,
        bytes_per_site_round=float(np.mean(traffic)) if traffic else math.nan,
        meta_share=float(np.mean(meta)) if meta else math.nan,
        state_bytes_per_site=statistics.fmean(r["client_state_bytes_per_site"] for r in results),
        wall_per_round=float(np.mean(walls)) if walls else math.nan,
        failed_rounds=failed,
        late_gain=late_gain(curves_array),
        late_mean=late_mean(curves_array),
    )


def load_cells(out: Path) -> dict[tuple[str, float], dict[str, list[dict[str, Any]]]]:
    """Finished cells grouped by (partition, participation), then by algorithm."""
    groups: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted((out / "cells").glob("*.json")):
        result = json.loads(path.read_text())
        cell = result["cell"]
        groups[(cell["partition"], cell["participation"])][cell["algorithm"]].append(result)
    return groups


def _pct(pair: tuple[float, float]) -> str:
    return f"{100 * pair[0]:.1f} ± {100 * pair[1]:.1f}"


def spread_text(spread: float) -> str:
    """The site-loss spread as a table cell: a run whose sites' losses blew up shows it in powers of ten (a fixed
    3 decimals printed 2154236579209450868441088.000), one with non-finite losses says so."""
    if not math.isfinite(spread):
        return "non-finite"
    return f"{spread:.3f}" if spread < 1000 else f"{spread:.1e}"


def group_table(summaries: Sequence[Summary], target: float) -> list[str]:
    notes = ranking_notes(summaries)
    lines = [
        f"| algorithm | seeds | final acc % | mean acc %, last {LATE_WINDOW} rounds | best acc % | rounds to "
        f"{target:.0%} | gain, last {LATE_WINDOW} rounds (pts) | site loss spread | worst site train acc | "
        "KB / site / round (meta share) | client state KB / site | s / round | |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted(summaries, key=lambda s: -s.final[0]):
        reach = f"{s.rounds_to_target:.1f} ({s.reached}/{s.seeds})" if s.rounds_to_target is not None else "never"
        failed = f"{s.failed_rounds} failed round{'s' * (s.failed_rounds != 1)}" if s.failed_rounds else ""
        remarks = "; ".join(text for text in (notes[s.algorithm], failed) if text)
        gain = "–" if math.isnan(s.late_gain) else f"{s.late_gain:+.1f}" + (" (flat)" if flattened(s) else "")
        traffic = f"{s.bytes_per_site_round / 1024:.0f} ({s.meta_share:.0%})"
        lines.append(
            f"| {s.algorithm} | {s.seeds} | {_pct(s.final)} | {_pct(s.late_mean)} | {_pct(s.best)} | {reach} | "
            f"{gain} | {spread_text(s.loss_spread)} | {s.worst_site_train_acc:.3f} | {traffic} | "
            f"{s.state_bytes_per_site / 1024:.0f} | {s.wall_per_round:.2f} | {remarks} |"
        )
    return lines


def group_title(partition: str, share: float) -> str:
    return f"{partition}, {share:.0%} of sites per round"


def overview_table(summaries_by_group: Mapping[tuple[str, float], Sequence[Summary]]) -> list[str]:
    """One row per algorithm, one column per (partition, participation): final accuracy, the group's best in bold,
    ties marked (`ranking_notes`); rows by mean final accuracy over the groups an algorithm ran in."""
    finals: dict[str, dict[tuple[str, float], str]] = defaultdict(dict)
    means: dict[str, list[float]] = defaultdict(list)
    for key, summaries in summaries_by_group.items():
        notes = ranking_notes(summaries)
        for s in summaries:
            finals[s.algorithm][key] = overview_cell(s, notes[s.algorithm])
            means[s.algorithm].append(s.final[0])
    keys = list(summaries_by_group)
    lines = [
        "| algorithm | " + " | ".join(group_title(*key) for key in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for algorithm in sorted(finals, key=lambda a: -float(np.mean(means[a]))):
        lines.append(f"| {algorithm} | " + " | ".join(finals[algorithm].get(key, "–") for key in keys) + " |")
    return [
        *lines,
        "",
        "Bold: the group's best final accuracy; (tie): within the seed spread of it; –: not run; a value without "
        "± comes from one seed and is not ranked.",
    ]


def overview_cell(summary: Summary, note: str) -> str:
    if summary.seeds == 1:
        return f"{100 * summary.final[0]:.1f}"
    text = _pct(summary.final)
    return f"**{text}**" if note == "best" else text + (" (tie)" if note == "tie" else "")


def plot_group(summaries: Sequence[Summary], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20")
    for i, s in enumerate(sorted(summaries, key=lambda s: -s.final[0])):
        rounds = np.arange(s.curves.shape[1])
        mean = np.nanmean(s.curves, axis=0)
        ax.plot(rounds, mean, label=f"{s.algorithm} ({100 * s.final[0]:.1f})", color=colors(i % 20))
        if s.seeds > 1:
            ax.fill_between(rounds, s.curves.min(axis=0), s.curves.max(axis=0), color=colors(i % 20), alpha=0.15)
    ax.set(xlabel="round", ylabel="test accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _optimizer_note(protocol: Protocol) -> str:
    notes = [f"{name.replace('_', ' ')} {getattr(protocol, name)}" for name in ("momentum", "weight_decay")]
    return "".join(
        f", {note}"
        for note, name in zip(notes, ("momentum", "weight_decay"), strict=True)
        if getattr(protocol, name) is not None
    )


def write_report(out: Path, command: str) -> Path:
    saved = json.loads((out / "protocol.json").read_text()) if (out / "protocol.json").exists() else {}
    if saved.get("site_val_fraction"):
        from benchmarks.personalization import write_folder_report

        return write_folder_report(out, command, PERSONALIZATION_METHODS, saved["dataset"])
    groups = load_cells(out)
    if not groups:
        raise SystemExit(f"error: no finished cells in {out / 'cells'}")
    protocol = Protocol(**next(iter(next(iter(groups.values())).values()))[0]["protocol"])
    lines = [
        "# Algorithm comparison",
        "",
        f"Produced by `{command}`. Protocol: {protocol.dataset}, {protocol.arch}, {protocol.num_sites} sites, "
        f"{protocol.rounds} rounds x {protocol.epochs} local epoch(s), batch {protocol.batch_size}, "
        f"SGD lr {protocol.lr}{_optimizer_note(protocol)} (the committed jobs' algorithm settings otherwise), "
        f"{protocol.max_train_samples or 'all'} training samples, test accuracy on {protocol.test_samples} test "
        "samples. Run in process through the round engine the NVFlare controller uses (bit-identical to the "
        "simulator, tested). Mean ± std over the seeds named in each table; a gap smaller than the seed spread "
        "is a tie. Single-seed rows carry no spread and cannot be ranked. Site loss spread: std of the sites' "
        "local training losses in a round. Worst site: local training accuracy (the sites' own data), last round. "
        f"Mean acc, last {LATE_WINDOW} rounds: each seed's mean test accuracy over its last {LATE_WINDOW} rounds, "
        "then mean ± std over seeds (the end point without the last round's oscillation). "
        f"Gain, last {LATE_WINDOW} rounds: mean accuracy of the last {LATE_WINDOW} rounds minus that of the "
        f"{LATE_WINDOW} before, in points, mean over seeds; (flat) when it is within the seed spread of the final "
        "accuracy.",
        "",
    ]
    summaries_by_group = {
        key: [summarise(a, r, protocol.target_accuracy) for a, r in sorted(by_algorithm.items())]
        for key, by_algorithm in sorted(groups.items(), key=lambda item: (-item[0][1], item[0][0]))
    }  # full participation first
    if len(summaries_by_group) > 1:
        lines += ["## Final test accuracy (%), every group", "", *overview_table(summaries_by_group), ""]
    for (partition, share), summaries in summaries_by_group.items():
        title = group_title(partition, share)
        image = f"compare_{partition}_p{share:g}.png"
        plot_group(summaries, title, out / image)
        lines += [f"## {title}", "", f"![{title}]({image})", "", *group_table(summaries, protocol.target_accuracy), ""]
    if protocol.arch == NIID_BENCH.arch and protocol.momentum == NIID_BENCH.momentum:
        lines += published_comparison(groups)
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


#: Best test accuracy (%) over 50 rounds published by Flower's niid_bench baseline (NIID-Bench, Li et al.) on
#: Fashion-MNIST, one seed (42): partition -> algorithm -> accuracy.
PUBLISHED_NIID_BENCH: dict[str, dict[str, float]] = {
    "iid": {"fedavg": 89.0, "scaffold": 89.5, "fedprox": 89.5, "fednova_equal_epochs": 89.3},
    "dir0.5": {"fedavg": 88.4, "scaffold": 88.4, "fedprox": 88.6, "fednova_equal_epochs": 88.1},
    "C3nb": {"fedavg": 83.2, "scaffold": 84.2, "fedprox": 82.5, "fednova_equal_epochs": 83.2},
    "C2nb": {"fedavg": 81.0, "scaffold": 10.0, "fedprox": 78.8, "fednova_equal_epochs": 70.5},
    "C1": {"fedavg": 10.0, "scaffold": 10.0, "fedprox": 38.0, "fednova_equal_epochs": 11.1},
}


def published_comparison(groups: Mapping[tuple[str, float], Mapping[str, list[dict[str, Any]]]]) -> list[str]:
    """Published vs measured best test accuracy per (partition, algorithm), with the difference in points."""
    algorithms = ("fedavg", "scaffold", "fedprox", "fednova_equal_epochs")
    lines = [
        "## Published (NIID-Bench, Flower's baseline) vs measured: best test accuracy over rounds, %",
        "",
        "| partition | " + " | ".join(algorithms) + " |",
        "|---|" + "---|" * len(algorithms),
    ]
    for partition, published in PUBLISHED_NIID_BENCH.items():
        cells = []
        for algorithm in algorithms:
            results = groups.get((partition, 1.0), {}).get(algorithm, [])
            if not results:
                cells.append(f"{published[algorithm]:.1f} / not run")
                continue
            best = 100 * float(
                np.mean([np.nanmax([r.get("test_accuracy", math.nan) for r in res["records"][1:]]) for res in results])
            )
            cells.append(f"{published[algorithm]:.1f} / {best:.1f} ({best - published[algorithm]:+.1f})")
        lines.append(f"| {partition} | " + " | ".join(cells) + " |")
    return [*lines, "", "Each cell: published / measured (measured − published).", ""]


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    grid = grid_from_args(args)
    failed = [] if args.report_only else run_grid(grid, args.out, max(1, args.workers))
    return finish(write_report, args.out, "benchmarks.compare", argv, failed)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default="headline", help="which grid (default: headline)")
    parser.add_argument("--out", type=Path, required=True, help="folder for cells/, report.md and the plots")
    parser.add_argument("--algorithms", nargs="+", help="run only these (preset names, fedavgm, median, ...)")
    parser.add_argument("--partitions", nargs="+", type=argparse_partition(), help=f"override the {PARTITION_HELP}")
    add_site_gain_options(parser)
    parser.add_argument("--site-val-fraction", type=float, help="override each site's validation share")
    parser.add_argument("--participations", nargs="+", type=float, help="shares of sites per round, e.g. 1 0.5")
    parser.add_argument("--seeds", type=int, help="number of seeds (0 .. n-1; the grid's own seeds by default)")
    parser.add_argument("--rounds", type=int, help="override the protocol's rounds")
    parser.add_argument("--max-train-samples", type=int, help="override the training subset size")
    parser.add_argument("--lr", type=float, help="override the local learning rate")
    parser.add_argument("--epochs", type=int, help="override the local epochs per round")
    parser.add_argument("--batch-size", type=int, help="override the local batch size")
    parser.add_argument("--momentum", type=float, help="local SGD momentum for every algorithm of the grid")
    parser.add_argument("--weight-decay", type=float, help="local SGD weight decay for every algorithm of the grid")
    parser.add_argument("--test-samples", type=int, help="override the number of test samples")
    parser.add_argument("--workers", type=int, default=usable_cores(), help="cells run at once (default: cores)")
    parser.add_argument("--report-only", action="store_true", help="only rewrite the report from finished cells")
    return parser


def add_site_gain_options(parser: argparse.ArgumentParser) -> None:
    """The per-site guarantee's options, the same in every harness (site_gain grids set them; others do not)."""
    parser.add_argument("--num-sites", type=int, help="override the number of sites")
    parser.add_argument(
        "--partition-seeds",
        type=int,
        help="number of site-data seeds (0 .. n-1), a factor apart from --seeds: each partition seed is its own "
        "setting, within which the site data stay fixed while the training seed varies (site_gain grids: 1; the "
        "other grids: the training seed draws the data too)",
    )
    parser.add_argument("--keep", choices=("last", "best"), help="what each site keeps (site_gain grids: best)")
    parser.add_argument(
        "--local-baseline",
        action=argparse.BooleanOptionalAction,
        help="every site trains a compute-matched local-only model in the job (site_gain grids: on)",
    )
    parser.add_argument("--site-test-fraction", type=float, help="override each site's test share")
    parser.add_argument(
        "--stop-patience",
        type=int,
        help="stop a cell at a validation plateau after this many rounds without improvement (--rounds is the cap)",
    )
    parser.add_argument(
        "--keep-margin",
        type=float,
        help="keep best's margin in standard errors (lightning_modules/site_choice.py; default: the grid's, else the "
        "job's)",
    )
    parser.add_argument(
        "--keep-view",
        choices=("own", "pooled"),
        help="the split each site chooses its own and its kept model on: own (its validation split; the default) or "
        "pooled (a pooled validation split apart from the pooled test view; docs/personalization.md)",
    )


def grid_from_args(args: argparse.Namespace) -> Grid:
    """The named grid with the command line's overrides."""
    grid = GRIDS[args.grid]()
    overrides = (
        "rounds",
        "max_train_samples",
        "lr",
        "epochs",
        "batch_size",
        "momentum",
        "weight_decay",
        "test_samples",
        "num_sites",
        "keep",
        "local_baseline",
        "site_val_fraction",
        "site_test_fraction",
        "stop_patience",
        "keep_margin",
        "keep_view",
    )
    protocol = replace(grid.protocol, **{k: getattr(args, k) for k in overrides if getattr(args, k) is not None})
    if protocol.keep_view == "pooled" and not protocol.site_pooled_val:
        protocol = replace(protocol, site_pooled_val=POOLED_VAL_IMAGES)
    grid = replace(
        grid,
        algorithms=tuple(args.algorithms or grid.algorithms),
        partitions=tuple(args.partitions or grid.partitions),
        participations=tuple(args.participations or grid.participations),
        seeds=tuple(range(args.seeds)) if args.seeds else grid.seeds,
        partition_seeds=tuple(range(args.partition_seeds)) if args.partition_seeds else grid.partition_seeds,
        protocol=protocol,
    )
    return grid


def finish(
    write: Callable[[Path, str], Path], out: Path, module: str, argv: Sequence[str] | None, failed: Sequence[str]
) -> int:
    """Write the report (naming the command that produced it), say which cells failed; the exit status."""
    # A report rewritten from finished cells names the command that ran them (--report-only only re-renders).
    command = f"python -m {module} " + " ".join(
        a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"
    )
    if failed:
        print(f"error: {len(failed)} cell(s) failed: {', '.join(failed)}", file=sys.stderr)
        if not any((out / "cells").glob("*.json")):
            return 1  # nothing to report on
    print(f"report: {write(out, command)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
