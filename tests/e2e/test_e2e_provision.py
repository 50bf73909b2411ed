"""A real deployment on loopback: ``nvflare provision``, server and three sites as separate processes, the committed
``jobs/scaffold`` submitted through the admin API, results checked, everything shut down. On the same deployment: a
job needing four sites is refused with NVFlare's reason, and a job without ``custom/`` runs from the installed
package under the class allow-list.

Sandboxed: HOME, kits, workspaces and the server's job store live under ``tmp_path``; the port is picked free at test
time; a finalizer kills every process of the deployment (also on failure) and the test fails if any is left.
The sites' training data comes from each site's own ``local/fedalg_site_data.json`` (300 samples per site), never
from the job; the bundle is used as installed in this ``.venv`` (the job carries only the client script).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from controllers import report
from jobs.build import JobSpec, export_job
from jobs.provision import loopback

REPO = Path(__file__).resolve().parents[2]
NUM_SITES = 3
JOB_TIMEOUT_S = 420.0
DATA = {"dataset": "fashion_mnist", "scheme": "dirichlet", "num_sites": NUM_SITES, "max_train_samples": 900}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, fashion_mnist):
    root = tmp_path_factory.mktemp("loopback")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(root / "home"))
        # A crashed site never reports its job's outcome; the server marks the job finished after this wait
        # (NVFlare's default: 900 s). test_a_site_killed_mid_job... crashes a site.
        patch.setenv("NVFLARE_CLIENT_OUTCOME_WAIT_TIMEOUT", "8")
        (root / "home").mkdir()
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", NUM_SITES, env)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        # Give up on unschedulable jobs after two tries one second apart (defaults: 10 tries, ~40 min).
        loopback.keep_server_storage_inside(
            deployment.server, {"max_schedule_count": 2, "min_schedule_interval": 1.0, "max_schedule_interval": 2.0}
        )
        for site, site_dir in deployment.sites.items():
            loopback.configure_site_data(site_dir, site, DATA)
        started = time.monotonic()
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                yield deployment, session
        finally:
            loopback.stop(deployment)
            left = loopback.leftover_processes(deployment)
            print(f"loopback deployment: {time.monotonic() - started:.1f} s from start to shutdown")
            shutil.rmtree(root, ignore_errors=True)
        assert not left, f"processes left behind: {left}"


def _initial_model() -> dict[str, np.ndarray]:
    from lightning_modules.classifier import FLClassifier

    config = json.loads((REPO / "jobs/scaffold/app/config/config_fed_server.json").read_text())
    persistor = next(c for c in config["components"] if c["id"] == "persistor")
    model = FLClassifier(**persistor["args"]["model"]["args"])
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def scaffold_run(deployment):
    """The committed ``jobs/scaffold`` run once on the deployment: (job id, final meta, downloaded result)."""
    deployment, session = deployment
    started = time.monotonic()
    job_id, meta = loopback.run_job(session, deployment, REPO / "jobs" / "scaffold", JOB_TIMEOUT_S)
    result = loopback.download_result(session, job_id)
    print(f"jobs/scaffold on the loopback deployment: {time.monotonic() - started:.1f} s")
    return job_id, meta, result


def _records(result: Path) -> list[dict]:
    return [json.loads(line) for line in (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()]


def test_scaffold_job_runs_on_provisioned_sites(deployment, scaffold_run):
    deployment, _ = deployment
    job_id, meta, result = scaffold_run

    assert meta["status"] == "FINISHED:COMPLETED", meta
    assert meta.get("byoc") is True  # the client script travels in app/custom/: NVFlare treats the job as BYOC
    records = _records(result)
    rounds = [r for r in records if r["stage"] == "round"]
    assert len(rounds) == 10
    assert all(r["aggregated"] == sorted(deployment.sites) and not r["rejected"] for r in rounds)
    digests = [records[0]["global_sha256"]] + [r["global_sha256"] for r in rounds]
    assert len(set(digests)) == len(digests), "the global model must change every round"
    # The saved global model is not the initial one.
    saved = torch.load(result / "app_server" / "FL_global_model.pt", weights_only=False)["model"]
    initial = _initial_model()
    assert set(saved) == set(initial)
    assert any(not np.allclose(saved[k].numpy(), initial[k]) for k in initial)
    # Each site trained on its own configured data and persisted its SCAFFOLD control in its own workspace.
    for site, site_dir in deployment.sites.items():
        assert (site_dir / "client_state" / records[0]["run_id"] / site / "scaffold.state").is_file()
        log = (site_dir / job_id / "log.txt").read_text()
        assert f"training data from {site_dir / 'data' / 'train.npz'}" in log
        assert rounds[0]["site_num_samples"][site] == len(np.load(site_dir / "data" / "train.npz")["y"])
    # Per-site training curves streamed to the server as TensorBoard event files.
    for site in deployment.sites:
        assert list((result / "tb_events" / site).glob("events.out.tfevents.*")), site
    # The report reads the downloaded result as the deployment tutorial runs it: <transfer>/<job id> or its workspace/.
    for folder in (result.parent, result):
        assert report.main([str(folder), "--plot", str(result.parent / "report.png")]) == 0, folder


def test_job_needing_more_sites_than_connected_is_refused(deployment, tmp_path):
    deployment, session = deployment
    job = tmp_path / "needs_four"
    shutil.copytree(REPO / "jobs" / "scaffold", job)
    meta_file = job / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "min_clients": NUM_SITES + 1}))

    job_id = loopback.submit(session, deployment, job)
    final = session.wait_for_job(job_id, timeout=60, poll_interval=1.0)

    assert final["status"] == "FINISHED:CAN_NOT_SCHEDULE", final
    history = " ".join(final.get("schedule_history", []))
    assert f"connected sites ({NUM_SITES}) < min_sites ({NUM_SITES + 1})" in history


def test_job_without_custom_code_runs_from_the_installed_package_under_the_allow_list(deployment, tmp_path):
    deployment, session = deployment
    spec = JobSpec(name="fedavg_installed", num_rounds=2, max_test_samples=500)
    job = loopback.installed_script_job(export_job(spec, tmp_path / "exported"), tmp_path / "fedavg_installed")
    assert not list(job.rglob("custom")) and not list(job.rglob("*.py"))

    job_id, meta = loopback.run_job(session, deployment, job, JOB_TIMEOUT_S)

    assert meta["status"] == "FINISHED:COMPLETED", meta
    assert not meta.get("byoc"), "a job without custom/ must not be BYOC: the allow-list applies"
    result = loopback.download_result(session, job_id)
    records = [json.loads(line) for line in (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()]
    assert [r["aggregated"] for r in records if r["stage"] == "round"] == [sorted(deployment.sites)] * 2


def _server_metrics(deployment, job_id: str) -> list[dict]:
    """The running job's round records, read from the server's run folder while the job runs: its complete lines
    only (the server may be writing the last one)."""
    for path in deployment.server.glob(f"{job_id}/**/round_metrics.jsonl"):
        return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]
    return []


def _crash(deployment, name: str, job_id: str) -> None:
    """SIGKILL a whole participant (``server`` or a site), as a machine that loses power: its parent process group
    first (so nothing is left to report the job process's death), then its job process for ``job_id``, which runs
    in a session of its own. The participant is then down until `loopback.restart`."""
    import psutil

    kit = deployment.server if name == "server" else deployment.sites[name]
    process = deployment.processes.pop(name)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    for job_process in psutil.process_iter(["pid", "cmdline"]):
        cmdline = job_process.info["cmdline"] or []
        if any(job_id in arg for arg in cmdline) and any(str(kit) in arg for arg in cmdline):
            job_process.kill()
            return
    raise AssertionError(f"no job process of {name} for job {job_id}")


def _wait_for_round(deployment, job_id: str, round_num: int) -> None:
    """Block until the server's run folder holds round ``round_num`` of the job ``job_id`` (its metrics looked at
    every 0.2 s, its status every 10 looks). A job that has ended (NVFlare's status FINISHED:*, e.g.
    CAN_NOT_SCHEDULE) records no more rounds: that fails at the first look at its status, naming it and what the
    server said, and so does a job still without that round after `JOB_TIMEOUT_S` (in CI the deployment's start and
    a whole 10-round jobs/scaffold run took 42-44 s together)."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    with loopback.admin_session(deployment) as session:
        while True:
            for _ in range(10):
                if any(r.get("round") == round_num for r in _server_metrics(deployment, job_id)):
                    return
                time.sleep(0.2)
            meta = session.get_job_meta(job_id)
            if str(meta.get("status")).startswith("FINISHED") or time.monotonic() > deadline:
                raise AssertionError(_not_recorded(deployment, session, job_id, round_num, meta))


