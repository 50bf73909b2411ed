"""Summarise simulator runs from their metrics: a per-round table, the final numbers, and a PNG plot.

    python -m controllers.report /tmp/fl-demo/fedavg                      # one run
    python -m controllers.report WS_A WS_B --labels fedavg scaffold        # side by side, one plot

Reads ``<workspace>/server/simulate_job/metrics/round_metrics.jsonl`` as written by the controller. The NVFlare
simulator exits 0 even when a job aborts, so the report checks that every configured round is in the metrics and
that at least one round aggregated; otherwise it prints why and exits 1 (``make demo`` fails with it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUN_DIR = Path("server") / "simulate_job"
METRICS = RUN_DIR / "metrics" / "round_metrics.jsonl"


def load_records(workspace: Path) -> list[dict[str, Any]]:
    path = workspace / METRICS
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}: did the simulation run with this workspace (-w)?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completion_problems(records: Sequence[dict[str, Any]]) -> list[str]:
    """Why the metrics show an unfinished or useless run: rounds missing, or no round that aggregated."""
    if not records:
        return ["the metrics file is empty: the server stopped before its first round"]
    start = records[0]
    expected = start.get("num_rounds")
    rounds = [r for r in records if r.get("stage") == "round"]
    problems = []
    last = max((r["round"] for r in rounds), default=-1)
    if isinstance(expected, int) and last + 1 < expected:
        problems.append(
            f"the job stopped after round {last + 1} of {expected} (the simulator exits 0 on an abort: "
            "look for the first Error/Traceback in its log)"
        )
    if rounds and not any(r.get("status", "aggregated") == "aggregated" for r in rounds):
        reason = rounds[-1].get("failure") or "no valid result"
        problems.append(f"no round updated the global model (last failure: {reason})")
    return problems


def failed_rounds(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per round that left the global model unchanged, with the engine's reason."""
    return [
        f"round {r['round'] + 1}: {r.get('failure', 'failed')}"
        for r in records
        if r.get("stage") == "round" and r.get("status", "aggregated") != "aggregated"
    ]


def site_eval_metric(records: Sequence[dict[str, Any]]) -> str | None:
    """The site-evaluation metric to show: the first one named like an accuracy, else the first one."""
    names = sorted({name for r in records for name in (r.get("site_eval") or {})})
    return next((n for n in names if "acc" in n.lower()), names[0] if names else None)


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """One line per round. ``site <metric>``: the sites' scores of the global model they received at the start of
    that round on their own validation data: sample-weighted mean, and the worst site's value."""
    metric = site_eval_metric(records)
    site_column = f"  {'site ' + metric + ' mean (worst site)':>36}" if metric else ""
    lines = [f"{'round':>5}  {'test acc':>8}  {'test loss':>9}  {'mean site train loss':>20}{site_column}  rejected"]
    for record in records:
        label = "init" if record["stage"] == "initial" else str(record["round"] + 1)
        losses = [v for v in (record.get("site_train_loss") or {}).values() if v is not None]
        mean_loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        rejected = ",".join(record.get("rejected") or {}) or "-"
        site = ""
        if metric:
            summary = (record.get("site_eval") or {}).get(metric)
            text = f"{summary['mean']:.4f} ({summary['worst']:.4f} {summary['worst_site']})" if summary else "-"
            site = f"  {text:>36}"
        lines.append(
            f"{label:>5}  {_fmt(record.get('test_accuracy')):>8}  {_fmt(record.get('test_loss')):>9}  "
            f"{mean_loss:>20}{site}  {rejected}"
        )
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


def plot_runs(runs: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for label, records in runs.items():
        rounds = [0 if r["stage"] == "initial" else r["round"] + 1 for r in records]
        acc_ax.plot(rounds, [r.get("test_accuracy") for r in records], marker="o", label=label)
        loss_ax.plot(rounds, [r.get("test_loss") for r in records], marker="o", label=label)
    acc_ax.set(xlabel="round", ylabel="global test accuracy", title="Global model accuracy")
    loss_ax.set(xlabel="round", ylabel="global test loss", title="Global model loss")
    for axis in (acc_ax, loss_ax):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controllers.report", description=__doc__.splitlines()[0])
    parser.add_argument("workspaces", nargs="+", type=Path, help="simulator workspaces (the -w folders)")
    parser.add_argument("--labels", nargs="+", help="one label per workspace (default: folder names)")
    parser.add_argument("--plot", type=Path, help="PNG path (default: <first workspace>/round_metrics.png)")
    args = parser.parse_args(argv)
    labels = args.labels or [ws.name for ws in args.workspaces]
    if len(labels) != len(args.workspaces):
        parser.error("give one label per workspace")
    try:
        runs = {label: load_records(ws) for label, ws in zip(labels, args.workspaces, strict=True)}
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for (label, records), workspace in zip(runs.items(), args.workspaces, strict=True):
        final = records[-1]
        print(f"\n== {label}: {workspace}\n{format_table(records)}")
        print(f"final global test accuracy: {_fmt(final.get('test_accuracy'))}")
        metric = site_eval_metric(records)
        if metric:
            last = next(r["site_eval"][metric] for r in reversed(records) if metric in (r.get("site_eval") or {}))
            print(
                f"site {metric} of the last global model the sites received: mean {last['mean']:.4f}, "
                f"worst {last['worst']:.4f} ({last['worst_site']}), spread {last['spread']:.4f}"
            )
        print(f"global model: {workspace / RUN_DIR / 'app_server' / 'FL_global_model.pt'}")
        print(f"metrics:      {workspace / METRICS}")
    plot = plot_runs(runs, args.plot or args.workspaces[0] / "round_metrics.png")
    print(f"plot:         {plot}")
    status = 0
    for label, records in runs.items():
        for line in failed_rounds(records):
            print(f"warning: {label}: {line}", file=sys.stderr)
        for problem in completion_problems(records):
            print(f"error: {label}: {problem}", file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    raise SystemExit(main())
