"""``nvflare simulator`` as the end-to-end tests run it: a subprocess whose output is watched, started once more when
its start-up failed.

NVFlare 2.9's simulator starts a worker process for a client and waits up to 60 s (its ``simulator_worker_timeout``)
for the worker to open its port. When the worker does not (a slow start on a loaded machine), the simulator logs
``Failed to create connection to the child process``, that client's thread ends, and the run waits for the lost
client until the caller's timeout (900 s) instead of failing. A worker whose connection is reset as it starts (seen
once in CI: ``SimulatorClientRunner - ERROR - Communication error with client site-2: [Errno 104] Connection reset
by peer``, the site never logged a line, the secure-aggregation QC job waited for it until its 300-s timeout) is lost
the same way. Either message is in the output as soon as it happens (`STARTUP_FAILURES`): the run is stopped then
(every process of it) and started once more in a fresh workspace, the failed one kept beside it as
``<workspace>-startup-failure``, with the reason logged and a `SimulatorRestarted` warning (pytest's warnings
summary names the test). What the run writes outside its workspace (a tracker's folder named by an environment
variable, such as ``WANDB_DIR``) is named by the caller in ``outputs`` and set aside the same way, so that the try
that completes starts from none of the failed try's files. A failure of the last try is stopped too and returned
as it is, for the test's own checks to report.

Import it as ``from tests.e2e.simulator_run import run_simulator_command`` (tests/conftest.py puts the repository
first on the path)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

#: What NVFlare's simulator logs (to stdout and its workspace's log.txt) when a client's worker never connected.
STARTUP_FAILURE = "Failed to create connection to the child process"
#: ... and when its connection to a client's worker broke (the client's thread ends; the run waits for the client).
LOST_CLIENT = "Communication error with client"  # the console line has no logger name: "<time> - ERROR - ..."
#: ... and when a client's thread died of any error (seen in CI: "run_client_thread error: ConnectionResetError:
#: [Errno 104] Connection reset by peer"; the egress QC job then waited for that site until its 900-s timeout).
CLIENT_THREAD_DIED = "run_client_thread error"
STARTUP_FAILURES = (STARTUP_FAILURE, LOST_CLIENT, CLIENT_THREAD_DIED)
#: How often the output is looked at for `STARTUP_FAILURES` and the process for its exit, in seconds.
POLL_S = 1.0

log = logging.getLogger(__name__)


class SimulatorRestarted(UserWarning):
    """An ``nvflare simulator`` run was stopped at a failed start-up and run once more."""


class _Output:
    """Everything a pipe yields, read by a thread of its own (so neither pipe fills while the other is waited on)."""

    def __init__(self, pipe) -> None:
        self.chunks: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in iter(pipe.readline, ""):
            self.chunks.append(line)
        pipe.close()

    def text(self, join_s: float = 10.0) -> str:
        self._thread.join(join_s)
        return "".join(self.chunks)


def _stop_tree(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, to ``process`` and everything below it: the simulator starts its client workers in
    sessions of their own, so they are found as its descendants, not by process group. ``process`` itself is waited
    for through `subprocess.Popen` (its exit status stays readable)."""
    import psutil

    try:
        below = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        below = []
    process.terminate()
    for member in below:
        with contextlib.suppress(psutil.Error):
            member.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace_s)
    _, alive = psutil.wait_procs(below, timeout=grace_s)
    for member in alive:
        with contextlib.suppress(psutil.Error):
            member.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _run_once(command: Sequence[str], timeout: float, **popen_kwargs) -> tuple[subprocess.CompletedProcess, str | None]:
    """The completed run and None, or the stopped run and why it was stopped (the simulator's line that says its
    start-up failed). A run past ``timeout`` is stopped and raises `subprocess.TimeoutExpired`, as
    `subprocess.run` does."""
    process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen_kwargs)
    streams = [_Output(process.stdout), _Output(process.stderr)]
    looked_at = [0, 0]  # lines of each stream already looked at
    deadline = time.monotonic() + timeout
    failure = None
    while failure is None and process.poll() is None:
        for i, stream in enumerate(streams):
            lines = stream.chunks[looked_at[i] :]
            looked_at[i] += len(lines)
            failed = (line.strip() for line in lines if any(known in line for known in STARTUP_FAILURES))
            failure = failure or next(failed, None)
        if failure is not None:
            _stop_tree(process)
        elif time.monotonic() > deadline:
            _stop_tree(process)
            out, err = (stream.text() for stream in streams)
            raise subprocess.TimeoutExpired(list(command), timeout, output=out, stderr=err)
        else:
            time.sleep(POLL_S)
    out, err = (stream.text() for stream in streams)
    return subprocess.CompletedProcess(list(command), process.returncode, out, err), failure


def _set_aside(folder: Path) -> Path:
    """Move ``folder`` (if the failed try made it) to ``<folder>-startup-failure``, replacing an older one there."""
    kept = folder.with_name(f"{folder.name}-startup-failure")
    shutil.rmtree(kept, ignore_errors=True)
    if folder.exists():
        folder.rename(kept)
    return kept


def run_simulator_command(
    command: Sequence[str],
    workspace: Path,
    timeout: float = 900.0,
    retries: int = 1,
    outputs: Sequence[Path] = (),
    **popen_kwargs,
) -> subprocess.CompletedProcess:
    """Run the ``nvflare simulator`` ``command`` line whose workspace (``-w``) is ``workspace``, like
    ``subprocess.run(command, capture_output=True, text=True, timeout=timeout, **popen_kwargs)`` (``cwd``, ``env``),
    but stopped as soon as its output says its start-up failed and then run again, at most ``retries`` times, in a
    fresh workspace and with none of ``outputs`` (the folders it writes outside the workspace) left from the failed
    try (module docstring). The simulator exits 0 even on some aborts, so callers check the outputs."""
    workspace, outputs = Path(workspace), [Path(folder) for folder in outputs]
    for attempt in range(retries + 1):
        completed, failure = _run_once(command, timeout, **popen_kwargs)
        if failure is None or attempt == retries:
            return completed
        kept = [_set_aside(folder) for folder in (workspace, *outputs)]
        reason = (
            f"nvflare simulator start-up failed ({failure!r}); stopped it and running it again "
            f"(attempt {attempt + 2} of {retries + 1}); the failed try's workspace and outputs are kept at "
            + ", ".join(map(str, kept))
        )
        log.warning(reason)
        warnings.warn(reason, SimulatorRestarted, stacklevel=2)
    raise AssertionError("unreachable")
