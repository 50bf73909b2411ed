"""The tracking channel under DP-SGD (docs/privacy.md, tracking row): a site's tracker (NVFlare's ``SummaryWriter``,
forwarded to the server's receiver by ``--tracking``) is fed only by ``jobs.client.log_round_metrics`` with the meta
the site releases. Played with real site rounds: without DP the round's training loss and accuracy are tracked
(so the check can see a leak), under DP-SGD nothing is, and the client script calls its tracker nowhere else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("opacus")

from aggregators.contracts import meta_keys
from jobs import client
from lightning_modules.state_store import ClientStateStore

SITE, RUN = "site-1", "run-tracking"


class RecordingTracker:
    """Stands in for NVFlare's SummaryWriter: every call that would become a tracking event."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self.calls.append((name, args, kwargs))


def released_meta(tmp_path: Path, **dp: Any) -> dict[str, Any]:
    """The meta a digits MLP site sends after one real round (with the job's DP settings ``dp``)."""
    from benchmarks.in_process import site_args
    from jobs.spec import JobSpec
    from lightning_modules.classifier import FLClassifier
    from lightning_modules.site import build_site_round

    args = site_args(JobSpec(name="tracking", dataset="digits", arch="mlp", site_val_fraction=0.25, **dp))
    args.accelerator = "cpu"
    x, y = np.random.default_rng(0).random((40, 64), dtype=np.float32), np.arange(40) % 10
    site = build_site_round(args, SITE, 0, x, y, 10, ClientStateStore(tmp_path, SITE, per_run=True))
    start = {k: v.numpy().copy() for k, v in FLClassifier(arch="mlp", init_seed=0).state_dict().items()}
    server = {meta_keys.ROUND: 0, meta_keys.NUM_ROUNDS: 2, meta_keys.RUN_ID: RUN}
    _, meta = site.train(0, start, server)
    return meta


def test_without_dp_the_rounds_training_scores_reach_the_tracker(tmp_path: Path) -> None:
    meta = released_meta(tmp_path)
    tracker = RecordingTracker()
    client.log_round_metrics(tracker, meta, 0)
    logged = {args[0]: args[1] for name, args, _ in tracker.calls if name == "add_scalar"}
    assert logged == {"train_loss": meta[meta_keys.TRAIN_LOSS], "train_accuracy": meta[meta_keys.TRAIN_ACCURACY]}


def test_under_dp_sgd_nothing_reaches_the_tracker(tmp_path: Path) -> None:
    meta = released_meta(tmp_path, dp_noise_multiplier=1.0, dp_max_grad_norm=1.0)
    assert meta[meta_keys.PRIVACY_EPSILON] > 0  # a DP round did run
    tracker = RecordingTracker()
    client.log_round_metrics(tracker, meta, 0)
    assert tracker.calls == []


def test_the_client_script_feeds_its_tracker_only_through_log_round_metrics() -> None:
    """Every use of the tracker in jobs/client.py: created in run_builtin, passed to log_round_metrics, and called
    (add_scalar) only inside it, so the released meta is all a tracking event can carry."""
    tree = ast.parse(inspect.getsource(client))
    uses: list[tuple[str, str]] = []
    for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "tracker":
                uses.append((function.name, node.attr))
            if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == "tracker" for a in node.args):
                uses.append((function.name, ast.unparse(node.func)))
    assert sorted(set(uses)) == [("log_round_metrics", "add_scalar"), ("run_builtin", "log_round_metrics")]
