"""benchmarks/committed_job_views.py records the choice rule it ran with: a record made under an older default keep
margin must not read as today's."""

from __future__ import annotations

from types import SimpleNamespace


def test_the_record_names_its_keep_margin_and_runs_the_job_with_the_pooled_view(monkeypatch):
    from benchmarks import committed_job_views, in_process, site_report
    from jobs.presets import PRESETS

    ran = []

    def fake_run(spec, root):
        ran.append(spec)
        return SimpleNamespace(records=[], rounds=[{}, {}])

    monkeypatch.setattr(in_process, "run_in_process", fake_run)
    monkeypatch.setattr(site_report, "test_metrics_record", lambda records: {})
    monkeypatch.setattr(site_report, "cell_scores", lambda record: {"site_test": {}})
    record = committed_job_views.job_views("finetune", 300)
    assert ran[0].site_pooled_test == 300 and ran[0].keep_margin == PRESETS["finetune"].keep_margin
    assert (record["job"], record["pooled_test_images"], record["keep_margin"], record["rounds"]) == (
        "finetune",
        300,
        PRESETS["finetune"].keep_margin,
        2,
    )
