"""Robustness under attack: final global test accuracy per aggregation rule, attack type and share of malicious sites.

    python -m benchmarks.robustness                       # the full grid (45 federations a seed), resumable
    python -m benchmarks.robustness --seeds 0,1,2         # the same grid over three seeds (seed 0's cells reused)
    python -m benchmarks.robustness --quick               # seconds: the smoke run the tests use (a temporary folder)
    python -m benchmarks.robustness --capture-dir DIR     # pretraining data for the attention network instead

A *cell* is one federation: (rule, attack, share of malicious sites, seed). Cells run on the comparison harness
(`benchmarks.compare.run_cells`): ``--workers`` at a time in a process pool, each finished cell written to
``<out-dir>/cells/<key>.json`` at once and never recomputed (kill and rerun to resume, or rerun with more seeds), a
progress bar with the ETA, and a cell that crashes costs only itself. ``<out-dir>/protocol.json`` holds the settings
every cell shares (all but the seed): cells of other settings are refused, never mixed. The report is built from
the cells on disk: a markdown table of final accuracies (mean ± std over the seeds when there are several), the
attack-adaptive targets, and a plot.

Every federation is a `jobs.build.JobSpec` (FedAvg clients, the rule under test, the attack) run by
`benchmarks.in_process.run_in_process`: the same round engine as the NVFlare controller (site sampling,
validation that rejects bad results by site, failure handling) and the same Lightning site round as the client
script, with only NVFlare's messaging left out. The numbers are therefore those the job gives under
``nvflare simulator`` (``tests/e2e/test_e2e_engine_equivalence.py`` checks the two paths bit for bit); the simulator
itself would take hours for the grid on 2 cores. Local training: plain SGD with a fresh optimizer every round,
batch 32, lr 0.1 here so that 15 rounds get far enough.

Every round: all sites train locally from the global model; malicious sites (chosen with the seed) attack from
``--attack-start-round`` on; the rule aggregates the sites' full models; the global model is scored on the first
``--test-samples`` Fashion-MNIST test images.
With ``--capture-dir`` the harness instead records attack-adaptive training data, one federation after the other
in this process: each round an ``attack_adaptive`` rule with ``dataset_capture_dir`` set also sees the accepted
updates (its output is discarded; the trajectory follows the driving rule), over a mix of attacks, strengths and
robust rules (see docs/robustness.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aggregators.attack_adaptive import SHIPPED_CHECKPOINT
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext
from benchmarks.compare import mean_std, require_rounds, run_cells, same_protocol
from benchmarks.in_process import quiet_lightning, run_in_process
from jobs.build import JobSpec
from lightning_modules.attacks import AttackConfig

RULE_LABELS = {
    "fedavg": "FedAvg",
    "attack_adaptive": "attack-adaptive",
    "median": "median",
    "trimmed_mean": "trimmed mean",
    "krum": "Krum",
}
ATTACK_NAMES = ("sign_flip", "scale", "gaussian", "label_flip")
#: Where ``make bench-robust`` keeps its cells (and protocol.json); --quick without --out-dir uses a temporary folder.
DEFAULT_OUT_DIR = Path("benchmarks/results/robustness")

#: (rule, attack, share of malicious sites): one entry of the table, over its seeds.
GridKey = tuple[str, str, float]


@dataclass(frozen=True)
class Settings:
    """What every federation of the grid shares (the seed is the cell's own: adding seeds reuses finished cells)."""

    num_sites: int = 10
    rounds: int = 15
    max_train_samples: int = 3000
    test_samples: int = 1000
    scheme: str = "dirichlet"
    alpha: float = 1.0
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    attack_start_round: int = 0
    attention_model_path: str = SHIPPED_CHECKPOINT


@dataclass(frozen=True)
class RobustnessCell:
    """One federation of the grid; its result is ``<out-dir>/cells/<key>.json``."""

    rule: str
    attack: str
    fraction: float
    seed: int

    @property
    def key(self) -> str:
        return f"{self.rule}__{self.attack}__m{self.fraction:g}__s{self.seed}"

    @property
    def label(self) -> str:
        return f"{self.rule} under {self.attack} at {self.fraction:.0%} malicious, seed {self.seed}"


def rule_args(rule: str, settings: Settings, fraction: float) -> dict[str, Any]:
    """Hyperparameters per rule: the robust rules are told the true share of attackers (their best case)."""
    assumed = max(1, math.floor(fraction * settings.num_sites + 0.5))
    if rule == "trimmed_mean":
        return {"beta": max(0.1, assumed / settings.num_sites)}
    if rule == "krum":
        return {"num_byzantine": assumed, "num_selected": 1}
    if rule == "attack_adaptive":
        return {"attention_model_path": settings.attention_model_path}
    return {}


def federation_spec(
    rule: str, attack: str, fraction: float, settings: Settings, seed: int, strength: float | None = None
) -> JobSpec:
    """One cell of the grid as a job: FedAvg clients, ``rule`` on the server, ``attack`` by a seeded share of sites."""
    return JobSpec(
        name="robustness",
        client="fedavg",
        server=rule,
        server_args=rule_args(rule, settings, fraction),
        num_rounds=settings.rounds,
        num_sites=settings.num_sites,
        max_train_samples=settings.max_train_samples,
        max_test_samples=settings.test_samples,
        scheme=settings.scheme,
        alpha=settings.alpha,
        epochs=settings.epochs,
        batch_size=settings.batch_size,
        lr=settings.lr,
        seed=seed,
        attack=attack,
        attack_strength=strength if attack != "none" else None,
        attack_start_round=settings.attack_start_round,
        malicious_fraction=fraction if attack != "none" else 0.0,
    )


def run_federation(
    rule_name: str,
    attack_name: str,
    fraction: float,
    settings: Settings,
    seed: int,
    strength: float | None = None,
    capture_dir: str | None = None,
) -> list[float]:
    """Test accuracy of the global model after every round (a failed round keeps the previous model's accuracy)."""
    spec = federation_spec(rule_name, attack_name, fraction, settings, seed, strength)
    observers = [CaptureObserver(capture_dir)] if capture_dir is not None else []
    with tempfile.TemporaryDirectory(prefix="fedalg_robustness_") as state_root, quiet_lightning():
        run = run_in_process(spec, Path(state_root), observers=observers)
    for record in run.rounds:
        if record["status"] != "aggregated":
            print(f"round {record['round']}: {record.get('failure')}", file=sys.stderr)
    require_rounds(run.rounds, settings.rounds)
    return [record["test_accuracy"] for record in run.rounds]


def run_robustness_cell(cell: RobustnessCell, settings: Settings, threads: int) -> dict[str, Any]:
    """One federation of the grid (a worker of `benchmarks.compare.run_cells` calls it); the JSON-able result
    written to ``cells/<key>.json``. A federation that crashes or stops early raises: the cell fails."""
    torch.set_num_threads(threads)
    started = time.monotonic()
    accuracies = run_federation(cell.rule, cell.attack, cell.fraction, settings, cell.seed)
    return {
        "cell": asdict(cell),
        "settings": asdict(settings),
        "accuracies": accuracies,  # test accuracy of the global model after every round
        "threads": threads,
        "wall_s": time.monotonic() - started,
    }


def attempt(label: str, failures: list[str], federation: Callable[[], list[float]]) -> list[float] | None:
    """The federation's accuracies, or ``None`` with the reason appended to ``failures``: one capture federation that
    crashes or stops early leaves the others running, and makes `main` exit 1."""
    try:
        return federation()
    except Exception as exc:
        failures.append(f"{label}: {type(exc).__name__}: {exc}")
        print(f"{label}: did not complete: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return None


class CaptureObserver:
    """An ``attack_adaptive`` rule that only records each round's accepted updates (random frozen network: its
    output is unused); the engine calls it before the driving rule aggregates."""

    def __init__(self, capture_dir: str) -> None:
        logging.getLogger("fedalg.attack_adaptive").setLevel(logging.ERROR)  # the random-weights warning is expected
        self.rule = build_rule("attack_adaptive", allow_random_attention=True, dataset_capture_dir=capture_dir)
        self.state: dict[str, Any] | None = None

    def __call__(
        self, round_num: int, params: dict[str, np.ndarray], updates: Sequence[ClientUpdate], context: RoundContext
    ) -> None:
        state = self.rule.init_state(params) if self.state is None else self.state
        try:
            self.state = self.rule.aggregate(params, updates, state, context).state
        except AggregationError as exc:  # e.g. every delta non-finite: nothing to record this round
            print(f"round {round_num}: capture skipped: {exc}", file=sys.stderr)


def scenarios(fractions: Sequence[float], attacks: Sequence[str]) -> list[tuple[str, float]]:
    """(attack, fraction) cells; 0 % malicious is one clean run shared by every attack."""
    cells = [("none", 0.0)] if 0.0 in fractions else []
    return cells + [(a, f) for f in fractions if f > 0 for a in attacks]


def grid_cells(
    rules: Sequence[str], attack_shares: Sequence[tuple[str, float]], seeds: Sequence[int]
) -> list[RobustnessCell]:
    """Every (rule, attack, share, seed) federation, seed by seed (a first pass over the grid finishes early)."""
    return [RobustnessCell(r, a, f, s) for s in seeds for a, f in attack_shares for r in rules]


def run_grid(cells: Sequence[RobustnessCell], settings: Settings, out_dir: Path, workers: int) -> list[str]:
    """Run every cell not yet in ``out_dir/cells`` on the comparison harness; the keys of the cells that failed."""
    cells_dir = out_dir / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    same_protocol(out_dir / "protocol.json", settings, option="--out-dir")
    return run_cells(cells, partial(run_robustness_cell, settings=settings), cells_dir, workers)


def load_results(cells: Iterable[RobustnessCell], out_dir: Path) -> list[dict[str, Any]]:
    """The finished results of ``cells`` in ``out_dir/cells`` (a failed or missing cell is left out)."""
    paths = [out_dir / "cells" / f"{cell.key}.json" for cell in cells]
    return [json.loads(path.read_text()) for path in paths if path.exists()]


def final_accuracies(results: Iterable[Mapping[str, Any]]) -> dict[GridKey, dict[int, float]]:
    """Final test accuracy by (rule, attack, share), then by seed, from cell results."""
    finals: dict[GridKey, dict[int, float]] = defaultdict(dict)
    for result in results:
        cell = result["cell"]
        finals[(cell["rule"], cell["attack"], float(cell["fraction"]))][int(cell["seed"])] = result["accuracies"][-1]
    return dict(finals)


def seeds_of(finals: Mapping[GridKey, Mapping[int, float]]) -> list[int]:
    return sorted({seed for by_seed in finals.values() for seed in by_seed})


def markdown_table(finals: Mapping[GridKey, Mapping[int, float]], rules: Sequence[str]) -> str:
    """Rows = (attack, share malicious), columns = rules, cells = final test accuracy in %: the value for one seed,
    mean ± std over several (an entry with fewer seeds than the table names its count)."""
    seeds = len(seeds_of(finals))
    header = "| attack | malicious | " + " | ".join(RULE_LABELS.get(r, r) for r in rules) + " |"
    lines = [header, "|---|---|" + "---|" * len(rules)]
    cells = sorted({(a, f) for (_, a, f) in finals}, key=lambda c: (c[1], c[0]))
    for attack, fraction in cells:
        text = []
        for rule in rules:
            by_seed = finals.get((rule, attack, fraction))
            if not by_seed:
                text.append("–")
                continue
            mean, std = mean_std(by_seed.values())
            value = f"{100 * mean:.1f}" if seeds == 1 else f"{100 * mean:.1f} ± {100 * std:.1f}"
            text.append(value if len(by_seed) == seeds else f"{value} ({len(by_seed)} of {seeds} seeds)")
        lines.append(f"| {attack} | {fraction:.0%} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def seeds_line(finals: Mapping[GridKey, Mapping[int, float]]) -> str:
    """The table's caption: how many seeds it stands on."""
    seeds = seeds_of(finals)
    if len(seeds) == 1:
        return f"Final global test accuracy (%), one seed ({seeds[0]}):"
    return f"Final global test accuracy (%), mean ± std over {len(seeds)} seeds ({', '.join(map(str, seeds))}):"


def target_check(finals: Mapping[GridKey, Mapping[int, float]], rules: Sequence[str]) -> list[str]:
    """Attack-adaptive vs the target of ≤ 3 points below clean at ≤ 20 % malicious and ≤ 2 below the best classical
    (means over the seeds)."""
    aaa = "attack_adaptive"
    if aaa not in rules or not finals.get((aaa, "none", 0.0)):
        return []
    means = {key: mean_std(by_seed.values())[0] for key, by_seed in finals.items() if by_seed}
    clean = means[(aaa, "none", 0.0)]
    lines = []
    for (rule, attack, fraction), acc in sorted(means.items()):
        if rule != aaa or fraction == 0:
            continue
        classical = [
            means[(r, attack, fraction)] for r in rules if r not in (aaa, "fedavg") and (r, attack, fraction) in means
        ]
        best = max(classical) if classical else float("nan")
        drop = 100 * (clean - acc)
        gap = 100 * (best - acc)
        ok_drop = drop <= 3 or fraction > 0.2
        lines.append(
            f"- {attack} {fraction:.0%}: {100 * acc:.1f} (clean {100 * clean:.1f}, drop {drop:+.1f} pts"
            f"{'' if fraction > 0.2 else (' ✓' if ok_drop else ' ✗ target ≤ 3')}); best classical {100 * best:.1f} "
            f"(gap {gap:+.1f} pts {'✓' if gap <= 2 else '✗ target ≤ 2'})"
        )
    return lines


def save_plot(finals: Mapping[GridKey, Mapping[int, float]], rules: Sequence[str], path: Path) -> Path:
    """One panel per attack: final accuracy vs share of malicious sites, one line per rule (mean over the seeds,
    error bars ± std when there are several)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = sorted({a for (_, a, f) in finals if f > 0})
    fig, axes = plt.subplots(1, max(1, len(attacks)), figsize=(4 * max(1, len(attacks)), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, attack in zip(axes, attacks, strict=False):
        for rule in rules:
            shown = [(f, v) for (r, a, f), v in finals.items() if r == rule and a in (attack, "none") and v]
            points = sorted((f, *mean_std(v.values())) for f, v in shown)
            if points:
                ax.errorbar(
                    [100 * f for f, _, _ in points],
                    [100 * m for _, m, _ in points],
                    yerr=[100 * s for _, _, s in points] if len(seeds_of(finals)) > 1 else None,
                    marker="o",
                    capsize=3,
                    label=RULE_LABELS.get(rule, rule),
                )
        ax.set_title(attack)
        ax.set_xlabel("malicious sites (%)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final test accuracy (%)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_report(
    results: Sequence[Mapping[str, Any]], rules: Sequence[str], settings: Settings, wall: str
) -> tuple[str, dict[GridKey, dict[int, float]]]:
    """The markdown report of the finished cells, and their final accuracies (what the table and plot show)."""
    finals = final_accuracies(results)
    if not finals:
        return f"Settings: {settings}\n{wall}\n\nNo finished federation.", finals
    report = [
        f"Settings: {settings}",
        wall,
        "",
        seeds_line(finals),
        "",
        markdown_table(finals, rules),
        "",
        *target_check(finals, rules),
    ]
    return "\n".join(report), finals


def capture(
    settings: Settings,
    seed: int,
    capture_dir: str,
    rules: Sequence[str],
    fractions: Sequence[float],
    log: Any,
    failures: list[str] | None = None,
) -> None:
    """Record pretraining data: every attack × share × driving rule, with attack strengths varied by a seeded draw,
    one federation after the other (they write into one dataset folder); a federation that did not complete is
    named in ``failures``."""
    rng = np.random.default_rng(seed)
    failures = [] if failures is None else failures
    for attack_name, fraction in scenarios(fractions, ATTACK_NAMES):
        for rule in rules:
            multiplier = float(rng.choice([0.5, 1.0, 2.0]))
            strength = AttackConfig(name=attack_name).effective_strength * multiplier
            label = f"capture {attack_name} {fraction:.0%} x{multiplier} via {rule}, seed {seed}"
            federation = partial(run_federation, rule, attack_name, fraction, settings, seed, strength, capture_dir)
            accs = attempt(label, failures, federation)
            if accs is not None:
                print(f"{label}: final acc {accs[-1]:.4f}", file=log, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.robustness", description=__doc__.splitlines()[0])
    defaults = Settings()
    parser.add_argument(
        "--rules", default="fedavg,attack_adaptive,median,trimmed_mean,krum", help="comma-separated rule names"
    )
    parser.add_argument("--attacks", default=",".join(ATTACK_NAMES), help="comma-separated attacks")
    parser.add_argument("--fractions", default="0,0.2,0.4", help="comma-separated shares of malicious sites")
    parser.add_argument("--rounds", type=int, default=defaults.rounds)
    parser.add_argument("--num-sites", type=int, default=defaults.num_sites)
    parser.add_argument("--max-train-samples", type=int, default=defaults.max_train_samples)
    parser.add_argument("--test-samples", type=int, default=defaults.test_samples)
    parser.add_argument(
        "--alpha", type=float, default=defaults.alpha, help="Dirichlet concentration of the label split"
    )
    seeds = parser.add_mutually_exclusive_group()
    seeds.add_argument(
        "--seeds",
        default="0",
        help="comma-separated seeds (data split, model, malicious sites, noise); the table is the mean over them "
        "(default: 0)",
    )
    seeds.add_argument("--seed", type=int, default=None, help="one seed: the same as --seeds N")
    parser.add_argument("--attack-start-round", type=int, default=defaults.attack_start_round)
    parser.add_argument("--attention-model-path", default=defaults.attention_model_path)
    parser.add_argument("--quick", action="store_true", help="tiny smoke settings (seconds)")
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help=f"folder for cells/ and protocol.json: finished cells are reused (default: {DEFAULT_OUT_DIR}; "
        "a temporary folder with --quick)",
    )
    parser.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="federations run at once (default: cores)"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG) here")
    parser.add_argument(
        "--capture-dir", default=None, help="record attention pretraining data here instead (sequential)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads with --capture-dir (grid cells get cores ÷ workers each)",
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    settings = Settings(
        num_sites=args.num_sites,
        rounds=args.rounds,
        max_train_samples=args.max_train_samples,
        test_samples=args.test_samples,
        alpha=args.alpha,
        attack_start_round=args.attack_start_round,
        attention_model_path=args.attention_model_path,
    )
    if args.quick:
        settings = replace(settings, num_sites=5, rounds=2, max_train_samples=500, test_samples=200)
    return settings


def seeds_from_args(args: argparse.Namespace) -> list[int]:
    seeds = [args.seed] if args.seed is not None else [int(s) for s in args.seeds.split(",") if s]
    if not seeds or len(set(seeds)) != len(seeds):
        raise SystemExit(f"error: --seeds needs distinct seeds, got {args.seeds!r}")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from_args(args)
    seeds = seeds_from_args(args)
    rules = [r for r in args.rules.split(",") if r]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    attacks = [a for a in args.attacks.split(",") if a]
    started = time.monotonic()
    if args.capture_dir:
        torch.set_num_threads(args.threads)
        failures: list[str] = []
        for seed in seeds:
            capture(settings, seed, args.capture_dir, rules, fractions, sys.stderr, failures)
        print(f"captured into {args.capture_dir} in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return exit_status(failures)
    cells = grid_cells(rules, scenarios(fractions, attacks), seeds)
    workers = max(1, args.workers)
    with contextlib.ExitStack() as stack:
        out_dir = args.out_dir
        if out_dir is None:
            temporary = partial(tempfile.TemporaryDirectory, prefix="fedalg_robustness_quick_")
            out_dir = Path(stack.enter_context(temporary())) if args.quick else DEFAULT_OUT_DIR
        failed = set(run_grid(cells, settings, out_dir, workers))
        results = load_results(cells, out_dir)
    cell_time = sum(r["wall_s"] for r in results)
    wall = (
        f"Wall time: {time.monotonic() - started:.0f} s on {workers} worker(s); the {len(results)} federations "
        f"took {cell_time:.0f} s in all (cells finished by earlier runs included)"
    )
    report, finals = build_report(results, rules, settings, wall)
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")
    if args.plot and finals:
        save_plot(finals, rules, args.plot)
    return exit_status([f"{cell.key} ({cell.label})" for cell in cells if cell.key in failed])


def exit_status(failures: Sequence[str]) -> int:
    """1 with every reason on stderr when a federation did not complete (its numbers are missing), else 0."""
    for failure in failures:
        print(f"error: federation did not complete: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
