"""Robustness under attack: final global test accuracy per aggregation rule, attack type and share of malicious sites.

    python -m benchmarks.robustness                       # the full grid (45 federations, about 20 min)
    python -m benchmarks.robustness --quick               # seconds: the smoke run the tests use
    python -m benchmarks.robustness --capture-dir DIR     # pretraining data for the attention network instead

An in-process harness, not ``nvflare simulator``: through the simulator the grid would take hours on 2 cores. It
reuses exactly the bundle's pieces — the rule classes (``aggregators.build_rule``), the attack functions
(``lightning_modules.attacks``), the data partitioner (``data_prep.site_split``) and the model (``FLClassifier``,
same state-dict keys as the jobs) — and replaces only NVFlare's messaging and Lightning's loop with a plain SGD
loop (plain SGD as in ``jobs/client.py``, a fresh optimizer every round; batch 32, lr 0.1 here so that 15
rounds get far enough).

Every round: all sites train locally from the global model; malicious sites (chosen with the seed) attack from
``--attack-start-round`` on; the rule aggregates the clients' full models; the global model is scored on the first
``--test-samples`` Fashion-MNIST test images. The report is a markdown table of final accuracies and a plot.
With ``--capture-dir`` the harness instead records attack-adaptive training data: each round it also calls an
``attack_adaptive`` rule with ``dataset_capture_dir`` set (its output is discarded; the trajectory follows the
driving rule), over a mix of attacks, strengths and robust rules (see docs/robustness.md).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from aggregators import AggregationError, ClientUpdate, RoundContext, build_rule, meta_keys
from aggregators.attack_adaptive import SHIPPED_CHECKPOINT
from data_prep import SiteDataConfig, load_dataset, site_split
from lightning_modules.attacks import (
    UPDATE_ATTACKS,
    AttackConfig,
    attacked_params,
    choose_malicious_sites,
    site_labels,
)
from lightning_modules.classifier import FLClassifier
from lightning_modules.evaluation import evaluate_classifier

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


def local_train(
    model: FLClassifier, x: torch.Tensor, y: torch.Tensor, settings: Settings, seed: int
) -> dict[str, np.ndarray]:
    """E epochs of plain SGD (fresh optimizer, shuffled batches) on the model; returns its state as numpy."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.net.parameters(), lr=settings.lr)
    model.train()
    for _ in range(settings.epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), settings.batch_size):
            batch = order[start : start + settings.batch_size]
            optimizer.zero_grad()
            F.cross_entropy(model.net(x[batch]), y[batch]).backward()
            optimizer.step()
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def site_data(settings: Settings) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    config = SiteDataConfig(
        "fashion_mnist",
        settings.scheme,
        num_sites=settings.num_sites,
        seed=settings.seed,
        alpha=settings.alpha,
        max_train_samples=settings.max_train_samples,
    )
    return {f"site-{i + 1}": site_split(config, f"site-{i + 1}") for i in range(settings.num_sites)}


def client_update(
    model: FLClassifier,
    global_params: dict[str, np.ndarray],
    data: tuple[np.ndarray, np.ndarray],
    site: str,
    round_num: int,
    attack: AttackConfig,
    settings: Settings,
) -> ClientUpdate:
    """One site's round: load the global model, train (on flipped labels if so attacked), attack the update."""
    index = int(site.split("-")[1]) - 1
    model.load_state_dict({key: torch.from_numpy(value.copy()) for key, value in global_params.items()})
    x, y = data
    labels = site_labels(y, attack, site, round_num)
    seed = int(np.random.SeedSequence([settings.seed, index, round_num]).generate_state(1)[0])
    params = local_train(model, torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64)), settings, seed)
    active = attack.active(site, round_num)
    if active and attack.name in UPDATE_ATTACKS:
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        current = {key: torch.from_numpy(params[key]) for key in trainable}
        start = {key: torch.from_numpy(global_params[key]) for key in trainable}
        params.update(
            {
                k: v.numpy()
                for k, v in attacked_params(current, start, attack, attack.generator(index, round_num)).items()
            }
        )
    meta = {meta_keys.ATTACK_APPLIED: active, meta_keys.ATTACK_NAME: attack.name if active else "none"}
    return ClientUpdate(site=site, params=params, num_samples=len(y), meta=meta)


