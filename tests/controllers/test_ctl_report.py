"""The run report: a job that stopped early or never aggregated makes it exit 1 with the reason (the simulator
itself exits 0 when a job aborts)."""

from __future__ import annotations

import json
import sys

import pytest

from controllers import report


def write_metrics(workspace, records):
    path = workspace / report.METRICS
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return workspace


def initial(num_rounds=3):
    return {"stage": "initial", "round": None, "num_rounds": num_rounds, "test_accuracy": 0.1}


def round_record(i, status="aggregated", **extra):
    return {"stage": "round", "round": i, "status": status, "test_accuracy": 0.5, **extra}


def test_a_finished_run_exits_0(tmp_path, capsys):
    ws = write_metrics(tmp_path / "ws", [initial(), *(round_record(i) for i in range(3))])
    assert report.main([str(ws), "--plot", str(tmp_path / "p.png")]) == 0
    assert "error" not in capsys.readouterr().err


def test_missing_rounds_exit_1_and_say_where_the_job_stopped(tmp_path, capsys):
    ws = write_metrics(tmp_path / "ws", [initial(5), round_record(0), round_record(1)])
    assert report.main([str(ws), "--plot", str(tmp_path / "p.png")]) == 1
    assert "stopped after round 2 of 5" in capsys.readouterr().err


def test_without_matplotlib_a_short_job_still_says_why_it_stopped_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # importing it now fails as on a site install
    ws = write_metrics(tmp_path / "ws", [initial(5), round_record(0), round_record(1)])
    assert report.main([str(ws), "--plot", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert "error: ws: the job stopped after round 2 of 5" in err
    assert "error: no plot: the report's plot needs matplotlib, which a site install leaves out" in err
    assert err.index("stopped after round 2") < err.index("no plot") and not (tmp_path / "p.png").exists()


def test_a_run_whose_rounds_all_failed_exits_1_with_the_last_reason(tmp_path, capsys):
    rounds = [round_record(i, "failed", failure="rule 'fedadam' failed in aggregate") for i in range(3)]
    ws = write_metrics(tmp_path / "ws", [initial(), *rounds])
    assert report.main([str(ws), "--plot", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert "no round updated the global model" in err and "fedadam" in err
    assert err.count("warning:") == 3


def test_some_failed_rounds_are_warnings_not_errors(tmp_path, capsys):
    ws = write_metrics(tmp_path / "ws", [initial(2), round_record(0, "failed", failure="x"), round_record(1)])
    assert report.main([str(ws), "--plot", str(tmp_path / "p.png")]) == 0
    assert "warning: ws: round 1: x" in capsys.readouterr().err


def test_an_empty_metrics_file_is_an_error(tmp_path, capsys):
    assert report.completion_problems([]) == ["the metrics file is empty: the server stopped before its first round"]
    empty = write_metrics(tmp_path / "empty", [])
    assert report.main([str(empty), "--plot", str(tmp_path / "p.png")]) == 1
    assert "error: empty: the metrics file is empty" in capsys.readouterr().err
    finished = write_metrics(tmp_path / "ws", [initial(), *(round_record(i) for i in range(3))])
    assert report.main([str(finished), str(empty), "--plot", str(tmp_path / "p.png")]) == 1  # one bad run of two
    assert "error: empty: the metrics file is empty" in capsys.readouterr().err


def test_a_scaffold_control_runaway_is_named_by_site_and_round():
    def record(round_num, norms):
        return {
            "stage": "round",
            "round": round_num,
            "site_meta": {s: {report.LOCAL_NORM: n} for s, n in norms.items()},
        }

    records = [
        record(0, {"site-1": 1.0, "site-2": 2.0}),
        record(1, {"site-1": 4.9, "site-2": 2.5}),
        record(2, {"site-1": 30.0, "site-2": 2.4}),
    ]
    lines = report.control_runaways(records)
    assert len(lines) == 1 and lines[0].startswith("round 3: site-1's SCAFFOLD control ||c_i|| jumped from 4.9 to 30")
    assert report.control_runaways(records[:2]) == []  # x4.9 is growth, not a runaway


def test_scripts_that_run_the_simulator_get_the_records_only_of_a_finished_job(tmp_path):
    finished = write_metrics(tmp_path / "done", [initial(2), round_record(0), round_record(1)])
    assert len(report.finished_records(finished)) == 3
    aborted = write_metrics(tmp_path / "aborted", [initial(5), round_record(0)])
    with pytest.raises(RuntimeError, match=r"did not finish: the job stopped after round 1 of 5.*\nTraceback: boom"):
        report.finished_records(aborted, "Traceback: boom")
    with pytest.raises(RuntimeError, match=r"no metrics in .*\nsimulator log"):
        report.finished_records(tmp_path / "never-ran", "simulator log")


def summary(per_site, worst_site):
    values = list(per_site.values())
    return {
        "per_site": per_site,
        "mean": sum(values) / len(values),
        "worst": per_site[worst_site],
        "worst_site": worst_site,
        "spread": max(values) - min(values),
    }


def test_every_site_metric_is_summarised_and_per_site_on_request(tmp_path, capsys):
    evaluation = {
        "val_accuracy": summary({"site-1": 0.75, "site-2": 0.25}, "site-2"),
        "val_loss": summary({"site-1": 0.5, "site-2": 1.5}, "site-2"),
    }
    records = [initial(1), round_record(0, site_eval=evaluation)]
    ws = write_metrics(tmp_path / "ws", records)
    assert report.main([str(ws), "--plot", str(tmp_path / "p.png"), "--per-site"]) == 0
    out = capsys.readouterr().out
    assert "val_accuracy  mean 0.5000, worst 0.2500 (site-2), spread 0.5000" in out
    assert "val_loss      mean 1.0000, worst 1.5000 (site-2), spread 1.0000" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("site-")}
    assert rows == {"site-1": ["0.7500", "0.5000"], "site-2": ["0.2500", "1.5000"]}


def test_a_job_without_a_server_test_set_has_no_test_columns(tmp_path, capsys):
    records = [
        {"stage": "initial", "round": None, "num_rounds": 1},
        {"stage": "round", "round": 0, "status": "aggregated"},
    ]
    ws = write_metrics(tmp_path / "ws", records)
    assert report.main([str(ws), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "test acc" not in out and "final global test accuracy" not in out
    ws = write_metrics(tmp_path / "ws2", [initial(1), round_record(0)])
    report.main([str(ws), "--plot", str(tmp_path / "p2.png")])
    assert "test acc" in capsys.readouterr().out