def _not_recorded(deployment, session, job_id: str, round_num: int, meta: dict) -> str:
    """Why round ``round_num`` of ``job_id`` is missing, as far as the server tells: the job's status and
    scheduling history, the rounds recorded so far, the sites the server lists, the end of the server's log."""
    rounds = [r["round"] for r in _server_metrics(deployment, job_id) if r.get("stage") == "round"]
    try:
        listed = {c.name: time.ctime(c.last_connect_time or 0) for c in session.get_system_info().client_info}
    except Exception as exc:  # the server may be down: the rest still says what happened
        listed = f"unknown ({exc})"
    log = deployment.server / "log.txt"
    tail = log.read_text()[-3000:] if log.is_file() else "(no log.txt)"
    return (
        f"round {round_num} of job {job_id} not recorded: the job is {meta.get('status')} (rounds recorded: "
        f"{rounds or 'none'}); schedule history: {meta.get('schedule_history')}; sites listed (registered at): "
        f"{listed}; the server's log ends:\n{tail}"
    )


def _restart_site(deployment, site: str, timeout: float = 120.0) -> None:
    """Start the crashed ``site`` again and wait until the server holds its new registration. Waiting until the
    server lists the site is not enough: it keeps listing a SIGKILLed site (NVFlare drops a site only after 600 s
    without a heartbeat), so that holds before the new process has registered, and a job submitted then is refused
    in seconds (FINISHED:CAN_NOT_SCHEDULE: 2 of 3 sites answer the scheduler's resource check, twice)."""
    since = time.time()
    loopback.restart(deployment, site, loopback.participant_env())
    with loopback.admin_session(deployment) as session:
        loopback.wait_for_sites(session, deployment, timeout, registered_after={site: since})


