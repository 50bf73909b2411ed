"""What the per-site guarantee costs a site per round: ``--site-test-fraction``, ``--local-baseline`` and
``--keep best`` against the same job with a validation split only (docs/personalization.md).

    python -m benchmarks.site_gain_cost                       # fedavg and ditto, 7 sites, Dirichlet 0.3
    python -m benchmarks.site_gain_cost --algorithms fedrep --repeats 3

Every variant runs the same cells (``benchmarks.compare``'s site_gain protocol, in the in-process round engine), the
variants alternating within each repeat so that a change of machine load hits all of them. Per variant: the sites'
median ``train.fit_seconds`` (the federated fit, the same work in every variant) and ``train.candidate_seconds`` (the
local-only model's training and the scoring of every candidate on validation and test), and the median round's wall
time; ratios are against the first variant, measured in the same process. Round 1 is left out (start-up).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from dataclasses import replace
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
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--partition", default="dir0.3")
    parser.add_argument("--num-sites", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    protocol = replace(compare.SITE_GAIN, num_sites=args.num_sites, rounds=args.rounds)
    # Only the round records are read here; the harness's check that a test-split cell reported kept and local-only
    # scores does not apply to the variants without them.
    compare.cell_site_scores = lambda *_args, **_kwargs: {}
    for algorithm in args.algorithms:
        costs: dict[str, dict[str, list[float]]] = {name: {} for name in VARIANTS}
        for repeat in range(args.repeats):
            for name, fields in VARIANTS.items():
                cell = compare.Cell(algorithm, args.partition, 1.0, repeat, 0)
                result = compare.run_cell(cell, replace(protocol, **fields), threads=args.threads)
                for key, values in round_costs(result["records"]).items():
                    costs[name].setdefault(key, []).extend(values)
        medians = {name: {key: statistics.median(v) for key, v in c.items()} for name, c in costs.items()}
        print(
            f"\n{algorithm}, {args.partition}, {args.num_sites} sites, rounds 2..{args.rounds}, {args.repeats} repeats"
        )
        print("\n".join(ratio_table(medians, next(iter(VARIANTS)))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
