"""SCAFFOLD's control variates round by round, from finished comparison cells: where a collapse starts.

    python -m benchmarks.compare --out runs/scaf_lr05 --algorithms scaffold --partitions dir0.1 \\
        --participations 1 --seeds 2 --rounds 20
    python -m benchmarks.scaffold_diagnostics runs/scaf_lr05 --labels "lr 0.05" --plot diagnostics.png

For every cell (one seed of one run): the global test accuracy, the server's ||c|| and every site's ||c_i|| per
round (log scale), and a table naming, per cell, the first site whose ||c_i|| jumped by more than
``controllers.report.CONTROL_RUNAWAY_FACTOR`` in a round, with its sample count and optimizer steps per round.

    python -m benchmarks.scaffold_diagnostics --genomics runs/gen_1kg

``--genomics``: the folders are ``benchmarks.genomics`` outputs; prints, per split, the control norms of its SCAFFOLD
cells at selected rounds (||c||, the largest site's ||c_i||, the sites' mean ||delta c_i||; mean over the seeds)
and each cell's first runaway, with the same check as ``python -m controllers.report``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controllers.report import GLOBAL_CONTROL_NORM, LOCAL_NORM, control_runaways


def load(folder: Path) -> list[dict[str, Any]]:
    """The folder's SCAFFOLD cells: those whose rounds report a global control (a comparison run mixes algorithms)."""
    cells = [json.loads(path.read_text()) for path in sorted((folder / "cells").glob("*.json"))]
    scaffold = [
        cell for cell in cells if any(GLOBAL_CONTROL_NORM in (r.get("rule_diagnostics") or {}) for r in rounds_of(cell))
    ]
    if not scaffold:
        raise SystemExit(
            f"error: no finished SCAFFOLD cells in {folder / 'cells'} ({len(cells)} cells of other algorithms)"
        )
    return scaffold


def rounds_of(cell: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in cell["records"] if r.get("stage") == "round"]


def first_runaway(cell: dict[str, Any]) -> str:
    """'round R: site (n samples, k steps/round), ||c_i|| a -> b', or 'none'."""
    rounds = rounds_of(cell)
    lines = control_runaways(rounds)
    if not lines:
        return "none"
    round_num = int(lines[0].split(":")[0].split()[1]) - 1
    site = lines[0].split(": ", 1)[1].split("'s")[0]
    record = next(r for r in rounds if r["round"] == round_num)
    samples, steps = record["site_num_samples"][site], record["site_num_steps"][site]
    jump = lines[0].split("jumped from ")[1].split(":")[0]
    return f"round {round_num + 1}: {site} ({samples} samples, {steps} steps/round), ||c_i|| {jump}"


def genomics_records(cell: dict[str, Any]) -> list[dict[str, Any]]:
    """A genomics cell's per-round site norms as the round records ``control_runaways`` reads."""
    return [
        {"round": r, "site_meta": {site: {LOCAL_NORM: norm} for site, norm in norms.items()}}
        for r, norms in enumerate(cell.get("control_local_norm") or [])
    ]


def genomics_control_table(folder: Path, algorithm: str = "scaffold") -> list[str]:
    """Markdown: per split, ||c||, the largest ||c_i|| and the mean ||delta c_i|| at selected rounds (mean over the
    seeds), then each seed's first runaway."""
    cells = [json.loads(path.read_text()) for path in sorted((folder / "cells").glob(f"{algorithm}__*.json"))]
    lines = []
    for split in sorted({cell["cell"]["split"] for cell in cells}):
        ours = sorted((c for c in cells if c["cell"]["split"] == split), key=lambda c: c["cell"]["seed"])
        total = min(len(c["control_global_norm"]) for c in ours)
        lines += [
            f"{split} ({len(ours)} seeds):",
            "",
            "| round | ‖c‖ | largest ‖c_i‖ | mean ‖Δc_i‖ |",
            "|---|---|---|---|",
        ]
        for r in sorted({0, 1, 2, 4, 9, 19, total - 1} & set(range(total))):
            largest = [max(c["control_local_norm"][r].values(), default=float("nan")) for c in ours]
            columns = [[c["control_global_norm"][r] for c in ours], largest, [c["control_diff_norm"][r] for c in ours]]
            lines.append(f"| {r + 1} | " + " | ".join(f"{sum(v) / len(v):.3g}" for v in columns) + " |")
        runaways = [f"seed {c['cell']['seed']}: {(control_runaways(genomics_records(c)) or ['none'])[0]}" for c in ours]
        lines += ["", "First runaway: " + "; ".join(runaways) + ".", ""]
    return lines


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(label, cell) for label, run in runs.items() for cell in run]
    fig, axes = plt.subplots(2, len(cells), figsize=(4 * len(cells), 6), squeeze=False, sharex=True)
    for column, (label, cell) in enumerate(cells):
        rounds = rounds_of(cell)
        x = [r["round"] + 1 for r in rounds]
        top, bottom = axes[0][column], axes[1][column]
        top.plot(x, [r.get("test_accuracy") for r in rounds], color="black")
        top.set(title=f"{label}, seed {cell['cell']['seed']}", ylabel="test accuracy", ylim=(0, 1))
        for site in sorted(rounds[0]["site_meta"]):
            norms = [r["site_meta"].get(site, {}).get(LOCAL_NORM) for r in rounds]
            bottom.plot(x, norms, lw=0.8, alpha=0.6)
        bottom.plot(x, [(r.get("rule_diagnostics") or {}).get(GLOBAL_CONTROL_NORM) for r in rounds], "k--", lw=2)
        bottom.set(yscale="log", xlabel="round", ylabel="||c_i|| per site, ||c|| dashed")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.scaffold_diagnostics", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="benchmarks.compare output folders (SCAFFOLD cells)")
    parser.add_argument("--labels", nargs="+", help="one label per folder (default: folder names)")
    parser.add_argument("--plot", type=Path, help="PNG path (required unless --genomics)")
    parser.add_argument("--genomics", action="store_true", help="the folders are benchmarks.genomics outputs")
    args = parser.parse_args(argv)
    if args.genomics:
        for folder in args.runs:
            print("\n".join([f"### {folder.name}", "", *genomics_control_table(folder)]))
        return 0
    if args.plot is None:
        parser.error("--plot is required for benchmarks.compare folders")
    labels = args.labels or [run.name for run in args.runs]
    if len(labels) != len(args.runs):
        parser.error("give one label per folder")
    runs = {label: load(folder) for label, folder in zip(labels, args.runs, strict=True)}
    print("| run | seed | final acc | best acc | first runaway of a site's control |\n|---|---|---|---|---|")
    for label, run in runs.items():
        for cell in run:
            accuracy = [r.get("test_accuracy") or 0.0 for r in rounds_of(cell)]
            seed, runaway = cell["cell"]["seed"], first_runaway(cell)
            print(f"| {label} | {seed} | {accuracy[-1]:.3f} | {max(accuracy):.3f} | {runaway} |")
    plot(runs, args.plot)
    print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
