"""How a federated run ended, read from what NVFlare left in its folder; said as known facts, never a guess.

``python -m controllers.report`` prints this for a job that did not complete its rounds. The evidence, as NVFlare
2.9 writes it (measured on simulator runs of a 2-site job: an evaluator raising, a site's script raising, a missing
client script, a run killed with SIGKILL):

- ``Aborting current RUN due to FATAL_SYSTEM_ERROR`` in the **server's** log (a workflow exception, a site's bad
  result that leaves too few responses, ...). ``nvflare simulator`` returns 2 exactly when the server's run carries
  that flag (``SimulatorRunner._get_server_run_status``); a site's own FATAL_SYSTEM_ERROR does not change it.
- ``MPM: Good Bye!``, the last line of a simulator process that shut down by itself. Without it and without a fatal
  error the run shut down normally and the simulator exited 0; a log that stops without it was cut off from outside
  (SIGKILL, the out-of-memory killer, Ctrl-C) or belongs to a run still going.
- ``error_log.txt``: every ERROR record of a participant (``server/``, ``<site>/`` in a simulator workspace; the run
  folder in a deployment). The earliest across them is the first error; a traceback is summarised by its exception.
- ``meta.json`` beside a downloaded job's ``workspace/``: NVFlare's job status (``FINISHED:ABORTED``,
  ``FINISHED:EXECUTION_EXCEPTION``, ``FINISHED:ABNORMAL``, ...), which says it all for POC and provisioned runs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

FATAL_MARKERS = ("Aborting current RUN due to FATAL_SYSTEM_ERROR", "FL server execution exception")
SHUTDOWN_MARKER = "MPM: Good Bye!"
ERROR_LOG = "error_log.txt"
#: A record's first line: ``2026-11-27 21:24:18,489 - <logger> - ERROR - [context] - message``.
RECORD = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) - \S+ - (\w+) - (?:\[[^\]]*\] - )?(.*)$")
MAX_MESSAGE = 300


def error_records(text: str) -> list[tuple[str, str]]:
    """Every ERROR or CRITICAL record of a log as (its time stamp, one-line summary), in the log's order."""
    records: list[tuple[str, str, list[str]]] = []  # time, level, lines
    for line in text.splitlines():
        match = RECORD.match(line)
        if match:
            records.append((match[1], match[2], [match[3]]))
        elif records:
            records[-1][2].append(line)
    return [(time, summarise(lines)) for time, level, lines in records if level in ("ERROR", "CRITICAL")]


def summarise(lines: list[str]) -> str:
    """A record in one line: a traceback by its last line (the exception), anything else by its first."""
    rest = [line.strip() for line in lines[1:] if line.strip()]
    text = rest[-1] if lines[0].startswith("Traceback") and rest else lines[0].strip()
    return text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "..."


def first_error(folder: Path, logs: Iterable[Path]) -> str | None:
    """The earliest error of all these logs: ``(<log relative to folder>, <time>): <summary>``."""
    found = [
        (time, index, log, summary)
        for index, log in enumerate(logs)
        for time, summary in error_records(log.read_text(errors="replace"))
    ]
    if not found:
        return None
    time, _, log, summary = min(found, key=lambda item: item[:2])  # same-format stamps sort as text
    return f"({_relative(log, folder)}, {_to_second(time)}): {summary}"


def error_logs(folder: Path, run_dir: Path) -> list[Path]:
    """The participants' error logs under ``folder`` (itself and one level down) and in the run folder."""
    candidates = [folder / ERROR_LOG, *sorted(folder.glob(f"*/{ERROR_LOG}")), run_dir / ERROR_LOG]
    return list(dict.fromkeys(p for p in candidates if p.is_file()))


def job_status(run_dir: Path) -> tuple[str, Path] | None:
    """NVFlare's status of a downloaded job (``<job id>/meta.json`` beside its ``workspace/``), with the file."""
    meta = run_dir.parent / "meta.json"
    if run_dir.name != "workspace" or not meta.is_file():
        return None
    try:
        status = json.loads(meta.read_text()).get("status")
    except (ValueError, AttributeError):
        return None
    return (status, meta) if isinstance(status, str) else None


def server_ending(log: Path, simulator: bool) -> str | None:
    """What the server's log says about the end: a fatal error; else, for the simulator's log (whose shutdown line
    is known), a shutdown by itself or a log cut off from outside."""
    text = log.read_text(errors="replace")
    if any(marker in text for marker in FATAL_MARKERS):
        return (
            f"the server logged a fatal error (FATAL_SYSTEM_ERROR in {log}), on which nvflare simulator exits 2 "
            "(a deployment marks the job FINISHED:EXECUTION_EXCEPTION)"
        )
    if not simulator:
        return None
    if SHUTDOWN_MARKER in text:
        return f"the simulator shut down by itself without a fatal error ({log}), so nvflare simulator exits 0"
    times = [m[1] for line in text.splitlines() if (m := RECORD.match(line))]
    where = f"stops at {_to_second(times[-1])}" if times else "is empty"
    return (
        f"the server's log {log} {where} without NVFlare's shutdown line: the simulator was killed (a signal, "
        "out of memory, Ctrl-C) or is still running"
    )


def how_it_ended(folder: Path, run_dir: Path) -> str:
    """One line: NVFlare's job status or what the server's log says, then the first error of every participant."""
    status = job_status(run_dir)
    simulator_log = folder / "server" / "log.txt"
    if status:
        ending: str | None = f"NVFlare's job status: {status[0]} ({status[1]})"
    elif simulator_log.is_file():
        ending = server_ending(simulator_log, simulator=True)
    elif (run_dir / "log.txt").is_file():
        ending = server_ending(run_dir / "log.txt", simulator=False)
    else:
        ending = f"no NVFlare log in {folder} says how the run ended"
    first = first_error(folder, error_logs(folder, run_dir))
    parts = [ending, f"first error {first}" if first else "no error logged"]
    return "; ".join(part for part in parts if part)


def _to_second(stamp: str) -> str:
    return stamp.split(",")[0]


def _relative(path: Path, folder: Path) -> str:
    try:
        return str(path.relative_to(folder))
    except ValueError:
        return str(path)
