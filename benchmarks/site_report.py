"""The per-site report of a personalization grid scored on the sites' TEST splits: "does joining help my site?".

A cell (one method, one partition, one partition seed, one training seed) records what each site of a real job
reports after its last round (`cell_scores`): the test accuracy of the global model, the site's personal model,
its in-job local-only model (``--local-baseline``: same model, optimizer and local steps, never sent) and the model
it kept (``--keep best``: the candidate best on the site's validation split), which candidate it kept, and the sizes
of its training, validation and test splits. The page (`report_lines`) gives, per setting (a partition and
one partition seed: the site data are fixed within it, only the training seed varies):

- one row per method: mean site test accuracy of every candidate, kept - local-only with its 95 % t-interval
  (benchmarks/site_stats.py: over the per-seed means across sites), the worst (site, seed) pair, the pairs more than
  3 points below local-only, the target, bytes per site and round, and wall time per cell;
- the target check of the pre-registered default (`PREREGISTERED_DEFAULT`), naming every
  site that misses and by how much;
- per method, every site: its split sizes, every candidate's accuracy, kept / personal / global - local-only with
  their intervals over seeds, and which candidates it kept.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from aggregators.contracts.run_records import best_global
from benchmarks import site_stats

#: The centrally trained model of a grid (benchmarks/compare.py): a ceiling for the federated global models, not a
#: method a site could choose.
CENTRAL = "central"
#: The pre-registered default recommendation, fixed in code before the held-out runs it is judged on: the method every
#: site runs by default and the settings it runs with. The reports check this one recommendation in every setting;
#: they never pick a method after the fact. Up to the early-stopped counterfactual's section of
#: benchmarks/results/site_gain.md it was FedRep (the best personalized record of five methods on the committed
#: settings of benchmarks/results/personalization.md); from the 'site_gain_v3' grid on, FedAvg clients with server
#: momentum (FedAvgM), chosen on a tuning setting (Dirichlet 0.3, 8 sites, 4,000 images) that no held-out run uses.
#: ``keep="best"`` lets each site fall back to its own early-stopped local-only model (``local_baseline``).
PREREGISTERED_DEFAULT: Mapping[str, Any] = {"method": "fedavgm", "keep": "best", "local_baseline": True}

#: The candidates a site scores on its test split, in the order of the tables.
CANDIDATES = ("global", "personal", "local", "kept")
#: The views a cell records: its key -> the metric's name in the sites' meta (``eval.<candidate>_<name>_accuracy``).
VIEWS = {"site_test": "test", "site_pooled_test": "pooled_test"}
#: (partition, partition seed) -> method -> seed -> cell
Cells = Mapping[tuple[str, Any], Mapping[str, Mapping[int, Mapping[str, Any]]]]


# --------------------------------------------------------------------------------------------------------------------
# What a cell keeps of its run
# --------------------------------------------------------------------------------------------------------------------
def test_metrics_record(records: Sequence[Mapping[str, Any]]) -> Mapping[str, Mapping[str, Any]]:
    """The sites' meta of the last round record that carries test-split scores (site -> meta); empty when none."""
    for record in reversed(records):
        site_meta = record.get("site_meta") or {}
        if any(key.endswith("_test_accuracy") for meta in site_meta.values() for key in meta):
            return site_meta
    return {}


def best_global_scores(records: Sequence[Mapping[str, Any]], view: str = "pooled_test") -> dict[str, float]:
    """Per site, the ``view`` accuracy of the global model the job delivers (controllers/model_selection.py: the
    model sent in the round the sites' validation scores chose, ``best_FL_global_model.pt``) as the sites scored it
    in that round; empty where no model was chosen or the sites did not score that view."""
    chosen = best_global(records)
    sent_in = chosen[0]["sent_in_round"] - 1 if chosen else None  # 0-based: the round whose sites scored it
    sent = [r for r in records if r.get("stage") == "round" and sent_in is not None and r.get("round") == sent_in]
    site_meta = (sent[-1].get("site_meta") or {}) if sent else {}
    key = f"eval.global_{view}_accuracy"
    return {site: float(meta[key]) for site, meta in site_meta.items() if meta.get(key) is not None}


