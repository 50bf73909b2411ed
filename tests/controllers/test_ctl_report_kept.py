"""The report's kept-vs-local table (``--keep best --local-baseline``): per site the kept candidate, both test
accuracies and the gain with its 95 % interval (gain +/- 1.96 SE), from the last round each site reported it."""

from __future__ import annotations

import pytest

from controllers import report
from tests.controllers.test_ctl_report import initial, round_record, summary, write_metrics


def kept_round(i: int, gain: dict, se: dict, kept: dict, own: dict | None = None) -> dict:
    sites = list(gain)
    evaluation = {
        "kept_own": summary(own or dict.fromkeys(sites, 0.0), sites[0]),
        "val_accuracy": summary(dict.fromkeys(sites, 0.5), sites[0]),
        "global_test_accuracy": summary(dict.fromkeys(sites, 0.4), sites[0]),
        "kept_test_accuracy": summary({s: 0.6 + gain[s] for s in sites}, sites[0]),
        "local_test_accuracy": summary(dict.fromkeys(sites, 0.6), sites[0]),
        "kept_candidate": summary(kept, sites[0]),
        report.KEPT_MINUS_LOCAL: summary(gain, sites[0]),
        report.KEPT_MINUS_LOCAL + "_se": summary(se, sites[0]),
    }
    return round_record(i, site_eval=evaluation)


def test_each_site_shows_its_kept_candidate_and_the_gain_with_its_interval(tmp_path, capsys) -> None:
    records = [
        initial(2),
        kept_round(0, {"site-1": -0.5, "site-2": 0.0}, {"site-1": 0.1, "site-2": 0.0}, {"site-1": 0, "site-2": 2}),
        kept_round(1, {"site-1": 0.05, "site-2": -0.02}, {"site-1": 0.01, "site-2": 0.02}, {"site-1": 1, "site-2": 2}),
    ]
    rows = report.kept_vs_local(records)
    assert rows["site-1"]["kept"] == "personal" and rows["site-2"]["kept"] == "local"  # the last round's
    assert rows["site-1"]["low"] == pytest.approx(0.05 - 1.96 * 0.01, abs=1e-9)
    assert rows["site-1"]["high"] == pytest.approx(0.05 + 1.96 * 0.01, abs=1e-9)
    assert rows["site-2"]["gain"] == pytest.approx(-0.02) and rows["site-2"]["round"] == 1
    # The received model's validation score stays the headline metric (not a candidate's test score).
    assert report.site_eval_metric(records) == "val_accuracy"
    assert report.main([str(write_metrics(tmp_path / "ws", records)), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("site-1  personal"))
    assert row.split()[2:5] == ["0.4000", "-", "0.6000"]  # global, personal (not reported), local-only
    assert row.endswith("0.6500  +0.0500 [+0.0304, +0.0696]")


def test_a_site_that_kept_its_own_model_reads_no_gain_not_a_zero_width_interval(tmp_path, capsys) -> None:
    own = kept_round(0, {"site-1": 0.0, "site-2": 0.01}, {"site-1": 0.0, "site-2": 0.01}, {"site-1": 2, "site-2": 3},
                     own={"site-1": 1.0, "site-2": 0.0})  # fmt: skip
    rows = report.kept_vs_local([initial(2), own])
    assert rows["site-1"]["own"] and rows["site-2"]["kept"] == "mixture"
    lines = report.format_kept_vs_local(rows).splitlines()
    assert lines[1].endswith("no gain: kept its own model") and "[+0.0000, +0.0000]" not in lines[1]
    assert lines[2].endswith("+0.0100 [-0.0096, +0.0296]")


def test_a_job_without_the_local_model_has_no_kept_table(tmp_path, capsys) -> None:
    records = [initial(1), round_record(0, site_eval={"val_accuracy": summary({"site-1": 0.5}, "site-1")})]
    assert report.kept_vs_local(records) == {}
    report.main([str(write_metrics(tmp_path / "ws", records)), "--plot", str(tmp_path / "p.png")])
    assert "kept vs" not in capsys.readouterr().out
