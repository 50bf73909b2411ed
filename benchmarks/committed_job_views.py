"""Both views of a committed job's sites: a committed personal job (``jobs/<name>``) run in process with the pooled
("next patient") view added, each site's global, personal, local-only and kept models on its own test split and on
the pooled test set (docs/personalization.md, "Their sites hold 14-18 k images each").

    python -m benchmarks.committed_job_views finetune --pooled 1000 --out benchmarks/results/committed_job_views

The job runs as ``benchmarks.in_process`` runs it (the simulator's rounds in one process); the record, with its wall
seconds, is written to ``<out>/<job>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def job_views(name: str, pooled: int) -> dict:
    """The committed job ``name`` with ``site_pooled_test=pooled``, run in process: its sites' scores on both views."""
    from benchmarks.in_process import quiet_lightning, run_in_process
    from benchmarks.site_report import cell_scores, test_metrics_record
    from jobs.presets import PRESETS

    spec = dataclasses.replace(PRESETS[name], site_pooled_test=pooled)
    start = time.time()
    with tempfile.TemporaryDirectory() as root, quiet_lightning():
        run = run_in_process(spec, Path(root))
    scores = cell_scores(test_metrics_record(run.records))
    wall = time.time() - start
    # The keep margin is recorded: a default that changes later must not make an old record read as today's.
    head = {"job": name, "pooled_test_images": pooled, "keep_margin": spec.keep_margin}
    return {**head, "wall_s": wall, "rounds": len(run.rounds), **scores}


def main(argv: Sequence[str] | None = None) -> int:
    prog, description = "python -m benchmarks.committed_job_views", __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("job", help="a committed job's name (jobs.presets), e.g. finetune")
    parser.add_argument("--pooled", type=int, default=1000, help="pooled test images per site (default: 1000)")
    parser.add_argument("--out", type=Path, required=True, help="folder for <job>.json")
    args = parser.parse_args(argv)
    record = job_views(args.job, args.pooled)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.job}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("site_test", "site_pooled_test")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
