"""Summarise federated runs from their metrics: a per-round table, the final numbers, and a PNG plot.

    python -m controllers.report /tmp/fl-demo/fedavg                      # one run
    python -m controllers.report WS_A WS_B --labels fedavg scaffold        # side by side, one plot
    python -m controllers.report <admin kit>/transfer/<job id>             # a POC or provisioned job's result
    python -m controllers.report <site workspace>                          # at a DP site: its own scores

Reads the ``metrics/round_metrics.jsonl`` the controller writes into the server's run folder, wherever NVFlare put
it (`RUN_DIR_LAYOUTS`): a simulator workspace (``-w``; the recipe's SimEnv result), a job result downloaded
from a POC or provisioned server (``<job id>/`` or its ``workspace/``), or the server's run folder itself. A job
that did not run every configured round, or in which no round aggregated, makes it exit 1 with the reason; for a
run that stopped early it adds how the run ended as NVFlare's logs record it (`aggregators.contracts.run_outcome`: a
fatal error, on which ``nvflare simulator`` exits 2; a shutdown without one, on which it exits 0; a log cut off
by a kill; a deployment's job status) and the first error any participant logged. ``make demo`` fails with it.
That check comes before the plot, so without matplotlib (a site install) the reason is still printed; the missing
plot is then an error naming the extra that installs it.

The plot has a panel for each thing the runs logged: the global model (server test set, sites' validation mean and
worst site), personal vs global model at the sites (personalization jobs), loss (server test, sites' training),
SCAFFOLD's control norms (SCAFFOLD only) and epsilon per site (DP-SGD only). Every value is drawn at the round
number of the table row that prints it (0: the starting model), on integer round ticks.

Jobs run with ``--keep best --local-baseline`` get one more table (`kept_vs_local`): per site, from the last
round it reported them, which candidate it kept (global, personal, local-only or a mixture), the global, personal,
local-only (early-stopped) and kept models' accuracy on the site's own test split and, with ``--site-pooled-test``,
on the pooled test set, and the gain kept - local with its 95 % interval, gain +/- 1.96 SE (the normal
approximation of the paired per-sample difference on the site's test split, lightning_modules/kept_model.py). An
interval below 0 says the site lost from joining on its own test data; one that covers 0 says its test split cannot
tell; a site that kept its own model reads "no gain: kept its own model". Jobs built with ``--cross-site-eval`` get
the same comparison on the "next patient" view (`cross_site_table`): each site's kept and local-only models on the
other sites' validation splits (controllers/cross_site.py).

Under DP-SGD those scores never reach the server (unless ``--dp-release-site-scores``): each site keeps them in
``site_scores.jsonl`` in its own state folder (lightning_modules/privacy/site_scores.py). Pointed at a folder that
holds such a file and no server run (a site's workspace, e.g. ``<simulator workspace>/site-1`` or a provisioned
site's kit folder), the report prints that site's rounds and the same kept-vs-local table, from the site's file.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from aggregators.contracts.run_outcome import how_it_ended

# The run's files and the finished-run check live in the bottom layer (the exported jobs' runner and the loopback
# driver read runs too); the report's readers and tests also name them here.
from aggregators.contracts.run_records import (  # noqa: F401
    CROSS_SITE_SCORES_FILE,
    FINAL_SCORES,
    METRICS,
    METRICS_FILE,
    RUN_DIR,
    RUN_DIR_LAYOUTS,
    best_global,
    completion_problems,
    find_run_dir,
    finished_records,
    load_records,
    stop_note,
    stopped_early,
)
from data_prep.optional import require


def site_state_store(workspace: Path, site: str) -> Any:
    """The algorithm state store of ``site`` in a simulator run: ``<workspace>/<site>/client_state/<run id>/``, the
    run id read from the run's metrics (the sites keep each federated run's state apart)."""
    from lightning_modules.state_store import ClientStateStore

    run_id = next(r.get("run_id") for r in load_records(workspace) if r.get("stage") in ("initial", "resumed"))
    return ClientStateStore(workspace / site / "client_state" / run_id, site)


def failed_rounds(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per round that left the global model unchanged, with the engine's reason."""
    return [
        f"round {r['round'] + 1}: {r.get('failure', 'failed')}"
        for r in records
        if r.get("stage") == "round" and r.get("status", "aggregated") != "aggregated"
    ]


