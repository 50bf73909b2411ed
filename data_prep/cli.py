"""Command line: show (and optionally plot) how a dataset is split among sites.

Example::

    python -m data_prep --dataset fashion_mnist --scheme dirichlet --alpha 0.5 --num-sites 3 --seed 0 --plot parts.png

Bad input prints one ``data_prep: error: ...`` line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from data_prep.datasets import DATASETS, load_dataset
from data_prep.errors import DataPrepError
from data_prep.partition import SCHEMES
from data_prep.report import format_counts_table, label_counts, save_counts_heatmap
from data_prep.sites import SiteDataConfig, describe, partition_sites

__all__ = ["label_counts", "main"]

PROG = "data_prep"
EXIT_BAD_INPUT = 2


class _OneLineParser(argparse.ArgumentParser):
    """ArgumentParser whose errors are a single line (no usage dump), matching the data errors."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m data_prep``."""
    parser = _OneLineParser(prog=PROG, description="Partition a dataset among federated sites and show label counts.")
    parser.add_argument(
        "--dataset", default="fashion_mnist", help=f"one of {', '.join(DATASETS)} (default: %(default)s)"
    )
    parser.add_argument("--scheme", default="dirichlet", help=f"one of {', '.join(SCHEMES)} (default: %(default)s)")
    parser.add_argument("--num-sites", type=int, default=3, help="number of sites (default: %(default)s)")
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (default: %(default)s)")
    parser.add_argument("--classes-per-site", type=int, default=2, help="labels per site for shards (default: 2)")
    parser.add_argument("--seed", type=int, default=0, help="partition seed (default: %(default)s)")
    parser.add_argument("--max-train-samples", type=int, default=None, help="partition a seeded subset of this size")
    parser.add_argument("--data-dir", default=None, help="dataset directory (default: the offline install location)")
    parser.add_argument("--plot", metavar="PATH", default=None, help="write a sites x classes heatmap PNG to PATH")
    return parser


def _run(args: argparse.Namespace) -> None:
    cfg = SiteDataConfig.from_namespace(args)
    labels, parts = partition_sites(cfg)
    counts = label_counts(labels, parts, load_dataset(cfg.dataset, cfg.data_dir).num_classes)
    title = describe(cfg)
    print(format_counts_table(counts, title))
    unassigned = len(labels) - int(counts.sum())
    if unassigned:
        # Only shards with num_sites * k < classes leave data out; say so rather than let the totals puzzle the reader.
        print(f"note: {unassigned} of {len(labels)} training samples belong to labels no site holds")
    if args.plot:
        try:
            path = save_counts_heatmap(counts, args.plot, title)
        except OSError as exc:
            raise DataPrepError(
                f"cannot write plot {args.plot!r} ({exc.strerror or exc}); choose a writable path"
            ) from exc
        print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit status (0 on success, 2 on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except DataPrepError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0
