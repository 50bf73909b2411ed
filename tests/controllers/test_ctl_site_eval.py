"""The round record's summary of the sites' evaluations of the global model (``eval.*`` meta), in closed form."""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.types import ClientUpdate
from controllers.engine import site_eval_summary, site_metrics

PARAMS = {"w": np.zeros(2, np.float32)}


def update(site: str, n: int, **metrics: float) -> ClientUpdate:
    return ClientUpdate(site=site, params=PARAMS, num_samples=n, meta={f"eval.{k}": v for k, v in metrics.items()})


def test_sample_weighted_mean_worst_site_and_spread():
    updates = [
        update("site-1", 10, val_accuracy=0.9, val_loss=0.3),
        update("site-2", 30, val_accuracy=0.5, val_loss=1.1),
        update("site-3", 60, val_accuracy=0.7, val_loss=0.6),
    ]
    summary = site_eval_summary(updates)
    accuracy, loss = summary["val_accuracy"], summary["val_loss"]
    # (10 * 0.9 + 30 * 0.5 + 60 * 0.7) / 100 = 0.66; (3 + 33 + 36) / 100 = 0.72
    assert accuracy["mean"] == pytest.approx(0.66, abs=1e-12) and loss["mean"] == pytest.approx(0.72, abs=1e-12)
    assert (accuracy["worst_site"], accuracy["worst"]) == ("site-2", 0.5)  # lowest accuracy
    assert (loss["worst_site"], loss["worst"]) == ("site-2", 1.1)  # highest loss
    assert accuracy["spread"] == pytest.approx(0.4, abs=1e-12) and loss["spread"] == pytest.approx(0.8, abs=1e-12)
    assert accuracy["per_site"] == {"site-1": 0.9, "site-2": 0.5, "site-3": 0.7}


def test_no_eval_meta_adds_nothing_and_non_finite_values_are_left_out():
    assert "site_eval" not in site_metrics([update("site-1", 5)])
    summary = site_eval_summary([update("site-1", 5, val_loss=float("nan")), update("site-2", 5, val_loss=2.0)])
    assert summary["val_loss"]["per_site"] == {"site-2": 2.0}
