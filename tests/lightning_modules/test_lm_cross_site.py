"""A site's side of cross-site evaluation (lightning_modules/cross_site.py): it sends the models `KeptModel` stored
(a mixture as both states and the weight) and scores another site's models on its validation split as counts; it
refuses, in one line, when the run's models are not in its store."""

from __future__ import annotations

import pytest
import torch

from aggregators.contracts import cross_site
from lightning_modules.cross_site import CrossSiteError, answer, owner_models, score_owners, submission
from lightning_modules.kept_model import KeptModel
from lightning_modules.split_scores import classifier_batches
from lightning_modules.state_store import ClientStateStore

N = 30  # validation samples, 10 of each of 3 classes


def linear(scale: float) -> torch.nn.Module:
    """scale * identity: scale 20 classifies one-hot inputs right with confidence, scale 0 always says class 0."""
    layer = torch.nn.Linear(3, 3, bias=False)
    torch.nn.init.eye_(layer.weight)
    layer.weight.data.mul_(scale)
    return layer


def split():
    x = torch.eye(3).repeat(N // 3, 1)
    return classifier_batches(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.argmax(dim=1)), 8))


def stored_site(tmp_path, run_id: str = "run") -> ClientStateStore:
    """A site after one round of keep best: the received model is perfect, the own (local-only) model says class 0."""
    store = ClientStateStore(tmp_path, "site-1")
    splits = {"val": split(), "test": split()}
    models = {"global": linear(20.0), "personal": linear(0.0), "local": linear(0.0)}
    KeptModel(store, splits, margin=1.645).round(models, 0, run_id, True)
    return store


def test_the_site_sends_its_kept_and_local_models_and_another_site_scores_them_as_counts(tmp_path):
    store = stored_site(tmp_path)
    kept_kind = store.latest("kept_model").state["kind"]
    assert kept_kind in ("global", "mixture")  # the federated model wins on validation, alone or mixed
    params, meta = submission(store, "run", "site-1")
    parts = {cross_site.split_key(key)[1] for key in params}
    if kept_kind == "mixture":
        assert parts == {"kept.own", "kept.federated", "local"} and 0 < meta[cross_site.KEPT_WEIGHT] < 1
    else:
        assert parts == {"kept", "local"} and meta == {}
    torch.testing.assert_close(params["local/weight"], torch.zeros(3, 3))
    task = {f"site-1/{key}": value.numpy() for key, value in params.items()}  # as NVFlare hands them over
    assert set(owner_models(task)) == {"site-1"}
    counts = score_owners(task, {"site-1": meta.get(cross_site.KEPT_WEIGHT)}, split(), lambda: linear(1.0))
    # kept: every sample right; local-only: class 0 only (a third); the difference is the kept model's only
    assert counts == {
        "site-1/num_samples": N,
        "site-1/kept_correct": N,
        "site-1/local_correct": N // 3,
        "site-1/kept_only": N - N // 3,
        "site-1/local_only": 0,
    }
    summary = cross_site.summarize({"site-1": {"site-2": cross_site.owner_counts(counts)["site-1"]}})["site-1"]
    assert summary["kept_cross_site_accuracy"] == 1.0 and summary["local_cross_site_accuracy"] == pytest.approx(1 / 3)


def test_a_site_without_the_runs_models_or_a_validation_split_refuses_in_one_line(tmp_path):
    store = stored_site(tmp_path, run_id="other-run")
    with pytest.raises(CrossSiteError, match=r"^site-1: cross-site evaluation: no kept_model of run 'run'"):
        submission(store, "run", "site-1")
    meta = {"server.run_id": "run"}
    with pytest.raises(CrossSiteError, match="holds no validation split"):
        answer(cross_site.VALIDATE_TASK, {}, meta, "site-2", None, None, lambda: linear(1.0))
    reply = answer(cross_site.SUBMIT_TASK, None, {"server.run_id": "other-run"}, "site-1", store, None, None)
    assert {"params", "meta"} == set(reply)