def run_federation(
    rule_name: str,
    attack: AttackConfig,
    settings: Settings,
    fraction: float,
    data: dict[str, tuple[np.ndarray, np.ndarray]],
    test: tuple[np.ndarray, np.ndarray],
    capture_dir: str | None = None,
) -> list[float]:
    """Test accuracy of the global model after every round."""
    torch.manual_seed(settings.seed)
    model = FLClassifier(arch="lenet5", num_classes=10, init_seed=settings.seed)
    global_params = {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}
    rule = build_rule(rule_name, **rule_args(rule_name, settings, fraction))
    state = rule.init_state(global_params)
    recorder = capture_rule(capture_dir, global_params)
    population = tuple(sorted(data))
    accuracies = []
    for round_num in range(settings.rounds):
        updates = [client_update(model, global_params, data[s], s, round_num, attack, settings) for s in population]
        context = RoundContext(round_num=round_num, num_rounds=settings.rounds, population=population)
        if recorder is not None:
            recorder[1] = aggregate_or_keep(recorder[0], global_params, updates, recorder[1], context)[1]
        global_params, state = aggregate_or_keep(rule, global_params, updates, state, context)
        model.load_state_dict({key: torch.from_numpy(value.copy()) for key, value in global_params.items()})
        accuracies.append(evaluate_classifier(model.net, test[0], test[1], 10)["test_accuracy"])
    return accuracies


def aggregate_or_keep(rule: Any, global_params, updates, state, context) -> tuple[dict[str, np.ndarray], Any]:
    """As the controller does: a round the rule refuses (e.g. every delta non-finite) leaves the model unchanged."""
    try:
        result = rule.aggregate(global_params, updates, state, context)
    except AggregationError as exc:
        print(f"round {context.round_num}: {rule.name} refused the round, model kept: {exc}", file=sys.stderr)
        return global_params, state
    return result.params, result.state


def capture_rule(capture_dir: str | None, global_params: dict[str, np.ndarray]) -> list[Any] | None:
    """[rule, state] of an attack-adaptive rule that only records (random frozen network: its output is unused)."""
    if capture_dir is None:
        return None
    logging.getLogger("fedalg.attack_adaptive").setLevel(logging.ERROR)  # the random-weights warning is expected
    rule = build_rule("attack_adaptive", allow_random_attention=True, dataset_capture_dir=capture_dir)
    return [rule, rule.init_state(global_params)]


def scenarios(fractions: Sequence[float], attacks: Sequence[str]) -> list[tuple[str, float]]:
    """(attack, fraction) cells; 0 % malicious is one clean run shared by every attack."""
    cells = [("none", 0.0)] if 0.0 in fractions else []
    return cells + [(a, f) for f in fractions if f > 0 for a in attacks]


def run_grid(
    rules: Sequence[str], cells: Sequence[tuple[str, float]], settings: Settings, log: Any = sys.stderr
) -> dict[tuple[str, str, float], list[float]]:
    data = site_data(settings)
    test = load_test(settings.test_samples)
    results: dict[tuple[str, str, float], list[float]] = {}
    for attack_name, fraction in cells:
        attack = make_attack(attack_name, fraction, settings)
        for rule in rules:
            started = time.monotonic()
            results[(rule, attack_name, fraction)] = run_federation(rule, attack, settings, fraction, data, test)
            acc = results[(rule, attack_name, fraction)][-1]
            print(
                f"{attack_name:>10} {fraction:4.0%} {rule:>15}: {acc:.4f} ({time.monotonic() - started:.1f} s)",
                file=log,
                flush=True,
            )
    return results


def make_attack(name: str, fraction: float, settings: Settings, strength: float | None = None) -> AttackConfig:
    sites = choose_malicious_sites(settings.num_sites, fraction, settings.seed) if name != "none" else ()
    return AttackConfig(
        name=name, malicious_sites=sites, strength=strength, start_round=settings.attack_start_round, seed=settings.seed
    )


def load_test(limit: int) -> tuple[np.ndarray, np.ndarray]:
    data = load_dataset("fashion_mnist")
    return np.array(data.test_x[:limit], copy=True), np.array(data.test_y[:limit], copy=True)  # writable copies


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
    """The issue's targets for attack-adaptive, one line per (attack, share) at 20 % and clean accuracy."""
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


def capture(settings: Settings, capture_dir: str, rules: Sequence[str], fractions: Sequence[float], log: Any) -> None:
    """Record pretraining data: every attack × share × driving rule, with attack strengths varied by a seeded draw."""
    data = site_data(settings)
    test = load_test(settings.test_samples)
    rng = np.random.default_rng(settings.seed)
    for attack_name, fraction in scenarios(fractions, ATTACK_NAMES):
        for rule in rules:
            multiplier = float(rng.choice([0.5, 1.0, 2.0]))
            base = AttackConfig(name=attack_name).effective_strength
            attack = make_attack(attack_name, fraction, settings, strength=base * multiplier)
            accs = run_federation(rule, attack, settings, fraction, data, test, capture_dir=capture_dir)
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
    if args.capture_dir:
        capture(settings, args.capture_dir, rules, fractions, sys.stderr)
        print(f"captured into {args.capture_dir} in {time.monotonic() - started:.0f} s", file=sys.stderr)
        return 0
    results = run_grid(rules, scenarios(fractions, attacks), settings)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
