"""The global model a job delivers, replayed on recorded runs: the last round's against the one the sites'
validation scores choose over rounds (controllers/model_selection.py; benchmarks/results/site_gain.md).

A benchmark run with ``FL_RECORD_CANDIDATE_TABLES=<dir>`` (lightning_modules/kept_model.py) keeps, per site and
round, the log-probabilities of the global model the site received on its validation split and on the pooled test
set. For every run of a setting (the federated ones and, where recorded, the central ones: one site holding the
sites' union), this replays where the run stopped (the stopping rule on the kept models, benchmarks/keep_rule_study.py,
the shipped margin) and, up to that round, which received model the server's rule chooses: the lowest unweighted
mean over the sites of its validation loss, the first of equal values. Printed per setting, mean over the runs of
the pooled-test accuracy of the last received model (what the per-setting reports call the global model) and of the
chosen one, and the best any round reached (an oracle, for scale; nothing can choose it without the test set).

A counterfactual the server does not run is printed beside it: the round with the highest unweighted mean over the
sites of the received model's validation *accuracy* (the lower mean loss breaks ties, then the earlier round). The
loss punishes a few confident mistakes hard, so over a long run it can prefer an early, less confident model to a
later, more accurate one; the column shows where that happens.

    python -m benchmarks.global_choice /tmp/tables/setting-a /tmp/tables/setting-b --json out.json
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.keep_rule_study import (
    CENTRAL,
    RULES,
    recorded_settings_parser,
    replay_site,
    site_rounds,
    stop_round,
    write_record,
)
from lightning_modules.site_choice import DEFAULT_MARGIN

RULE = f"margin={DEFAULT_MARGIN}"


def chosen_round(losses: Sequence[float]) -> int:
    """The index of the lowest value, the first of equal ones (the server's rule)."""
    return int(np.argmin(np.asarray(losses, dtype=np.float64)))


def chosen_round_by_accuracy(accuracies: Sequence[float], losses: Sequence[float]) -> int:
    """The index of the highest accuracy; the lower loss breaks ties, then the earlier index (the counterfactual)."""
    return max(range(len(accuracies)), key=lambda t: (accuracies[t], -losses[t]))


def replay_run(run: Path, patience: int | None) -> dict[str, float]:
    """One recorded run: where it stopped, the round the rule chooses (and the accuracy counterfactual's), and the
    pooled accuracies."""
    rows = {site: replay_site(paths, RULES[RULE]) for site, paths in site_rounds(run).items()}
    stop = stop_round(rows, patience)

    def mean_over_sites(key: str) -> list[float]:
        return [float(np.mean([by_round[t][key] for by_round in rows.values()])) for t in range(stop + 1)]

    mean_loss = mean_over_sites("global_val_loss")
    # The pooled test set is the same at every site, so is the received model's score there.
    pooled = [100.0 * row["global_pooled"] for row in next(iter(rows.values()))[: stop + 1]]
    chosen = chosen_round(mean_loss)
    by_accuracy = chosen_round_by_accuracy(mean_over_sites("global_val_accuracy"), mean_loss)
    return {"rounds": stop + 1, "chosen_round": chosen + 1, "last": pooled[-1], "chosen": pooled[chosen],
            "best_any_round": max(pooled), "chosen_round_by_accuracy": by_accuracy + 1,
            "chosen_by_accuracy": pooled[by_accuracy]}  # fmt: skip


def replay_setting(setting: Path, patience: int | None) -> dict[str, dict[str, dict[str, float]]]:
    """Per kind (federated, central) and run: `replay_run`."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for run in sorted(p for p in setting.iterdir() if p.is_dir()):
        if site_rounds(run):
            kind = CENTRAL if run.name.startswith(f"{CENTRAL}__") else "federated"
            out.setdefault(kind, {})[run.name] = replay_run(run, patience)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = recorded_settings_parser(__doc__, "every run's replay")
    args = parser.parse_args(argv)
    record = {}
    print(
        "| setting | runs | rounds run | chosen round | last received model | chosen on validation | best any round "
        "| chosen round, on accuracy | chosen on validation accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for setting in args.settings:
        record[setting.name] = replayed = replay_setting(setting, args.patience or None)
        for kind, runs in replayed.items():
            rows = list(runs.values())
            keys = ("last", "chosen", "best_any_round", "chosen_by_accuracy")
            mean = {key: float(np.mean([r[key] for r in rows])) for key in keys}
            print(
                f"| {setting.name} | {kind} ×{len(rows)} | {', '.join(str(r['rounds']) for r in rows)} | "
                f"{', '.join(str(r['chosen_round']) for r in rows)} | {mean['last']:.1f} | {mean['chosen']:.1f} | "
                f"{mean['best_any_round']:.1f} | {', '.join(str(r['chosen_round_by_accuracy']) for r in rows)} | "
                f"{mean['chosen_by_accuracy']:.1f} |"
            )
    if args.json:
        write_record(args.json, {"patience": args.patience, "rule": RULE, "settings": record})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
