"""docs/adding_an_algorithm.md, "Every place you touch", against the repository.

Forwards: every ``file::NAME`` the page names exists and defines NAME at module level (a class's table is named by
its class). Backwards: every table in the tests and benchmarks that a new rule may have to extend is on the page,
found by what it holds: the arguments a rule cannot be built without (a dict whose ``"attack_adaptive"`` entry, the
registered rule that needs some, is a dict of arguments) and how a client reports a meta key (``META_FOR_KEY``).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adding_an_algorithm.md"
NAMED = re.compile(r"`([\w/.<>]+\.py)::(\w+)`")
SEARCHED = ("tests", "benchmarks")


def section() -> str:
    text = PAGE.read_text()
    start = text.index("## Every place you touch")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def module_names(path: Path) -> set[str]:
    """Names a module defines at its top level (assignments, functions, classes)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def rule_tables(path: Path) -> set[str]:
    """Top-level tables of ``path`` that a new rule may have to extend (see the module docstring)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.Assign | ast.AnnAssign) or not isinstance(node.value, ast.Dict):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        # {"attack_adaptive": {...arguments...}}; a dict of labels for some rules (benchmarks/robustness.py) is none
        argument_table = any(
            isinstance(k, ast.Constant) and k.value == "attack_adaptive" and isinstance(v, ast.Dict)
            for k, v in zip(node.value.keys, node.value.values, strict=True)
        )
        for target in targets:
            if isinstance(target, ast.Name) and (argument_table or target.id == "META_FOR_KEY"):
                found.add(target.id)
    return found


def test_every_named_table_and_file_exists():
    named = NAMED.findall(section())
    assert len(named) >= 10, named
    for relative, name in named:
        path = ROOT / relative
        assert path.is_file(), relative
        assert name in module_names(path), f"{relative} defines no top-level {name}"


def test_every_table_a_new_rule_may_have_to_extend_is_on_the_page():
    named = set(NAMED.findall(section()))
    missing = []
    for folder in SEARCHED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            missing += [f"{relative}::{name}" for name in rule_tables(path) if (relative, name) not in named]
    assert missing == [], "add these to docs/adding_an_algorithm.md, 'Every place you touch'"