def cell_scores(site_meta: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``site_test``: candidate -> site -> test accuracy (``eval.<candidate>_test_accuracy``), and
    ``kept_candidate``: site -> the candidate it kept (``eval.kept_candidate``)."""
    views: dict[str, dict[str, dict[str, float]]] = {view: {c: {} for c in CANDIDATES} for view in VIEWS}
    kept: dict[str, str] = {}
    own: dict[str, bool] = {}
    for site, meta in site_meta.items():
        for view, name in VIEWS.items():
            for candidate in CANDIDATES:
                value = meta.get(f"eval.{candidate}_{name}_accuracy")
                if value is not None:
                    views[view][candidate][site] = float(value)
        if meta.get("eval.kept_candidate") is not None:
            kept[site] = candidate_name(meta["eval.kept_candidate"])
        if meta.get("eval.kept_own") is not None:
            own[site] = bool(meta["eval.kept_own"])
    out: dict[str, Any] = {view: {c: s for c, s in scores.items() if s} for view, scores in views.items()}
    return {**out, "kept_candidate": kept, "kept_own": own}


def candidate_name(value: Any) -> str:
    """The kept candidate's name: the sites send its index into lightning_modules.keep_best.CANDIDATES (meta
    values are numbers); a name passes through; an index out of range reads 'unknown(<value>)'."""
    from lightning_modules.keep_best import CANDIDATES as SENT_ORDER

    if isinstance(value, str):
        return value
    index = float(value)
    if index.is_integer() and 0 <= index < len(SENT_ORDER):
        return SENT_ORDER[int(index)]
    return f"unknown({value:g})"


def bytes_per_site_round(traffic: Sequence[Mapping[str, int]]) -> float:
    """Mean over rounds of everything a round sent (model and meta, down and up) per site that took part."""
    per_round = [
        (t["model_down"] + t["meta_down"] + t["model_up"] + t["meta_up"]) / max(1, t["sites"]) for t in traffic
    ]
    return statistics.fmean(per_round) if per_round else float("nan")


# --------------------------------------------------------------------------------------------------------------------
# Gathering cells
# --------------------------------------------------------------------------------------------------------------------
def group_cells(cells: Sequence[Mapping[str, Any]]) -> dict[tuple[str, Any], dict[str, dict[int, Mapping[str, Any]]]]:
    """Cells with test-split scores (or, a central model's, pooled-test scores only) by (partition, partition
    seed), method and training seed."""
    grouped: dict[tuple[str, Any], dict[str, dict[int, Mapping[str, Any]]]] = defaultdict(lambda: defaultdict(dict))
    for cell in cells:
        if not cell.get("site_test") and not cell.get("site_pooled_test"):
            continue
        key = cell["cell"]
        setting = (key.get("partition") or key["split"], key.get("partition_seed"))
        grouped[setting][key["algorithm"]][key["seed"]] = cell
    return grouped


def candidate_runs(
    by_seed: Mapping[int, Mapping[str, Any]], candidate: str, view: str = "site_test"
) -> dict[int, dict[str, float]]:
    """seed -> site -> the candidate's accuracy on ``view`` (seeds whose cell has it)."""
    return {seed: dict(cell[view][candidate]) for seed, cell in by_seed.items() if candidate in cell.get(view, {})}


def views_sentence(method: str, by_seed: Mapping[int, Mapping[str, Any]]) -> str:
    """How often the site kept its own model (gain 0 by construction), and the pooled ("next patient") view:
    kept and local-only means and their paired difference."""
    owns = [flag for cell in by_seed.values() for flag in cell.get("kept_own", {}).values()]
    parts = [f"{method}: kept its own model at {sum(owns)} of {len(owns)} (site, seed) pairs" if owns else method]
    kept, local = (
        candidate_runs(by_seed, "kept", "site_pooled_test"),
        candidate_runs(by_seed, "local", "site_pooled_test"),
    )
    if kept and local:
        differences = site_stats.paired_differences(kept, local)
        parts.append(
            f"pooled view (all labels): kept {mean_site(kept)} vs local-only {mean_site(local)}, kept − local-only "
            f"{interval_text(site_stats.setting_interval(differences))}"
        )
    return "; ".join(parts) + "."


