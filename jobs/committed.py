"""The committed ``jobs/<name>/`` folders against what the builder generates now (a test keeps them in sync)."""

from __future__ import annotations

import filecmp
import tempfile
from pathlib import Path

from jobs.assembly import JOBS_DIR, export_job
from jobs.presets import PRESETS


def check_presets(jobs_dir: Path = JOBS_DIR) -> list[str]:
    """Differences between the committed ``jobs/<name>/`` folders and freshly generated ones (empty = in sync)."""
    differences: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in PRESETS.values():
            fresh = export_job(spec, Path(tmp))
            differences.extend(_diff_trees(fresh, jobs_dir / spec.name, spec.name))
    return differences


def _diff_trees(fresh: Path, committed: Path, label: str) -> list[str]:
    if not committed.is_dir():
        return [f"{label}: committed folder {committed} is missing"]
    fresh_files = {p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file()}
    committed_files = {
        p.relative_to(committed) for p in committed.rglob("*") if p.is_file() and "__pycache__" not in p.parts
    }
    problems = [f"{label}: missing {p}" for p in sorted(fresh_files - committed_files)]
    problems += [f"{label}: unexpected {p}" for p in sorted(committed_files - fresh_files)]
    problems += [
        f"{label}: {p} differs"
        for p in sorted(fresh_files & committed_files)
        if not filecmp.cmp(fresh / p, committed / p, shallow=False)
    ]
    return problems
