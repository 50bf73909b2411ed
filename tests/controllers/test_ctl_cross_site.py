"""The controller's cross-site evaluation (controllers/cross_site.py) over a recording transport: every site is asked
for its models once, each site then gets the other sites' models only (never its own), and the counts it answers
become the per-owner view; a site that sends nothing is named and left out."""

from __future__ import annotations

from aggregators.contracts import cross_site
from controllers.cross_site import Answer, cross_site_record, run_cross_site


def counts(owner: str, n: int, kept: int, local: int) -> dict[str, int]:
    values = (n, kept, local, max(kept - local, 0), max(local - kept, 0))
    return {cross_site.count_name(owner, name): value for name, value in zip(cross_site.COUNTS, values, strict=True)}


class Sites:
    """Three sites: site-3 has no models; a validator's counts for owner o are (10, kept=o's number, local=1)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, list[str], dict, dict]] = []

    def ask(self, task, targets, params, meta):
        self.sent.append((task, list(targets), dict(params), dict(meta)))
        if task == cross_site.SUBMIT_TASK:
            return [
                Answer(site, {"kept/w": [int(site[-1])], "local/w": [0]}, {}) for site in targets if site != "site-3"
            ] + [Answer("site-3")]
        (validator,) = targets
        owners = meta[cross_site.OWNERS]
        metrics = {}
        for owner in owners:
            metrics.update(counts(owner, 10, int(owner[-1]), 1))
        return [Answer(validator, metrics=metrics)]


def test_each_site_scores_the_others_models_only_and_the_view_is_per_owner():
    sites, warnings = Sites(), []
    record = run_cross_site(sites.ask, ["site-1", "site-2", "site-3"], "run-7", warnings.append)
    submit, *validates = sites.sent
    assert submit[0] == cross_site.SUBMIT_TASK and submit[1] == ["site-1", "site-2", "site-3"]
    assert submit[3] == {"server.run_id": "run-7"}
    assert [(task, targets) for task, targets, _, _ in validates] == [
        (cross_site.VALIDATE_TASK, ["site-1"]),
        (cross_site.VALIDATE_TASK, ["site-2"]),
    ]
    for _, (validator,), params, meta in validates:
        other = "site-2" if validator == "site-1" else "site-1"
        assert set(params) == {f"{other}/kept/w", f"{other}/local/w"}  # never the validator's own model
        assert meta[cross_site.OWNERS] == [other] and meta["server.run_id"] == "run-7"
    assert warnings == ["cross-site evaluation: no models from ['site-3']; they are neither scored nor scoring"]
    assert record["pairs"] == {
        "site-1": {"site-2": dict(zip(cross_site.COUNTS, (10, 1, 1, 0, 0), strict=True))},
        "site-2": {"site-1": dict(zip(cross_site.COUNTS, (10, 2, 1, 1, 0), strict=True))},
    }
    written = cross_site_record(record)["sites"]
    assert written["site-2"]["eval.kept_cross_site_accuracy"] == 0.2
    assert written["site-2"]["eval.local_cross_site_accuracy"] == 0.1
    assert written["site-2"]["eval.kept_minus_local_cross_site_accuracy"] == 0.1
    assert written["site-1"]["eval.cross_site_sites"] == 1.0


def test_the_report_prints_the_view_per_site_and_no_gain_where_the_site_kept_its_own(tmp_path):
    import json

    from controllers.report import cross_site_table

    sites = Sites()
    record = cross_site_record(run_cross_site(sites.ask, ["site-1", "site-2"], "run-7", lambda _: None))
    path = tmp_path / "cross_site_scores.json"
    path.write_text(json.dumps(record))
    lines = cross_site_table(path, {"site-1": {"own": True}, "site-2": {"own": False}}).splitlines()
    assert lines[0].split() == ["site", "kept", "local-only", "samples", "sites", "gain", "(95%", "interval)"]
    assert lines[1].split()[:5] == ["site-1", "0.1000", "0.1000", "10", "1"]
    assert lines[1].endswith("no gain: kept its own model")
    se = ((1 - 10 * 0.1**2) / 9) ** 0.5 / 10**0.5  # d: one 1 and nine 0s; sample sd (n - 1) over sqrt(n)
    assert lines[2].split()[:6] == ["site-2", "0.2000", "0.1000", "10", "1", "+0.1000"]
    assert lines[2].endswith(f"[{0.1 - 1.96 * se:+.4f}, {0.1 + 1.96 * se:+.4f}]")
    assert cross_site_table(tmp_path / "missing.json") is None