PERSONAL_PREFIX = "personal_"
#: Prefixes of the candidates' scores (lightning_modules/keep_best.py): not the received model's validation scores.
CANDIDATE_PREFIXES = (PERSONAL_PREFIX, "global_", "local_", "kept_")
#: ``eval.kept_candidate`` is an index into these (lightning_modules.keep_best.CANDIDATES).
KEPT_NAMES = ("global", "personal", "local", "mixture")
KEPT_MINUS_LOCAL = "kept_minus_local_test_accuracy"
KEPT_MINUS_LOCAL_POOLED = "kept_minus_local_pooled_test_accuracy"
#: The views a site reports its candidates on: its own test split and the pooled test set (``--site-pooled-test``).
VIEWS = ("test_accuracy", "pooled_test_accuracy")


def site_eval_metric(records: Sequence[dict[str, Any]]) -> str | None:
    """The site-evaluation metric to show: the first one named like an accuracy, else the first one (scores of the
    global model; a personal model's ``personal_<metric>`` is shown beside it)."""
    names = sorted(
        {name for r in records for name in (r.get("site_eval") or {}) if not name.startswith(CANDIDATE_PREFIXES)}
    )
    return next((n for n in names if "acc" in n.lower()), names[0] if names else None)


def last_site_eval(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every site-evaluation metric (global and personal scores) with its summary from the last round that
    reported it (``per_site``, ``mean``, ``worst``, ``worst_site``, ``spread``), by name."""
    last: dict[str, dict[str, Any]] = {}
    for record in records:
        last.update(record.get("site_eval") or {})
    return dict(sorted(last.items()))


def format_site_summaries(summaries: dict[str, dict[str, Any]]) -> str:
    """One line per metric: sample-weighted mean over the sites, the worst site and the spread."""
    width = max(len(name) for name in summaries)
    return "\n".join(
        f"  {name:<{width}}  mean {s['mean']:.4f}, worst {s['worst']:.4f} ({s['worst_site']}), spread {s['spread']:.4f}"
        for name, s in summaries.items()
    )


def format_per_site(summaries: dict[str, dict[str, Any]]) -> str:
    """One row per site, one column per metric (``-``: the site did not report that metric in its last round)."""
    sites = sorted({site for s in summaries.values() for site in s["per_site"]})
    width = max([len("site"), *map(len, sites)])
    columns = [max(12, len(name)) for name in summaries]
    lines = ["  ".join([f"{'site':<{width}}", *(f"{n:>{w}}" for n, w in zip(summaries, columns, strict=True))])]
    for site in sites:
        cells = (f"{_fmt(s['per_site'].get(site)):>{w}}" for s, w in zip(summaries.values(), columns, strict=True))
        lines.append("  ".join([f"{site:<{width}}", *cells]))
    return "\n".join(lines)


def personal_metric(records: Sequence[dict[str, Any]], metric: str | None) -> str | None:
    """``personal_<metric>`` when the sites reported their personal model's scores (docs/personalization.md)."""
    name = f"{PERSONAL_PREFIX}{metric}"
    return name if metric and any(name in (r.get("site_eval") or {}) for r in records) else None


def personal_gains(records: Sequence[dict[str, Any]], metric: str) -> dict[str, tuple[float, float, float]]:
    """Per site, from the last round in which it reported both: (global score, personal score, gain), the gain
    being personal minus global (negated for losses and errors, so that a positive gain is always better)."""
    from controllers.engine import lower_is_better

    sign = -1.0 if lower_is_better(metric) else 1.0
    gains: dict[str, tuple[float, float, float]] = {}
    for record in records:
        evaluation = record.get("site_eval") or {}
        if metric not in evaluation or PERSONAL_PREFIX + metric not in evaluation:
            continue
        personal = evaluation[PERSONAL_PREFIX + metric]["per_site"]
        for site, score in evaluation[metric]["per_site"].items():
            if site in personal:
                gains[site] = (score, personal[site], sign * (personal[site] - score))
    return dict(sorted(gains.items()))


def format_gains(gains: dict[str, tuple[float, float, float]], metric: str) -> str:
    """One row per site: the global model's score, the personal model's, and the gain."""
    width = max([len("site"), *map(len, gains)])
    lines = [f"{'site':<{width}}  {'global':>8}  {'personal':>8}  {'gain':>8}"]
    for site, (score, personal, gain) in gains.items():
        lines.append(f"{site:<{width}}  {score:>8.4f}  {personal:>8.4f}  {gain:>+8.4f}")
    return "\n".join(lines)


def kept_vs_local(records: Sequence[dict[str, Any]], z: float = 1.96) -> dict[str, dict[str, Any]]:
    """Per site, from the last round it reported its kept-minus-local difference: the candidate it kept, the kept
    and local-only test accuracies, the gain and its interval gain +/- ``z`` SE."""
    rows: dict[str, dict[str, Any]] = {}
    for record in records:
        evaluation = record.get("site_eval") or {}
        gains = (evaluation.get(KEPT_MINUS_LOCAL) or {}).get("per_site", {})
        for site, gain in gains.items():
            value = functools.partial(_site_value, evaluation, site)
            se, index = value(KEPT_MINUS_LOCAL + "_se"), value("kept_candidate")
            half = z * se if se is not None else float("nan")
            rows[site] = {
                "round": record.get("round"),
                "kept": KEPT_NAMES[int(index)] if index is not None and 0 <= index < len(KEPT_NAMES) else "?",
                "own": bool(value("kept_own")),
                **{f"{c}_{v}": value(f"{c}_{v}") for c in ("global", "personal", "local", "kept") for v in VIEWS},
                "gain": gain,
                "low": gain - half,
                "high": gain + half,
                "pooled_gain": value(KEPT_MINUS_LOCAL_POOLED),
            }
    return dict(sorted(rows.items()))


def _site_value(evaluation: dict[str, Any], site: str, name: str) -> Any:
    """The site's value of one site-evaluation metric in a round record (``None`` when it did not report it)."""
    return (evaluation.get(name) or {}).get("per_site", {}).get(site)


def format_kept_vs_local(rows: dict[str, dict[str, Any]]) -> str:
    """One row per site: the kept candidate, every candidate's accuracy on the site's own test split (and on the
    pooled test set where the job scored one, after the slash), the gain kept - local-only with its 95 % interval,
    or "no gain: kept its own model" (the gain is then 0 by construction, not a measured certainty)."""
    width = max([len("site"), *map(len, rows)])
    names = ("global", "personal", "local", "kept")
    header = "  ".join(f"{'local-only' if n == 'local' else n:>13}" for n in names)
    lines = [f"{'site':<{width}}  {'kept':>8}  {header}  gain on own test split (95% interval)"]
    for site, row in rows.items():
        cells = "  ".join(f"{_both(row, n):>13}" for n in names)
        if row["own"]:
            verdict = "no gain: kept its own model"
        else:
            verdict = f"{row['gain']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}]"
            if row.get("pooled_gain") is not None:
                verdict += f"; pooled {row['pooled_gain']:+.4f}"
        lines.append(f"{site:<{width}}  {row['kept']:>8}  {cells}  {verdict}")
    return "\n".join(lines)


def _both(row: dict[str, Any], name: str) -> str:
    """'own / pooled' accuracy of one candidate ('–' where the site did not report it)."""
    own, pooled = row.get(f"{name}_test_accuracy"), row.get(f"{name}_pooled_test_accuracy")
    return _fmt(own) if pooled is None else f"{_fmt(own)} / {_fmt(pooled)}"


GLOBAL_CONTROL_NORM = "scaffold.ctrl.global_norm"
DIFF_NORM = "scaffold.ctrl.diff_norm"


def control_norms(record: dict[str, Any]) -> tuple[float | None, float | None]:
    """SCAFFOLD's ||c|| after the round and the mean of the sites' ||delta c_i|| (None when not a SCAFFOLD run)."""
    global_norm = (record.get("rule_diagnostics") or {}).get(GLOBAL_CONTROL_NORM)
    diffs = [m[DIFF_NORM] for m in (record.get("site_meta") or {}).values() if DIFF_NORM in m]
    return global_norm, (sum(diffs) / len(diffs) if diffs else None)


LOCAL_NORM = "scaffold.ctrl.local_norm"
#: A site's ||c_i|| growing by more than this factor in one round: the start of the runaway measured under strong
#: label skew (benchmarks/results/scaffold_label_skew.md: 4.7 -> 34 -> 647 -> 3e10 in consecutive rounds).
CONTROL_RUNAWAY_FACTOR = 5.0


def control_runaways(records: Sequence[dict[str, Any]]) -> list[str]:
    """One line per site whose SCAFFOLD control ||c_i|| jumped by more than CONTROL_RUNAWAY_FACTOR in a round, over
    both its own previous norm and the median of the sites' previous norms. The median keeps a healthy run quiet: a
    site whose control had shrunk far below the others' (its local loss nearly minimised) and comes back towards
    their level is no runaway (healthy SCAFFOLD + AdamW runs of the genomics benchmark had a site go 0.186 -> 0.978,
    x5.3, while the median was 3.6: small controls move by large ratios)."""
    previous: dict[str, float] = {}
    lines = []
    for record in records:
        typical = statistics.median(previous.values()) if previous else 0.0
        for site, meta in sorted((record.get("site_meta") or {}).items()):
            norm = meta.get(LOCAL_NORM)
            if not isinstance(norm, int | float):
                continue
            before = previous.get(site)
            if before and before > 0 and norm > CONTROL_RUNAWAY_FACTOR * max(before, typical):
                lines.append(
                    f"round {record['round'] + 1}: {site}'s SCAFFOLD control ||c_i|| jumped from {before:.3g} to "
                    f"{norm:.3g}: the local lr is likely too large for this skew (a runaway spreads to every site "
                    "through c; lower the lr or use FedAvg/FedProx)"
                )
            previous[site] = float(norm)
    return lines


def format_table(records: Sequence[dict[str, Any]]) -> str:
    """One line per round. ``site <metric>``: the sites' scores of the global model they received at the start of
    that round on their own validation data: sample-weighted mean, and the worst site's value. SCAFFOLD runs add
    the norm of the global control and the sites' mean control change (are the control variates moving?)."""
    metric = site_eval_metric(records)
    personal = personal_metric(records, metric)
    site_column = f"  {'site ' + metric + ' mean (worst site)':>36}" if metric else ""
    site_column += f"  {personal + ' mean (worst site)':>36}" if personal else ""
    scaffold = any(control_norms(r)[0] is not None for r in records)
    control_column = f"  {'||c||':>9}  {'mean ||dc_i||':>13}" if scaffold else ""
    # A job without a server-side test set (your own model and data) has no test columns: they would be all "-".
    tested = any(r.get("test_accuracy") is not None or r.get("test_loss") is not None for r in records)
    test_column = f"  {'test acc':>8}  {'test loss':>9}" if tested else ""
    lines = [f"{'round':>5}{test_column}  {'mean site train loss':>20}{site_column}{control_column}  rejected"]
    for record, number in zip(records, row_numbers(records), strict=True):
        label = "init" if record["stage"] == "initial" else str(number)
        losses = [v for v in (record.get("site_train_loss") or {}).values() if v is not None]
        mean_loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        rejected = ",".join(record.get("rejected") or {}) or "-"
        site = "".join(
            f"  {_summary_text((record.get('site_eval') or {}).get(name)):>36}" for name in (metric, personal) if name
        )
        controls = ""
        if scaffold:
            global_norm, diff_norm = control_norms(record)
            controls = f"  {_fmt(global_norm):>9}  {_fmt(diff_norm):>13}"
        test = f"  {_fmt(record.get('test_accuracy')):>8}  {_fmt(record.get('test_loss')):>9}" if tested else ""
        lines.append(f"{label:>5}{test}  {mean_loss:>20}{site}{controls}  {rejected}")
    return "\n".join(lines)


def _summary_text(summary: dict[str, Any] | None) -> str:
    return f"{summary['mean']:.4f} ({summary['worst']:.4f} {summary['worst_site']})" if summary else "-"


def final_site_table(path: Path) -> str | None:
    """The final global model's scores at every site (jobs built with ``--final-site-eval``, written to ``path``),
    one row per site."""
    if not path.is_file():
        return None
    sites: dict[str, dict[str, float]] = json.loads(path.read_text()).get("sites", {})
    metrics = sorted({name for scores in sites.values() for name in scores})
    width = max([len("site"), *map(len, sites)])
    lines = ["  ".join([f"{'site':<{width}}", *(f"{m:>12}" for m in metrics)])]
    for site in sorted(sites):
        lines.append("  ".join([f"{site:<{width}}", *(f"{_fmt(sites[site].get(m)):>12}" for m in metrics)]))
    return "\n".join(lines)


def cross_site_table(path: Path, kept: dict[str, dict[str, Any]] | None = None, z: float = 1.96) -> str | None:
    """The "next patient" view of a job built with ``--cross-site-eval`` (``path``: its cross_site_scores.json,
    controllers/cross_site.py): per site, its kept and local-only models' accuracy on the other sites' validation
    splits (sample-weighted), the paired difference with its 95 % interval, and the samples and sites behind them.
    A site that kept its own model (``kept``: `kept_vs_local`'s rows) reads "no gain: kept its own model"."""
    if not path.is_file():
        return None
    sites: dict[str, dict[str, float]] = json.loads(path.read_text()).get("sites", {})
    if not sites:
        return None
    width = max([len("site"), *map(len, sites)])
    lines = [f"{'site':<{width}}  {'kept':>8}  {'local-only':>10}  {'samples':>7}  {'sites':>5}  gain (95% interval)"]
    for site in sorted(sites):
        row = {name.removeprefix("eval."): value for name, value in sites[site].items()}
        gain, se = row.get("kept_minus_local_cross_site_accuracy"), row.get("kept_minus_local_cross_site_accuracy_se")
        if (kept or {}).get(site, {}).get("own"):
            verdict = "no gain: kept its own model"
        elif gain is None:
            verdict = "-"
        else:
            half = z * se if se is not None else float("nan")
            verdict = f"{gain:+.4f} [{gain - half:+.4f}, {gain + half:+.4f}]"
        lines.append(
            f"{site:<{width}}  {_fmt(row.get('kept_cross_site_accuracy')):>8}  "
            f"{_fmt(row.get('local_cross_site_accuracy')):>10}  {int(row.get('cross_site_samples', 0)):>7}  "
            f"{int(row.get('cross_site_sites', 0)):>5}  {verdict}"
        )
    return "\n".join(lines)


def privacy_table(records: Sequence[dict[str, Any]]) -> str | None:
    """DP-SGD jobs (docs/privacy.md): each site's epsilon over every step it has taken so far, per round (``-``: the
    site did not train that round), at the delta the sites report; ``None`` without DP."""
    rounds = [r for r in records if r.get("privacy")]
    if not rounds:
        return None
    sites = sorted({site for r in rounds for site in r["privacy"]})
    deltas = sorted({p.get("delta") for r in rounds for p in r["privacy"].values()}, key=str)
    width = max(len(site) for site in sites) + 2
    lines = [f"{'round':>5}" + "".join(f"{site:>{max(width, 10)}}" for site in sites)]
    for record in rounds:
        cells = "".join(
            f"{_fmt((record['privacy'].get(site) or {}).get('epsilon')):>{max(width, 10)}}" for site in sites
        )
        lines.append(f"{record['round'] + 1:>5}{cells}")
    return f"epsilon per site (delta {', '.join(str(d) for d in deltas)}):\n" + "\n".join(lines)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "-"


class Line(NamedTuple):
    """One curve of the plot: its legend label, x (the table's round numbers), y, and how it is drawn (a run keeps
    one colour across the panels; its series differ by line style and marker)."""

    label: str
    x: tuple[int, ...]
    y: tuple[float, ...]
    style: str = "-o"
    color: str | None = None


def row_numbers(records: Sequence[dict[str, Any]]) -> list[int]:
    """The table's round number of each record: 0 for the starting model, r + 1 for round r's record; a resumed
    job's starting model is the global model after the rounds done before it, the round of the record after it."""
    numbers = []
    for index, record in enumerate(records):
        if record.get("stage") == "round":
            numbers.append(record["round"] + 1)
        else:
            later = (r["round"] for r in records[index + 1 :] if r.get("stage") == "round")
            numbers.append(next(later, 0) if record.get("stage") == "resumed" else 0)
    return numbers


def plot_panels(runs: dict[str, Sequence[dict[str, Any]]]) -> dict[str, list[Line]]:
    """The plot's panels by title, each with its curves from every run: only what the runs logged, in the order
    global model, personal vs global, loss, SCAFFOLD control norms, DP-SGD epsilon."""
    panels: dict[str, dict[str, list[Line]]] = {}  # kind -> part of the title -> curves
    for index, (label, records) in enumerate(runs.items()):
        for kind, part, line in _run_curves(label, records, f"C{index}"):
            panels.setdefault(kind, {}).setdefault(part, []).append(line)
    return {
        _panel_title(kind, list(panels[kind])): [line for lines in panels[kind].values() for line in lines]
        for kind in PANEL_KINDS
        if kind in panels
    }


PANEL_KINDS = ("global", "personal", "loss", "controls", "privacy")


def _panel_title(kind: str, parts: list[str]) -> str:
    if kind == "controls":
        return "SCAFFOLD control norms"
    if kind == "privacy":
        return f"DP-SGD: ε per site (δ {', '.join(parts)})"
    prefix = {"global": "Global model", "personal": "Personal vs global model", "loss": "Loss"}[kind]
    return f"{prefix}: {', '.join(parts)}"


def _run_curves(label: str, records: Sequence[dict[str, Any]], color: str) -> list[tuple[str, str, Line]]:
    """(panel kind, part of its title, curve) for every series this run logged, at the table's round numbers."""
    rows = row_numbers(records)
    metric = site_eval_metric(records)
    personal = personal_metric(records, metric)
    site = [_site_summary(r, metric) for r in records]
    series: list[tuple[str, str, str, list[Any], str]] = [
        ("global", "test accuracy", f"{label} test accuracy", [r.get("test_accuracy") for r in records], "-o"),
        ("global", f"sites' {metric}", f"{label} sites' {metric} mean", [s.get("mean") for s in site], "-.s"),
        ("global", f"sites' {metric}", f"{label} worst site", [s.get("worst") for s in site], "--v"),
        ("loss", "global test", f"{label} test loss", [r.get("test_loss") for r in records], "-o"),
        ("loss", "sites' training", f"{label} mean site train loss", [_mean_train_loss(r) for r in records], "--."),
        ("controls", "", f"{label} ||c||", [_control(r, 0) for r in records], "-o"),
        ("controls", "", f"{label} mean ||dc_i||", [_control(r, 1) for r in records], "--."),
    ]
    if personal:
        mine = [_site_summary(r, personal).get("mean") for r in records]
        series[3:3] = [
            ("personal", f"sites' {metric}", f"{label} global model", [s.get("mean") for s in site], "-.s"),
            ("personal", f"sites' {metric}", f"{label} personal model", mine, ":x"),
        ]
    best = best_global(records)
    if best and best[1] is not None:  # the delivered model (controllers/model_selection.py), at the row it is
        chosen = [record.get("test_accuracy") if record is best[1] else None for record in records]
        series.insert(1, ("global", "test accuracy", f"{label} chosen on validation", chosen, "*"))
    curves = [(kind, part, _line(name, rows, values, style, color)) for kind, part, name, values, style in series]
    curves += [("privacy", delta, line) for delta, line in _epsilon_curves(label, records, rows)]
    return [(kind, part, line) for kind, part, line in curves if line is not None]


def _line(label: str, rows: list[int], values: list[Any], style: str, color: str | None) -> Line | None:
    """The curve through the numeric values (a record without the value leaves a gap); None without any."""
    points = [(x, float(v)) for x, v in zip(rows, values, strict=True) if isinstance(v, int | float)]
    if not points:
        return None
    return Line(label, tuple(x for x, _ in points), tuple(y for _, y in points), style, color)


def _site_summary(record: dict[str, Any], metric: str | None) -> dict[str, Any]:
    return (record.get("site_eval") or {}).get(metric) or {} if metric else {}


def _mean_train_loss(record: dict[str, Any]) -> float | None:
    losses = [v for v in (record.get("site_train_loss") or {}).values() if isinstance(v, int | float)]
    return sum(losses) / len(losses) if losses else None


def _control(record: dict[str, Any], which: int) -> float | None:
    return control_norms(record)[which] if record.get("stage") == "round" else None


def _epsilon_curves(label: str, records: Sequence[dict[str, Any]], rows: list[int]) -> list[tuple[str, Line]]:
    """Each site's epsilon after every round it trained in, with its delta (a site of a DP-SGD job)."""
    sites = sorted({site for r in records for site in (r.get("privacy") or {})})
    curves = []
    for site in sites:
        reports = [(r.get("privacy") or {}).get(site) or {} for r in records]
        line = _line(f"{label} {site}", rows, [p.get("epsilon") for p in reports], "-o", None)
        delta = next((str(p["delta"]) for p in reports if "delta" in p), "?")
        if line:
            curves.append((delta, line))
    return curves


ROUND_AXIS = "round (0: the starting model)"


def draw_runs(runs: dict[str, Sequence[dict[str, Any]]]) -> Any:
    """The matplotlib figure of `plot_panels`: one panel per title (up to three a row), integer round ticks."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    panels = plot_panels(runs)
    columns = max(1, len(panels) if len(panels) <= 3 else 2 if len(panels) == 4 else 3)
    rows = max(1, -(-len(panels) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    for axis, (title, lines) in zip(axes.flat, panels.items(), strict=False):
        for line in lines:
            size = 12 if line.style == "*" else 4  # the chosen model's star, drawn over its round's marker
            axis.plot(line.x, line.y, line.style, color=line.color, label=line.label, markersize=size)
        axis.set(xlabel=ROUND_AXIS, title=title)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    for axis in list(axes.flat)[len(panels) :]:
        fig.delaxes(axis)
    if not panels:  # an image that says so rather than none (a job whose rounds logged no values)
        fig.text(0.5, 0.5, "nothing to plot: the rounds logged no values", ha="center")
    fig.tight_layout()
    return fig


def plot_runs(runs: dict[str, Sequence[dict[str, Any]]], path: Path) -> Path:
    """Draw `draw_runs` into the PNG ``path`` (needs matplotlib: the ``plots`` extra)."""
    matplotlib = require("matplotlib", "plots", "the report's plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = draw_runs(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m controllers.report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "workspaces",
        nargs="+",
        type=Path,
        help="runs: simulator workspaces (the -w folders), downloaded job results (<transfer>/<job id>) or a "
        "server's run folders (<server workspace>/<job id>)",
    )
    parser.add_argument("--labels", nargs="+", help="one label per run (default: folder names)")
    parser.add_argument("--plot", type=Path, help="PNG path (default: <first run folder>/round_metrics.png)")
    parser.add_argument(
        "--per-site", action="store_true", help="also print every site's score of every site-evaluation metric"
    )
    return parser


def default_label(folder: Path) -> str:
    """The folder's name; a downloaded job's ``workspace/`` is named by its job id, the folder above it."""
    folder = folder.resolve()
    return folder.parent.name if folder.name == "workspace" else folder.name


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    labels = args.labels or [default_label(ws) for ws in args.workspaces]
    if len(labels) != len(args.workspaces):
        parser.error("give one label per workspace")
    at_site = [is_site_folder(ws) for ws in args.workspaces]  # each folder looked at once
    for label, ws, site in zip(labels, args.workspaces, at_site, strict=True):
        if site:  # run at a site: its own scores, which a DP job never sent
            print_site(label, ws)
    if all(at_site):
        return 0
    labels = [label for label, site in zip(labels, at_site, strict=True) if not site]
    args.workspaces = [ws for ws, site in zip(args.workspaces, at_site, strict=True) if not site]
    try:
        run_dirs = {label: find_run_dir(ws) for label, ws in zip(labels, args.workspaces, strict=True)}
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    folders = dict(zip(labels, args.workspaces, strict=True))
    runs = {label: load_records(run_dir) for label, run_dir in run_dirs.items()}
    empty = [label for label, records in runs.items() if not records]
    for label in empty:  # nothing to show: say why, and never crash on it (the job must not look finished)
        print(f"error: {label}: {completion_problems([])[0]}", file=sys.stderr)
        print(f"error: {label}: how it ended: {how_it_ended(folders[label], run_dirs[label])}", file=sys.stderr)
    if len(empty) == len(runs):
        return 1
    shown = {label: records for label, records in runs.items() if records}
    for label, records in shown.items():
        print_run(label, folders[label], run_dirs[label], records, per_site=args.per_site)
    # Completion before the plot: a job that stopped early must say why even when the plot cannot be drawn.
    status = 1 if empty else 0
    for label, records in shown.items():
        for line in [*failed_rounds(records), *control_runaways(records)[:3]]:
            print(f"warning: {label}: {line}", file=sys.stderr)
        problems = completion_problems(records)
        for problem in problems:
            print(f"error: {label}: {problem}", file=sys.stderr)
        if stopped_early(records):
            print(f"error: {label}: how it ended: {how_it_ended(folders[label], run_dirs[label])}", file=sys.stderr)
        status = 1 if problems else status
    try:
        plot = plot_runs(shown, args.plot or args.workspaces[0] / "round_metrics.png")
    except ModuleNotFoundError as exc:  # matplotlib missing (a site install): the message names the extra
        print(f"error: no plot: {exc}", file=sys.stderr)
        return 1
    print(f"plot:         {plot}")
    return status


def is_site_folder(folder: Path) -> bool:
    """A site's folder (its workspace, its ``client_state``, or a ``site_scores.jsonl``) holding the scores a DP site
    kept to itself, and no server run: the report reads it at the site."""
    from lightning_modules.privacy.site_scores import find_site_score_files

    try:
        find_run_dir(folder)
    except FileNotFoundError:
        return bool(find_site_score_files(folder))
    return False


def print_site(label: str, folder: Path) -> None:
    """Per site-score file under ``folder`` (one per run and site): every round's kept candidate and gain, and the
    kept-vs-local table of the server's report, from the scores the site kept (lightning_modules/privacy/
    site_scores.py); the server's side of the run holds none of them."""
    from lightning_modules.privacy.site_scores import find_site_score_files, read_site_scores, site_records

    for path in find_site_score_files(folder):
        records = read_site_scores(path)
        if not records:
            continue
        site, run_id = records[-1]["site"], records[-1].get("run_id") or "?"
        print(f"\n== {label}: {site}'s own scores, kept at the site (run {run_id}): {path}")
        print(f"{'round':>5}  {'kept':>8}  {'kept test acc':>13}  {'local-only':>10}  gain kept - local (SE)")
        for record in records:
            scores = record["scores"]
            index = scores.get("kept_candidate")
            kept = KEPT_NAMES[int(index)] if index is not None and 0 <= index < len(KEPT_NAMES) else "-"
            gain, se = scores.get(KEPT_MINUS_LOCAL), scores.get(KEPT_MINUS_LOCAL + "_se")
            shown = "-" if gain is None else f"{gain:+.4f}" + ("" if se is None else f" ({se:.4f})")
            print(
                f"{record['round'] + 1:>5}  {kept:>8}  {_fmt(scores.get('kept_test_accuracy')):>13}  "
                f"{_fmt(scores.get('local_test_accuracy')):>10}  {shown}"
            )
        kept = kept_vs_local(site_records(records))
        if kept:
            print(
                "does this site gain from joining: the model it kept vs its local-only model, on its test split "
                f"(last round it reported both; gain = kept - local, 95% interval):\n{format_kept_vs_local(kept)}"
            )


