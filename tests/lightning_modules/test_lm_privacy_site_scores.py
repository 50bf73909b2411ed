"""A DP site reads its own gain at the site: the ``eval.*`` scores DP-SGD withholds go to the site's
log and to ``site_scores.jsonl`` in its state folder, never into the result; ``python -m controllers.report`` pointed
at the site's folder prints them, and a job that releases the scores writes no such file. Digits with the MLP, one
site round in process (a few seconds)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from aggregators.contracts import meta_keys
from benchmarks.in_process import initial_params, quiet_lightning, site_rounds
from controllers import report
from jobs.build import JobSpec
from lightning_modules.privacy.site_scores import (
    SITE_SCORES_FILE,
    find_site_score_files,
    log_line,
    read_site_scores,
    site_records,
)

SPEC = JobSpec(
    name="dp_site_scores", dataset="digits", arch="mlp", num_rounds=2, batch_size=32, lr=0.1,
    site_val_fraction=0.2, site_test_fraction=0.2, max_train_samples=300, local_baseline=True, keep="best",
    dp_noise_multiplier=1.0, dp_max_grad_norm=1.0,
)  # fmt: skip
GAIN = "kept_minus_local_test_accuracy"


def one_round(spec: JobSpec, root) -> dict:
    pytest.importorskip("opacus")
    with quiet_lightning():
        site = site_rounds(spec, root)["site-1"]
        _, sent = site.train(
            0, initial_params(spec), {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r", meta_keys.NUM_ROUNDS: 2}
        )
    return sent


def test_a_dp_site_keeps_its_gain_in_its_own_file_and_log_and_sends_none_of_it(tmp_path, capsys) -> None:
    sent = one_round(SPEC, tmp_path)
    files = find_site_score_files(tmp_path)
    assert [f.name for f in files] == [SITE_SCORES_FILE] and files[0].parent.name == "site-1"
    (record,) = read_site_scores(files[0])
    scores = record["scores"]
    assert record["round"] == 0 and record["site"] == "site-1"
    assert {GAIN, GAIN + "_se", "kept_candidate", "kept_test_accuracy", "local_test_accuracy"} <= set(scores)
    assert all(math.isfinite(v) for v in scores.values())
    # Exactly what was withheld from the result, and nothing of it in the result.
    assert {meta_keys.eval_key(name) for name in scores} == {
        k for k in sent[meta_keys.PRIVACY_WITHHELD] if k.startswith("eval.")
    }
    assert not [k for k in sent if k.startswith("eval.")]
    line = next(line for line in capsys.readouterr().out.splitlines() if "withheld from the server" in line)
    assert line.startswith("site-1 round 0: site scores") and f"{scores[GAIN]:+.4f}" in line and str(files[0]) in line

    # The report, run at the site: the site's rounds and the kept-vs-local table from its file.
    assert report.is_site_folder(tmp_path)
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "site-1's own scores, kept at the site" in out and "does this site gain from joining" in out
    assert f"{scores[GAIN]:+.4f}" in out
    assert report.kept_vs_local(site_records([record]))["site-1"]["gain"] == scores[GAIN]


def test_a_job_that_releases_the_scores_keeps_no_site_file(tmp_path) -> None:
    sent = one_round(dataclasses.replace(SPEC, dp_release_site_scores=True), tmp_path)
    assert meta_keys.eval_key(GAIN) in sent
    assert not find_site_score_files(tmp_path)
    assert not report.is_site_folder(tmp_path)


def test_the_file_keeps_the_last_record_of_a_round_run_again_and_names_a_bad_line(tmp_path) -> None:
    path = tmp_path / SITE_SCORES_FILE
    rows = [
        {"round": 0, "site": "s", "run_id": "r", "scores": {GAIN: 0.1}},
        {"round": 1, "site": "s", "run_id": "r", "scores": {GAIN: 0.2}},
        {"round": 1, "site": "s", "run_id": "r", "scores": {GAIN: 0.3}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["scores"][GAIN] for r in read_site_scores(path)] == [0.1, 0.3]
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=f"{SITE_SCORES_FILE}, line 1: not a JSON record"):
        read_site_scores(path)
    assert "gain kept - local-only +0.0500 (SE 0.0100)" in log_line("s", 2, {GAIN: 0.05, GAIN + "_se": 0.01}, None)
