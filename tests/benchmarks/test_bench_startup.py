"""The start-up benchmark's options for a GPU session: the -t 1 job from a committed preset with settings on top,
the nvflare command found where ``pip --target`` puts it, and a shipped package importable in the measured client."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import startup


def test_the_t1_job_is_the_tiny_one_unless_a_preset_is_named():
    assert startup.t1_job(None, {"precision": "bf16-mixed"}) == ("", {**startup.TINY_T1_JOB, "precision": "bf16-mixed"})
    assert startup.t1_job("snp_fedavg", {"tracking": "none"}) == ("snp_fedavg", {"tracking": "none"})


def test_a_preset_t1_job_has_two_rounds_and_the_settings_on_top(tmp_path, monkeypatch):
    settings = json.dumps({"precision": "bf16-mixed", "tracking": "none"})
    monkeypatch.setattr(sys, "argv", ["-c", str(tmp_path), "fedavg", settings])
    exec(startup.T1_EXPORT, {})  # in process (a subprocess costs seconds of imports); the code the benchmark runs
    config = tmp_path / "startup_t1" / "app" / "config"
    server = json.loads((config / "config_fed_server.json").read_text())
    assert '"num_rounds": 2' in json.dumps(server) and "tb_receiver" not in json.dumps(server)
    client_args = json.loads((config / "config_fed_client.json").read_text())["executors"][0]["executor"]["args"]
    assert "bf16-mixed" in client_args["task_script_args"]


def test_nvflare_is_found_beside_the_interpreter_else_on_path(tmp_path, monkeypatch):
    env_bin, target_bin = tmp_path / "env" / "bin", tmp_path / "site" / "bin"
    for folder in (env_bin, target_bin):
        folder.mkdir(parents=True)
        (folder / "nvflare").write_text("#!/bin/sh\n")
        (folder / "nvflare").chmod(0o755)
    assert startup.nvflare_command(str(env_bin / "python")) == str(env_bin / "nvflare")
    monkeypatch.setenv("PATH", str(target_bin))
    assert startup.nvflare_command(str(tmp_path / "python3")) == str(target_bin / "nvflare")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(RuntimeError, match=r"no nvflare command beside .* or on PATH"):
        startup.nvflare_command(str(tmp_path / "python3"))


def test_simulate_args_must_be_a_json_object(capsys):
    with pytest.raises(SystemExit):
        startup.parse_args(["--simulate-args", "[1]"])
    assert "--simulate-args must be a JSON object of job settings, got [1]" in capsys.readouterr().err


def test_the_measured_client_imports_a_package_shipped_beside_it(tmp_path):
    custom = tmp_path / "custom"
    (custom / "shipped_pkg").mkdir(parents=True)
    (custom / "shipped_pkg" / "__init__.py").write_text("VALUE = 7\n")
    (custom / "client.py").write_text("import shipped_pkg\nassert shipped_pkg.VALUE == 7\n")
    command = [sys.executable, startup.__file__, "--harness", str(custom / "client.py"), "--"]
    done = subprocess.run(command, cwd=tmp_path, env=startup.code_env(startup.ROOT), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["script_s"] >= 0
