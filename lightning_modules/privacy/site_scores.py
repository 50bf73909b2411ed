"""A DP site's own scores, kept at the site: the ``eval.*`` meta DP-SGD withholds from the server.

Under DP-SGD the site-evaluation scores (the received model's validation scores, the keep-best candidates' test
scores, the kept model, the local-only model, the gain kept - local-only and its standard error;
lightning_modules/keep_best.py, kept_model.py) are computed on the site's data outside DP: they never leave the site
unless the job releases them (``--dp-release-site-scores``, unaccounted). So that the site can still read whether
joining helps it, every round the withheld scores go

- to the site's own log, one line (`log_line`): the kept candidate and the gain with its SE where the round has them;
- to a site-local file, ``site_scores.jsonl`` (`SITE_SCORES_FILE`) next to the site's privacy ledger in its state
  store (``<site workspace>/client_state/<run id>/<site>/``): one JSON object a round, ``{"round", "site",
  "run_id", "scores"}`` with the ``eval.`` prefix dropped from the names.

Nothing of it is in the result the site sends (the release rule drops it first, and the site's egress gate strips
any meta the job does not declare). ``python -m controllers.report <site workspace>`` run at the site reads the file
(`read_site_scores`) and prints the same kept-vs-local table the server's report prints for a job that releases the
scores.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aggregators.contracts import meta_keys
from lightning_modules.site_choice import KINDS
from lightning_modules.state_store import ClientStateStore, is_writer

__all__ = [
    "SITE_SCORES_FILE",
    "find_site_score_files",
    "log_line",
    "read_site_scores",
    "site_records",
    "write_site_scores",
]

SITE_SCORES_FILE = "site_scores.jsonl"
GAIN = "kept_minus_local_test_accuracy"
KEPT_NAMES = KINDS  # eval.kept_candidate is an index into these


def site_scores_path(store: ClientStateStore) -> Path:
    """The site's file in its (per-run) state store: beside the ledger, never in what it sends."""
    return store.root / store.site_name / SITE_SCORES_FILE


def withheld_scores(meta: Mapping[str, Any], withheld: list[str]) -> dict[str, float]:
    """The withheld ``eval.*`` scores of a round's meta, by metric name (the ``eval.`` prefix dropped)."""
    out = {}
    for key in withheld:
        name = meta_keys.eval_metric(key)
        value = meta.get(key)
        if name is not None and isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return dict(sorted(out.items()))


def write_site_scores(
    store: ClientStateStore | None, round_num: int, run_id: str, scores: Mapping[str, float]
) -> Path | None:
    """Append one round's withheld scores to the site's file; the path, or ``None`` (no store, no scores, a DDP rank
    other than 0)."""
    if store is None or not scores or not is_writer():
        return None
    path = site_scores_path(store)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"round": int(round_num), "site": store.site_name, "run_id": run_id, "scores": dict(scores)}
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, sort_keys=True, allow_nan=True) + "\n")
    return path


def log_line(site: str, round_num: int, scores: Mapping[str, float], path: Path | None) -> str:
    """The site's log line of a round's withheld scores: the kept candidate, the gain over training alone with its
    SE (where the round has them), and where the file is."""
    parts = []
    index = scores.get("kept_candidate")
    if index is not None and math.isfinite(index) and 0 <= int(index) < len(KEPT_NAMES):
        parts.append(f"kept {KEPT_NAMES[int(index)]}")
    for name in ("kept_test_accuracy", "local_test_accuracy"):
        if name in scores:
            parts.append(f"{name} {scores[name]:.4f}")
    if GAIN in scores:
        se = scores.get(GAIN + "_se")
        parts.append(f"gain kept - local-only {scores[GAIN]:+.4f}" + (f" (SE {se:.4f})" if se is not None else ""))
    where = f"; all {len(scores)} scores in {path}" if path is not None else ""
    shown = ", ".join(parts) or f"{len(scores)} scores"
    return f"{site} round {round_num}: site scores, withheld from the server under DP-SGD: {shown}{where}"


def find_site_score_files(folder: Path) -> list[Path]:
    """The site-score files under ``folder`` (a site's workspace, its ``client_state`` or one run's folder)."""
    folder = Path(folder)
    if folder.is_file():
        return [folder] if folder.name == SITE_SCORES_FILE else []
    return sorted(folder.rglob(SITE_SCORES_FILE))


def read_site_scores(path: Path) -> list[dict[str, Any]]:
    """The rounds of one file, the last line of each round kept (a round run again after a restart replaces it)."""
    rounds: dict[int, dict[str, Any]] = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}, line {number}: not a JSON record ({exc.msg})") from None
        rounds[int(record["round"])] = record
    return [rounds[r] for r in sorted(rounds)]


def site_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The file's rounds in the shape of the server's round records (``site_eval`` -> metric -> ``per_site``), so
    the report's tables read them as they read a job that released the scores."""
    return [
        {
            "round": r["round"],
            "site_eval": {name: {"per_site": {r["site"]: value}} for name, value in r["scores"].items()},
        }
        for r in records
    ]
