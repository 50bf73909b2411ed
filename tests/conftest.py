"""Fixtures shared by every test folder."""

from __future__ import annotations

import ast
import functools
import json
import os
import sys
from pathlib import Path

import pytest

from data_prep import DataPrepError, load_dataset

# The repository's own ``benchmarks`` package must win over the top-level ``benchmarks`` package that opacus (the
# privacy extra) installs into site-packages: ``python -m pytest`` puts the working directory first, the ``pytest``
# script does not.
REPO = str(Path(__file__).resolve().parents[1])
if sys.path[:1] != [REPO]:
    sys.path.insert(0, REPO)
    sys.modules.pop("benchmarks", None)


@pytest.fixture(scope="session")
def fashion_mnist() -> None:
    """Use in tests that need the real dataset: skipped locally when Fashion-MNIST is absent; in CI (CI=true) its
    absence is a failure, not a skip."""
    try:
        load_dataset("fashion_mnist")
    except DataPrepError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"Fashion-MNIST not installed: {exc}")


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """Every test leaves torch's intra-op thread count as it found it. In-process training is bit-identical to the
    simulator's only at the same thread count: a benchmark function called in process (dp_overhead pins 1 thread)
    once left the rest of the suite on 1 thread, and the engine-equivalence and thread-independence tests failed
    after it, though each passed alone."""
    import torch  # once per session; nearly every test session imports it anyway

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# The test pyramid. `make test-fast` runs the unit and contract tests (`-m "not slow"`, tests/e2e not collected);
# `make test` (CI) runs every tier. Tiers are assigned here, centrally, so that a test file needs no marker of its
# own: everything under tests/e2e is `e2e` (and `slow`), and the tests named in SLOW_TESTS are `slow`.
E2E_DIR = "tests/e2e/"
#: Tests outside tests/e2e that start the simulator or a training subprocess, run several processes, or train long
#: enough in process to take over ~5 s on the development machine: node-id of a test file, of a test (every
#: parameter of it) or of one parametrized case, with why it is slow. tests/test_test_tiers.py checks that each
#: still names a test.
SLOW_BY_FILE: dict[str, dict[str, str]] = {
    "tests/jobs/test_recipe_job_entry.py": {
        "test_job_py_runs_in_simenv_and_streams_tensorboard_curves": "SimEnv run",
        "test_report_reads_the_recipe_run_and_names_it_under_the_workspace_root": "the SimEnv run",
        "test_job_py_shows_the_rounds_as_make_demo_does_and_keeps_the_rest_in_its_log": "the SimEnv run",
        "test_the_folder_and_its_job_py_train_bit_identical_models": "SimEnv and nvflare simulator runs",
        "test_every_committed_jobs_record_rebuilds_its_preset": "24 specs validated",
    },
    "tests/jobs/test_job_site_imports.py": {
        "test_the_client_set_up_path_imports_no_optional_package": "client process",
        "test_a_shipped_package_importing_an_unshipped_sibling_is_refused_naming_both": (
            "two builds, each importing the user's code as a site would"
        ),
    },
    "tests/jobs/test_job_filter_order.py": {
        "test_the_he_job_exports_the_same_under_two_hash_seeds": "two builders",
    },
    "tests/jobs/test_job_quick_setting.py": {
        "test_make_demo_quick_learns": "5 in-process rounds on Fashion-MNIST",
        "test_the_hand_shortened_demo_stays_at_chance": "in-process rounds",
        "test_the_readme_custom_model_job_learns": "in-process rounds",
    },
    "tests/jobs/test_job_own_model.py": {
        "test_the_jobs_thin_client_script_runs_the_users_script_shipped_beside_it": "a client process training",
        "test_the_example_exports_with_its_package_shipped_and_the_server_building_the_users_model": (
            "builds that import the user's code as a site would"
        ),
        "test_what_the_algorithms_need_from_the_users_code_is_refused_at_build_time[fedmos-task-loss]": (
            "a build importing the user's code"
        ),
        "test_what_the_algorithms_need_from_the_users_code_is_refused_at_build_time[moon-projection]": (
            "a build importing the user's code"
        ),
        "test_a_users_own_script_travels_in_the_job_and_the_sites_get_its_file_name": (
            "a build importing the user's code"
        ),
    },
    "tests/benchmarks/test_bench_genotype_io.py": {
        "test_the_benchmark_measures_every_format_the_loader_and_the_step": (
            "harmonises every format twice, each in a new process"
        ),
    },
    "tests/benchmarks/test_bench_round_overhead.py": {
        "test_quick_round_overhead_run_reports_both_variants": "simulator",
        "test_quick_startup_run_reports_the_client_path": "client processes",
    },
    "tests/benchmarks/test_bench_robustness.py": {
        "test_quick_grid_writes_cells_table_and_plot": "a grid of federations",
        "test_capture_pretrain_and_rerun_with_the_new_checkpoint": "federations",
    },
    "tests/benchmarks/test_bench_client_algorithms.py": {
        "test_quick_mode_reports_every_variant_with_finite_ratios_and_memory": (
            "times every client algorithm's training"
        ),
    },
    "tests/benchmarks/test_bench_step_overhead.py": {
        "test_quick_mode_prints_one_row_per_algorithm_with_finite_ratios": "times every client algorithm's steps",
    },
    "tests/jobs/test_job_snp_consortium.py": {
        "test_one_round_trains_in_process_and_moves_the_batchnorm_statistics": "a genomics round in process",
    },
    "tests/jobs/test_job_user_code_faults.py": {
        "test_the_server_and_every_site_build_the_same_initial_model_from_the_job_seed": "a build and three models",
    },
    "tests/aggregators/test_agg_dp_fedavg_accounting.py": {
        "test_the_mechanism_the_rule_runs_costs_what_it_reports_and_the_uncentred_count_cost_more[200-20-100]": (
            "privacy accounting of the largest case"
        ),
        "test_the_reported_epsilon_is_dp_accountings_rdp_and_not_below_its_pld[200-20-100-True]": (
            "privacy accounting of the largest case"
        ),
        "test_the_reported_epsilon_is_dp_accountings_rdp_and_not_below_its_pld[200-20-100-False]": (
            "privacy accounting of the largest case"
        ),
    },
    "tests/lightning_modules/test_lm_site_validation.py": {
        "test_in_process_rounds_carry_site_eval_for_every_site": "in-process rounds",
        "test_training_is_deterministic_and_untouched_by_the_evaluation": "trains several times",
    },
    "tests/controllers/test_ctl_in_process.py": {
        "test_reruns_are_bit_identical_and_every_round_aggregates": "two runs",
    },
    "tests/controllers/test_ctl_faults.py": {
        "test_feddyn_server_sum_equals_the_sum_of_the_site_states_after_a_fault": "rounds with a fault, per fault",
        "test_a_replayed_round_starts_from_the_committed_state_and_sends_the_same_diff": "rounds with a replay",
    },
    "tests/lightning_modules/test_lm_privacy_sum_workflow.py": {
        "test_the_ledger_counts_every_round_of_the_job_and_sigma_covers_the_planned_rounds": "DP-SGD rounds",
        "test_under_the_sum_workflow_a_site_on_a_restored_old_ledger_stops": "DP-SGD rounds",
    },
    "tests/lightning_modules/test_lm_privacy_composition.py": {
        "test_dp_sgd_composes_with_the_client_algorithm": "DP-SGD training per client algorithm",
    },
    "tests/lightning_modules/test_lm_privacy_stale_ledger.py": {
        "test_a_site_on_a_restored_old_ledger_sends_nothing_and_the_others_go_on": "three DP-SGD rounds in process",
    },
    "tests/lightning_modules/test_state_store.py": {
        "test_state_survives_a_fresh_process_using_the_default_root": "a fresh process",
    },
    "tests/lightning_modules/test_lm_keep_best.py": {
        "test_a_user_module_reports_its_own_metric_names_and_an_unlogged_keep_metric_is_named": (
            "site rounds with a user module"
        ),
    },
}
SLOW_TESTS: dict[str, str] = {
    f"{file}::{test}": why for file, tests in SLOW_BY_FILE.items() for test, why in tests.items()
}
#: A test in the fast tier slower than this is named at the end of the session (mark it slow above).
FAST_TIER_LIMIT_S = 5.0


