"""The report reads every kind of folder a run leaves: a simulator workspace (``nvflare simulator -w``, the recipe's
SimEnv ``<workspace_root>/<job name>``), a job result downloaded from a POC or provisioned server
(``<transfer>/<job id>/`` and its ``workspace/``), and the server's own run folder ``<server workspace>/<job id>/``.
Synthetic folders laid out as NVFlare 2.9 writes them; a folder with none of them is one error line naming every
place looked at."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controllers import report
from tests.controllers.test_ctl_report import initial, round_record

RECORDS = [initial(2), round_record(0), round_record(1)]


def write_run(run_dir: Path, records=RECORDS) -> Path:
    """A server run folder as the controller leaves it: metrics/, app_server/ and the final site scores."""
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "metrics" / "round_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "metrics" / "final_site_scores.json").write_text(json.dumps({"sites": {"site-1": {"val_acc": 0.5}}}))
    (run_dir / "app_server").mkdir()
    (run_dir / "app_server" / "FL_global_model.pt").write_bytes(b"")
    return run_dir


def downloaded_job(transfer: Path, job_id: str = "3f1c-job") -> Path:
    """``session.download_job_result(job_id)``: <transfer>/<job id>/ with meta.json, job/ and workspace/."""
    job = transfer / job_id
    write_run(job / "workspace")
    (job / "job").mkdir()
    (job / "meta.json").write_text(json.dumps({"status": "FINISHED:COMPLETED", "job_id": job_id}))
    return job


@pytest.mark.parametrize(
    ("make", "run_dir"),
    [
        pytest.param(
            lambda root: write_run(root / "server" / "simulate_job") and root, "server/simulate_job", id="sim"
        ),
        pytest.param(lambda root: downloaded_job(root / "transfer"), "workspace", id="downloaded-job"),
        pytest.param(lambda root: downloaded_job(root / "transfer") / "workspace", "", id="downloaded-workspace"),
        pytest.param(lambda root: write_run(root / "server_ws" / "3f1c-job"), "", id="server-run-folder"),
    ],
)
def test_every_layout_is_read_and_its_files_are_named(tmp_path, capsys, make, run_dir) -> None:
    folder = make(tmp_path)
    assert report.find_run_dir(folder) == folder / run_dir
    assert len(report.load_records(folder)) == 3
    assert report.main([str(folder), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert f"global model: {folder / run_dir / 'app_server' / 'FL_global_model.pt'}" in out
    assert f"metrics:      {folder / run_dir / 'metrics' / 'round_metrics.jsonl'}" in out
    assert "the final global model at every site" in out and "site-1" in out


def test_the_recipe_sim_env_result_is_a_simulator_workspace(tmp_path) -> None:
    # SimEnv(workspace_root=R).get_job_result(job) is R/<job name>, which the simulator fills like -w.
    workspace = tmp_path / "simulation" / "scaffold"
    write_run(workspace / "server" / "simulate_job")
    assert report.find_run_dir(workspace) == workspace / "server" / "simulate_job"


def test_a_folder_without_metrics_is_one_line_naming_every_place_looked(tmp_path, capsys) -> None:
    empty = tmp_path / "nothing"
    empty.mkdir()
    with pytest.raises(FileNotFoundError) as caught:
        report.find_run_dir(empty)
    message = str(caught.value)
    assert "\n" not in message
    for place in ("server/simulate_job/metrics", "workspace/metrics", f"{empty}/metrics/round_metrics.jsonl"):
        assert place in message, place
    assert report.main([str(empty), "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: no metrics in {empty}")


def test_a_folder_that_does_not_exist_says_so(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no metrics in .*/gone: it does not exist$"):
        report.find_run_dir(tmp_path / "gone")


def test_the_admin_transfer_folder_names_the_jobs_it_holds(tmp_path) -> None:
    transfer = tmp_path / "transfer"
    downloaded_job(transfer, "job-a")
    downloaded_job(transfer, "job-b")
    with pytest.raises(FileNotFoundError, match=r"it holds runs: .*job-a, .*job-b: name one"):
        report.find_run_dir(transfer)


def test_the_metrics_file_itself_names_its_run(tmp_path) -> None:
    run_dir = write_run(tmp_path / "run")
    assert report.find_run_dir(run_dir / "metrics" / "round_metrics.jsonl") == run_dir
    other = run_dir / "metrics" / "final_site_scores.json"  # any other file is no run
    with pytest.raises(FileNotFoundError, match="no metrics in"):
        report.find_run_dir(other)
