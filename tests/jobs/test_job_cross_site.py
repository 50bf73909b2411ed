"""``--cross-site-eval`` at build time (jobs/spec.py, jobs/egress.py, jobs/job_record.py): refused in one line with
nothing written wherever it would release site models under DP or secure aggregation, or has nothing to send or
nothing to score on; declared as a release where it runs; and absent from a job that does not ask for it."""

from __future__ import annotations

import json

import pytest

from aggregators.contracts import cross_site
from jobs.build import main
from jobs.egress import job_releases
from jobs.spec import JobSpec, job_model

BASE = [
    "--dataset", "digits", "--arch", "mlp", "--num-sites", "2", "--num-rounds", "1", "--site-val-fraction", "0.2",
    "--site-test-fraction", "0.2", "--keep", "best", "--local-baseline", "--cross-site-eval",
]  # fmt: skip
SETTINGS = {
    "dataset": "digits",
    "arch": "mlp",
    "num_sites": 2,
    "site_val_fraction": 0.2,
    "site_test_fraction": 0.2,
    "keep": "best",
    "local_baseline": True,
}


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (["--dp-noise-multiplier", "1.0", "--dp-max-grad-norm", "1.0"], "not with DP-SGD"),
        (["--dp-target-epsilon", "8", "--dp-max-grad-norm", "1.0"], "not with DP-SGD"),
        (["--server", "dp_fedavg"], "not with the DP-FedAvg rule"),
        (["--secure-aggregation", "plain"], "cross_site_eval: sends the sites' models in clear"),
        (["--keep", "last"], "--keep best and --local-baseline; add both"),
        (["--site-val-fraction", "0"], "the sites hold none: set site_val_fraction"),
        (["--keep-metric", "val_accuracy"], "leave keep_metric at val_loss"),
    ],
)
def test_a_job_that_cannot_run_it_is_refused_in_one_line_with_nothing_written(tmp_path, capsys, change, reason):
    code = main([*BASE, *change, "--name", "cs", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "cross_site_eval" in err and reason in err, err
    assert not (tmp_path / "out").exists()


def test_without_the_local_only_model_it_is_refused():
    with pytest.raises(ValueError, match="--keep best and --local-baseline"):
        JobSpec(name="t", **{**SETTINGS, "local_baseline": False, "finetune_epochs": 1}, cross_site_eval=True)


def test_the_release_is_declared_the_whole_models_out_and_counts_back():
    spec = JobSpec(name="t", **SETTINGS, cross_site_eval=True)
    releases = {release.task: release for release in job_releases(spec)}
    entries = tuple(job_model(spec).state_dict())
    submit, validate = releases[cross_site.SUBMIT_TASK], releases[cross_site.VALIDATE_TASK]
    assert set(submit.data) == {f"{part}/{name}" for part in cross_site.PARTS for name in entries}
    assert submit.meta == (cross_site.KEPT_WEIGHT,) and submit.metrics == ()
    assert validate.data == () and validate.meta == ()
    assert validate.metrics == tuple(f"*/{count}" for count in cross_site.COUNTS)
    assert set(releases) == {"train", "validate", cross_site.SUBMIT_TASK, cross_site.VALIDATE_TASK}


def test_off_it_changes_nothing_in_the_exported_job(tmp_path):
    base = [arg for arg in BASE if arg != "--cross-site-eval"]
    assert main([*base, "--name", "off", "--output-dir", str(tmp_path)]) == 0
    assert main([*BASE, "--name", "on", "--output-dir", str(tmp_path)]) == 0
    off, on = tmp_path / "off", tmp_path / "on"
    assert "cross_site_eval" not in json.loads((off / "job_spec.json").read_text())["settings"]
    assert json.loads((on / "job_spec.json").read_text())["settings"]["cross_site_eval"] is True
    assert "cross_site" not in (off / "app" / "config" / "config_fed_server.json").read_text()
    assert "cross_site" not in (off / "app" / "config" / "config_fed_client.json").read_text()
    server = json.loads((on / "app" / "config" / "config_fed_server.json").read_text())
    assert any(w["args"].get("settings", {}).get("cross_site_eval") is True for w in server["workflows"])


def test_a_site_that_cannot_take_part_answers_empty_and_says_why_in_one_line(tmp_path, capsys):
    from types import SimpleNamespace

    from jobs.client import cross_site_reply
    from lightning_modules.state_store import ClientStateStore

    site_round = SimpleNamespace(validation=None, training=SimpleNamespace(batch_size=8), module=None)
    received = SimpleNamespace(params={}, meta={"server.run_id": "run-1"})
    store = ClientStateStore(tmp_path, "site-1")
    sent = []
    for task in (cross_site.SUBMIT_TASK, cross_site.VALIDATE_TASK):
        assert cross_site_reply(task, received, "site-1", store, site_round, sent.append) == {}
    assert (sent[0].params, sent[0].meta, sent[1].params, sent[1].metrics) == ({}, {}, None, {})  # empty answers
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "error: site-1: cross-site evaluation: no kept_model of run 'run-1' in the site's state store (the job needs "
        "--keep best --local-baseline and a validation split, and at least one round); answering cross_site_submit "
        "with nothing",
        "error: site-1: cross-site evaluation: the site holds no validation split; answering cross_site_validate with "
        "nothing",
    ]
