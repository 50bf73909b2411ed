"""The user's package folders shipped with a job (``--ship``): which they are, and importable while the builder
checks the job as a site will see it. Apart from `jobs.spec` so that the user-code checks can use them without an
import circle (tests/test_import_graph.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobs.settings import JobBuildError


def shipped_folders(spec: Any) -> list[Path]:
    """The package folders ``--ship`` copies into the job, checked to exist."""
    folders = [Path(p.strip()) for p in spec.ship.split(",") if p.strip()]
    for folder in folders:
        if not (folder / "__init__.py").is_file():
            raise JobBuildError(
                f"ship: {str(folder)!r} is not a package folder (no __init__.py: add an empty one) from {Path.cwd()}"
            )
    return folders


@contextlib.contextmanager
def importable(folders: list[Path]) -> Iterator[None]:
    """The shipped packages importable while the job is checked, as they will be in the job's custom/."""
    added = [str(folder.resolve().parent) for folder in folders]
    sys.path[:0] = added
    try:
        yield
    finally:
        for entry in added:
            sys.path.remove(entry)