def _restart_server(deployment) -> None:
    """Start the crashed server again and wait for the live sites to reconnect. (NVFlare 2.9 still lists the job the
    server was running as RUNNING after the restart, while ``abort_job`` answers that it is not running.)"""
    loopback.restart(deployment, "server", loopback.participant_env())
    with loopback.admin_session(deployment) as session:
        loopback.wait_for_sites(session, deployment, sites=[s for s in deployment.sites if s in deployment.processes])


def _resume_point_copy(deployment, job_id: str, target: Path) -> Path:
    """The crashed job's server app folder (server_state.pt + the global model), copied out of the job's run folder."""
    return Path(shutil.copytree(deployment.server / job_id / "app_server", target))


def _site_state(
    site_dir: Path, site: str, run_id: str, aggregated_round: int | None, algorithm: str = "scaffold"
) -> dict[str, np.ndarray]:
    """The site's algorithm state (SCAFFOLD's c_i, FedDyn's H_k) as of its last aggregated round: its pending state
    if that round wrote it (not settled yet: the job ended), else its committed one; empty for a site that was never
    aggregated (its state as the server knows it is still the initial 0)."""
    from lightning_modules.state_store import ClientStateStore

    store = ClientStateStore(site_dir / "client_state" / run_id, site)
    if aggregated_round is None:
        return {}
    pending = store.latest(algorithm)
    stored = pending if pending.round_num == aggregated_round else store.load(algorithm)
    assert stored.round_num == aggregated_round, (site, stored.round_num, aggregated_round)
    return {k: v.numpy() for k, v in stored.state.items() if isinstance(v, torch.Tensor)}


def _site_states(deployment, run_id: str, last_aggregated: dict, algorithm: str) -> list[dict[str, np.ndarray]]:
    """Every site's state as the server counts it (a never-aggregated site's as zeros)."""
    states = [
        _site_state(deployment.sites[s], s, run_id, last_aggregated.get(s), algorithm) for s in sorted(deployment.sites)
    ]
    shapes = next(state for state in states if state)
    return [state or {k: np.zeros_like(v) for k, v in shapes.items()} for state in states]


