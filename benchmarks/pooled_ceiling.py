"""How much could joining pay a site at most? The own-view gain of training on the pooled data, then fine-tuning.

A federation learns from the sites' data without pooling it; the most its global model can usually know is what the
same model learns from the pooled data (benchmarks/results/site_gain.md: run to the stopping rule, the federated
model ends within a point or two of central training where sites hold several labels). This replay asks, for a
recorded site-gain setting (a folder of ``benchmarks.compare`` cells), what a site would gain on its own test split
if the federation delivered exactly that:

1. ``pooled``: the setting's model trained on the **union of the sites' training splits** (the same architecture,
   initial weights, optimizer, batch and one epoch a round), early-stopped on the union of their validation splits:
   the epoch with the lowest validation loss, training stopped by the job's rule (``controllers/stopping.py``:
   ``patience`` epochs without an improvement of 1e-4), at most the setting's round cap;
2. ``pooled, fine-tuned``: per site, that model trained on the site's own training split, early-stopped the same
   way on the site's validation split (epoch 0, the pooled model itself, included);
3. ``best on test``: per (site, seed), the best on its test split of those two and the site's own model: an oracle.

Each is scored on the site's test split and on the pooled test images, and compared per (site, seed) with the
early-stopped local-only model the job recorded (the counterfactual of every site-gain table), with the same
t-interval over the seeds' site means as the site reports (benchmarks/site_stats.py). The sites' splits are rebuilt
from the job's own code and checked against the sizes the cells recorded.

Reading rule, fixed before any run: where the fine-tuned pooled model's own-view gain is below +3 points, or its
interval holds 0, the own-view target is beyond what pooling the sites' data would give them there, whatever the
federated algorithm or keep rule: the data, not the method, limits it.

    python -m benchmarks.pooled_ceiling benchmarks/results/site_gain_v4c_dir0.2 --json out.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset

from benchmarks import site_stats
from controllers.stopping import MIN_DELTA, rounds_since_best

#: The recorded default whose cells the ceiling is read against.
DEFAULT = "fedavgm"
#: The views: a site's own test split, and the pooled "next patient" test images.
VIEWS = ("site_test", "site_pooled_test")
CANDIDATES = ("pooled", "pooled_finetuned", "best_on_test")
#: Scoring batch (scores do not depend on it).
EVAL_BATCH = 512


@dataclass(frozen=True)
class Stopped:
    """An early-stopped training: the chosen epoch (0: the starting model), its validation loss, epochs run."""

    state: dict[str, torch.Tensor]
    epoch: int
    val_loss: float
    epochs_run: int


def chosen_epoch(val_losses: Sequence[float], min_delta: float = MIN_DELTA) -> int:
    """The epoch early stopping keeps: the first reaching the lowest validation loss (up to ``min_delta``), the
    stopping rule's ``argmin``."""
    return len(val_losses) - 1 - rounds_since_best(val_losses, min_delta)


def scores(module: torch.nn.Module, data: Dataset) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``module`` on ``data``."""
    module.eval()
    loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in DataLoader(data, batch_size=EVAL_BATCH):
            logits = module(x)
            loss += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
            seen += len(y)
    return loss / seen, correct / seen


def early_stopped(
    module: Any, train: Dataset, val: Dataset, batch_size: int, max_epochs: int, patience: int, seed: int
) -> Stopped:
    """Train ``module`` (its own ``training_step`` and ``configure_optimizers``: a fresh optimizer every epoch, as
    every round of a job) one epoch at a time on ``train``; keep the epoch `chosen_epoch` picks on ``val``."""
    from lightning_modules.local_baseline import plain_fit
    from lightning_modules.personal_scores import own_random_stream

    losses = [scores(module, val)[0]]
    best_state = {key: value.clone() for key, value in module.state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    # Dropout draws from the global generator: seeded here, a run does not depend on what its process ran before.
    with own_random_stream(seed):
        while len(losses) <= max_epochs and rounds_since_best(losses) < patience:
            loader = DataLoader(train, batch_size=batch_size, shuffle=True, generator=generator)
            plain_fit(module, loader, len(loader))
            losses.append(scores(module, val)[0])
            if chosen_epoch(losses) == len(losses) - 1:
                best_state = {key: value.clone() for key, value in module.state_dict().items()}
    epoch = chosen_epoch(losses)
    return Stopped(best_state, epoch, losses[epoch], len(losses) - 1)


@dataclass(frozen=True)
class RecordedRun:
    """What the replay needs of one recorded run, rebuilt by its harness's own code: per site its (training,
    validation, test) datasets, the pooled test set, the job's initial model and its training settings."""

    sites: dict[str, tuple[Dataset, Dataset, Dataset]]
    pooled_test: Dataset | None
    make_module: Callable[[], Any]
    batch_size: int
    max_epochs: int
    patience: int
    seed: int


