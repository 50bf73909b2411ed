"""docs/reliability.md's fault table stays true: every test it names exists, and its count is the table's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "reliability.md"


def fault_rows() -> list[list[str]]:
    section = DOC.read_text().split("## The fault-injection suite", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| fault |")]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows]


def test_every_row_names_tests_that_exist():
    rows = fault_rows()
    assert rows
    for fault, _required, _measured, held, tests in rows:
        assert held in ("yes", "no"), fault
        named = re.findall(r"`([\w/]+\.py)::(\w+)`", tests)
        assert named, f"row names no test: {fault}"
        for file_name, function in named:
            [path] = [p for p in (ROOT / "tests").rglob(file_name)]
            assert re.search(rf"^def {function}\(", path.read_text(), re.MULTILINE), f"{file_name}::{function}"


def test_the_summary_counts_the_rows_and_the_held_ones():
    rows = fault_rows()
    held = sum(row[3] == "yes" for row in rows)
    assert f"**{len(rows)} faults tried, {held} held.**" in DOC.read_text()
