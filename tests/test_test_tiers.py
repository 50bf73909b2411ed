"""The test tiers of tests/conftest.py: which marker a node-id gets, and that the slow table names real tests.

A renamed or deleted test would leave its SLOW_TESTS entry naming nothing, and the test it meant would silently run
in the fast tier again; the check reads the test files' syntax only (no collection, no imports).
"""

from __future__ import annotations

import ast
import json
import re
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


def test_end_to_end_tests_sharing_an_expensive_fixture_share_an_xdist_work_unit(tiers):
    """`make test` runs tests/e2e on two pytest-xdist workers: a work unit runs on one worker, so a module's simulator
    run or deployment (a module-scoped fixture), or the session's shared simulations, still run once."""
    independent = "import pytest\n\n@pytest.fixture\ndef spec(simulate):\n    ...\n\ndef test_t(spec, tmp_path): ..."
    module = "import pytest\n\n@pytest.fixture(scope='module')\ndef runs(simulate):\n    ...\n\ndef test_t(runs): ..."
    klass = "from pytest import fixture\n\n@fixture(scope='class')\ndef runs():\n    ...\n"
    e2e = "tests/e2e/test_e2e_m.py::test_t[p]"
    assert tiers.xdist_work_unit(e2e, independent) == e2e  # any free worker
    assert tiers.xdist_work_unit(e2e, module) == "tests/e2e/test_e2e_m.py"
    assert tiers.xdist_work_unit(e2e, klass) == "tests/e2e/test_e2e_m.py"
    for name in tiers.SHARED_SESSION_FIXTURES:  # every module using it, together
        assert tiers.xdist_work_unit(e2e, module.replace("(simulate)", f"({name})")) == name
        assert tiers.xdist_work_unit(e2e, f"def test_t({name}): ...") == name
    assert tiers.xdist_work_unit("tests/a/test_x.py::test_a", module) == "tests/a/test_x.py::test_a"  # not e2e


def test_the_modules_sharing_the_sessions_simulations_are_one_work_unit(tiers):
    """The FedAvg, SCAFFOLD and engine-equivalence modules check the same simulator runs (``simulated``)."""
    for module in ("fedavg_simulator", "scaffold_simulator", "engine_equivalence"):
        assert tiers.xdist_work_unit(f"tests/e2e/test_e2e_{module}.py::test_x") == "simulated", module
    provision = "tests/e2e/test_e2e_provision.py"
    assert tiers.xdist_work_unit(f"{provision}::test_x") == provision  # one deployment, module-scoped


def test_a_session_records_each_tests_setup_call_and_teardown_seconds_only_where_asked(tiers, tmp_path, monkeypatch):
    """FL_RECORD_TEST_SECONDS: the xdist controller (or a plain session) writes {node-id: seconds}; a worker never."""
    from types import SimpleNamespace

    monkeypatch.setattr(tiers, "_test_seconds", {})
    for when, seconds in (("setup", 1.0), ("call", 2.0), ("teardown", 0.5)):
        tiers.pytest_runtest_logreport(SimpleNamespace(when=when, duration=seconds, nodeid="tests/e2e/t.py::test_a"))
    tiers.pytest_runtest_logreport(SimpleNamespace(when="call", duration=0.25, nodeid="tests/e2e/t.py::test_b"))
    target = tmp_path / "seconds.json"
    monkeypatch.delenv(tiers.RECORD_TEST_SECONDS_ENV, raising=False)
    tiers.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace()))
    assert not target.exists()  # not asked
    monkeypatch.setenv(tiers.RECORD_TEST_SECONDS_ENV, str(target))
    tiers.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace(workerinput={})))
    assert not target.exists()  # a worker: its reports reach the controller
    tiers.pytest_sessionfinish(SimpleNamespace(config=SimpleNamespace()))
    assert json.loads(target.read_text()) == {"tests/e2e/t.py::test_a": 3.5, "tests/e2e/t.py::test_b": 0.2}


def test_every_shared_session_fixture_is_a_session_fixture_of_the_end_to_end_conftest(tiers):
    """A renamed fixture would leave its tests in units of their own: each worker would run its simulations again."""
    tree = ast.parse((REPO / "tests" / "e2e" / "conftest.py").read_text())
    session_fixtures = {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef)
        for decorator in node.decorator_list
        if isinstance(decorator, ast.Call)
        and any(k.arg == "scope" and getattr(k.value, "value", None) == "session" for k in decorator.keywords)
    }
    assert set(tiers.SHARED_SESSION_FIXTURES) <= session_fixtures


def test_make_test_runs_the_end_to_end_tier_on_two_xdist_workers_after_the_rest():
    """The Makefile's `test` target: lint, every test outside tests/e2e on two pytest-xdist workers, then tests/e2e
    with pytest-xdist's loadgroup on E2E_WORKERS (2) workers; each part prints its slowest tests. `make setup` installs
    pytest-xdist (dev extra)."""
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\ntest: setup lint\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert recipe == [
        "\tOMP_WAIT_POLICY=PASSIVE $(PY) -m pytest --ignore=tests/e2e -n 2 --dist loadgroup --durations=30",
        "\tOMP_WAIT_POLICY=PASSIVE $(PY) -m pytest tests/e2e $(E2E_PARALLEL) --durations=30",
    ]
    assert "\nE2E_WORKERS ?= 2\n" in makefile
    assert "\nE2E_PARALLEL := -n $(E2E_WORKERS) --dist loadgroup\n" in makefile
    dev = re.search(r"\ndev = \[\n(.*?)\n\]", (REPO / "pyproject.toml").read_text(), re.S)
    assert dev and re.search(r'^    "pytest-xdist==[0-9.]+",$', dev.group(1), re.M), "pyproject.toml: dev extra"
