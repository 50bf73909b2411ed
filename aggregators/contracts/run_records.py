"""What the server writes about a run and how a reader finds it and tells whether it finished.

The bundle's controller (and the secure-aggregation workflow's recorder) append one JSON line per round to
``<run folder>/metrics/round_metrics.jsonl`` (`METRICS_FILE`); every reader, ``python -m controllers.report``, the
exported jobs' own runner, the provisioning loopback driver and the benchmarks, reads the run through here. The file
layout is a contract between the server runtime and those readers, so it lives in the bottom layer, which both
import without importing each other (docs/design.md, "Layers").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aggregators.contracts.run_outcome import how_it_ended

RUN_DIR = Path("server") / "simulate_job"
METRICS_FILE = Path("metrics") / "round_metrics.jsonl"
METRICS = RUN_DIR / METRICS_FILE
FINAL_SCORES_FILE = Path("metrics") / "final_site_scores.json"
FINAL_SCORES = RUN_DIR / FINAL_SCORES_FILE
#: Cross-site evaluation (``cross_site_eval``, controllers/cross_site.py): per site the kept and local-only models'
#: accuracy on the other sites' validation splits, and the counts they come from.
CROSS_SITE_SCORES_FILE = Path("metrics") / "cross_site_scores.json"
#: Where the server's run folder (``metrics/``, ``app_server/``) lies under the folder a user names, in the order
#: looked at. The controller writes ``<run folder>/metrics/round_metrics.jsonl``; NVFlare puts the run folder at
#: ``<workspace>/server/simulate_job`` in the simulator (``-w``, and the recipe's SimEnv under
#: ``<workspace_root>/<job name>``), at ``<server workspace>/<job id>`` on a POC or provisioned server, and a job
#: result downloaded by the admin (``download_job_result``, the recipe's PocEnv/ProdEnv) is
#: ``<transfer>/<job id>/`` with the run folder as ``workspace/`` beside ``meta.json``.
RUN_DIR_LAYOUTS = (
    (RUN_DIR, "a simulator workspace"),
    (Path("workspace"), "a downloaded job result <transfer>/<job id>"),
    (Path(), "its workspace/ or a server's run folder <server workspace>/<job id>"),
)


def find_run_dir(folder: Path) -> Path:
    """The server's run folder of the run in ``folder`` (any of `RUN_DIR_LAYOUTS`, or the metrics file
    itself); otherwise one line naming every place looked at and the runs one level down, if any."""
    if folder.is_file() and folder.name == METRICS_FILE.name:
        return folder.parent.parent
    if not folder.exists():
        raise FileNotFoundError(f"no metrics in {folder}: it does not exist")
    for relative, _ in RUN_DIR_LAYOUTS:
        if (folder / relative / METRICS_FILE).is_file():
            return folder / relative
    looked = ", ".join(f"{folder / relative / METRICS_FILE} ({kind})" for relative, kind in RUN_DIR_LAYOUTS)
    below = sorted(
        {
            path.relative_to(folder).parts[0]
            for relative, _ in RUN_DIR_LAYOUTS
            for path in folder.glob(f"*/{relative}/{METRICS_FILE}")
        }
    )
    hint = f"; it holds runs: {', '.join(str(folder / b) for b in below)}: name one" if below else ""
    raise FileNotFoundError(f"no metrics in {folder}: looked for {looked}{hint}")


def load_records(workspace: Path) -> list[dict[str, Any]]:
    """The round records of the run in ``workspace`` (any layout `find_run_dir` reads)."""
    path = find_run_dir(workspace) / METRICS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def completion_problems(records: Sequence[dict[str, Any]]) -> list[str]:
    """Why the metrics show an unfinished or useless run: rounds missing, or no round that aggregated. What ended
    it is not in the metrics: `aggregators.contracts.run_outcome.how_it_ended` reads that from the run's logs."""
    if not records:
        return ["the metrics file is empty: the server stopped before its first round"]
    rounds = [r for r in records if r.get("stage") == "round"]
    problems = []
    if stopped_early(records):
        problems.append(f"the job stopped after round {_rounds_done(records)} of {records[0]['num_rounds']}")
    if rounds and not any(r.get("status", "aggregated") == "aggregated" for r in rounds):
        reason = rounds[-1].get("failure") or "no valid result"
        problems.append(f"no round updated the global model (last failure: {reason})")
    return problems


def stopped_early(records: Sequence[dict[str, Any]]) -> bool:
    """Whether the run ended before its last round (no records at all, or rounds missing) without its stopping
    rule (``--stop-patience``) ending it: a round record marked ``stopped`` is a finished run."""
    if not records:
        return True
    if stop_note(records) is not None:
        return False
    expected = records[0].get("num_rounds")
    return isinstance(expected, int) and _rounds_done(records) < expected


def stop_note(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The stopping rule's note of a run it ended (controllers/stopping.py), or ``None``: on a round record, or on
    the ``resumed`` record of a resumed job whose restored history had already reached the plateau (it runs no
    round)."""
    return next((r["stopped"] for r in records if r.get("stage") in ("round", "resumed") and r.get("stopped")), None)


def best_global(records: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any] | None] | None:
    """The best global model's note (controllers/model_selection.py: the last one a round record carries) and the
    record of that model: the round record before the round it was sent in, or the ``initial``/``resumed`` record
    where it is the model the run started from (``test_accuracy`` there is that model's where a server evaluator
    ran; ``None`` where the records do not reach back to it); ``None`` where no model was chosen."""
    rounds = [r for r in records if r.get("stage") == "round"]
    note = next((r["best_global"] for r in reversed(rounds) if r.get("best_global")), None)
    if note is None:
        return None
    produced_by = note["sent_in_round"] - 2  # the 0-based round whose aggregate was sent in round sent_in_round
    found = [r for r in rounds if r.get("round") == produced_by]
    if found:
        return note, found[-1]
    starts = [r for r in records if r.get("stage") in ("initial", "resumed")]
    started_with_it = bool(rounds) and rounds[0].get("round") == produced_by + 1
    return note, starts[-1] if starts and started_with_it else None


def _rounds_done(records: Sequence[dict[str, Any]]) -> int:
    return max((r["round"] + 1 for r in records if r.get("stage") == "round"), default=0)


def finished_records(workspace: Path, log_tail: str = "") -> list[dict[str, Any]]:
    """The metrics of a run that completed its rounds; otherwise an error with the reasons and how the run ended
    (for scripts that run ``nvflare simulator`` themselves: its exit code alone does not say whether every round
    ran). ``log_tail``: appended to the error."""
    try:
        run_dir = find_run_dir(workspace)
    except FileNotFoundError as exc:
        raise RuntimeError(f"{exc}\n{log_tail}".rstrip()) from exc
    records = load_records(run_dir)
    problems = completion_problems(records)
    if stopped_early(records):
        problems.append(f"how it ended: {how_it_ended(workspace, run_dir)}")
    if problems:
        raise RuntimeError(f"the job in {workspace} did not finish: {'; '.join(problems)}\n{log_tail}".rstrip())
    return records