# --------------------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------------------
def pct(value: float) -> str:
    return f"{100 * value:.1f}"


def interval_text(interval: site_stats.Interval) -> str:
    """'+1.2 [-0.3, +2.7]' in points; one run has no interval, and runs that all gave the same value have no spread
    to make one from (every site kept a model as good as its own on every test sample, say): a zero-width interval
    would read as certainty."""
    if interval.half == float("inf"):
        return f"{100 * interval.mean:+.1f} (1 seed, no interval)"
    if interval.half == 0:
        return f"{100 * interval.mean:+.1f} (no spread over seeds)"
    return f"{100 * interval.mean:+.1f} [{100 * interval.low:+.1f}, {100 * interval.high:+.1f}]"


def mean_site(runs: Mapping[int, Mapping[str, float]]) -> str:
    """Mean over seeds of the unweighted mean over sites."""
    if not runs:
        return "–"
    return pct(statistics.fmean(statistics.fmean(sites.values()) for sites in runs.values()))


def method_row(method: str, by_seed: Mapping[int, Mapping[str, Any]], default: str) -> str:
    """One method's row of the setting table (module docstring)."""
    runs = {c: candidate_runs(by_seed, c) for c in CANDIDATES}
    means = [mean_site(runs[c]) for c in CANDIDATES]
    traffic = [bytes_per_site_round(cell["traffic"]) for cell in by_seed.values() if cell.get("traffic")]
    cost = f"{statistics.fmean(traffic) / 1024:.0f}" if traffic else "–"
    wall = f"{statistics.fmean(cell['wall_s'] for cell in by_seed.values()):.0f}"
    label = f"{method} ★" if method == default else method
    if not (runs["kept"] and runs["local"]):
        return f"| {label} | {len(by_seed)} | " + " | ".join(means) + f" | – | – | – | – | {cost} | {wall} |"
    differences = site_stats.paired_differences(runs["kept"], runs["local"])
    site, seed, worst = site_stats.worst_pair(differences)
    check = site_stats.target_check(runs["kept"], runs["local"])
    return (
        f"| {label} | {len(by_seed)} | "
        + " | ".join(means)
        + f" | {interval_text(site_stats.setting_interval(differences))} | {100 * worst:+.1f} ({site}, seed {seed}) "
        f"| {len(check.misses)} of {check.pairs} | {'met' if check.met else 'missed'} | {cost} | {wall} |"
    )


def setting_table(methods: Mapping[str, Mapping[int, Mapping[str, Any]]], default: str) -> list[str]:
    header = " | ".join(f"{c if c != 'local' else 'local-only'}: mean site" for c in CANDIDATES)
    return [
        f"| method | seeds | {header} | kept − local-only, 95 % CI | worst (site, seed) kept − local-only | pairs "
        f"below −{100 * site_stats.TOLERANCE:g} pts | target | KB / site / round | s / cell |",
        "|---" * 12 + "|",
        *(method_row(m, methods[m], default) for m in sorted(methods)),
    ]


def target_sentence(method: str, by_seed: Mapping[int, Mapping[str, Any]], tolerance: float) -> str:
    """The target check of one method, naming every (site, seed) that misses and by how much."""
    kept, local = candidate_runs(by_seed, "kept"), candidate_runs(by_seed, "local")
    if not (kept and local):
        return f"Target for {method}: not checked (its cells carry no kept and local-only test scores)."
    check = site_stats.target_check(kept, local, tolerance)
    means = f"mean kept {pct(check.mean_kept)} vs local-only {pct(check.mean_local)} over {check.pairs} pairs"
    if check.met:
        return f"Target for {method}: **met** ({means}; no pair more than {100 * tolerance:g} points below)."
    missing = ", ".join(f"{site} seed {seed} ({100 * d:+.1f})" for site, seed, d in check.misses) or "none"
    below = "" if check.mean_kept >= check.mean_local else "; the mean kept is below the mean local-only"
    return (
        f"Target for {method}: **missed** ({means}{below}). Pairs more than {100 * tolerance:g} points below "
        f"local-only: {missing}."
    )


