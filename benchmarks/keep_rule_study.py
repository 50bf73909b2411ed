"""Keep rules replayed offline on recorded candidate tables: which rule lets a small site leave its own model when
the federation's is better, without losing where it is not (benchmarks/results/site_gain.md).

A benchmark run with ``FL_RECORD_CANDIDATE_TABLES=<dir>`` (lightning_modules/kept_model.py) writes every site's
round tables: per model (``global``, ``personal``, ``local``: the round's local-only model) and split (``val``,
``test``, ``pooled``) the (n, classes) log-probabilities, and the labels. This script replays what the site does
each round (lightning_modules/kept_model.py, `KeptModel.round`) with the site's own functions
(lightning_modules/site_choice.py): the early-stopped own model, the challengers (the round's federated models,
their mixtures with the own model, the model kept so far when federated) and a keep rule; and the server's stopping
rule (controllers/stopping.py) on the mean kept validation loss. Only the rule changes between rows, so a row is
what the job would have reported with that rule, stopping included.

A pair (site, seed) more than 2 points below its own model is also counted as "within test noise" when the
difference is within 1.96 standard errors of the paired per-sample difference on that site's test split (the
standard error the site reports with its gain, `site_choice.paired_mean_se`): on the recorded Fashion-MNIST sites'
test splits of 22-113 samples its median, where a site left its own model, is 2.4-6.9 points per setting, so such a
pair shows no harm the split can resolve (nor would a gain of the same size show one).

Each row also gives how far a site's validation split's label mix is from its test split's (`label_distance`, the
total-variation distance, median and maximum over the runs' sites): label-blind hold-outs (``site_holdout
random``, every grid up to v4) can give a small label-skewed site a split that selects with another mix than the
split that reports; stratified ones (v5) hold every label within one sample of its share in both.

Rules (`RULES`): ``margin=m``: the best challenger replaces the own model when its validation loss is lower by more
than ``m`` standard errors of the paired per-sample difference (the shipped rule at 1.0 since v4, 1.645 before);
``guard=m``: the same, and the challenger is not below the own model on validation accuracy. A counterfactual
family, replayed only when named (`COUNTERFACTUAL_RULES`): ``prefer=m``: the other way round, the best challenger
replaces the own model unless the own model's validation loss is lower by more than ``m`` standard errors (a tie
goes to the federated candidate, which knows the labels the site rarely sees).

    python -m benchmarks.keep_rule_study /tmp/tables/setting-a /tmp/tables/setting-b --patience 5

The tables are large (6-160 MB a setting) and stay out of the repository; ``--json`` writes what the tables in
benchmarks/results/site_gain.md are computed from (every run's final kept/own scores per site and rule), which is
committed (benchmarks/results/keep_rule_study/).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.site_stats import ROUNDING, TOLERANCE, t_interval
from controllers.stopping import rounds_since_best
from lightning_modules.kept_model import Offer, candidate_of, early_stopped_offer, round_challengers
from lightning_modules.site_choice import Candidate, beats, paired_mean_se

Tables = dict[str, np.ndarray]
#: The centrally trained model's cells (benchmarks/site_report.py): one site, a ceiling, not a federation to replay.
CENTRAL = "central"
Rule = Callable[[Candidate, Candidate], bool]  # (challenger, own) -> replace the own model
#: The replay never stores a model: no weights behind its offers.
NO_WEIGHTS: Callable[[], None] = lambda: None  # noqa: E731


def margin_rule(margin: float) -> Rule:
    return lambda challenger, own: beats(challenger, own, margin)


def guard_rule(margin: float) -> Rule:
    def rule(challenger: Candidate, own: Candidate) -> bool:
        not_worse = challenger.scores.accuracy("val") >= own.scores.accuracy("val")
        return not_worse and beats(challenger, own, margin)

    return rule


def prefer_rule(margin: float) -> Rule:
    return lambda challenger, own: not beats(own, challenger, margin)


RULES: dict[str, Rule] = {
    **{f"margin={m}": margin_rule(m) for m in (1.645, 1.282, 1.0, 0.5, 0.0)},
    **{f"guard={m}": guard_rule(m) for m in (1.0, 0.5, 0.0)},
}
#: Rules replayed only when ``--rules`` names them (the default replays `RULES`, as the committed records were made).
COUNTERFACTUAL_RULES: dict[str, Rule] = {f"prefer={m}": prefer_rule(m) for m in (1.0, 0.0)}


def read_round(path: Path) -> tuple[dict[str, Tables], dict[str, np.ndarray]]:
    arrays = np.load(path)
    models: dict[str, Tables] = {}
    labels = {}
    for key in arrays.files:
        name, split = key.split("__")
        if name == "labels":
            labels[split] = arrays[key]
        else:
            models.setdefault(name, {})[split] = arrays[key].astype(np.float64)
    return models, labels


def read_labels(path: Path) -> dict[str, np.ndarray]:
    """A recorded round's labels per split, without reading its models' tables (an ``.npz`` loads keys lazily)."""
    with np.load(path) as arrays:
        return {key.split("__")[1]: arrays[key] for key in arrays.files if key.startswith("labels__")}


def site_rounds(run: Path) -> dict[str, list[Path]]:
    """Per site, its recorded rounds in order."""
    found: dict[str, dict[int, Path]] = {}
    for path in run.glob("*_r*.npz"):
        site, number = re.fullmatch(r"(.+)_r(\d+)\.npz", path.name).groups()
        found.setdefault(site, {})[int(number)] = path
    return {site: [rounds[r] for r in sorted(rounds)] for site, rounds in sorted(found.items())}


def recent_ensemble(tables: Sequence[Tables]) -> Tables:
    """Per split, the log of the mean probability of ``tables`` (each model's (n, classes) log-probabilities)."""
    return {
        split: np.logaddexp.reduce(np.stack([t[split] for t in tables]), axis=0) - math.log(len(tables))
        for split in tables[0]
    }


def label_prior(labels: np.ndarray, classes: int) -> np.ndarray:
    """The site's label frequencies with one added to every count (Laplace), so no class has probability 0."""
    counts = np.bincount(labels, minlength=classes).astype(np.float64)
    return (counts + 1.0) / (counts.sum() + classes)


def prior_shifted(tables: Tables, prior: np.ndarray, tau: float) -> Tables:
    """A model's log-probabilities moved towards ``prior``: ``log_softmax(log p(y | x) + tau log prior(y))`` per
    split (the label-shift correction of Saerens et al. 2002 at tau = 1, for a model trained on roughly balanced
    labels)."""
    out = {}
    for split, table in tables.items():
        shifted = table + tau * np.log(prior)[None, :]
        out[split] = shifted - np.logaddexp.reduce(shifted, axis=1, keepdims=True)
    return out


def replay_site(
    paths: Sequence[Path],
    rule: Rule,
    local_patience: int | None = None,
    window: int = 0,
    prior_shift: Sequence[float] = (),
) -> list[dict[str, float]]:
    """Per round: the kept and own models' scores after that round, as the site would report them (the site's own
    early stopping and challengers, kept_model.py; ``rule`` in place of the margin test).

    Counterfactuals the site does not run (``python -m benchmarks.keep_rule_study --help``): ``local_patience`` P
    stops the local-only model's training once its validation loss has not improved for P rounds (the own model is
    frozen from then on); ``window`` K >= 2 adds, per federated kind, the probability average of the last K
    received models of that kind as a challenger; each ``prior_shift`` tau adds, per federated kind, the received
    model shifted towards the site's label frequencies (`prior_shifted`). Those frequencies are counted on the
    validation labels, the only labels the tables keep (a site would count its training labels): a choice on
    validation among such candidates is a little optimistic, which can only flatter them."""
    own: Offer | None = None
    kept: Offer | None = None
    since_better, recent = 0, {kind: deque(maxlen=max(window, 1)) for kind in ("global", "personal")}
    out = []
    for round_num, path in enumerate(paths):
        models, labels = read_round(path)
        offers = {kind: Offer(candidate_of(kind, round_num, t, labels), t, NO_WEIGHTS) for kind, t in models.items()}
        if own is None or local_patience is None or since_better < local_patience:
            latest = offers["local"]
            stopped = latest if own is None else early_stopped_offer(own, latest)
            since_better = 0 if stopped is latest else since_better + 1
            own = stopped
        federated = [offers[kind] for kind in ("global", "personal") if kind in offers]
        for kind in ("global", "personal") if window >= 2 else ():
            if kind in models:
                recent[kind].append(models[kind])
            if len(recent[kind]) >= 2:
                tables = recent_ensemble(list(recent[kind]))
                federated.append(Offer(candidate_of(kind, round_num, tables, labels), tables, NO_WEIGHTS))
        prior = label_prior(labels["val"], models["local"]["val"].shape[1]) if prior_shift else None
        for tau in prior_shift:
            for kind in ("global", "personal"):
                if kind in models:
                    tables = prior_shifted(models[kind], prior, tau)
                    federated.append(Offer(candidate_of(kind, round_num, tables, labels), tables, NO_WEIGHTS))
        finite = [
            c for c in round_challengers(own, federated, kept, round_num, labels) if math.isfinite(c.candidate.val_loss)
        ]
        best = min(finite, key=lambda c: c.candidate.val_loss) if finite else None  # the first of equal values
        kept = best if best is not None and rule(best.candidate, own.candidate) else own
        row = {"kept_val_loss": kept.candidate.val_loss, "kept_own": float(kept is own)}
        row["global_val_loss"] = offers["global"].candidate.val_loss  # what the server's model choice reads
        row["global_val_accuracy"] = offers["global"].candidate.scores.accuracy("val")
        for split in ("test", "pooled"):
            if split in labels:
                row[f"kept_{split}"] = kept.candidate.scores.accuracy(split)
                row[f"own_{split}"] = own.candidate.scores.accuracy(split)
                row[f"global_{split}"] = offers["global"].candidate.scores.accuracy(split)
        if "test" in labels:
            # The standard error the site itself reports with its gain (eval.kept_minus_local_test_accuracy_se).
            correct = (kept.candidate.scores.correct["test"], own.candidate.scores.correct["test"])
            row["test_difference_se"] = paired_mean_se(*correct)[1]
        out.append(row)
    return out


def label_distance(first: np.ndarray, second: np.ndarray) -> float:
    """Total-variation distance between the label distributions of two splits: half the summed absolute
    difference of their label shares (0: the same mix; 1: no label in common)."""
    classes = int(max(first.max(initial=0), second.max(initial=0))) + 1
    shares = [np.bincount(labels, minlength=classes) / max(len(labels), 1) for labels in (first, second)]
    return float(0.5 * np.abs(shares[0] - shares[1]).sum())


#: A pair's test difference within this many paired standard errors of 0 is within the test split's own noise.
NOISE_Z = 1.96


def stop_round(per_site: dict[str, list[dict[str, float]]], patience: int | None) -> int:
    """The round the server's plateau rule ends the job after (the last recorded round without a rule)."""
    rounds = min(len(rows) for rows in per_site.values())
    if patience is None:
        return rounds - 1
    history = []
    for t in range(rounds):
        history.append(float(np.mean([rows[t]["kept_val_loss"] for rows in per_site.values()])))
        if rounds_since_best(history) >= patience:
            return t
    return rounds - 1


def interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the 95 % t-interval (benchmarks/site_stats.py); low and high nan below 2 values."""
    found = t_interval(values)
    if not math.isfinite(found.half):
        return found.mean, float("nan"), float("nan")
    return found.mean, found.low, found.high


def summary_of(finals: Sequence[Sequence[dict[str, float]]]) -> dict[str, object]:
    """A setting's figures from its runs' final rows (per run, one `replay_site` row per site): the own-view gain
    (kept − own on the test split, in points; the mean over the run's sites, then the 95 % t-interval over runs), the
    pooled-view one, the worst (site, seed) pair, the pairs below −2 points (and of them those within their test
    split's noise, `NOISE_Z`), and how many sites kept their own model."""
    seed_means, pooled_means, pairs, within_noise, own_kept = [], [], [], 0, 0
    for rows in finals:
        gains = [100 * (r["kept_test"] - r["own_test"]) for r in rows]
        pairs += gains
        within_noise += sum(
            g < -100 * (TOLERANCE + ROUNDING) and -g <= 100 * NOISE_Z * r["test_difference_se"]
            for g, r in zip(gains, rows, strict=True)
        )
        own_kept += sum(int(r["kept_own"]) for r in rows)
        seed_means.append(float(np.mean(gains)))
        if "kept_pooled" in rows[0]:
            pooled_means.append(float(np.mean([100 * (r["kept_pooled"] - r["own_pooled"]) for r in rows])))
    return {
        "gain": interval(seed_means),
        "pooled": interval(pooled_means) if pooled_means else None,
        "worst": min(pairs),
        "below2": sum(g < -100 * (TOLERANCE + ROUNDING) for g in pairs),
        "below2_within_noise": within_noise,
        "pairs": len(pairs),
        "own_kept": own_kept,
    }


def replayed_runs(
    setting: Path,
    rule: Rule,
    local_patience: int | None = None,
    window: int = 0,
    prior_shift: Sequence[float] = (),
) -> dict[str, dict[str, list[dict[str, float]]]]:
    """Per federated run of ``setting`` (one folder per training seed; central cells left out) and site, the
    `replay_site` rows of every recorded round."""
    runs = {}
    for run in sorted(p for p in setting.iterdir() if p.is_dir() and not p.name.startswith(f"{CENTRAL}__")):
        per_site = {
            site: replay_site(paths, rule, local_patience, window, prior_shift)
            for site, paths in site_rounds(run).items()
        }
        if per_site:
            runs[run.name] = per_site
    return runs


def study(
    setting: Path,
    rule: Rule,
    patience: int | None,
    local_patience: int | None = None,
    window: int = 0,
    prior_shift: Sequence[float] = (),
) -> dict[str, object]:
    """One setting (a folder of runs, one per training seed) under one rule (counterfactuals: `replay_site`)."""
    finals, stops, finals_by_run, split_distances = [], [], {}, []
    for name, per_site in replayed_runs(setting, rule, local_patience, window, prior_shift).items():
        # The hold-outs are fixed: the first round's labels are every round's.
        for paths in site_rounds(setting / name).values():
            labels = read_labels(paths[0])
            if "test" in labels:
                split_distances.append(label_distance(labels["val"], labels["test"]))
        t = stop_round(per_site, patience)
        stops.append(t + 1)
        finals.append([rows[t] for rows in per_site.values()])
        finals_by_run[name] = {"stopped_after": t, "sites": {site: rows[t] for site, rows in per_site.items()}}
    own_test = [100 * r["own_test"] for f in finals_by_run.values() for r in f["sites"].values()]
    summary = summary_of(finals)
    own_kept = summary.pop("own_kept")
    return {  # the keys in the order of the committed records
        **summary,
        "own_test": float(np.mean(own_test)),
        "own_kept": own_kept,
        # Over the runs' sites: how far the validation split's label mix is from the test split's (median, max).
        "val_test_label_distance": [float(np.median(split_distances)), max(split_distances)]
        if split_distances
        else None,
        "rounds": stops,
        "finals": finals_by_run,
    }


def write_record(path: Path, payload: dict[str, object]) -> None:
    """The committed record of a replay: ``payload`` as indented JSON at ``path`` (its folder made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")


def fmt_distance(distance: Sequence[float] | None) -> str:
    return "–" if distance is None else f"{distance[0]:.2f} ({distance[1]:.2f})"


def fmt(interval: tuple[float, float, float] | None) -> str:
    if interval is None:
        return "–"
    mean, low, high = interval
    if low == high:  # every seed gave the same value: no interval to show, not certainty
        return f"{mean:+.1f} (no spread over seeds)"
    return f"{mean:+.1f} [{low:+.1f}, {high:+.1f}]"


def recorded_settings_parser(doc: str, json_help: str) -> argparse.ArgumentParser:
    """The replays' shared command line: the settings' folders, the stopping rule's patience and ``--json``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("settings", nargs="+", type=Path, help="folders of recorded runs (one per setting)")
    parser.add_argument("--patience", type=int, default=5, help="the stopping rule's patience (0: no stopping)")
    parser.add_argument("--json", type=Path, help=f"also write {json_help} here (the committed record)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = recorded_settings_parser(__doc__, "every (setting, rule, run, site) final score")
    rules = {**RULES, **COUNTERFACTUAL_RULES}
    parser.add_argument("--rules", nargs="+", default=list(RULES), choices=list(rules), help="rules to replay")
    parser.add_argument(
        "--local-patience",
        type=int,
        help="counterfactual: stop training the local-only model after this many rounds without a better "
        "validation loss (the site trains it every round)",
    )
    parser.add_argument(
        "--window",
        type=int,
        default=0,
        help="counterfactual: also offer the probability average of the last K received global (and personal) "
        "models as challengers (K >= 2; 0: none, as the site does)",
    )
    parser.add_argument(
        "--prior-shift",
        nargs="+",
        type=float,
        default=[],
        metavar="TAU",
        help="counterfactual: also offer each received federated model shifted towards the site's label "
        "frequencies, log p(y|x) + TAU log prior(y), renormalised, for every TAU given (none, as the site does)",
    )
    args = parser.parse_args(argv)
    patience = args.patience or None
    record: dict[str, dict[str, object]] = {}
    print(
        "| setting | rule | rounds | kept − own, own view | worst pair | pairs < −2 | own kept | pooled view "
        "| own model, own test | val/test label distance, median (max) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setting in args.settings:
        for name in args.rules:
            r = study(setting, rules[name], patience, args.local_patience, args.window, args.prior_shift)
            record.setdefault(setting.name, {})[name] = r
            print(
                f"| {setting.name} | {name} | {', '.join(map(str, r['rounds']))} | {fmt(r['gain'])} | "
                f"{r['worst']:+.1f} | {r['below2']} of {r['pairs']} ({r['below2_within_noise']} within test noise) | "
                f"{r['own_kept']} of {r['pairs']} | "
                f"{fmt(r['pooled'])} | {r['own_test']:.1f} | {fmt_distance(r['val_test_label_distance'])} |"
            )
    if args.json:
        counterfactuals = {
            "local_patience": args.local_patience,
            "window": args.window,
            "prior_shift": args.prior_shift,
        }
        write_record(args.json, {"patience": patience, **counterfactuals, "settings": record})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
