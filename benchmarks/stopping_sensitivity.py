"""Whether a setting's verdict depends on where the job stops: the shipped keep rule replayed on recorded candidate
tables (benchmarks/keep_rule_study.py), with every recorded round a possible stopping point
(benchmarks/results/site_gain.md, "Does the verdict depend on where the job stops?").

A job reports its sites' kept and own models as they stand after its last round. The stopping rule (the mean kept
validation loss over the sites has not improved for ``--patience`` rounds) decides that round; a target met only
there, and not a few rounds earlier or later, would be a lucky stopping point. So, per setting, the three targets
are checked at the rule's round (each run's own, as the job stopped) and at every fixed round t from
``--from-round`` to the last round every run recorded (every run stopped after t; runs end at their rule's round,
so no fixed round lies beyond the earliest one):

- ``own +3``: the own-view gain (kept − early-stopped local-only on the sites' test splits, the mean over a run's
  sites, then the 95 % t-interval over runs) is +3 points or more with its interval above 0;
- ``no pair < -2``: no (site, seed) pair loses more than 2 points on its own test split;
- ``pooled +15``: the pooled-view gain ("next patient") is +15 points or more on the mean.

Each row gives the verdict at the rule's round and at how many fixed rounds the same verdict holds, among them and
among the last ``--last`` of them (the rounds a job near its stopping point could have ended at; early rounds, before
the federation has learned, rarely meet a target), the range of the own-view and pooled-view gains over the fixed
rounds, and the most pairs below -2 points beyond their test split's noise at any fixed round. ``--plot`` draws both
gains against the fixed stopping round, one line per setting, the rule's rounds marked.

    python -m benchmarks.stopping_sensitivity /tmp/tables/setting-a /tmp/tables/setting-b --json out.json --plot out.png
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from benchmarks.keep_rule_study import (
    RULES,
    recorded_settings_parser,
    replayed_runs,
    stop_round,
    summary_of,
    write_record,
)
from benchmarks.site_report import OWN_GAIN_TARGET, POOLED_GAIN_TARGET

SHIPPED = "margin=1.0"
TARGETS = ("own +3", "no pair < -2", "pooled +15")
#: The site report's gain targets, in points (the summaries here are in points, the report's in fractions).
OWN_TARGET, POOLED_TARGET = 100 * OWN_GAIN_TARGET, 100 * POOLED_GAIN_TARGET

Rows = dict[str, list[dict[str, float]]]  # site -> replay_site rows, one per round


def targets_met(summary: Mapping[str, object]) -> dict[str, bool]:
    """Whether each of `TARGETS` holds for a `keep_rule_study.summary_of` summary (an interval that could not be
    computed, with one run, is not above 0)."""
    mean, low, _ = summary["gain"]
    pooled = summary["pooled"]
    return {
        "own +3": mean >= OWN_TARGET and math.isfinite(low) and low > 0,
        "no pair < -2": summary["below2"] == 0,
        "pooled +15": pooled is not None and pooled[0] >= POOLED_TARGET,
    }


def at_rounds(runs: Sequence[Rows], rounds: Sequence[int]) -> dict[str, object]:
    """The summary of every run stopped after its round in ``rounds`` (0-based, one per run)."""
    return summary_of([[rows[t] for rows in per_site.values()] for per_site, t in zip(runs, rounds, strict=True)])


def sensitivity(setting: Path, patience: int | None, from_round: int = 5, last_window: int = 10) -> dict[str, object]:
    """The setting's verdict at the stopping rule's round and at every fixed round from ``from_round`` (1-based) to
    the last one every run recorded, and among the last ``last_window`` of those (module docstring)."""
    runs = list(replayed_runs(setting, RULES[SHIPPED]).values())
    if not runs:
        raise ValueError(f"{setting}: no recorded federated run")
    stops = [stop_round(per_site, patience) for per_site in runs]
    rule = at_rounds(runs, stops)
    last = min(len(rows) for per_site in runs for rows in per_site.values())
    fixed = {t + 1: at_rounds(runs, [t] * len(runs)) for t in range(min(from_round, last) - 1, last)}
    verdict = targets_met(rule)
    late = [fixed[t] for t in sorted(fixed)[-last_window:]]
    return {
        "rule_rounds": [t + 1 for t in stops],
        "at_rule": rule,
        "met_at_rule": verdict,
        "fixed": fixed,
        "same_verdict": same_verdict(verdict, list(fixed.values())),
        "last_window": len(late),
        "same_verdict_last": same_verdict(verdict, late),
        "most_below2_beyond_noise": max(s["below2"] - s["below2_within_noise"] for s in fixed.values()),
    }


def same_verdict(verdict: Mapping[str, bool], summaries: Sequence[Mapping[str, object]]) -> dict[str, int]:
    """Per target, at how many of ``summaries`` it is met or missed as in ``verdict``."""
    return {name: sum(targets_met(s)[name] == verdict[name] for s in summaries) for name in TARGETS}


def gain_range(summaries: Sequence[Mapping[str, object]], key: str) -> str:
    means = [s[key][0] for s in summaries if s[key] is not None]
    return f"{min(means):+.1f} to {max(means):+.1f}" if means else "–"


def row(name: str, found: Mapping[str, object]) -> str:
    fixed = found["fixed"]
    rounds = f"{min(fixed)}–{max(fixed)}"
    verdicts = " | ".join(
        f"{'met' if found['met_at_rule'][t] else 'not met'}; same at {found['same_verdict'][t]} of {len(fixed)}, "
        f"{found['same_verdict_last'][t]} of the last {found['last_window']}"
        for t in TARGETS
    )
    rule = found["at_rule"]
    own, pooled = rule["gain"][0], rule["pooled"][0] if rule["pooled"] is not None else float("nan")
    return (
        f"| {name} | {', '.join(map(str, found['rule_rounds']))} | {own:+.1f} / {pooled:+.1f} | {rounds} | "
        f"{verdicts} | {gain_range(list(fixed.values()), 'gain')} | {gain_range(list(fixed.values()), 'pooled')} | "
        f"{found['most_below2_beyond_noise']} |"
    )


def plot(found: Mapping[str, Mapping[str, object]], path: Path) -> None:
    """Own-view and pooled-view gain against the fixed stopping round, one line per setting; a dot at each run's
    rule round (the setting's gain there), the targets as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharex=True)
    for ax, key, target, title in (
        (axes[0], "gain", OWN_TARGET, "own view"),
        (axes[1], "pooled", POOLED_TARGET, "pooled view"),
    ):
        for name, setting in found.items():
            fixed = setting["fixed"]
            rounds = [t for t in sorted(fixed) if fixed[t][key] is not None]
            if not rounds:
                continue
            (line,) = ax.plot(rounds, [fixed[t][key][0] for t in rounds], label=name, linewidth=1.2)
            if setting["at_rule"][key] is not None:
                gain = setting["at_rule"][key][0]
                ax.scatter(setting["rule_rounds"], [gain] * len(setting["rule_rounds"]), color=line.get_color(), s=14)
        ax.axhline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_title(f"kept − own, {title} (points; dots: the rule's rounds)")
        ax.set_xlabel("fixed stopping round")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = recorded_settings_parser(__doc__, "every setting's summary at the rule's and at every fixed round")
    parser.add_argument("--from-round", type=int, default=5, help="the first fixed stopping round (1-based)")
    parser.add_argument("--last", type=int, default=10, help="also count the verdicts among the last N fixed rounds")
    parser.add_argument("--plot", type=Path, help="draw both gains against the fixed stopping round here (PNG)")
    args = parser.parse_args(argv)
    for option, value in (("--from-round", args.from_round), ("--last", args.last)):
        if value < 1:
            parser.error(f"{option} must be 1 or more, got {value}")
    header = " | ".join(f"{t}: at the rule's round; same verdict at fixed rounds" for t in TARGETS)
    print(
        f"| setting | rule's rounds | gain at the rule's round, own / pooled | fixed rounds | {header} "
        "| own-view gain over the fixed rounds | pooled-view gain over the fixed rounds "
        "| most pairs < −2 beyond test noise at a fixed round |"
    )
    print("|---|---|---|---|" + "---|" * len(TARGETS) + "---|---|---|")
    record = {}
    for setting in args.settings:
        found = sensitivity(setting, args.patience or None, args.from_round, args.last)
        record[setting.name] = found
        print(row(setting.name, found))
    if args.json:
        write_record(args.json, {"patience": args.patience or None, "rule": SHIPPED, "settings": record})
    if args.plot:
        plot(record, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