def test_a_site_killed_mid_job_leaves_rounds_of_the_others_and_scaffold_state_consistent(deployment, tmp_path):
    """Site-3 crashes (SIGKILL to all its processes) once the first round is recorded. The job goes on
    (min_responses 2, so the job needs 2 live sites), the remaining rounds aggregate the two live sites, the
    server's SCAFFOLD control stays the population mean c = (1/3) sum_i c_i of every site's control as of its last
    aggregated round, and the crashed site's state files are intact and readable. Site-3 then comes back.

    (A site whose *job process* alone dies is reported by its parent as a job failure, and NVFlare 2.9 then fails
    the whole job: the site must crash as a whole, or leave, for the others to go on.)"""
    from controllers.checkpoint import load_resume_point

    deployment, session = deployment
    spec = JobSpec(
        name="kill_site",
        client="scaffold",
        server="scaffold",
        num_rounds=4,
        min_responses=2,
        epochs=15,
        max_test_samples=200,
        num_sites=NUM_SITES,
    )
    job_id = loopback.submit(session, deployment, export_job(spec, tmp_path / "exported"))
    _wait_for_round(deployment, job_id, 0)
    _crash(deployment, "site-3", job_id)
    try:
        meta = session.wait_for_job(job_id, timeout=JOB_TIMEOUT_S, poll_interval=1.0)
        result = loopback.download_result(session, job_id)

        logs = "\n".join(p.read_text()[-4000:] for p in result.rglob("log.txt"))
        assert meta["status"] == "FINISHED:COMPLETED", logs
        records = [json.loads(line) for line in (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()]
        rounds = [r for r in records if r["stage"] == "round"]
        assert [r["status"] for r in rounds] == ["aggregated"] * 4
        assert all("site-3" not in r["aggregated"] and len(r["aggregated"]) == 2 for r in rounds[2:]), rounds
        resume = load_resume_point(result / "app_server", "scaffold")
        last = resume.last_aggregated_sites
        # site-3 may or may not have been among the first min_responses = 2 results of round 1 (the server goes on as
        # soon as two are in): either way it was never aggregated after the crash.
        assert last["site-1"] == last["site-2"] == 3 and last.get("site-3", -1) < 3, last
        run_id = records[0]["run_id"]
        controls = _site_states(deployment, run_id, last, "scaffold")
        for key, value in resume.state["control"].items():
            np.testing.assert_allclose(value, np.mean([c[key] for c in controls], axis=0), atol=1e-6, err_msg=key)
        leftovers = list((deployment.sites["site-3"] / "client_state" / run_id).rglob("*.tmp*"))
        # A SIGKILL between the atomic write's mkstemp and its rename leaves that write's temporary behind: never
        # read (the state files above loaded intact), removed by the site's next save (test_state_store.py).
        assert all(p.name.startswith(".") and p.name.endswith(".tmp") for p in leftovers), leftovers
    finally:
        # The machine comes back (also when an assertion above failed, so that the next tests find 3 sites): the
        # site restarts from its kit and registers again.
        _restart_site(deployment, "site-3")


def test_the_server_crashed_mid_job_restarts_and_the_resumed_job_continues_bit_identically(
    deployment, scaffold_run, tmp_path
):
    """The committed jobs/scaffold again; the server crashes (SIGKILL to all its processes) once round 4 of 10 is
    recorded, while the sites train the next one. The server restarts from its kit, the sites reconnect by
    themselves, and the same job submitted with ``resume_from`` = the crashed run's app folder continues with the
    crashed run's id and gives, round by round, the global models of the uninterrupted run (``scaffold_run``) bit
    for bit: the sites discard the pending state of the interrupted round (a replay). At the end c = mean(c_i)."""
    from controllers.checkpoint import load_resume_point

    deployment, _ = deployment
    _, reference_meta, reference = scaffold_run
    assert reference_meta["status"] == "FINISHED:COMPLETED", reference_meta
    with loopback.admin_session(deployment) as session:
        job_id = loopback.submit(session, deployment, REPO / "jobs" / "scaffold")
    _wait_for_round(deployment, job_id, 3)
    crashed_run_id = _server_metrics(deployment, job_id)[0]["run_id"]
    _crash(deployment, "server", job_id)
    _restart_server(deployment)
    resume_point = _resume_point_copy(deployment, job_id, tmp_path / "resume_point")
    job = Path(shutil.copytree(REPO / "jobs" / "scaffold", tmp_path / "scaffold_resumed"))
    config_file = job / "app" / "config" / "config_fed_server.json"
    config = json.loads(config_file.read_text())
    config["workflows"][0]["args"]["settings"]["resume_from"] = str(resume_point)
    config_file.write_text(json.dumps(config, indent=4))
    with loopback.admin_session(deployment) as session:
        resumed_id, meta = loopback.run_job(session, deployment, job, JOB_TIMEOUT_S)
        result = loopback.download_result(session, resumed_id)

    assert meta["status"] == "FINISHED:COMPLETED", meta
    expected = {r["round"]: r["global_sha256"] for r in _records(reference) if r["stage"] == "round"}
    last_saved = load_resume_point(resume_point, "scaffold").next_round - 1
    assert last_saved >= 3
    records = _records(result)
    assert records[0]["stage"] == "resumed" and records[0]["run_id"] == crashed_run_id
    assert records[0]["global_sha256"] == expected[last_saved]
    resumed = {r["round"]: r["global_sha256"] for r in records if r["stage"] == "round"}
    assert resumed == {k: v for k, v in expected.items() if k > last_saved}
    final = load_resume_point(result / "app_server", "scaffold")
    controls = _site_states(deployment, crashed_run_id, final.last_aggregated_sites, "scaffold")
    for key, value in final.state["control"].items():
        np.testing.assert_allclose(value, np.mean([c[key] for c in controls], axis=0), atol=1e-6, err_msg=key)


class _FakeAdmin:
    """The admin session as the wait helpers use it, without a deployment: the job's meta is ``meta``; the sites the
    server lists are ``stale`` (site: registration time) for the first ``stale_calls`` calls, then every one of them
    registered now."""

    def __init__(self, meta: dict | None = None, stale: dict[str, float] | None = None, stale_calls: int = 0) -> None:
        self.meta, self.stale, self.stale_calls = meta or {}, stale or {}, stale_calls
        self.meta_calls = self.info_calls = 0

    def get_job_meta(self, job_id: str) -> dict:
        self.meta_calls += 1
        return self.meta

    def get_system_info(self) -> SimpleNamespace:
        self.info_calls += 1
        now = time.time()
        listed = self.stale if self.info_calls <= self.stale_calls else dict.fromkeys(self.stale, now)
        return SimpleNamespace(client_info=[SimpleNamespace(name=n, last_connect_time=t) for n, t in listed.items()])


@pytest.fixture
def fake_admin(monkeypatch):
    """Install a `_FakeAdmin` as every `loopback.admin_session`; returns the function that installs one."""

    def install(admin: _FakeAdmin) -> _FakeAdmin:
        monkeypatch.setattr(loopback, "admin_session", lambda *a, **k: contextlib.nullcontext(admin))
        return admin

    return install


def _fake_run_folder(tmp_path: Path, job_id: str, text: str) -> SimpleNamespace:
    metrics = tmp_path / "server" / job_id / "metrics" / "round_metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    metrics.write_text(text)
    return SimpleNamespace(server=tmp_path / "server", sites={}, processes={}, workspace=tmp_path)


def test_the_running_jobs_records_leave_out_the_line_still_being_written(tmp_path):
    record = json.dumps({"stage": "round", "round": 0, "run_id": "r"})
    deployment = _fake_run_folder(tmp_path, "job", record + "\n" + record[:17])

    assert _server_metrics(deployment, "job") == [json.loads(record)]


def test_waiting_for_a_round_of_a_job_that_ended_fails_at_its_first_status_naming_it(tmp_path, fake_admin):
    """The job was refused (as after a site's restart that the server had not seen yet): no round will come. The
    wait fails at its first look at the job's status, with the status, the scheduler's reason and the rounds so far,
    not after `JOB_TIMEOUT_S` with "not recorded" alone."""
    refused = {
        "status": "FINISHED:CAN_NOT_SCHEDULE",
        "schedule_history": ["not enough sites have enough resources (ok sites 2 < min sites 3)"],
    }
    admin = fake_admin(_FakeAdmin(refused, {"site-1": 1.0}))
    deployment = _fake_run_folder(tmp_path, "job", json.dumps({"stage": "round", "round": 0}) + "\n")

    with pytest.raises(AssertionError) as failed:
        _wait_for_round(deployment, "job", 3)

    assert admin.meta_calls == 1
    message = str(failed.value)
    assert "FINISHED:CAN_NOT_SCHEDULE" in message and "ok sites 2 < min sites 3" in message, message
    assert "rounds recorded: [0]" in message, message


def test_a_restarted_site_counts_once_the_server_holds_its_new_registration_not_its_old_listing(
    tmp_path, fake_admin, monkeypatch
):
    """The server still lists the crashed site-3 (registered long ago) for three looks: the restart is not done
    until a look shows site-3 registered after the restart."""
    admin = fake_admin(_FakeAdmin(stale={"site-1": 1.0, "site-2": 1.0, "site-3": 1.0}, stale_calls=3))
    restarted = []

    def restart(deployment, name, env):
        restarted.append(name)
        deployment.processes[name] = SimpleNamespace(poll=lambda: None)

    monkeypatch.setattr(loopback, "restart", restart)
    deployment = SimpleNamespace(sites=dict.fromkeys(["site-1", "site-2", "site-3"]), processes={}, workspace=tmp_path)

    _restart_site(deployment, "site-3")

    assert restarted == ["site-3"] and admin.info_calls == 4


def _feddyn_spec(num_rounds: int, min_responses: int, resume_from: Path | None = None) -> JobSpec:
    return JobSpec(
        name="feddyn_faults",
        client="feddyn",
        server="feddyn",
        num_rounds=num_rounds,
        min_responses=min_responses,
        epochs=3,
        max_test_samples=200,
        num_sites=NUM_SITES,
        save_client_updates=True,
        resume_from=None if resume_from is None else str(resume_from),
    )


def test_a_site_down_when_the_job_resumes_stays_in_feddyns_population_and_rejoins_when_back(deployment, tmp_path):
    """FedDyn, min_responses 2. Site-3 crashes once round 0 is recorded, the server once round 1 is (round 1 from the
    two live sites). The server restarts while site-3 is still down, and the job resumed for one more round runs on
    the two sites NVFlare deploys it to, site-3 still counted: the global model is the participants' mean + h / m
    with m = 3 (recomputed from the saved client models; m = 2 would differ). Site-3 comes back; resumed once
    more with min_responses 3, the job aggregates all three, and the server's h equals the sum of the sites' H_k,
    site-3's settled from what it had written before its crash."""
    from aggregators.feddyn import feddyn_params
    from aggregators.types import ClientUpdate
    from controllers.checkpoint import load_resume_point, load_updates

    deployment, _ = deployment
    with loopback.admin_session(deployment) as session:
        first = loopback.submit(session, deployment, export_job(_feddyn_spec(5, 2), tmp_path / "first"))
    _wait_for_round(deployment, first, 0)
    _crash(deployment, "site-3", first)
    _wait_for_round(deployment, first, 1)
    _crash(deployment, "server", first)
    _restart_server(deployment)
    first_point = _resume_point_copy(deployment, first, tmp_path / "first_point")
    start = load_resume_point(first_point, "feddyn")
    with loopback.admin_session(deployment) as session:
        spec = _feddyn_spec(start.next_round + 1, 2, first_point)
        second, meta = loopback.run_job(session, deployment, export_job(spec, tmp_path / "second"), JOB_TIMEOUT_S)
        second_result = loopback.download_result(session, second)
    assert meta["status"] == "FINISHED:COMPLETED", meta
    round_num = start.next_round
    [record] = [r for r in _records(second_result) if r["stage"] == "round"]
    assert record["round"] == round_num and record["aggregated"] == ["site-1", "site-2"], record
    assert "resuming without ['site-3']" in (second_result / "log.txt").read_text()
    second_point = load_resume_point(second_result / "app_server", "feddyn")
    capture = load_updates(second_result / "client_updates" / f"round_{round_num:05d}.npz")
    updates = [ClientUpdate(site, p, capture.site_samples[site]) for site, p in capture.site_params.items()]
    h_sum = second_point.state["h_sum"]
    for m, equal in ((3, True), (2, False)):
        expected = feddyn_params(start.global_params, updates, h_sum, m)
        same = all(np.allclose(expected[k], second_point.global_params[k], atol=1e-6) for k in h_sum)
        assert same is equal, f"population {m}"

    _restart_site(deployment, "site-3")
    with loopback.admin_session(deployment) as session:
        spec = _feddyn_spec(round_num + 2, 3, second_result / "app_server")
        third, meta = loopback.run_job(session, deployment, export_job(spec, tmp_path / "third"), JOB_TIMEOUT_S)
        third_result = loopback.download_result(session, third)
    assert meta["status"] == "FINISHED:COMPLETED", meta
    [record] = [r for r in _records(third_result) if r["stage"] == "round"]
    assert record["round"] == round_num + 1 and record["aggregated"] == sorted(deployment.sites), record
    final = load_resume_point(third_result / "app_server", "feddyn")
    states = _site_states(deployment, final.run_id, final.last_aggregated_sites, "feddyn")
    for key, value in final.state["h_sum"].items():
        np.testing.assert_allclose(value, sum(state[key] for state in states), atol=1e-6, err_msg=key)
