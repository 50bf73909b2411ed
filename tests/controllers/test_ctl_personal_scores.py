"""Personal models scored at the sites: the server summarises eval.personal_* like the global model's scores, and
``python -m controllers.report`` shows both and the gain per site; a Ditto site sends its v_i's scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

from aggregators.types import ClientUpdate
from controllers import report
from controllers.engine import site_eval_summary


def update(site: str, n: int, **scores: float) -> ClientUpdate:
    return ClientUpdate(site=site, params={}, num_samples=n, meta={f"eval.{k}": v for k, v in scores.items()})


def test_personal_scores_are_summarised_like_the_global_ones():
    updates = [
        update("site-1", 100, val_accuracy=0.5, personal_val_accuracy=0.8, personal_val_loss=0.4),
        update("site-2", 300, val_accuracy=0.7, personal_val_accuracy=0.6, personal_val_loss=0.9),
    ]
    summary = site_eval_summary(updates)
    accuracy = summary["personal_val_accuracy"]
    assert accuracy["per_site"] == {"site-1": 0.8, "site-2": 0.6}
    assert accuracy["mean"] == pytest.approx((100 * 0.8 + 300 * 0.6) / 400, abs=1e-12)
    assert (accuracy["worst"], accuracy["worst_site"]) == (0.6, "site-2")
    assert accuracy["spread"] == pytest.approx(0.2, abs=1e-12)
    loss = summary["personal_val_loss"]  # a loss: the worst site is the highest
    assert (loss["worst"], loss["worst_site"]) == (0.9, "site-2")
    assert summary["val_accuracy"]["mean"] == pytest.approx(0.65, abs=1e-12)


def records() -> list[dict]:
    rounds = []
    for r, (glob, mine) in enumerate([((0.5, 0.7), (0.8, 0.6)), ((0.6, 0.7), (0.9, 0.65))]):
        updates = [
            update("site-1", 100, val_accuracy=glob[0], personal_val_accuracy=mine[0]),
            update("site-2", 100, val_accuracy=glob[1], personal_val_accuracy=mine[1]),
        ]
        rounds.append({"stage": "round", "round": r, "site_eval": site_eval_summary(updates)})
    return [{"stage": "initial", "round": -1, "num_rounds": 2}, *rounds]


def test_report_shows_global_and_personal_scores_and_the_gain_per_site():
    history = records()
    assert report.site_eval_metric(history) == "val_accuracy"
    assert report.personal_metric(history, "val_accuracy") == "personal_val_accuracy"
    gains = report.personal_gains(history, "val_accuracy")
    assert gains["site-1"] == pytest.approx((0.6, 0.9, 0.3))
    assert gains["site-2"] == pytest.approx((0.7, 0.65, -0.05))
    table = report.format_table(history)
    assert "personal_val_accuracy mean (worst site)" in table.splitlines()[0]
    assert "0.7750 (0.6500 site-2)" in table
    assert "+0.3000" in report.format_gains(gains, "val_accuracy")


def test_a_loss_gain_is_positive_when_the_personal_loss_is_lower():
    updates = [update("site-1", 10, val_loss=1.0, personal_val_loss=0.25)]
    history = [{"stage": "round", "round": 0, "site_eval": site_eval_summary(updates)}]
    assert report.personal_gains(history, "val_loss")["site-1"] == pytest.approx((1.0, 0.25, 0.75))


def test_report_main_prints_the_gains(tmp_path, capsys):
    metrics = tmp_path / "ws" / report.METRICS
    metrics.parent.mkdir(parents=True)
    metrics.write_text("\n".join(json.dumps(r) for r in records()) + "\n")
    pytest.importorskip("matplotlib")
    status = report.main([str(tmp_path / "ws"), "--plot", str(tmp_path / "plot.png")])
    out = capsys.readouterr().out
    assert status == 0
    assert "global model received vs the site's personal model" in out and "site-1" in out and "+0.3000" in out


def test_without_a_personal_model_no_personal_column():
    updates = [update("site-1", 10, val_accuracy=0.5)]
    history = [{"stage": "round", "round": 0, "site_eval": site_eval_summary(updates)}]
    assert report.personal_metric(history, "val_accuracy") is None
    assert "personal" not in report.format_table(history)


def digits_site_round(tmp_path, **settings):
    """Site-1 of a digits MLP job with ``settings`` and a 20 % validation split, on 60 seeded random samples; its
    first round from its own initial weights: (the site round, what it sent, its meta)."""
    from benchmarks.in_process import site_args
    from jobs.spec import JobSpec
    from lightning_modules.site import build_site_round
    from lightning_modules.state_store import ClientStateStore

    args = site_args(JobSpec(name="d", dataset="digits", arch="mlp", site_val_fraction=0.2, **settings))
    args.accelerator = "cpu"
    rng = np.random.default_rng(0)
    x, y = rng.random((60, 64), dtype=np.float32), rng.integers(0, 10, 60).astype(np.int64)
    site = build_site_round(args, "site-1", 0, x, y, 10, ClientStateStore(tmp_path, "site-1"))
    params = {k: v.numpy().copy() for k, v in site.module.state_dict().items()}
    return (site, *site.train(0, params, {"server.round": 0, "server.run_id": "r"}))


def test_a_ditto_site_sends_its_personal_models_scores(tmp_path):
    _, _, meta = digits_site_round(tmp_path, client="ditto")
    assert {"eval.val_accuracy", "eval.personal_val_accuracy", "eval.personal_val_loss"} <= set(meta)
    # v_i after one epoch of personal steps is not the received model: its loss differs from the global one's.
    assert meta["eval.personal_val_loss"] != meta["eval.val_loss"]


def test_a_fedper_site_scores_its_trained_module_with_its_own_head(tmp_path):
    # Partial sharing: the personal model is the module the site trained (shared entries + its own head), scored
    # on the same split as the received model, before the result (without the head) is sent.
    from lightning_modules.personal_scores import single_process_trainer, validation_scores

    site, sent, meta = digits_site_round(tmp_path, local_keys="net.classifier.*")
    assert not any(key.startswith("net.classifier.") for key in sent)
    expected = validation_scores(
        site.module, single_process_trainer("32-true", "cpu"), dataloaders=site.validation_loader()
    )
    assert meta["eval.personal_val_loss"] == pytest.approx(expected["val_loss"], abs=1e-6)
    assert meta["eval.personal_val_accuracy"] == pytest.approx(expected["val_accuracy"], abs=1e-6)
    assert meta["eval.personal_val_loss"] != meta["eval.val_loss"]  # the trained module, not the received one


def test_finetuning_with_local_keys_or_fedrep_is_refused_at_build_time():
    from jobs.spec import JobBuildError, JobSpec

    for extra in ({"local_keys": "net.classifier.*"}, {"client": "fedrep"}):
        with pytest.raises(JobBuildError, match=r"finetune_epochs 1 with local_keys .*choose one"):
            JobSpec(name="f", dataset="digits", arch="mlp", site_val_fraction=0.2, finetune_epochs=1, **extra)