#: The gain targets a site-gain setting is read against (benchmarks/results/site_gain.md): on the own view a mean gain
#: of at least +3 points with its 95 % interval above 0, where the sites hold fewer than 600 training samples; on the
#: pooled view, under label skew, at least +15 points on the mean.
OWN_GAIN_TARGET, POOLED_GAIN_TARGET, SMALL_SITE_SAMPLES = 0.03, 0.15, 600


def kept_gain(by_seed: Mapping[int, Mapping[str, Any]], view: str = "site_test") -> site_stats.Interval | None:
    """Kept − local-only on ``view``: the setting's t-interval over the seeds' site means (``None`` without both)."""
    kept, local = candidate_runs(by_seed, "kept", view), candidate_runs(by_seed, "local", view)
    if not (kept and local):
        return None
    return site_stats.setting_interval(site_stats.paired_differences(kept, local))


def gain_target_sentence(method: str, by_seed: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The gain targets (`OWN_GAIN_TARGET`, `POOLED_GAIN_TARGET`) of one method, met or missed with the numbers;
    ``None`` without kept and local-only scores. The pooled target applies under label skew only: the reader
    knows the setting, the sentence gives the number either way."""
    own = kept_gain(by_seed)
    if own is None:
        return None
    own_met = own.mean >= OWN_GAIN_TARGET and own.low > 0
    parts = [f"own view {interval_text(own)} ({'met' if own_met else 'missed'}: ≥ +{100 * OWN_GAIN_TARGET:g} "
             "with the interval above 0)"]  # fmt: skip
    pooled = kept_gain(by_seed, "site_pooled_test")
    if pooled is not None:
        verdict = "met" if pooled.mean >= POOLED_GAIN_TARGET else "missed"
        parts.append(f"pooled view {interval_text(pooled)} ({verdict}: ≥ +{100 * POOLED_GAIN_TARGET:g} on the mean)")
    sizes = [s.get("train", 0) for cell in by_seed.values() for s in cell.get("site_sizes", {}).values()]
    small = f"sites of {min(sizes)}–{max(sizes)} training samples" if sizes else "site sizes not recorded"
    scope = "" if not sizes or max(sizes) < SMALL_SITE_SAMPLES else f"; some site holds ≥ {SMALL_SITE_SAMPLES}"
    return f"Gain targets for {method} ({small}{scope}): " + "; ".join(parts) + "."


def sizes_text(by_seed: Mapping[int, Mapping[str, Any]], site: str) -> str:
    sizes = next((cell.get("site_sizes", {}).get(site) for cell in by_seed.values()), None)
    return "–" if not sizes else " / ".join(str(sizes.get(k, "–")) for k in ("train", "val", "test"))


def site_rows(by_seed: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """One row per site of one method: sizes, candidates' mean accuracy over seeds, the three paired differences
    against local-only with their intervals and the verdict of kept's, and the candidates kept."""
    runs = {c: candidate_runs(by_seed, c) for c in CANDIDATES}
    differences = {
        c: site_stats.paired_differences(runs[c], runs["local"]) for c in ("kept", "personal", "global") if runs[c]
    }
    sites = sorted({s for sites in runs.values() for by_site in sites.values() for s in by_site}, key=_site_order)
    rows = []
    for site in sites:
        scores = [_site_mean(runs[c], site) for c in CANDIDATES]
        gaps = [_gap_text(differences.get(c, {}).get(site)) for c in ("kept", "personal", "global")]
        kept = differences.get("kept", {}).get(site)
        verdict = site_stats.verdict(site_stats.t_interval(list(kept.values()))) if kept else "–"
        chosen = sorted(str(cell.get("kept_candidate", {}).get(site, "–")) for cell in by_seed.values())
        if kept_own_everywhere(by_seed, site):  # the difference is 0 by construction, not a measured certainty
            gaps[0], verdict = "no gain: kept its own model", "own"

        rows.append(
            f"| {site} | {sizes_text(by_seed, site)} | "
            + " | ".join([*scores, *gaps, verdict, ", ".join(chosen)])
            + " |"
        )
    return rows


def _gap_text(values: Mapping[int, float] | None) -> str:
    return interval_text(site_stats.t_interval(list(values.values()))) if values else "–"


def kept_own_everywhere(by_seed: Mapping[int, Mapping[str, Any]], site: str) -> bool:
    """Whether the site kept its own (local-only) model at every seed."""
    flags = [cell.get("kept_own", {}).get(site) for cell in by_seed.values()]
    return bool(flags) and all(flags)


def pooled_site_rows(by_seed: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """Per site, the "next patient" view beside the own one: what the site has on the pooled test set (local-only,
    kept) and what the federation's global model would give it there, at what cost on its own test split."""
    own = {c: candidate_runs(by_seed, c) for c in ("global", "local")}
    pooled = {c: candidate_runs(by_seed, c, "site_pooled_test") for c in ("global", "local", "kept")}
    if not (pooled["local"] and pooled["kept"]):
        return []
    kept_gap = site_stats.paired_differences(pooled["kept"], pooled["local"])
    global_gap = site_stats.paired_differences(pooled["global"], pooled["local"]) if pooled["global"] else {}
    global_own = site_stats.paired_differences(own["global"], own["local"]) if own["global"] else {}
    rows = []
    for site in sorted(kept_gap, key=_site_order):
        scores = [_site_mean(pooled[c], site) for c in ("local", "kept", "global")]
        kept = "no gain: kept its own model" if kept_own_everywhere(by_seed, site) else _gap_text(kept_gap[site])
        gaps = [kept, _gap_text(global_gap.get(site)), _gap_text(global_own.get(site))]
        rows.append(f"| {site} | " + " | ".join([*scores, *gaps]) + " |")
    return rows


def pooled_site_table(method: str, by_seed: Mapping[int, Mapping[str, Any]]) -> list[str]:
    rows = pooled_site_rows(by_seed)
    if not rows:
        return []
    return [
        f"Per site, {method}, the pooled view (all labels; the next patient): the site's models there, and what the "
        "final global model would give it instead of its local-only model, on the pooled view and on its own test "
        "split:",
        "",
        "| site | local-only: pooled | kept: pooled | global: pooled | kept − local-only: pooled | global − "
        "local-only: pooled | global − local-only: own |",
        "|---" * 7 + "|",
        *rows,
        "",
    ]


def _site_mean(runs: Mapping[int, Mapping[str, float]], site: str) -> str:
    values = [sites[site] for sites in runs.values() if site in sites]
    return pct(statistics.fmean(values)) if values else "–"


def _site_order(site: str) -> tuple[int, str]:
    tail = site.rsplit("-", 1)[-1]
    return (int(tail), site) if tail.isdigit() else (1 << 30, site)


def per_site_table(method: str, by_seed: Mapping[int, Mapping[str, Any]]) -> list[str]:
    return [
        f"Per site, {method} (mean over seeds {sorted(by_seed)}; differences paired by seed, 95 % t-interval):",
        "",
        "| site | train / val / test | global | personal | local-only | kept | kept − local-only | personal − "
        "local-only | global − local-only | kept vs local-only | kept candidate per seed |",
        "|---" * 11 + "|",
        *site_rows(by_seed),
        "",
    ]


def setting_title(partition: str, partition_seed: Any) -> str:
    return partition if partition_seed is None else f"{partition}, partition seed {partition_seed}"


def learning_sentence(methods: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> str | None:
    """Does the federation learn: every method's global model on the pooled test set beside the same model trained
    centrally (the `CENTRAL` method's cells); ``None`` without a central run or a pooled view."""
    pooled = {m: candidate_runs(by_seed, "global", "site_pooled_test") for m, by_seed in methods.items()}
    pooled = {m: runs for m, runs in pooled.items() if runs}
    if CENTRAL not in pooled or len(pooled) < 2:
        return None
    best = {m: candidate_runs(by_seed, "best_global", "site_pooled_test") for m, by_seed in methods.items()}

    def scores(method: str) -> str:  # with the model chosen on the sites' validation (controllers/model_selection.py)
        last = mean_site(pooled[method])
        return f"{last} at the end, {mean_site(best[method])} chosen on validation" if best.get(method) else last

    federated = ", ".join(f"{m} {scores(m)}" for m in sorted(pooled) if m != CENTRAL)
    return (
        f"Does the federation learn? Global model on the pooled test set (all labels, mean over seeds): {federated}; "
        f"the same model trained centrally on data of the same size and distribution as the sites' union, same "
        f"optimizer, epochs and rounds: {scores(CENTRAL)}."
    )


def setting_section(
    title: str, methods: Mapping[str, Mapping[int, Mapping[str, Any]]], default: str, tolerance: float
) -> list[str]:
    """One setting: the methods' table, the default's target check, then every method's per-site table; a central
    run is read only against the federated global models (`learning_sentence`)."""
    learning = learning_sentence(methods)
    methods = {m: by_seed for m, by_seed in methods.items() if m != CENTRAL}
    lines = [f"### {title}", "", *([learning, ""] if learning else []), *setting_table(methods, default), ""]
    if default in methods:
        lines += [target_sentence(default + " (the pre-registered default)", methods[default], tolerance), ""]
        gains = gain_target_sentence(default, methods[default])
        lines += [gains, ""] if gains else []
    else:
        lines += [f"The pre-registered default ({default}) did not run in this setting.", ""]
    lines += [target_sentence(m, methods[m], tolerance) for m in sorted(methods) if m != default]
    lines += ["", *(views_sentence(m, methods[m]) for m in sorted(methods))]
    lines.append("")
    for method in sorted(methods):
        lines += [*per_site_table(method, methods[method]), *pooled_site_table(method, methods[method])]
    return lines


def chosen_on(cells: Sequence[Mapping[str, Any]]) -> str:
    """The split the cells' sites chose their kept and own models on, as the legend names it (``keep_view``;
    cells from before the setting chose on their own validation splits)."""
    if any(cell.get("protocol", {}).get("keep_view", "own") == "pooled" for cell in cells):
        return (
            "a pooled validation split of all labels, disjoint from the pooled view (keep_view pooled; the local-only "
            "model is early-stopped on it too)"
        )
    return "the site's validation split"


def legend(
    seeds: Sequence[int], default: Mapping[str, Any], tolerance: float, selection: str = "the site's validation split"
) -> list[str]:
    return [
        f"Test accuracy in % on each site's own TEST split (never trained or selected on); training seeds "
        f"{list(seeds)} on fixed site data per setting (the partition seed is stated in the setting's title when it "
        "is not the training seed). Mean site: the unweighted mean over sites, per seed first, then over seeds. "
        "Candidates: global (the final global model), personal (the method's personal model), local-only (the "
        f"site's in-job local-only model, compute-matched, never sent), kept (the candidate best on {selection}). "
        "Differences are paired per (site, seed); a setting's 95 % t-interval is taken over the "
        "per-seed means across sites (the sites are fixed, only training varies), a site's over its seeds; 'gain' "
        "/ 'loss' when the interval excludes 0, 'within' otherwise (one seed: no interval), 'own' (no gain: kept "
        "its own model) when the site kept its local-only model at every seed. Target: no (site, "
        f"seed) pair's kept accuracy more than {100 * tolerance:g} points below its local-only model, and mean "
        f"kept ≥ mean local-only. ★ the pre-registered default ({default['method']}, keep {default['keep']}, "
        f"local baseline {'on' if default['local_baseline'] else 'off'}), fixed in code before any held-out run.",
        "",
    ]


def report_lines(
    cells: Sequence[Mapping[str, Any]], dataset: str, tolerance: float = site_stats.TOLERANCE
) -> list[str]:
    """Every setting of a folder's test-split cells (empty when it has none)."""

    grouped = group_cells(cells)
    if not grouped:
        return []
    seeds = sorted({seed for methods in grouped.values() for by_seed in methods.values() for seed in by_seed})
    lines = legend(seeds, PREREGISTERED_DEFAULT, tolerance, chosen_on(cells))
    for (partition, partition_seed), methods in sorted(grouped.items(), key=lambda item: str(item[0])):
        title = f"{dataset}, {setting_title(partition, partition_seed)}"
        lines += setting_section(title, methods, PREREGISTERED_DEFAULT["method"], tolerance)
    return lines
