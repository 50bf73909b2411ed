"""docs/adding_an_algorithm.md against the registries, the capabilities and the tables derived from them.

Forwards: every ``file::NAME`` the page's "Every place you touch" names exists and defines NAME at module level (a
class's table is named by its class). Backwards, each found in the code, not listed here, so that a place a
contributor must touch fails this test until the page names it:

- every table in the tests and benchmarks that a new rule may have to extend, found by what it holds: the arguments
  a rule cannot be built without (a dict whose ``"attack_adaptive"`` entry, the registered rule that needs some, is
  a dict of arguments) and how a client reports a meta key (``META_FOR_KEY``);
- every registry (a module-level ``dict[str, type...]`` in the library) and every table derived from one (a
  module- or class-level value computed from a registry);
- every table in the library keyed by the names of registered algorithms or rules (a dict literal with two or more
  such keys): a new algorithm may need a line there;
- every capability the algorithm and rule base classes declare (their ``ClassVar`` attributes): a contributor
  declares them, so the page says what each is;
- the personalization axis: its section, every kind of personal model and the shared state helper.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "adding_an_algorithm.md"
NAMED = re.compile(r"`([\w/.<>]+\.py)::(\w+)`")
SEARCHED = ("tests", "benchmarks")
LIBRARY = ("aggregators", "controllers", "data_prep", "jobs", "lightning_modules")
REGISTRY_NAMES = ("RULES", "CLIENT_ALGORITHMS", "COMPANIONS")
#: The base classes whose declarations a contributor fills in.
BASES = (("lightning_modules/algorithms/base.py", "ClientAlgorithm"), ("aggregators/types.py", "AggregationRule"))


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


@functools.cache
def library_files() -> list[tuple[str, ast.Module]]:
    files = []
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            files.append((path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())))
    return files


def assignments(tree: ast.Module) -> list[tuple[str, str, ast.expr | None, ast.expr | None]]:
    """(owner, name, annotation, value) of every module-level and class-level assignment; owner is the class or ""."""
    found = []
    for node in tree.body:
        members = [(node.name, child) for child in node.body] if isinstance(node, ast.ClassDef) else []
        for owner, item in [("", node), *members]:
            if isinstance(item, ast.Assign):
                found += [(owner, t.id, None, item.value) for t in item.targets if isinstance(t, ast.Name)]
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                found.append((owner, item.target.id, item.annotation, item.value))
    return found


def named_on_page() -> set[str]:
    """``file::NAME`` entries of the page's section, as ``file::NAME`` strings."""
    return {f"{relative}::{name}" for relative, name in NAMED.findall(section())}


def missing(entries: set[str]) -> list[str]:
    return sorted(entries - named_on_page())


def test_every_registry_is_on_the_page():
    registries = set()
    for relative, tree in library_files():
        for owner, name, annotation, _ in assignments(tree):
            kind = ast.unparse(annotation) if annotation is not None else ""
            if not owner and kind.startswith("dict[str, type") and "nn.Module" not in kind:  # models: not ours
                registries.add(f"{relative}::{name}")
    assert {entry.split("::")[1] for entry in registries} >= set(REGISTRY_NAMES), registries
    assert missing(registries) == [], "name these registries in docs/adding_an_algorithm.md"


def test_every_table_derived_from_a_registry_is_on_the_page():
    derived = set()
    for relative, tree in library_files():
        for owner, name, _, value in assignments(tree):
            used = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)} if value is not None else set()
            if name.startswith("__") or not used & set(REGISTRY_NAMES) or name in REGISTRY_NAMES:
                continue
            derived.add(f"{relative}::{owner or name}")
    assert derived, "no derived table found: the scan is broken"
    assert missing(derived) == [], "name these tables, derived from a registry, in docs/adding_an_algorithm.md"


def registered_names() -> set[str]:
    from aggregators.compose import COMPANIONS
    from aggregators.registry import RULES
    from lightning_modules.algorithms import CLIENT_ALGORITHMS

    return set(RULES) | set(CLIENT_ALGORITHMS) | set(COMPANIONS)


def test_every_table_keyed_by_algorithm_names_in_the_library_is_on_the_page():
    names, keyed = registered_names(), set()
    for relative, tree in library_files():
        for owner, name, _, value in assignments(tree):
            keys = value.keys if isinstance(value, ast.Dict) else []
            if sum(isinstance(k, ast.Constant) and k.value in names for k in keys) >= 2:
                keyed.add(f"{relative}::{owner or name}")
    assert keyed, "no name-keyed table found: the scan is broken"
    assert missing(keyed) == [], "a new algorithm may need a line there: name these in docs/adding_an_algorithm.md"


def test_every_declared_capability_is_on_the_page():
    page = PAGE.read_text()
    undocumented = []
    for relative, class_name in BASES:
        for owner, name, annotation, _ in assignments(ast.parse((ROOT / relative).read_text())):
            if owner == class_name and annotation is not None and ast.unparse(annotation).startswith("ClassVar"):
                undocumented += [f"{class_name}.{name}"] if f"`{name}" not in page else []
    assert undocumented == [], "say in docs/adding_an_algorithm.md what each declaration is"


def test_the_personalization_axis_is_on_the_page():
    from lightning_modules.algorithms.capabilities import PERSONAL_KINDS

    page = PAGE.read_text()
    assert "## A personalization method" in page, "docs/adding_an_algorithm.md needs the section"
    start = page.index("## A personalization method")
    text = page[start : page.index("\n## ", start + 1)]
    for needed in ("`personal_model", "`personal_weights", "personal_state.py", "`load_personal", "`save_personal"):
        assert needed in text, needed
    assert all(f'"{kind}"' in text or f"`{kind}`" in text for kind in PERSONAL_KINDS), PERSONAL_KINDS
