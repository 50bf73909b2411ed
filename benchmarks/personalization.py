"""Does each site gain from joining? Per-site scores of the global, personalized and local-only models, and the page.

The comparison harnesses (``benchmarks.compare --grid personalization``, ``benchmarks.genomics --grid
personalization``) run the methods of docs/personalization.md as cells; after a federation ends, this module scores
on every site's own validation split (the split the sites score on during the run):

- **global**: the final global model. With local keys (FedPer, FedBN, FedRep) its local entries are the initial
  model's (the server never sees the sites' own), which serve no site: the report marks those values;
- **personalized**: the model the site keeps at the end: fine-tuning, the final global model fine-tuned
  ``finetune_epochs`` on the site's training part (as every round does); partial sharing, the final global model
  with the site's own local entries from its state store; Ditto, v_i from its state store (the trainable
  parameters); FedAvg has none, its sites use the global model;
- **local-only** (the ``local`` cell): every site alone, from the same initial model, for the federation's total
  local epochs (rounds x epochs), with the site's optimizer on its training part: fine-tuning the initial model for
  that many epochs (the fine-tuning path, reused), scored on the same split.

The report compares each method's personalized score with local-only site by site, paired by seed (the seed draws
the split, so site-3 of seed 0 and of seed 1 hold different data): d = personalized - local-only per seed; a site
**gains** when the mean of d over seeds exceeds its standard deviation over seeds (the site's seed spread), **loses**
when it is below minus that spread, and **ties** otherwise.

    python -m benchmarks.personalization --out benchmarks/results/personalization.md DIR [DIR ...]

writes the page from the cells of several harness folders (one section per folder).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The local-only baseline's label in every personalization grid.
LOCAL = "local"

#: Accuracy metric the sites' validation_step logs (built-in classifier and the genomics model alike).
METRIC = "val_accuracy"

SiteScores = Mapping[str, float]  # site -> accuracy


# --------------------------------------------------------------------------------------------------------------------
# Scoring at the sites (after a federation, on the sites' own validation split)
# --------------------------------------------------------------------------------------------------------------------
def site_validation(site: Any) -> dict[str, Any]:
    """The keyword naming the site's validation data for ``trainer.validate``: the built-in site's held-out split, or
    a user data module (whose ``val_dataloader`` is the split)."""
    if hasattr(site, "validation_loader"):
        return {"dataloaders": site.validation_loader()}
    return {"datamodule": site.data}


def score_module(site: Any, module: Any) -> float:
    """``module``'s accuracy on the site's validation split, with a fresh single-process Trainer."""
    from lightning_modules.personal_scores import single_process_trainer, validation_scores

    return validation_scores(module, single_process_trainer("32-true", "cpu"), **site_validation(site))[METRIC]


def load_params(site: Any, params: Mapping[str, Any]) -> Any:
    """The site's module holding ``params`` (a whole state_dict, loaded strictly as the round's exchange does)."""
    from lightning_modules.site import LocalExchange

    LocalExchange(params).on_train_start(None, site.module)
    return site.module


def score_params(site: Any, params: Mapping[str, Any]) -> float:
    from lightning_modules.personal_scores import site_copy

    return score_module(site, site_copy(load_params(site, params)))


def finetuned(site: Any, params: Mapping[str, Any], round_num: int) -> Any:
    """The site's fine-tuning of ``params`` (its own ``finetune_epochs``, seeded by site and round), the module."""
    load_params(site, params)
    return site.finetune(round_num, site.dataset) if hasattr(site, "dataset") else site.finetune(round_num)


def stored_entries(state_root: Path, site: str, name: str, keys: Sequence[str]) -> dict[str, Any]:
    """The entries ``keys`` of the site's committed state ``name`` (numpy); empty when the site stored none (it never
    took part in an aggregated round)."""
    from lightning_modules.state_store import ClientStateStore

    stored = ClientStateStore(state_root, site).load(name)
    if stored is None:
        return {}
    return {key: stored.state[key].detach().cpu().numpy() for key in keys if key in stored.state}


def personal_params(spec: Any, state_root: Path, site: str, final: Mapping[str, Any]) -> dict[str, Any] | None:
    """The final global model with the site's own entries over it (partial sharing: L; Ditto: v_i), or None for a
    method that keeps none."""
    from lightning_modules.algorithms.ditto import Ditto
    from lightning_modules.personalization.partial_sharing import STORE_NAME

    if spec.client == "ditto":
        return {**final, **stored_entries(state_root, site, Ditto.name, list(final))}
    if spec.local_keys:
        return {**final, **stored_entries(state_root, site, STORE_NAME, spec.local_keys.split(","))}
    return None


