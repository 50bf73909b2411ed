"""A kept loopback deployment (``--keep``) stopped from another process, as a user does after ``make poc
POC_ARGS=--keep``: ``python -m jobs.provision.loopback --stop WORKSPACE`` (``make poc-stop``) shuts the server down
through the admin's ``shutdown all`` and leaves no process of the deployment running.

Sandboxed as tests/e2e/test_e2e_provision.py: HOME and the kits under ``tmp_path``, a port free at test time; the
deployment is provisioned and started, not given a job (the job's own run is that file's test)."""

from __future__ import annotations

import subprocess
import sys

from jobs.provision import loopback


def test_a_kept_deployment_is_stopped_from_another_process(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    env = loopback.participant_env()
    deployment = loopback.provision(tmp_path / "fl", 2, env)
    for participant in [deployment.server, *deployment.sites.values()]:
        loopback.allow_bundle_classes(participant)
    loopback.keep_server_storage_inside(deployment.server)
    try:
        loopback.start(deployment, env)
        with loopback.admin_session(deployment) as session:
            loopback.wait_for_sites(session, deployment)
        assert loopback.leftover_processes(deployment), "nothing of the deployment is running before the stop"
        command = [sys.executable, "-m", "jobs.provision.loopback", "--stop", str(deployment.workspace)]
        stopped = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        for process in deployment.processes.values():  # this process started them: reap them
            process.wait(timeout=30)
        left = loopback.leftover_processes(deployment)
    finally:
        loopback.stop(deployment)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert f"stopped: no process of the deployment in {deployment.workspace} is running" in stopped.stdout
    assert left == []
    assert "FL server shutdown" in (deployment.workspace / "server.out").read_text()