def tier_markers(nodeid: str, slow_tests: dict[str, str] = SLOW_TESTS) -> set[str]:
    """The tier markers of the test ``nodeid``: ``{"e2e", "slow"}`` under tests/e2e, ``{"slow"}`` when an entry of
    ``slow_tests`` names its file, the test or this parametrized case, else none. An entry ``f.py::test_a`` does not
    name ``f.py::test_ab``."""
    if nodeid.startswith(E2E_DIR):
        return {"e2e", "slow"}
    test = nodeid.split("[", 1)[0]
    file = nodeid.split("::", 1)[0]
    return {"slow"} if nodeid in slow_tests or test in slow_tests or file in slow_tests else set()


#: Session fixtures of tests/e2e that run something expensive once per session, i.e. once per pytest-xdist worker:
#: the tests of every module that uses one run on one worker, so that it runs once, as in a serial session.
SHARED_SESSION_FIXTURES = ("simulated",)
#: Fixture scopes wider than a test but narrower than the session: such a fixture runs once per module (or class).
MODULE_SCOPES = frozenset({"package", "module", "class"})


def _fixture_scope(decorator: ast.expr) -> str | None:
    """The ``scope=`` of a ``@pytest.fixture(...)`` decorator ("function" when it has none), else None."""
    call = decorator if isinstance(decorator, ast.Call) else None
    target = call.func if call else decorator
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    if name != "fixture":
        return None
    scopes = [
        k.value.value for k in (call.keywords if call else []) if k.arg == "scope" and isinstance(k.value, ast.Constant)
    ]
    return scopes[0] if scopes else "function"