def print_run(label: str, folder: Path, run_dir: Path, records: Sequence[dict[str, Any]], per_site: bool) -> None:
    """The run's tables on stdout: per round, the site evaluation, personal gains, kept vs local, epsilon, the final
    model at every site, and where the model and the metrics are."""
    final = records[-1]
    print(f"\n== {label}: {folder}\n{format_table(records)}")
    note = stop_note(records)
    if note:
        print(
            f"stopped after round {note['after_round'] + 1} of {records[0].get('num_rounds')}: {note['rule']} (the "
            f"sites' mean {note['metric']} best {note['best']:.4f}, not improved for "
            f"{note['rounds_without_improvement']} rounds; --stop-patience {note['patience']})"
        )
    if final.get("test_accuracy") is not None:
        print(f"final global test accuracy: {_fmt(final.get('test_accuracy'))}")
    best = best_global(records)
    if best:
        note, accuracy = best[0], (best[1] or {}).get("test_accuracy")
        print(
            f"best global model on the sites' validation splits: the one sent in round {note['sent_in_round']} "
            f"(mean {note['metric']} over the sites {note['mean_over_sites']:.4f}"
            + (f"; global test accuracy {_fmt(accuracy)}" if accuracy is not None else "")
            + f"): {run_dir / 'app_server' / 'best_FL_global_model.pt'}"
        )
    metric = site_eval_metric(records)
    summaries = last_site_eval(records)
    if summaries:
        print(f"site evaluation, last round each metric was reported:\n{format_site_summaries(summaries)}")
        if per_site:
            print(f"per site:\n{format_per_site(summaries)}")
    personal = personal_metric(records, metric)
    if personal and metric:
        gains = personal_gains(records, metric)
        mean_gain = sum(g for _, _, g in gains.values()) / len(gains)
        print(
            f"site {metric}: global model received vs the site's personal model (last round each site scored "
            f"both; gain = personal - global, higher is better; mean {mean_gain:+.4f}):\n"
            f"{format_gains(gains, metric)}"
        )
    kept = kept_vs_local(records)
    if kept:
        print(
            "does each site gain from joining: the model it kept vs its local-only model, on its test split (last "
            f"round each site reported both; gain = kept - local, 95% interval):\n{format_kept_vs_local(kept)}"
        )
    cross = cross_site_table(run_dir / CROSS_SITE_SCORES_FILE, kept)
    if cross:
        print(
            "the next patient: each site's kept vs local-only model on the other sites' validation splits "
            f"(--cross-site-eval; sample-weighted; gain = kept - local, 95% interval):\n{cross}"
        )
    privacy = privacy_table(records)
    if privacy:
        print(privacy)
    scores = run_dir / FINAL_SCORES.relative_to(RUN_DIR)
    table = final_site_table(scores)
    if table:
        print(f"the final global model at every site ({scores}):\n{table}")
    print(f"global model: {run_dir / 'app_server' / 'FL_global_model.pt'}")
    print(f"metrics:      {run_dir / METRICS_FILE}")


if __name__ == "__main__":
    raise SystemExit(main())
