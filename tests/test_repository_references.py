"""The repository stands on its own: every repository path a committed file names exists, and nothing points at
design notes outside the repository or at tracker numbers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yml", ".cfg"}
TOP_LEVEL = (
    "aggregators",
    "controllers",
    "data_prep",
    "jobs",
    "lightning_modules",
    "tests",
    "benchmarks",
    "docs",
    "examples",
    "scripts",
)
#: A repository path written in text: a top-level folder, then path characters, ending in a file suffix.
PATH = re.compile(r"(?<![\w/.-])(?:\.\./)*((?:" + "|".join(TOP_LEVEL) + r")/[\w./-]*\.(?:py|md|png|json|sh|yml|pt))")
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OUTSIDE_NOTES = re.compile(r"\b(?:DESIGN|ALGORITHMS|NVFLARE_NOTES)\.md\b")
TRACKER = re.compile(r"\bissues? #?\d+\b", re.IGNORECASE)
#: Files that commands write (named as their output, so they need not exist in a checkout).
GENERATED = {"benchmarks/results/robustness.md"}
#: Paths of the docs site, not of a checkout: a page the mkdocs hook generates (scripts/mkdocs_hooks.py), and the
#: missing report that tests/test_docs_site.py links to on purpose to see the strict build fail.
SITE_ONLY = {"examples/genomics/index.md", "benchmarks/results/no_such_report.md"}
#: Tests that build made-up trees or test ids to check a rule on them: the paths they write name those trees, not
#: files of this checkout (the layer rule on a fake ``examples/demo``, tier matching on made-up test ids).
MADE_UP_TREES = {"tests/test_layers.py", "tests/test_test_tiers.py"}


def committed_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    files = [ROOT / name for name in listed.splitlines()]
    files += [ROOT / name for name in untracked()]  # files of this change that are not committed yet
    return sorted({f for f in files if f.is_file() and (f.suffix in TEXT_SUFFIXES or f.name == "Makefile")})


def untracked() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return listed.splitlines()


def exists(reference: str, source: Path) -> bool:
    """A path resolves from the repository root, or (markdown links, ../ paths) from the citing file's folder."""
    reference = reference.rstrip(".")
    return (ROOT / reference).exists() or (source.parent / reference).resolve().exists()


@pytest.fixture(scope="module")
def files() -> list[Path]:
    try:
        return committed_text_files()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")


def test_every_named_repository_path_exists(files):
    missing = []
    for path in files:
        if str(path.relative_to(ROOT)) in MADE_UP_TREES:
            continue
        text = path.read_text(errors="replace")
        for match in PATH.finditer(text):
            reference = match.group(1)
            placeholder = "<" in reference or "*" in reference or reference in GENERATED | SITE_ONLY
            if not placeholder and not exists(reference, path):
                missing.append(f"{path.relative_to(ROOT)}: {reference}")
    assert missing == []


def test_every_relative_markdown_link_resolves(files):
    missing = []
    for path in (f for f in files if f.suffix == ".md"):
        for match in MARKDOWN_LINK.finditer(path.read_text()):
            target = match.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (path.parent / target).resolve().exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert missing == []


def test_nothing_points_at_notes_outside_the_repository_or_at_tracker_numbers(files):
    found = []
    for path in files:
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE_NOTES.search(line) or TRACKER.search(line) or "../shared" in line:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert found == []
