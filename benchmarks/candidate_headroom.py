"""How much better than the site's own model its candidates are on its test split: the room any keep rule has,
replayed on recorded candidate tables (benchmarks/keep_rule_study.py; benchmarks/results/site_gain.md, "Where the
own-view gain is missing").

At the round the server's stopping rule ends the replayed job (the shipped keep rule, margin 1.0, patience 5), per
site and then as the mean over the setting's sites and seeds, in points over the early-stopped own model:

- ``kept``: the model the shipped rule keeps (what the site reports);
- ``<kind> early-stopped``: the received global model, or the personal (round) model, of the round with the lowest
  validation loss so far, the rule the site's own model is chosen by;
- ``<kind> last``: that kind's model of the final round, which no rule on validation chose;
- ``best on test``: per site, the best on its test split of the own model and the two early-stopped federated
  models: an oracle that reads the test split, so the most any choice among those models could give.

If ``best on test`` is below a target, no rule choosing among these candidates on validation can meet it: the
candidates, not the rule, are what limits the gain there.

    python -m benchmarks.candidate_headroom /tmp/tables/setting-a /tmp/tables/setting-b --json out.json
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.keep_rule_study import (
    CENTRAL,
    RULES,
    read_round,
    recorded_settings_parser,
    replay_site,
    site_rounds,
    stop_round,
    write_record,
)
from lightning_modules.kept_model import candidate_of
from lightning_modules.site_choice import Candidate

FEDERATED = ("global", "personal")
SHIPPED = "margin=1.0"
COLUMNS = ("kept", "global early-stopped", "global last", "personal early-stopped", "personal last", "best on test")


def early_stopped_and_last(paths: Sequence[Path]) -> dict[str, tuple[Candidate, Candidate]]:
    """Per federated kind the site had in every round of ``paths``: its model of the round with the lowest
    validation loss (the earlier of equal ones) and its model of the last round, from one read of each round."""
    best: dict[str, Candidate] = {}
    latest: dict[str, Candidate] = {}
    kinds = set(FEDERATED)
    for round_num, path in enumerate(paths):
        models, labels = read_round(path)
        kinds &= set(models)
        for kind in kinds:
            latest[kind] = candidate_of(kind, round_num, models[kind], labels)
            if kind not in best or latest[kind].val_loss < best[kind].val_loss:
                best[kind] = latest[kind]
    return {kind: (best[kind], latest[kind]) for kind in FEDERATED if kind in kinds and kind in latest}


def site_headroom(paths: Sequence[Path], stop: int, replayed: dict[str, float]) -> dict[str, float]:
    """One site's test accuracy, in points over its own model, for every `COLUMNS` entry at round ``stop``
    (``replayed``: the shipped rule's row of that round, `keep_rule_study.replay_site`)."""
    own = replayed["own_test"]
    out = {"own": 100 * own, "kept": 100 * (replayed["kept_test"] - own)}
    best = own
    found = early_stopped_and_last(paths[: stop + 1])
    for kind in FEDERATED:
        stopped, last = (own, own) if kind not in found else (c.scores.accuracy("test") for c in found[kind])
        out[f"{kind} early-stopped"], out[f"{kind} last"] = 100 * (stopped - own), 100 * (last - own)
        best = max(best, stopped)
    out["best on test"] = 100 * (best - own)
    return out


def headroom(setting: Path, patience: int | None = 5) -> dict[str, object]:
    """Every run of ``setting`` (one folder per training seed) at its replayed stopping round: per site
    `site_headroom`, and the means over sites and seeds."""
    runs: dict[str, dict[str, dict[str, float]]] = {}
    for run in sorted(p for p in setting.iterdir() if p.is_dir() and not p.name.startswith(f"{CENTRAL}__")):
        by_site = site_rounds(run)
        replayed = {site: replay_site(paths, RULES[SHIPPED]) for site, paths in by_site.items()}
        if not replayed:
            continue
        stop = stop_round(replayed, patience)
        runs[run.name] = {site: site_headroom(by_site[site], stop, replayed[site][stop]) for site in by_site}
    rows = [row for sites in runs.values() for row in sites.values()]
    means = {column: float(np.mean([row[column] for row in rows])) for column in ("own", *COLUMNS)}
    return {"runs": runs, "mean": means, "sites": len(rows)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = recorded_settings_parser(__doc__, "every run's per-site values")
    args = parser.parse_args(argv)
    print(f"| setting | (site, seed) pairs | own model, own test | {' | '.join(COLUMNS)} |")
    print("|---|---|---|" + "---|" * len(COLUMNS))
    record = {}
    for setting in args.settings:
        found = headroom(setting, args.patience or None)
        record[setting.name] = found
        mean = found["mean"]
        cells = " | ".join(f"{mean[c]:+.1f}" for c in COLUMNS)
        print(f"| {setting.name} | {found['sites']} | {mean['own']:.1f} | {cells} |")
    if args.json:
        write_record(args.json, {"patience": args.patience or None, "rule": SHIPPED, "settings": record})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
