"""The test tiers of tests/conftest.py: which marker a node-id gets, and that the slow table names real tests.

A renamed or deleted test would leave its SLOW_TESTS entry naming nothing, and the test it meant would silently run
in the fast tier again; the check reads the test files' syntax only (no collection, no imports).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiers(request):
    """tests/conftest.py as pytest loaded it (test modules cannot import conftest under importlib mode)."""
    return next(p for p in request.config.pluginmanager.get_plugins() if hasattr(p, "SLOW_TESTS"))


def test_end_to_end_tests_are_slow_and_e2e_and_others_only_when_named(tiers):
    table = {"tests/a/test_x.py::test_a": "", "tests/a/test_y.py": "", "tests/a/test_z.py::test_p[2]": ""}
    assert tiers.tier_markers("tests/e2e/test_e2e_any.py::test_t[p]", table) == {"e2e", "slow"}
    assert tiers.tier_markers("tests/a/test_x.py::test_a", table) == {"slow"}
    assert tiers.tier_markers("tests/a/test_x.py::test_a[case-1]", table) == {"slow"}
    assert tiers.tier_markers("tests/a/test_x.py::test_ab", table) == set()  # a prefix of a name is not the name
    assert tiers.tier_markers("tests/a/test_y.py::test_any[1]", table) == {"slow"}  # a whole file
    assert tiers.tier_markers("tests/a/test_z.py::test_p[2]", table) == {"slow"}  # one case of a test
    assert tiers.tier_markers("tests/a/test_z.py::test_p[1]", table) == set()
    assert tiers.tier_markers("tests/e2e_like/test_q.py::test_q", table) == set()


def test_every_slow_entry_names_an_existing_test(tiers):
    missing = []
    for entry in tiers.SLOW_TESTS:
        file, _, name = entry.partition("::")
        path = REPO / file
        if not path.is_file():
            missing.append(entry)
            continue
        functions = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)}
        if name and name.split("[", 1)[0] not in functions:
            missing.append(entry)
    assert not missing, f"tests/conftest.py SLOW_TESTS names no test: {missing}"
