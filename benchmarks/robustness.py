"""Robustness under attack: final global test accuracy per aggregation rule, attack type and share of malicious sites.

    python -m benchmarks.robustness                       # the full grid (45 federations)
    python -m benchmarks.robustness --quick               # seconds: the smoke run the tests use
    python -m benchmarks.robustness --capture-dir DIR     # pretraining data for the attention network instead

Every federation is a :class:`jobs.build.JobSpec` (FedAvg clients, the rule under test, the attack) run in this
process by :func:`controllers.in_process.run_in_process`: the same round engine as the NVFlare controller (site
sampling, validation that rejects bad results by site, failure handling) and the same Lightning site round as the
client script, with only NVFlare's messaging left out. The numbers are therefore those the job gives under
``nvflare simulator`` (``tests/e2e/test_e2e_engine_equivalence.py`` checks the two paths bit for bit); the simulator
itself would take hours for the grid on 2 cores. Local training: plain SGD with a fresh optimizer every round,
batch 32, lr 0.1 here so that 15 rounds get far enough.

Every round: all sites train locally from the global model; malicious sites (chosen with the seed) attack from
``--attack-start-round`` on; the rule aggregates the sites' full models; the global model is scored on the first
``--test-samples`` Fashion-MNIST test images. The report is a markdown table of final accuracies and a plot.
With ``--capture-dir`` the harness instead records attack-adaptive training data: each round an ``attack_adaptive``
rule with ``dataset_capture_dir`` set also sees the accepted updates (its output is discarded; the trajectory
follows the driving rule), over a mix of attacks, strengths and robust rules (see docs/robustness.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aggregators import AggregationError, ClientUpdate, RoundContext, build_rule
from aggregators.attack_adaptive import SHIPPED_CHECKPOINT
from controllers.in_process import quiet_lightning, run_in_process
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


@dataclass(frozen=True)
class Settings:
    """One federation's settings (shared by every cell of the grid)."""

    num_sites: int = 10
    rounds: int = 15
    max_train_samples: int = 3000
    test_samples: int = 1000
    scheme: str = "dirichlet"
    alpha: float = 1.0
    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    seed: int = 0
    attack_start_round: int = 0
    attention_model_path: str = SHIPPED_CHECKPOINT


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
    rule: str, attack: str, fraction: float, settings: Settings, strength: float | None = None
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
        seed=settings.seed,
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
    strength: float | None = None,
    capture_dir: str | None = None,
) -> list[float]:
    """Test accuracy of the global model after every round (a failed round keeps the previous model's accuracy)."""
    spec = federation_spec(rule_name, attack_name, fraction, settings, strength)
    observers = [CaptureObserver(capture_dir)] if capture_dir is not None else []
    with tempfile.TemporaryDirectory(prefix="fedalg_robustness_") as state_root, quiet_lightning():
        run = run_in_process(spec, Path(state_root), observers=observers)
    for record in run.rounds:
        if record["status"] != "aggregated":
            print(f"round {record['round']}: {record.get('failure')}", file=sys.stderr)
    if len(run.rounds) < settings.rounds:  # a table cell must come from the rounds it claims
        raise IncompleteFederation(f"{len(run.rounds)} round record(s) of {settings.rounds} planned")
    return [record["test_accuracy"] for record in run.rounds]


class IncompleteFederation(RuntimeError):
    """A federation that recorded fewer rounds than planned."""


def attempt(label: str, failures: list[str], federation: Callable[[], list[float]]) -> list[float] | None:
    """The federation's accuracies, or ``None`` with the reason appended to ``failures``: one federation that
    crashes or stops early leaves the rest of the grid running, and makes :func:`main` exit 1."""
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


def run_grid(
    rules: Sequence[str],
    cells: Sequence[tuple[str, float]],
    settings: Settings,
    log: Any = sys.stderr,
    failures: list[str] | None = None,
) -> dict[tuple[str, str, float], list[float]]:
    """Every (rule, attack, share) federation; one that did not complete is left out of the results (its table
    cell shows "–") and named in ``failures``."""
    results: dict[tuple[str, str, float], list[float]] = {}
    failures = [] if failures is None else failures
    for attack_name, fraction in cells:
        for rule in rules:
            started = time.monotonic()
            label = f"{rule} under {attack_name} at {fraction:.0%} malicious"
            accs = attempt(label, failures, partial(run_federation, rule, attack_name, fraction, settings))
            if accs is None:
                continue
            results[(rule, attack_name, fraction)] = accs
            acc = accs[-1]
            print(
                f"{attack_name:>10} {fraction:4.0%} {rule:>15}: {acc:.4f} ({time.monotonic() - started:.1f} s)",
                file=log,
                flush=True,
            )
    return results


def markdown_table(results: dict[tuple[str, str, float], list[float]], rules: Sequence[str]) -> str:
    """Rows = (attack, share malicious), columns = rules, cells = final test accuracy in %."""
    header = "| attack | malicious | " + " | ".join(RULE_LABELS.get(r, r) for r in rules) + " |"
    lines = [header, "|---|---|" + "---|" * len(rules)]
    cells = sorted({(a, f) for (_, a, f) in results}, key=lambda c: (c[1], c[0]))
    for attack, fraction in cells:
        values = [results.get((rule, attack, fraction)) for rule in rules]
        text = [f"{100 * v[-1]:.1f}" if v else "–" for v in values]
        lines.append(f"| {attack} | {fraction:.0%} | " + " | ".join(text) + " |")
    return "\n".join(lines)


