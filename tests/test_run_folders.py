"""No command the repository gives a user writes into ``make demo``'s results, and each example runs into a folder
of its own: running an example after the demo leaves the demo's report, plot and model where they were.

``make demo`` writes under ``DEMO_WS`` (scripts/demo.sh: ``/tmp/fl-demo``; ``/tmp/fl-demo/scaffold`` is its run). The
README, every docs page and every example's docstring are read for the options that name where a command writes
(``-w``, ``--workspace``, ``--output-dir``, ``--out-dir``, ``--export-dir``); ``job.py`` without ``--workspace``
writes to its default, computed here from its own parser. The demo's own command, quoted
where the docs say what ``make demo`` runs, is the one allowed writer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from jobs import job_entry
from jobs.presets import PRESETS

REPO = Path(__file__).resolve().parents[1]
#: The options by which a documented command names the folder it writes.
WRITES = re.compile(r"(?:^|\s)(?:-w|--workspace|--output-dir|--out-dir|--export-dir)[ =]([^\s`'\")]+)")
#: The demo's own command as the docs quote it: its job into the folder of that job's name.
DEMO_COMMAND = re.compile(r"nvflare simulator jobs/(\w+) -w (\S+)")
#: The Makefile's variables that the demo targets themselves write (demo-quick's job folder).
DEMO_OWN = {"QUICK_JOBS"}


def demo_root() -> str:
    match = re.search(r"^DEMO_WS=\$\{DEMO_WS:-(\S+)\}$", (REPO / "scripts" / "demo.sh").read_text(), re.MULTILINE)
    assert match, "scripts/demo.sh: no DEMO_WS default"
    return match.group(1)


def inside(path: str, root: str) -> bool:
    path, root = path.rstrip("/"), root.rstrip("/")
    return path == root or path.startswith(root + "/")


def demo_writers(text: str, root: str) -> list[str]:
    """The lines of ``text`` whose command writes into ``root`` (other than the demo's own command)."""
    found = []
    for line in text.splitlines():
        own = {f"{root}/{job}" for job, folder in DEMO_COMMAND.findall(line) if folder == f"{root}/{job}"}
        if any(inside(path, root) and path not in own for path in WRITES.findall(line)):
            found.append(line.strip())
    return found


def documented_pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "examples").rglob("*.py"))]


def test_the_check_finds_a_command_that_writes_into_the_demos_run():
    """The README's job.py line of an earlier release wrote the demo's run again (its run is WORKSPACE/scaffold)."""
    old = "`python jobs/scaffold/job.py --workspace /tmp/fl-demo` (SimEnv; the run is `/tmp/fl-demo/scaffold`)"
    assert demo_writers(old, "/tmp/fl-demo") == [old]
    assert demo_writers("nvflare simulator jobs/fedavg -w /tmp/fl-demo/scaffold -n 3", "/tmp/fl-demo")
    assert demo_writers("nvflare simulator jobs/scaffold -w /tmp/fl-demo/scaffold -n 3", "/tmp/fl-demo") == []
    assert demo_writers("nvflare simulator jobs/scaffold -w /tmp/fl-demo-2 -n 3", "/tmp/fl-demo") == []


@pytest.mark.parametrize("page", documented_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_documented_command_writes_into_the_demos_results(page):
    assert demo_writers(page.read_text(), demo_root()) == []


def test_no_make_target_but_the_demos_writes_into_them():
    root = demo_root()
    variables = re.findall(r"^(\w+)\s*[:?]?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert {name for name, value in variables if inside(value, root)} <= DEMO_OWN


def test_job_py_by_default_runs_outside_the_demos_folder():
    """SimEnv's run is WORKSPACE/<job name>; the committed jobs are named as their presets (tested elsewhere)."""
    args = job_entry.build_parser(PRESETS["scaffold"], "scaffold").parse_args([])
    runs = [Path(args.workspace) / name for name in PRESETS]
    assert [run for run in runs if inside(str(run), demo_root())] == []


def test_each_example_runs_into_a_folder_of_its_own():
    folders = {}
    for package in sorted(p for p in (REPO / "examples").iterdir() if (p / "__init__.py").is_file()):
        named = WRITES.findall((package / "__init__.py").read_text())
        runs = [path for path in named if not path.endswith("/jobs")]  # the builder's shared job folder
        folders[package.name] = runs
    flat = [folder for runs in folders.values() for folder in runs]
    assert all(folders.values()), folders
    assert len(flat) == len(set(flat)), folders
