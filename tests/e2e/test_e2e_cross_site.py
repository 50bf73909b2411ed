"""Cross-site evaluation in a real simulator job (``--cross-site-eval``; aggregators/contracts/cross_site.py): after the
last round each site's kept and local-only models are scored on the other site's validation split.

Tiny: digits MLP, 2 label-skewed sites, 2 rounds, ``--keep best --local-baseline``. Checked against an independent
recomputation: each site's kept and local-only models, read from its own state store after the run, scored here on
the other site's validation split (derived as the site derives it) give exactly the counts the other site sent;
the per-site view in ``metrics/cross_site_scores.json`` follows from them; the egress gate stripped and refused
nothing (the release is declared); and the report prints the cross-site table.
"""

from __future__ import annotations

import json

import pytest

from aggregators.contracts import cross_site
from jobs.build import JobSpec, export_job

SPEC = JobSpec(
    name="e2e_cross_site",
    dataset="digits",
    arch="mlp",
    num_sites=2,
    num_rounds=2,
    site_val_fraction=0.2,
    site_test_fraction=0.2,
    keep="best",
    local_baseline=True,
    cross_site_eval=True,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory, simulate):
    root = tmp_path_factory.mktemp("cross_site")
    completed = simulate(export_job(SPEC, root / "jobs"), root / "ws", SPEC.num_sites, SPEC.num_sites)
    return root / "ws", completed


def validation_split(site: str):
    """The site's validation split as its client derives it (lightning_modules/site.py's hold_out)."""
    import torch

    from data_prep import SiteDataConfig
    from data_prep.sites import site_split
    from lightning_modules.site import hold_out
    from lightning_modules.split_scores import classifier_batches

    x, y = site_split(SiteDataConfig.from_namespace(SPEC), site)
    validation = hold_out(SPEC, x, y, int(site.split("-")[1]) - 1).validation
    return classifier_batches(torch.utils.data.DataLoader(validation, batch_size=SPEC.batch_size))


def test_each_site_scores_the_other_sites_kept_and_local_models(run):
    from controllers.report import site_state_store
    from jobs.spec import job_model
    from lightning_modules.cross_site import score_owners, submission

    workspace, completed = run
    output = completed.stdout + completed.stderr
    path = workspace / "server" / "simulate_job" / "metrics" / "cross_site_scores.json"
    assert path.is_file(), output[-3000:]
    record = json.loads(path.read_text())
    assert set(record["pairs"]) == {"site-1", "site-2"}
    for owner, validator in (("site-1", "site-2"), ("site-2", "site-1")):
        assert set(record["pairs"][owner]) == {validator}  # the other site only, never the owner itself
        store = site_state_store(workspace, owner)
        run_id = store.root.name
        params, meta = submission(store, run_id, owner)
        task = {f"{owner}/{key}": value.numpy() for key, value in params.items()}
        split = validation_split(validator)
        counts = score_owners(task, {owner: meta.get(cross_site.KEPT_WEIGHT)}, split, lambda: job_model(SPEC))
        assert cross_site.owner_counts(counts)[owner] == record["pairs"][owner][validator]
        view = record["sites"][owner]
        sent = record["pairs"][owner][validator]
        assert sent["num_samples"] == len(split) > 0
        assert view["eval.kept_cross_site_accuracy"] == sent["kept_correct"] / len(split)
        assert view["eval.local_cross_site_accuracy"] == sent["local_correct"] / len(split)
        assert view["eval.cross_site_sites"] == 1.0
    assert "egress gate" not in output, [line for line in output.splitlines() if "egress gate" in line]


def test_the_report_shows_the_cross_site_view(run):
    from controllers.report import main

    workspace, _ = run
    from contextlib import redirect_stdout
    from io import StringIO

    printed = StringIO()
    with redirect_stdout(printed):
        main([str(workspace), "--plot", str(workspace / "plot.png")])
    text = printed.getvalue()
    assert "the other sites' validation splits" in text, text
    assert "site-1" in text and "site-2" in text


def test_a_users_own_model_takes_part_through_the_bundles_site_loop(tmp_path, simulate):
    """The consortium's own model and data module (examples/genomics; --model, --data, a validation and a test
    split from the data module): the user site loop answers both tasks, and each site's models are scored by the
    other site only, on its data module's validation split."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    spec = JobSpec(
        name="e2e_cross_site_model",
        num_sites=2,
        num_rounds=1,
        ship=str(repo / "examples" / "genomics"),
        model="genomics.model:SnpClassifier",
        data="genomics.data:SnpSites",
        model_args={"arch": "mlp", "n_snps": 127, "num_classes": 5, "lr": 0.001},
        data_args={"source": "1kg", "split": "population", "batch_size": 128, "test_fraction": 0.1},
        keep="best",
        local_baseline=True,
        cross_site_eval=True,
    )
    completed = simulate(export_job(spec, tmp_path / "jobs"), tmp_path / "ws", 2, 2)
    output = completed.stdout + completed.stderr
    path = tmp_path / "ws" / "server" / "simulate_job" / "metrics" / "cross_site_scores.json"
    assert path.is_file(), output[-3000:]
    record = json.loads(path.read_text())
    assert {owner: set(by) for owner, by in record["pairs"].items()} == {"site-1": {"site-2"}, "site-2": {"site-1"}}
    for owner, by in record["pairs"].items():
        (counts,) = by.values()
        assert counts["num_samples"] > 0 and 0 <= counts["kept_correct"] <= counts["num_samples"]
        assert record["sites"][owner]["eval.cross_site_samples"] == counts["num_samples"]
    for site in ("site-1", "site-2"):
        for task in (cross_site.SUBMIT_TASK, cross_site.VALIDATE_TASK):
            assert f"{site}: answered {task}" in output
    assert "egress gate" not in output


def test_the_best_global_model_is_saved_beside_the_last_one(run, round_metrics):
    """controllers/model_selection.py in NVFlare: the persistor wrote the model the sites' validation scores chose
    (NVFlare's best-model event), the one the round records name, recomputed here from their site_eval."""
    import numpy as np
    import torch

    from controllers.checkpoint import params_digest

    workspace, completed = run
    app = workspace / "server" / "simulate_job" / "app_server"
    records = round_metrics(workspace)
    means = [np.mean(list(r["site_eval"]["val_loss"]["per_site"].values())) for r in records[1:]]
    best_round = int(np.argmin(means))  # the first of equal values, as the rule
    assert best_round > 0  # a trained model, not the initial one (which a persistor ignoring the event would hold)
    notes = [r["best_global"] for r in records[1:] if "best_global" in r]
    assert notes[-1]["sent_in_round"] == best_round + 1 and notes[-1]["mean_over_sites"] == means[best_round]
    saved = torch.load(app / "best_FL_global_model.pt", weights_only=False)["model"]
    sent = records[best_round]["global_sha256"]  # the model sent in that round: the record before it
    assert params_digest({k: v.numpy() for k, v in saved.items()}) == sent, completed.stdout[-2000:]