def image_run(protocol: Mapping[str, Any], cell: Mapping[str, Any]) -> RecordedRun:
    """A ``benchmarks.compare`` run (built-in image data): the sites as the client script splits them."""
    from benchmarks.compare import Cell, Protocol, cell_spec
    from benchmarks.in_process import site_args
    from data_prep import SiteDataConfig, to_tensor_dataset
    from data_prep.site_config import seed_index
    from data_prep.sites import site_split
    from jobs.build import dataset_num_classes
    from lightning_modules.classifier import FLClassifier
    from lightning_modules.options import json_arg
    from lightning_modules.site import hold_out, pooled_test_set

    spec = cell_spec(Cell(**cell), Protocol(**protocol))
    args = site_args(spec)
    config = SiteDataConfig.from_namespace(args)
    sites = {}
    for i in range(spec.num_sites):
        name = f"site-{i + 1}"
        x, y = site_split(config, name)
        split = hold_out(args, x, y, seed_index(name, spec.num_sites))
        sites[name] = (to_tensor_dataset(split.x, split.y), split.validation, split.test)
    settings = {"lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay}
    classes = dataset_num_classes(spec.dataset)

    def make_module() -> FLClassifier:  # the job's initial model: what its persistor and local-only model build
        return FLClassifier(args.arch, classes, json_arg(args.arch_args), init_seed=args.seed, **settings)

    patience = protocol.get("stop_patience") or 5
    return RecordedRun(sites, pooled_test_set(args), make_module, args.batch_size, spec.num_rounds, patience, spec.seed)


def genotype_run(protocol: Mapping[str, Any], cell: Mapping[str, Any]) -> RecordedRun:
    """A ``benchmarks.genomics`` run: the consortium's data module and model, as its job builds them."""
    from benchmarks import genomics

    settings, run = genomics.Protocol(**protocol), genomics.Cell(**cell)
    modules = genomics._data_modules(run, settings)
    sites = {name: (data.train, data.val, data.test) for name, data in modules.items()}
    pooled = next(iter(modules.values())).pooled

    def make_module() -> Any:
        return genomics._module(settings, run.algorithm, run.seed)

    patience = settings.stop_patience or 5
    return RecordedRun(sites, pooled, make_module, settings.batch_size, settings.rounds, patience, run.seed)


def recorded_run(protocol: Mapping[str, Any], cell: Mapping[str, Any]) -> RecordedRun:
    """The run's harness by its protocol: the genotype harness's names a ``source``."""
    return (genotype_run if "source" in protocol else image_run)(protocol, cell)


def check_sizes(sites: Mapping[str, Sequence[Any]], recorded: Mapping[str, Mapping[str, int]]) -> None:
    """Refuse to read a setting whose rebuilt splits differ from the ones its job recorded."""
    for name, (train, val, test) in sites.items():
        rebuilt = {"train": len(train), "val": len(val), "test": len(test)}
        if dict(recorded.get(name, {})) != rebuilt:
            raise SystemExit(f"error: {name}: rebuilt splits {rebuilt} differ from the recorded {recorded.get(name)}")


def ceiling_cell(
    protocol: Mapping[str, Any], cell: Mapping[str, Any], sizes: Mapping[str, Any], patience: int | None = None
) -> dict[str, Any]:
    """One recorded run's sites under the pooled model and its fine-tuned copies (module docstring); ``patience``
    overrides the job's stopping patience for both."""
    torch.set_num_threads(1)
    run = recorded_run(protocol, cell)
    if patience is not None:
        run = replace(run, patience=patience)
    check_sizes(run.sites, sizes)
    train = ConcatDataset([train for train, _, _ in run.sites.values()])
    val = ConcatDataset([val for _, val, _ in run.sites.values()])
    pooled = early_stopped(run.make_module(), train, val, run.batch_size, run.max_epochs, run.patience, run.seed)
    out: dict[str, Any] = {"pooled_epoch": pooled.epoch, "pooled_epochs_run": pooled.epochs_run, "sites": {}}
    module = run.make_module()
    module.load_state_dict(pooled.state)
    # One model, one pooled test set: scored once, reported in every site's row.
    on_pooled = {} if run.pooled_test is None else {"pooled@pooled": scores(module, run.pooled_test)[1]}
    for index, (name, (train, val, test)) in enumerate(run.sites.items()):
        module = run.make_module()
        module.load_state_dict(pooled.state)
        row = {"pooled": scores(module, test)[1], **on_pooled}
        seed = run.seed * 1000 + index + 1
        tuned = early_stopped(module, train, val, run.batch_size, run.max_epochs, run.patience, seed)
        module.load_state_dict(tuned.state)
        row.update(pooled_finetuned=scores(module, test)[1], finetune_epoch=tuned.epoch)
        if run.pooled_test is not None:
            row["pooled_finetuned@pooled"] = scores(module, run.pooled_test)[1]
        out["sites"][name] = row
    return out


# --------------------------------------------------------------------------------------------------------------------
# A setting: its recorded cells, the replay, and the table
# --------------------------------------------------------------------------------------------------------------------
def recorded_cells(setting: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The setting's protocol and its default's cells (one per training seed)."""
    protocol = json.loads((setting / "protocol.json").read_text())
    cells = [json.loads(path.read_text()) for path in sorted((setting / "cells").glob(f"{DEFAULT}__*.json"))]
    if not cells:
        folder = "a benchmarks.compare or benchmarks.genomics site-gain folder"
        raise SystemExit(f"error: {setting}: no {DEFAULT} cells under cells/ ({folder})")
    return protocol, cells


def run_scores(cells: Sequence[Mapping[str, Any]], ceilings: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """view -> model -> seed -> site -> test accuracy, for the recorded ``local`` and ``kept`` models and the
    replay's `CANDIDATES`."""
    out: dict[str, Any] = {view: {} for view in VIEWS}
    for cell, ceiling in zip(cells, ceilings, strict=True):
        seed = cell["cell"]["seed"]
        for view, suffix in zip(VIEWS, ("", "@pooled"), strict=True):
            for model in ("local", "kept"):
                out[view].setdefault(model, {})[seed] = dict(cell[view][model])
            for model in CANDIDATES[:2]:
                out[view].setdefault(model, {})[seed] = {
                    site: row[model + suffix] for site, row in ceiling["sites"].items() if model + suffix in row
                }
            local = out[view]["local"][seed]
            out[view].setdefault("best_on_test", {})[seed] = {
                site: max(local[site], *(out[view][m][seed][site] for m in CANDIDATES[:2]))
                for site in local
                if all(site in out[view][m][seed] for m in CANDIDATES[:2])
            }
    return out


def gain_summary(by_model: Mapping[str, Any]) -> dict[str, Any]:
    """Per model: its gain over the local-only model in points (mean, t-interval over seeds, worst pair, pairs
    below -2)."""
    summary = {}
    for model, runs in by_model.items():
        if model == "local" or not any(runs.values()):
            continue
        differences = site_stats.paired_differences(runs, by_model["local"])
        interval = site_stats.setting_interval(differences)
        check = site_stats.target_check(runs, by_model["local"])  # the site reports' "below -2" rule
        summary[model] = {
            "mean": 100 * interval.mean,
            "low": 100 * interval.low,
            "high": 100 * interval.high,
            "worst": 100 * site_stats.worst_pair(differences)[2],
            "below_minus_2": len(check.misses),
            "pairs": check.pairs,
        }
    return summary


def ceiling(setting: Path, workers: int, patience: int | None = None) -> dict[str, Any]:
    """Replay one setting (module docstring): every seed's ceiling, the scores, and the gains on both views."""
    protocol, cells = recorded_cells(setting)
    jobs = [(protocol, cell["cell"], cell["site_sizes"], patience) for cell in cells]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        ceilings = list(pool.map(_ceiling_job, jobs))
    scores_by_view = run_scores(cells, ceilings)
    local_own = [v for run in scores_by_view["site_test"]["local"].values() for v in run.values()]
    return {
        "protocol": protocol,
        "patience": patience,
        "runs": ceilings,
        "local_own_test": 100 * float(np.mean(local_own)),
        "gains": {view: gain_summary(scores_by_view[view]) for view in VIEWS},
        "scores": scores_by_view,
    }


def _ceiling_job(job: tuple[Mapping[str, Any], Mapping[str, Any], Mapping[str, Any], int | None]) -> dict[str, Any]:
    from benchmarks.in_process import quiet_lightning

    with quiet_lightning():
        return ceiling_cell(*job)


def fmt(gain: Mapping[str, float] | None) -> str:
    if gain is None:
        return "–"
    return f"{gain['mean']:+.1f} [{gain['low']:+.1f}, {gain['high']:+.1f}]"


def table(found: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The markdown table: per setting, the own-view gains of the recorded kept model and the replay's models, and
    the fine-tuned pooled model's gain on the pooled view."""
    lines = [
        "| setting | (site, seed) pairs | local-only, own test | kept (recorded) | pooled model | pooled, fine-tuned | "
        "fine-tuned: pairs < −2 | best on test (oracle) | pooled view: kept (recorded) | pooled view: fine-tuned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, record in found.items():
        own, pooled = record["gains"]["site_test"], record["gains"]["site_pooled_test"]
        tuned = own["pooled_finetuned"]
        lines.append(
            f"| {name} | {tuned['pairs']} | {record['local_own_test']:.1f} | {fmt(own.get('kept'))} | "
            f"{fmt(own.get('pooled'))} | {fmt(tuned)} | {tuned['below_minus_2']} | {fmt(own.get('best_on_test'))} | "
            f"{fmt(pooled.get('kept'))} | {fmt(pooled.get('pooled_finetuned'))} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", type=Path, help="benchmarks.compare site-gain folders (cells/ inside)")
    parser.add_argument("--workers", type=int, default=2, help="processes, one recorded seed each (default 2)")
    parser.add_argument("--json", type=Path, help="also write every run's per-site scores here")
    parser.add_argument(
        "--patience",
        type=int,
        help="early-stopping patience of the pooled model and the fine-tuning, in epochs (default: the job's "
        "stopping patience, 5 where it has none): a sensitivity check",
    )
    args = parser.parse_args(argv)
    found = {}
    for setting in args.settings:
        found[setting.name] = ceiling(setting, args.workers, args.patience)
        print("\n".join(table({setting.name: found[setting.name]})[2:]), flush=True)
    print("\n".join(table(found)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
