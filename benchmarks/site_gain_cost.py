"""What the per-site guarantee costs a site per round: ``--site-test-fraction``, ``--local-baseline`` and
``--keep best`` against the same job with a validation split only (docs/personalization.md).

    python -m benchmarks.site_gain_cost                       # fedavg and ditto, 7 sites, Dirichlet 0.3
    python -m benchmarks.site_gain_cost --algorithms fedrep --repeats 3
    python -m benchmarks.site_gain_cost --engine simulator --algorithms fedavg --rounds 4

Every variant runs the same cells (``benchmarks.compare``'s site_gain protocol), the variants alternating within each
repeat so that a change of machine load hits all of them. ``--engine in_process`` (default) runs them in the
in-process round engine (benchmarks/in_process.py: the sites' code without NVFlare); ``--engine simulator`` exports
each cell as a job folder and runs it with ``nvflare simulator -n SITES -t THREADS``, so a round is a real job's
round: task hand-out, the sites' Trainers, (de)serialisation and the server's work included. Per variant: the sites'
median ``train.fit_seconds`` (the federated fit, the same work in every variant) and ``train.candidate_seconds`` (the
local-only model's training and the scoring of every candidate on validation and test), and the median round's wall
time; ratios are against the first variant, measured in the same process. Round 1 is left out (start-up).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks import compare

#: name -> the protocol fields that differ from the site_gain protocol.
VARIANTS: dict[str, dict[str, Any]] = {
    "validation only (baseline)": {"site_test_fraction": 0.0, "keep": "last", "local_baseline": False},
    "+ test split": {"keep": "last", "local_baseline": False},
    "+ local baseline": {"keep": "last", "local_baseline": True},
    "+ local baseline + keep best": {"keep": "best", "local_baseline": True},
}


def round_costs(records: Sequence[dict[str, Any]]) -> dict[str, list[float]]:
    """Per round after the first: the round's wall seconds, and every site's fit and candidate seconds."""
    costs: dict[str, list[float]] = {"round": [], "fit": [], "candidates": []}
    rounds = [record for record in records if record.get("stage") == "round"][1:]
    for record in rounds:
        costs["round"].append(float(record["elapsed_s"]))
        for meta in record.get("site_meta", {}).values():
            costs["fit"].append(float(meta.get("train.fit_seconds", 0.0)))
            costs["candidates"].append(float(meta.get("train.candidate_seconds", 0.0)))
    return costs


ENGINES = ("in_process", "simulator")
TASKS = ("fmnist", "genomics")
PROTOCOLS = ("site_gain", "site_gain_v4")


def task_protocol(task: str, name: str, source: str, num_sites: int, rounds: int) -> Any:
    """The cells' protocol: the grid ``name``'s (``site_gain``: the first per-site grids, batch 64, FedAvg's plain
    rounds; ``site_gain_v4``: the pre-registered default, batch 16), every round run (no stopping rule)."""
    if task == "fmnist":
        base = compare.SITE_GAIN if name == "site_gain" else compare.SITE_GAIN_V4
    else:
        from benchmarks import genomics

        base = genomics.site_gain_protocol(source) if name == "site_gain" else genomics.GRIDS[name](source)[3]
    return replace(base, num_sites=num_sites, rounds=rounds, stop_patience=None)


def cell_spec(task: str, algorithm: str, partition: str, repeat: int, protocol: Any) -> Any:
    """The job of one cell (its site data fixed across repeats: partition seed 0)."""
    if task == "fmnist":
        return compare.cell_spec(compare.Cell(algorithm, partition, 1.0, repeat, 0), protocol)
    from benchmarks import genomics

    return genomics.cell_spec(genomics.Cell(algorithm, partition, repeat, 0), protocol)


def cell_records(spec: Any, engine: str, threads: int) -> list[dict[str, Any]]:
    """The server's round records of the job ``spec`` run in ``engine`` (module docstring)."""
    scratch = Path(tempfile.mkdtemp(prefix="site-gain-cost-"))
    try:
        if engine == "in_process":
            import torch

            from benchmarks.in_process import quiet_lightning, run_in_process

            torch.set_num_threads(threads)
            with quiet_lightning():
                return run_in_process(spec, scratch, run_id=spec.name).records
        from benchmarks.round_overhead import simulator_records
        from benchmarks.startup import ROOT, code_env
        from jobs.assembly import export_job

        job = export_job(spec, scratch / "jobs")
        return simulator_records(job, scratch / "ws", code_env(ROOT), spec.num_sites, threads)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def ratio_table(medians: dict[str, dict[str, float]], baseline: str) -> list[str]:
    """Markdown rows: each variant's median seconds, and its round and per-site work relative to ``baseline``."""
    base = medians[baseline]
    base_work = base["fit"] + base["candidates"]
    lines = [
        "| variant | fit s (median site) | candidate s (median site) | site work ÷ baseline | round s "
        "| round ÷ baseline |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in medians.items():
        work = m["fit"] + m["candidates"]
        lines.append(
            f"| {name} | {m['fit']:.3f} | {m['candidates']:.3f} | {work / base_work:.2f} | {m['round']:.2f} | "
            f"{m['round'] / base['round']:.2f} |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Measure the per-round cost of the per-site guarantee's options; print a table per algorithm."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.site_gain_cost", description=main.__doc__)
    parser.add_argument("--task", choices=TASKS, default="fmnist", help="fmnist: LeNet-5; genomics: the SNP MLP")
    parser.add_argument("--source", default="1kg", help="genomics only: 1kg or sim (benchmarks.genomics)")
    parser.add_argument("--protocol", choices=PROTOCOLS, default="site_gain", help="the grid whose protocol runs")
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--partition", default="dir0.3")
    parser.add_argument("--num-sites", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="in_process: torch threads; simulator: the simulator's -t (give the number of sites: with fewer, "
        "NVFlare starts a fresh process for every site and round)",
    )
    parser.add_argument("--engine", choices=ENGINES, default="in_process", help="where the cells run (module doc)")
    args = parser.parse_args(argv)
    protocol = task_protocol(args.task, args.protocol, args.source, args.num_sites, args.rounds)
    for algorithm in args.algorithms:
        costs: dict[str, dict[str, list[float]]] = {name: {} for name in VARIANTS}
        for repeat in range(args.repeats):
            for name, fields in VARIANTS.items():
                spec = cell_spec(args.task, algorithm, args.partition, repeat, replace(protocol, **fields))
                for key, values in round_costs(cell_records(spec, args.engine, args.threads)).items():
                    costs[name].setdefault(key, []).extend(values)
        medians = {name: {key: statistics.median(v) for key, v in c.items()} for name, c in costs.items()}
        print(
            f"\n{args.task} {algorithm}, {args.protocol}, {args.partition}, {args.num_sites} sites, rounds "
            f"2..{args.rounds}, {args.repeats} repeats, {args.engine} engine, {args.threads} thread(s)"
        )
        print("\n".join(ratio_table(medians, next(iter(VARIANTS)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
