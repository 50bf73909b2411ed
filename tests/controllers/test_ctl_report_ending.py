"""How a run that stopped early ended, as the report says it: from the logs NVFlare 2.9 leaves in a simulator
workspace (or a downloaded job's meta.json), never a guess. The log lines are trimmed from three measured simulator
runs of a 2-site, 3-round job (nvflare 2.9.0): an evaluator raising in round 2 (exit code 2), a site's script
raising in round 2 (exit code 2), the client script missing (exit code 0), and a run killed with SIGKILL after
round 1 (no shutdown in its log)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aggregators.contracts import run_outcome
from controllers import report
from tests.controllers.test_ctl_report import initial, round_record, write_metrics
from tests.controllers.test_ctl_report_layouts import write_run

CTX = "[identity=simulator_server, run=simulate_job, wf=controller]"
GOODBYE = "2026-11-27 21:24:33,309 - MPM - INFO - MPM: Good Bye!\n"
ROUND_2 = f"2026-11-27 21:25:18,270 - FedAlgController - INFO - {CTX} - round 2/3: training on ['site-1', 'site-2']\n"
FATAL = (
    f"2026-11-27 21:24:18,491 - ServerRunner - ERROR - {CTX} - Aborting current RUN due to FATAL_SYSTEM_ERROR "
    "received: Exception in model controller run: RuntimeError: boom: injected evaluator failure\n"
)
CONTROLLER_TRACEBACK = (
    f"2026-11-27 21:24:18,489 - FedAlgController - ERROR - {CTX} - Exception in model controller run: "
    "RuntimeError: boom: injected evaluator failure\n"
    "2026-11-27 21:24:18,491 - FedAlgController - ERROR - Traceback (most recent call last):\n"
    '  File "/work/main/controllers/fedalg_controller.py", line 230, in run\n'
    "    final_params, _ = engine.run(\n"
    "RuntimeError: boom: injected evaluator failure\n\n"
)
SITE_TRACEBACK = (
    "2026-11-27 21:26:23,082 - TaskScriptRunner - ERROR - Traceback (most recent call last):\n"
    '  File "/tmp/ws/site-2/simulate_job/app_site-2/custom/client.py", line 28, in receive\n'
    '    raise RuntimeError("boom: injected client failure")\n'
    "RuntimeError: boom: injected client failure\n\n"
    "2026-11-27 21:26:23,082 - TaskScriptRunner - ERROR - fire abort event\n"
)
SITE_BAD_RESULT = (
    f"2026-11-27 21:26:23,117 - ServerRunner - ERROR - {CTX} - Aborting current RUN due to FATAL_SYSTEM_ERROR "
    "received: Result from site-2 is bad, error code: TASK_ABORTED.\n"
)
MISSING_SCRIPT = (
    "2026-11-27 21:26:54,056 - ClientAPIExecutor - ERROR - [identity=site-1, run=simulate_job] - Traceback (most "
    "recent call last):\n"
    '  File "/work/main/.venv/lib/python3.11/site-packages/nvflare/app_common/executors/task_script_runner.py", '
    "line 193, in get_script_full_path\n"
    "    raise ValueError(msg)\n"
    "ValueError: Can not find client.py\n\n"
    "2026-11-27 21:26:54,056 - ClientRunner - ERROR - [identity=site-1, run=simulate_job] - Stopped ClientRunner due "
    "to FATAL_SYSTEM_ERROR: ClientAPIExecutor cannot start: ValueError: Can not find client.py\n"
)
ROUND_1_FAILED = (
    f"2026-11-27 21:26:55,628 - FedAlgController - ERROR - {CTX} - round 1: only 0 valid result(s), 1 needed; the "
    "global model is left unchanged this round\n"
)


def simulator_run(root: Path, server_log: str, errors: dict[str, str], rounds: int = 1) -> Path:
    """A simulator workspace of a 3-round job that recorded ``rounds`` rounds, with these logs."""
    workspace = write_metrics(root, [initial(3), *(round_record(i) for i in range(rounds))])
    (workspace / "server" / "log.txt").write_text(server_log)
    for participant, text in errors.items():
        (workspace / participant).mkdir(exist_ok=True)
        (workspace / participant / "error_log.txt").write_text(text)
    return workspace


def ending(workspace: Path) -> str:
    return run_outcome.how_it_ended(workspace, report.find_run_dir(workspace))


def test_a_fatal_error_on_the_server_is_the_exit_code_2_case_with_its_first_error(tmp_path) -> None:
    errors = {"server": CONTROLLER_TRACEBACK + FATAL, "site-1": "", "site-2": ""}
    line = ending(simulator_run(tmp_path / "ws", ROUND_2 + FATAL + GOODBYE, errors))
    assert "FATAL_SYSTEM_ERROR" in line and "exits 2" in line and "exits 0" not in line
    assert line.endswith(
        "first error (server/error_log.txt, 2026-11-27 21:24:18): Exception in model controller run: "
        "RuntimeError: boom: injected evaluator failure"
    )
    assert "\n" not in line


def test_the_first_error_is_the_earliest_of_all_participants_and_a_traceback_gives_its_exception(tmp_path) -> None:
    errors = {"server": SITE_BAD_RESULT, "site-1": "", "site-2": SITE_TRACEBACK}
    line = ending(simulator_run(tmp_path / "ws", ROUND_2 + SITE_BAD_RESULT + GOODBYE, errors))
    assert "exits 2" in line
    assert line.endswith(
        "first error (site-2/error_log.txt, 2026-11-27 21:26:23): RuntimeError: boom: injected client failure"
    )


def test_a_run_the_simulator_ended_itself_is_the_exit_code_0_case(tmp_path) -> None:
    # A site's own FATAL_SYSTEM_ERROR does not make the simulator exit 2: only the server's does (measured: exit 0).
    errors = {"server": ROUND_1_FAILED, "site-1": MISSING_SCRIPT}
    line = ending(simulator_run(tmp_path / "ws", ROUND_1_FAILED + GOODBYE, errors))
    assert "without a fatal error" in line and "exits 0" in line and "exits 2" not in line
    assert line.endswith("first error (site-1/error_log.txt, 2026-11-27 21:26:54): ValueError: Can not find client.py")


def test_a_killed_run_is_told_by_its_log_stopping_without_the_shutdown(tmp_path) -> None:
    line = ending(simulator_run(tmp_path / "ws", ROUND_2, {"server": "", "site-1": ""}))
    assert "stops at 2026-11-27 21:25:18 without NVFlare's shutdown" in line and "killed" in line
    assert "exits 0" not in line and "exits 2" not in line
    assert line.endswith("no error logged")


def test_a_downloaded_job_says_nvflares_job_status(tmp_path) -> None:
    job = tmp_path / "transfer" / "job-1"
    write_run(job / "workspace", [initial(3), round_record(0)])
    (job / "meta.json").write_text(json.dumps({"status": "FINISHED:ABORTED"}))
    line = ending(job)
    assert line.startswith(f"NVFlare's job status: FINISHED:ABORTED ({job / 'meta.json'})")
    assert "simulator" not in line


def test_the_report_prints_how_the_run_ended_and_no_guess(tmp_path, capsys) -> None:
    workspace = simulator_run(tmp_path / "ws", ROUND_2, {"server": ""})
    assert report.main([str(workspace), "--plot", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert "error: ws: the job stopped after round 1 of 3\n" in err
    assert "error: ws: how it ended: the server's log" in err and "killed" in err
    assert "the simulator exits 0 on an abort" not in err


def test_scripts_get_how_it_ended_in_the_error(tmp_path) -> None:
    workspace = simulator_run(tmp_path / "ws", ROUND_2 + FATAL + GOODBYE, {"server": FATAL})
    with pytest.raises(RuntimeError, match=r"stopped after round 1 of 3; how it ended: .*exits 2.*\nlog tail"):
        report.finished_records(workspace, "log tail")


def test_an_empty_metrics_file_also_says_how_the_run_ended(tmp_path, capsys) -> None:
    workspace = write_metrics(tmp_path / "ws", [])
    (workspace / "server" / "log.txt").write_text(GOODBYE)
    (workspace / "site-1").mkdir()
    (workspace / "site-1" / "error_log.txt").write_text(MISSING_SCRIPT)
    assert report.main([str(workspace), "--plot", str(tmp_path / "p.png")]) == 1
    assert "ValueError: Can not find client.py" in capsys.readouterr().err


def test_a_workspace_without_logs_says_so(tmp_path) -> None:
    workspace = write_metrics(tmp_path / "ws", [initial(3), round_record(0)])
    assert ending(workspace) == f"no NVFlare log in {workspace} says how the run ended; no error logged"