def target_check(results: dict[tuple[str, str, float], list[float]], rules: Sequence[str]) -> list[str]:
    """Attack-adaptive vs the target of ≤ 3 points below clean at ≤ 20 % malicious and ≤ 2 below the best classical."""
    aaa = "attack_adaptive"
    if aaa not in rules or (aaa, "none", 0.0) not in results:
        return []
    clean = results[(aaa, "none", 0.0)][-1]
    lines = []
    for (rule, attack, fraction), accs in sorted(results.items()):
        if rule != aaa or fraction == 0:
            continue
        classical = [
            results[(r, attack, fraction)][-1]
            for r in rules
            if r not in (aaa, "fedavg") and (r, attack, fraction) in results
        ]
        best = max(classical) if classical else float("nan")
        drop = 100 * (clean - accs[-1])
        gap = 100 * (best - accs[-1])
        ok_drop = drop <= 3 or fraction > 0.2
        lines.append(
            f"- {attack} {fraction:.0%}: {100 * accs[-1]:.1f} (clean {100 * clean:.1f}, drop {drop:+.1f} pts"
            f"{'' if fraction > 0.2 else (' ✓' if ok_drop else ' ✗ target ≤ 3')}); best classical {100 * best:.1f} "
            f"(gap {gap:+.1f} pts {'✓' if gap <= 2 else '✗ target ≤ 2'})"
        )
    return lines


def save_plot(results: dict[tuple[str, str, float], list[float]], rules: Sequence[str], path: Path) -> Path:
    """One panel per attack: final accuracy vs share of malicious sites, one line per rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = sorted({a for (_, a, f) in results if f > 0})
    fig, axes = plt.subplots(1, max(1, len(attacks)), figsize=(4 * max(1, len(attacks)), 3.4), sharey=True)
    axes = np.atleast_1d(axes)
    for ax, attack in zip(axes, attacks, strict=False):
        for rule in rules:
            points = sorted((f, v[-1]) for (r, a, f), v in results.items() if r == rule and a in (attack, "none"))
            if points:
                ax.plot(
                    [100 * f for f, _ in points],
                    [100 * v for _, v in points],
                    marker="o",
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


def capture(
    settings: Settings,
    capture_dir: str,
    rules: Sequence[str],
    fractions: Sequence[float],
    log: Any,
    failures: list[str] | None = None,
) -> None:
    """Record pretraining data: every attack × share × driving rule, with attack strengths varied by a seeded draw;
    a federation that did not complete is named in ``failures``."""
    rng = np.random.default_rng(settings.seed)
    failures = [] if failures is None else failures
    for attack_name, fraction in scenarios(fractions, ATTACK_NAMES):
        for rule in rules:
            multiplier = float(rng.choice([0.5, 1.0, 2.0]))
            strength = AttackConfig(name=attack_name).effective_strength * multiplier
            label = f"capture {attack_name} {fraction:.0%} x{multiplier} via {rule}"
            federation = partial(run_federation, rule, attack_name, fraction, settings, strength, capture_dir)
            accs = attempt(label, failures, federation)
            if accs is None:
                continue
            print(
                f"capture {attack_name} {fraction:.0%} x{multiplier} via {rule}: final acc {accs[-1]:.4f}",
                file=log,
                flush=True,
            )


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
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="seeds data split, model, malicious sites, noise"
    )
    parser.add_argument("--attack-start-round", type=int, default=defaults.attack_start_round)
    parser.add_argument("--attention-model-path", default=defaults.attention_model_path)
    parser.add_argument("--quick", action="store_true", help="tiny smoke settings (seconds)")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown report here")
    parser.add_argument("--plot", type=Path, default=None, help="write the plot (PNG) here")
    parser.add_argument("--capture-dir", default=None, help="record attention pretraining data here instead")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    settings = Settings(
        num_sites=args.num_sites,
        rounds=args.rounds,
        max_train_samples=args.max_train_samples,
        test_samples=args.test_samples,
        alpha=args.alpha,
        seed=args.seed,
        attack_start_round=args.attack_start_round,
        attention_model_path=args.attention_model_path,
    )
    if args.quick:
        settings = replace(settings, num_sites=5, rounds=2, max_train_samples=500, test_samples=200)
    return settings


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    rules = [r for r in args.rules.split(",") if r]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    attacks = [a for a in args.attacks.split(",") if a]
    started = time.monotonic()
    failures: list[str] = []
    if args.capture_dir:
        capture(settings, args.capture_dir, rules, fractions, sys.stderr, failures)
        print(f"captured into {args.capture_dir} in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return exit_status(failures)
    results = run_grid(rules, scenarios(fractions, attacks), settings, failures=failures)
    report = "\n".join(
        [
            f"Settings: {settings}",
            f"Wall time: {time.monotonic() - started:.0f} s ({torch.get_num_threads()} torch thread(s))",
            "",
            "Final global test accuracy (%):",
            "",
            markdown_table(results, rules),
            "",
            *target_check(results, rules),
        ]
    )
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")
    if args.plot:
        save_plot(results, rules, args.plot)
    return exit_status(failures)


def exit_status(failures: Sequence[str]) -> int:
    """1 with every reason on stderr when a federation did not complete (its numbers are missing), else 0."""
    for failure in failures:
        print(f"error: federation did not complete: {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