@functools.cache
def _module_sharing(file: str, source: str | None = None) -> str | None:
    """What the tests of test module ``file`` (its ``source``, read from the repository if None) share: the name of a
    `SHARED_SESSION_FIXTURES` fixture that a test or fixture of it takes; else "module" when it defines a module-
    (or class-) scoped fixture; else None."""
    if source is None:
        path = Path(REPO) / file
        if not path.is_file():
            return None
        source = path.read_text()
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    arguments = {a.arg for f in functions for a in [*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs]}
    shared = [name for name in SHARED_SESSION_FIXTURES if name in arguments]
    if shared:
        return shared[0]
    if any(_fixture_scope(d) in MODULE_SCOPES for f in functions for d in f.decorator_list):
        return "module"
    return None


def xdist_work_unit(nodeid: str, source: str | None = None) -> str:
    """The pytest-xdist work unit of test ``nodeid`` under ``make test``'s ``-n 2 --dist loadgroup`` (a unit runs on
    one worker; `pytest_xdist_make_scheduler`): for a test under tests/e2e, the name of a `SHARED_SESSION_FIXTURES`
    fixture its module uses (every such module together), else its file when its module has a module- or
    class-scoped fixture (one simulator run or deployment its tests share), else the test alone, as every test outside
    tests/e2e. ``source``: the module's text (default: read from the repository). Read from the test files' syntax,
    as the scheduler sees node-ids only."""
    file = nodeid.split("::", 1)[0]
    if not nodeid.startswith(E2E_DIR):
        return nodeid
    sharing = _module_sharing(file, source)
    if sharing is None:
        return nodeid
    return file if sharing == "module" else sharing


#: Set to a path, the session writes there what each test took (setup + call + teardown, seconds by node-id).
RECORD_TEST_SECONDS_ENV = "FL_RECORD_TEST_SECONDS"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` with `xdist_work_unit`'s units instead of ``xdist_group`` markers: pytest-xdist 3.8 marks
    a group by appending it to the test's node-id, which pytest 9.2 ignores (every test was its own unit, and each
    worker ran the module fixtures it needed again). Other ``--dist`` modes: xdist's own scheduler."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_work_unit(nodeid)

    return WorkUnitScheduling(config, log)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        for name in sorted(tier_markers(item.nodeid)):
            item.add_marker(name)


#: (seconds, node-id) of the tests whose call took over FAST_TIER_LIMIT_S in this session.
_over_limit: list[tuple[float, str]] = []


#: node-id -> seconds of the tests this session ran (setup + call + teardown), for `RECORD_TEST_SECONDS_ENV`.
_test_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.duration > FAST_TIER_LIMIT_S:
        _over_limit.append((report.duration, report.nodeid))
    _test_seconds[report.nodeid] = _test_seconds.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    """Under `RECORD_TEST_SECONDS_ENV`, write what each test took as JSON (on the controller of an xdist session,
    which receives every worker's reports; a worker writes nothing): ``FL_RECORD_TEST_SECONDS=/tmp/e2e.json make
    test-e2e`` tells whether the end-to-end tier's time is its tests' work or a worker left idle (docs/results.md)."""
    target = os.environ.get(RECORD_TEST_SECONDS_ENV)
    if target and not hasattr(session.config, "workerinput") and _test_seconds:
        rounded = {nodeid: round(seconds, 1) for nodeid, seconds in sorted(_test_seconds.items())}
        Path(target).write_text(json.dumps(rounded, indent=1) + "\n")


def pytest_terminal_summary(terminalreporter, config) -> None:
    """In a fast-tier session, the tests that took too long for it: the tier stays fast only if they move out."""
    if "not slow" in (config.getoption("markexpr", "") or "") and _over_limit:
        terminalreporter.section(
            f"fast tier: tests over {FAST_TIER_LIMIT_S:g} s (add them to tests/conftest.py SLOW_TESTS)"
        )
        for seconds, nodeid in sorted(_over_limit, reverse=True):
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")
