"""Site evaluation of the received global model on the built-in path (``site_val_fraction``).

Every sampled site holds out a seeded share of its shard, scores the global model it received on it before
training (``eval.*`` meta, the user-model path's format) and is weighed by its training part. The default 0.0
changes nothing; training stays deterministic and untouched by the evaluation. Digits with the MLP (offline, tiny).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from aggregators.contracts import meta_keys
from benchmarks.in_process import initial_params, quiet_lightning, run_in_process, site_args, site_rounds
from jobs.build import JobSpec
from jobs.client import build_parser
from jobs.spec import client_script_args
from lightning_modules.classifier import FLClassifier
from lightning_modules.site import SiteRound, ValidatedClassifier, validation_indices

SPEC = JobSpec(name="tiny", dataset="digits", arch="mlp", num_rounds=2, max_test_samples=100, batch_size=32, lr=0.1)
VALIDATED = dataclasses.replace(SPEC, site_val_fraction=0.2)
META = {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r"}


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def test_validation_indices_are_a_seeded_disjoint_split() -> None:
    train, val = validation_indices(100, 0.2, seed=0, site_index=1)
    assert len(val) == 20 and len(train) == 80
    assert sorted([*train, *val]) == list(range(100))
    assert np.array_equal(val, validation_indices(100, 0.2, seed=0, site_index=1)[1])
    assert not np.array_equal(val, validation_indices(100, 0.2, seed=0, site_index=2)[1])
    assert not np.array_equal(val, validation_indices(100, 0.2, seed=1, site_index=1)[1])
    assert len(validation_indices(100, 0.0, 0, 1)[1]) == 0
    assert [len(part) for part in validation_indices(1, 0.4, 0, 1)] == [1, 0]  # a site keeps a sample to train


@pytest.mark.parametrize("value, ok", [("0", True), ("0.25", True), ("0.5", False), ("-0.1", False)])
def test_client_script_checks_the_fraction(value: str, ok: bool) -> None:
    if ok:
        assert build_parser().parse_args(["--site-val-fraction", value]).site_val_fraction == float(value)
    else:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--site-val-fraction", value])


def test_the_fraction_reaches_the_sites_only_when_set() -> None:
    assert "--site-val-fraction" not in client_script_args(SPEC)  # committed jobs regenerate unchanged
    assert "--site-val-fraction 0.2" in client_script_args(VALIDATED)
    assert site_args(VALIDATED).site_val_fraction == 0.2


def test_default_sites_are_unchanged(tmp_path) -> None:
    site = site_rounds(SPEC, tmp_path)["site-1"]
    assert type(site.module) is FLClassifier and site.validation is None
    _, meta = site.train(0, initial_params(SPEC), META)
    assert not [key for key in meta if meta_keys.eval_metric(key)]


def _manual_scores(site: SiteRound, params: dict) -> tuple[float, float]:
    module = FLClassifier(arch="mlp", num_classes=10)
    module.load_state_dict({k: torch.as_tensor(v) for k, v in params.items()})
    x, y = site.validation.tensors
    with torch.no_grad():
        logits = module.eval()(x)
    return float(torch.nn.functional.cross_entropy(logits, y)), float((logits.argmax(1) == y).float().mean())


def test_sites_score_the_received_model_and_send_the_training_count(tmp_path) -> None:
    site = site_rounds(VALIDATED, tmp_path)["site-1"]
    full = site_rounds(SPEC, tmp_path / "full")["site-1"]
    assert isinstance(site.module, ValidatedClassifier)
    assert len(site.y) + len(site.validation) == len(full.y)
    start = initial_params(SPEC)
    _, meta = site.train(0, start, META)
    loss, accuracy = _manual_scores(site, start)
    assert meta[meta_keys.eval_key("val_loss")] == pytest.approx(loss, rel=1e-5)
    assert meta[meta_keys.eval_key("val_accuracy")] == pytest.approx(accuracy, abs=1e-6)
    assert meta[meta_keys.NUM_SAMPLES] == len(site.y)


def test_evaluation_is_in_eval_mode_without_gradients(tmp_path, monkeypatch) -> None:
    seen: list[tuple[bool, bool]] = []
    step = ValidatedClassifier.validation_step

    def spy(self: ValidatedClassifier, batch, batch_idx: int) -> None:
        seen.append((self.training, torch.is_grad_enabled()))
        step(self, batch, batch_idx)

    monkeypatch.setattr(ValidatedClassifier, "validation_step", spy)
    site_rounds(VALIDATED, tmp_path)["site-1"].train(0, initial_params(SPEC), META)
    assert seen and set(seen) == {(False, False)}


def test_training_is_deterministic_and_untouched_by_the_evaluation(tmp_path) -> None:
    start = initial_params(SPEC)
    first, _ = site_rounds(VALIDATED, tmp_path / "a")["site-2"].train(1, start, META)
    again, _ = site_rounds(VALIDATED, tmp_path / "b")["site-2"].train(1, start, META)
    unscored = site_rounds(VALIDATED, tmp_path / "c")["site-2"]
    unscored.validation = None  # the same training part, no evaluation before training
    plain, _ = unscored.train(1, start, META)
    for key in first:
        assert np.array_equal(first[key], again[key]) and np.array_equal(first[key], plain[key])


def test_in_process_rounds_carry_site_eval_for_every_site(tmp_path) -> None:
    spec = dataclasses.replace(VALIDATED, num_sites=3, num_rounds=2)
    rounds = run_in_process(spec, tmp_path).rounds
    assert len(rounds) == 2
    for record in rounds:
        accuracy = record["site_eval"]["val_accuracy"]
        assert sorted(accuracy["per_site"]) == ["site-1", "site-2", "site-3"]
        assert {"mean", "worst", "worst_site", "spread"} <= set(accuracy)
        assert "val_loss" in record["site_eval"]
