"""What a local run prints: NVFlare's full output goes to a log file, the per-round lines are shown as they come.

``nvflare simulator`` and ``python job.py`` in SimEnv print every participant's log (about 280 lines for a 5-round,
3-site job, 512 for the demo's 10 rounds). ``make demo`` keeps that in a log and shows only the lines that
`PROGRESS_PATTERN` matches (``scripts/demo.sh`` greps for the same pattern; tested): the global model's score, each
round's start, the end, and anything that names an error. `quiet_output` does the same for a run in this process
and every process it starts: file descriptors 1 and 2 (and ``sys.stdout``/``sys.stderr``) point at the log while
the run lasts (the simulator's site processes inherit them), and a thread copies the matching lines to the
terminal. Nothing the run computes changes.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

#: The lines shown of a run's output (``grep -E`` syntax, as scripts/demo.sh uses it).
PROGRESS_PATTERN = r"round [0-9]+/[0-9]+: training|global model: |finished [0-9]+ rounds|Error|Traceback"
_PROGRESS = re.compile(PROGRESS_PATTERN)
#: How often the log is read for new lines while the run lasts (seconds).
POLL_S = 0.2


def is_progress(line: str) -> bool:
    """Whether ``line`` of a run's output is one the quiet output shows."""
    return _PROGRESS.search(line) is not None


def progress_lines(text: str) -> list[str]:
    """The lines of ``text`` the quiet output shows, in order."""
    return [line for line in text.splitlines() if is_progress(line)]


class _LogTail:
    """Reads the lines appended to a log and writes those `is_progress` accepts to a file descriptor."""

    def __init__(self, log: Path, target_fd: int) -> None:
        self._log = log.open("rb")
        self._target = target_fd
        self._partial = b""

    def pump(self, final: bool = False) -> None:
        data = self._partial + self._log.read()
        lines = data.split(b"\n")
        self._partial = b"" if final else lines.pop()
        for raw in lines:
            line = raw.decode("utf-8", errors="replace").rstrip("\r")
            if is_progress(line):
                os.write(self._target, (line + "\n").encode())

    def close(self) -> None:
        self._log.close()


@contextlib.contextmanager
def quiet_output(log: Path) -> Iterator[Path]:
    """Send everything written to stdout and stderr (this process's and its children's) to ``log``, emptied first,
    and show only the progress lines on the stdout in place when entered; the descriptors are back when it exits."""
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_bytes(b"")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    sink = os.open(log, os.O_WRONLY | os.O_APPEND)
    tail = _LogTail(log, saved[1])
    done = threading.Event()

    def follow() -> None:
        while not done.wait(POLL_S):
            tail.pump()

    thread = threading.Thread(target=follow, name="run-output-tail", daemon=True)
    streams = sys.stdout, sys.stderr
    try:
        for fd in (1, 2):
            os.dup2(sink, fd)
        # Python's own streams may not be descriptors 1 and 2 (a test runner's capture, a notebook): these are.
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, errors="replace", closefd=False) for fd in (1, 2))  # noqa: SIM115
        thread.start()
        yield log
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = streams
        for fd, copy in saved.items():
            os.dup2(copy, fd)
        done.set()
        if thread.is_alive():
            thread.join()
        tail.pump(final=True)
        tail.close()
        os.close(sink)
        for copy in saved.values():
            os.close(copy)