def site_scores(spec: Any, state_root: Path, final: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """After ``spec``'s federation (its client state still under ``state_root``): per site, the final global model's
    and the personalized model's accuracy on the site's validation split (module docstring)."""
    from benchmarks.in_process import site_rounds

    scores: dict[str, dict[str, float]] = {"global": {}, "personal": {}}
    for name, site in site_rounds(spec, state_root).items():
        scores["global"][name] = score_params(site, final)
        if spec.finetune_epochs:
            scores["personal"][name] = score_module(site, finetuned(site, final, spec.num_rounds))
            continue
        personal = personal_params(spec, state_root, name, final)
        scores["personal"][name] = scores["global"][name] if personal is None else score_params(site, personal)
    return scores


def local_only_scores(spec: Any, state_root: Path) -> dict[str, float]:
    """Every site alone: ``spec``'s initial model fine-tuned at the site for ``num_rounds x epochs`` epochs (the
    federation's total local epochs), scored on the site's validation split."""
    from dataclasses import replace

    from benchmarks.in_process import initial_params, site_rounds

    alone = replace(spec, finetune_epochs=spec.num_rounds * spec.epochs)
    initial = initial_params(alone)
    return {
        name: score_module(site, finetuned(site, initial, 0)) for name, site in site_rounds(alone, state_root).items()
    }


# --------------------------------------------------------------------------------------------------------------------
# Summaries (pure)
# --------------------------------------------------------------------------------------------------------------------
def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def site_mean_and_worst(per_seed: Mapping[int, SiteScores]) -> tuple[tuple[float, float], tuple[float, float]]:
    """Over seeds: (mean, sd) of the unweighted mean over sites, and (mean, sd) of the worst site."""
    seeds = sorted(per_seed)
    means = [statistics.fmean(per_seed[s].values()) for s in seeds]
    worst = [min(per_seed[s].values()) for s in seeds]
    return mean_sd(means), mean_sd(worst)


def site_differences(
    personal: Mapping[int, SiteScores], local: Mapping[int, SiteScores]
) -> dict[str, tuple[float, float]]:
    """Per site: (mean, sd) over the seeds both ran of personalized - local-only, paired by seed."""
    seeds = sorted(set(personal) & set(local))
    sites = sorted(set.intersection(*(set(personal[s]) & set(local[s]) for s in seeds))) if seeds else []
    return {site: mean_sd([personal[s][site] - local[s][site] for s in seeds]) for site in sites}


def verdict(difference: float, spread: float) -> str:
    """'gain' / 'lose' when the mean difference is beyond the seed spread, else 'tie'."""
    if difference > spread:
        return "gain"
    if difference < -spread:
        return "lose"
    return "tie"


def gain_tie_lose(differences: Mapping[str, tuple[float, float]]) -> tuple[int, int, int]:
    verdicts = [verdict(*d) for d in differences.values()]
    return verdicts.count("gain"), verdicts.count("tie"), verdicts.count("lose")


@dataclass(frozen=True)
class MethodSummary:
    """One method in one setting, over its seeds (``final``: the personalized mean over sites, as
    `benchmarks.site_stats.ranking_notes` reads it)."""

    algorithm: str
    seeds: int
    final: tuple[float, float]  # personalized: mean over sites, (mean, sd) over seeds
    worst: tuple[float, float]  # personalized: worst site
    global_mean: tuple[float, float] | None
    global_worst: tuple[float, float] | None
    counts: tuple[int, int, int] | None  # sites that gain, tie, lose against local-only


def summarise_method(
    algorithm: str, scores: Mapping[int, Mapping[str, SiteScores]], local: Mapping[int, SiteScores]
) -> MethodSummary:
    """``scores``: seed -> {"global": site scores (absent for local-only), "personal": site scores}."""
    personal = {seed: s["personal"] for seed, s in scores.items()}
    final, worst = site_mean_and_worst(personal)
    has_global = all(s.get("global") for s in scores.values())
    global_mean, global_worst = (
        site_mean_and_worst({k: s["global"] for k, s in scores.items()})
        if has_global
        else (
            None,
            None,
        )
    )
    counts = gain_tie_lose(site_differences(personal, local)) if local and algorithm != LOCAL else None
    return MethodSummary(algorithm, len(scores), final, worst, global_mean, global_worst, counts)


def best_method(summaries: Sequence[MethodSummary]) -> MethodSummary:
    """The federated method with the highest personalized mean site accuracy."""
    return max((s for s in summaries if s.algorithm != LOCAL), key=lambda s: s.final[0])


def target_check(summaries: Sequence[MethodSummary], global_method: str = "fedavg") -> tuple[bool, str]:
    """The personalization target in one setting: the best method's personalized mean site accuracy is at least
    max(local-only, ``global_method``'s global model) within the seed spread, and none of its sites loses against
    local-only. Returns (met, one sentence with the numbers)."""
    by_name = {s.algorithm: s for s in summaries}
    best = best_method(summaries)
    bars = {"local-only": by_name[LOCAL].final}
    if global_method in by_name and by_name[global_method].global_mean is not None:
        bars[f"{global_method}'s global model"] = by_name[global_method].global_mean
    bar_name, bar = max(bars.items(), key=lambda item: item[1][0])
    mean_ok = best.final[0] >= bar[0] - max(best.final[1], bar[1])
    losing = best.counts[2] if best.counts else 0
    met = mean_ok and losing == 0
    text = (
        f"best: {best.algorithm}, {_pct(best.final)} vs {bar_name} {_pct(bar)} "
        f"({'at least, within the seed spread' if mean_ok else 'below it beyond the seed spread'}); "
        f"{losing} site(s) below local-only beyond their seed spread"
    )
    return met, text


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------
def _pct(pair: tuple[float, float] | None) -> str:
    return "–" if pair is None else f"{100 * pair[0]:.1f} ± {100 * pair[1]:.1f}"


def keeps_local_entries(settings: Mapping[str, Any]) -> bool:
    """A method whose global model holds the initial values of the entries its sites keep (marked in the tables)."""
    return bool(settings.get("local_keys")) or settings.get("client") == "fedrep"


def setting_table(summaries: Sequence[MethodSummary], marked: set[str]) -> list[str]:
    """One row per method: global, personalized (best in bold, ties marked) and the gain/tie/lose counts."""
    from benchmarks.site_stats import ranking_notes

    notes = ranking_notes([s for s in summaries if s.seeds > 0])
    lines = [
        "| method | seeds | global: mean site | global: worst site | personalized: mean site | personalized: worst "
        "site | sites gain / tie / lose vs local-only |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in sorted(summaries, key=lambda s: -s.final[0]):
        mark = " †" if s.algorithm in marked else ""
        personal = _pct(s.final)
        personal = (
            f"**{personal}**"
            if notes[s.algorithm] == "best"
            else personal + (" (tie)" if notes[s.algorithm] == "tie" else "")
        )
        counts = "–" if s.counts is None else " / ".join(map(str, s.counts))
        lines.append(
            f"| {s.algorithm} | {s.seeds} | {_pct(s.global_mean)}{mark if s.global_mean else ''} | "
            f"{_pct(s.global_worst)}{mark if s.global_worst else ''} | {personal} | {_pct(s.worst)} | {counts} |"
        )
    return lines


def per_site_table(
    best: str, scores: Mapping[str, Mapping[int, Mapping[str, SiteScores]]], local: Mapping[int, SiteScores]
) -> list[str]:
    """Per site for the best method: global, personalized, local-only (mean ± sd over seeds), the paired
    difference and its verdict."""
    personal = {seed: s["personal"] for seed, s in scores[best].items()}
    local = {seed: s for seed, s in local.items() if seed in personal}  # the columns show the seeds paired
    differences = site_differences(personal, local)
    lines = [
        "| site | global | personalized | local-only | personalized − local-only | |",
        "|---|---|---|---|---|---|",
    ]
    for site, (diff, spread) in sorted(differences.items(), key=lambda item: _site_order(item[0])):
        glob = [s["global"][site] for s in scores[best].values() if s.get("global")]
        cells = [
            _pct(mean_sd(glob)) if glob else "–",
            _pct(mean_sd([p[site] for p in personal.values()])),
            _pct(mean_sd([p[site] for p in local.values()])),
            f"{100 * diff:+.1f} ± {100 * spread:.1f}",
            verdict(diff, spread),
        ]
        lines.append(f"| {site} | " + " | ".join(cells) + " |")
    return lines


def _site_order(site: str) -> tuple[int, str]:
    tail = site.rsplit("-", 1)[-1]
    return (int(tail), site) if tail.isdigit() else (math.inf, site)  # type: ignore[return-value]


def setting_section(
    title: str, scores: Mapping[str, Mapping[int, Mapping[str, SiteScores]]], marked: set[str]
) -> list[str]:
    """One setting: the methods' table, the target check and the best method's per-site table."""
    local = {seed: s["personal"] for seed, s in scores.get(LOCAL, {}).items()}
    summaries = [summarise_method(a, by_seed, local) for a, by_seed in sorted(scores.items())]
    lines = [f"### {title}", "", *setting_table(summaries, marked), ""]
    if not local or len(summaries) < 2:
        return [*lines, "No local-only cells in this setting: no gain/tie/lose counts, no target check.", ""]
    met, text = target_check(summaries)
    best = best_method(summaries).algorithm
    return [
        *lines,
        f"Target {'met' if met else 'missed'}: {text}.",
        "",
        f"Per site, {best} (mean ± sd over seeds; the difference is paired by seed):",
        "",
        *per_site_table(best, scores, local),
        "",
    ]


def legend(seeds: Sequence[int]) -> list[str]:
    return [
        f"Accuracy in % on each site's own validation split, mean ± sd over seeds {list(seeds)}; mean site: the "
        "unweighted mean over sites (every site counts once), worst site: the lowest site, each per seed first. "
        "Personalized: the model the site keeps (fedavg: the global model). Bold: the setting's best personalized "
        "mean; (tie): within the seed spread of it. Gain / tie / lose: per site, d = personalized − local-only "
        "per seed; gain when mean(d) > sd(d) over seeds, lose when mean(d) < −sd(d), tie otherwise. † the global "
        "model holds the initial values of the entries each site keeps (FedPer's and FedRep's head, FedBN's "
        "BatchNorm entries): it serves no site as it is.",
        "",
    ]


def load_scores(out: Path) -> tuple[dict[str, dict[str, dict[int, dict[str, SiteScores]]]], dict[str, Any]]:
    """A harness folder's personalization cells: setting -> method -> seed -> {"global", "personal"}; and the
    folder's protocol."""
    grouped: dict[str, dict[str, dict[int, dict[str, SiteScores]]]] = defaultdict(lambda: defaultdict(dict))
    for path in sorted((out / "cells").glob("*.json")):
        result = json.loads(path.read_text())
        if "site_personal" not in result:
            continue  # a cell of another grid in the same folder
        cell = result["cell"]
        setting = cell.get("partition") or cell["split"]
        grouped[setting][cell["algorithm"]][cell["seed"]] = {
            "global": result.get("site_global") or {},
            "personal": result["site_personal"],
        }
    protocol = json.loads((out / "protocol.json").read_text()) if (out / "protocol.json").exists() else {}
    return grouped, protocol


def folder_sections(out: Path, methods: Mapping[str, Mapping[str, Any]], dataset: str) -> list[str]:
    """Every setting of a harness folder, one section each."""
    grouped, _ = load_scores(out)
    marked = {a for a, settings in methods.items() if keeps_local_entries(settings)}
    seeds = sorted({seed for by_method in grouped.values() for by_seed in by_method.values() for seed in by_seed})
    lines = legend(seeds)
    for setting in sorted(grouped):
        lines += setting_section(f"{dataset}, {setting}", grouped[setting], marked)
    return lines


def test_split_sections(out: Path, dataset: str) -> list[str]:
    """The per-site test-split report (benchmarks/site_report.py) of a folder whose cells carry test-split scores;
    empty for a folder of validation-only cells (the sections above)."""
    from benchmarks.site_report import report_lines

    cells = [json.loads(path.read_text()) for path in sorted((out / "cells").glob("*.json"))]
    return report_lines(cells, dataset)


def write_folder_report(out: Path, command: str, methods: Mapping[str, Mapping[str, Any]], dataset: str) -> Path:
    protocol = json.loads((out / "protocol.json").read_text())
    lines = [
        f"# Does each site gain from joining? {dataset}",
        "",
        f"Produced by `{command}`. Protocol: {json.dumps(protocol)}.",
        "",
        *(test_split_sections(out, dataset) or folder_sections(out, methods, dataset)),
    ]
    report = out / "report.md"
    report.write_text("\n".join(lines))
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Gather several harness folders' reports into one page (each folder's report.md, its title demoted)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.personalization", description=main.__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the page to write")
    parser.add_argument("--title", default="Does each site gain from joining?")
    parser.add_argument("folders", nargs="+", type=Path, help="harness folders with report.md")
    args = parser.parse_args(argv)
    lines = [f"# {args.title}", ""]
    for folder in args.folders:
        report = (folder / "report.md").read_text().splitlines()
        lines += ["#" + report[0], *report[1:], ""]
    args.out.write_text("\n".join(lines))
    print(f"page: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
