"""Attack-adaptive aggregation rule (docs/robustness.md, attack-adaptive aggregation): checkpoint loading and checks,
the aggregation step
against independent numpy, capture on/off, and the shipped LeNet-5 checkpoint."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from aggregators.attack_adaptive import SHIPPED_CHECKPOINT, AttackAdaptive
from aggregators.attention import AttentionNet, save_attention_checkpoint
from aggregators.capture import read_capture
from aggregators.contracts import meta_keys
from aggregators.registry import build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext

GLOBAL = {"w": np.array([0.5, -0.5, 1.0], np.float32), "bn.num_batches_tracked": np.array(4, np.int64)}
DELTAS = [[1.0, 0.2, 0.1], [0.9, 0.1, 0.2], [0.8, 0.3, 0.0], [-2.0, 5.0, -3.0]]  # the last one is the outlier
CONTEXT = RoundContext(round_num=3, num_rounds=5, population=())
HIDDEN = {"attention_hidden": 3}  # the identity-like test network maps C=3 -> H=3


def _updates(deltas=DELTAS) -> list[ClientUpdate]:
    return [
        ClientUpdate(
            site=f"site-{i + 1}",
            params={"w": GLOBAL["w"] + np.array(d, np.float32), "bn.num_batches_tracked": np.array(8, np.int64)},
            num_samples=10 * (i + 1),
            meta={meta_keys.ATTACK_APPLIED: i == 3},
        )
        for i, d in enumerate(deltas)
    ]


def _identity_checkpoint(path, width: int = 3, shapes=None):
    net = AttentionNet(width, hidden=width)
    eye = torch.eye(width)
    with torch.no_grad():
        net.inner.weight.copy_(torch.cat([eye, -eye], dim=0))
        net.outer.weight.copy_(torch.cat([eye, -eye], dim=1))
    return save_attention_checkpoint(path, net, pca_components=10, layer_shapes=shapes or {"w": [3]})


def _numpy_expected(deltas: np.ndarray) -> np.ndarray:
    """Independent numpy: uncentred SVD of the d x n delta matrix, canonical signs, cosine attention (phi ~ I)."""
    _, s, vt = np.linalg.svd(deltas.T, full_matrices=False)
    vt = vt * np.sign(vt[np.arange(len(s)), np.argmax(np.abs(vt), axis=1)])[:, None]
    p = (s[:, None] * vt).T  # (n, 3)
    unit = p / np.linalg.norm(p, axis=1, keepdims=True)
    beta = np.median(p, axis=0)
    for _ in range(5):
        scores = 10.0 * unit @ (beta / np.linalg.norm(beta))
        w = np.exp(scores - scores.max())
        w = w / w.sum()
        w = np.where(w > 0.005, w, 0.0)
        beta = w @ p
    return w / w.sum()


def test_aggregation_matches_numpy_and_zeroes_the_outlier(tmp_path) -> None:
    rule = build_rule("attack_adaptive", attention_model_path=str(_identity_checkpoint(tmp_path / "a.pt")), **HIDDEN)
    result = rule.aggregate(GLOBAL, _updates(), rule.init_state(GLOBAL), CONTEXT)
    deltas = np.array(DELTAS)
    weights = _numpy_expected(deltas)
    assert weights[3] == 0.0
    assert result.state["weights"]["site-4"] == 0.0
    np.testing.assert_allclose(list(result.state["weights"].values()), weights, atol=1e-6)
    np.testing.assert_allclose(result.params["w"], GLOBAL["w"] + weights @ deltas, atol=1e-6)
    assert result.params["bn.num_batches_tracked"] == 8  # integer buffer: sample-weighted mean, cast back


def test_non_finite_client_is_dropped_first(tmp_path) -> None:
    rule = build_rule("attack_adaptive", attention_model_path=str(_identity_checkpoint(tmp_path / "a.pt")), **HIDDEN)
    clean = rule.aggregate(GLOBAL, _updates(DELTAS[:3]), {}, CONTEXT)
    with_nan = rule.aggregate(GLOBAL, _updates([*DELTAS[:3], [np.nan, 0.0, 0.0]]), {}, CONTEXT)
    np.testing.assert_allclose(with_nan.params["w"], clean.params["w"], atol=1e-7)
    assert "site-4" not in with_nan.state["weights"]


def test_width_mismatch_is_a_clear_error(tmp_path) -> None:
    path = _identity_checkpoint(tmp_path / "a.pt", width=3)
    rule = AttackAdaptive(attention_model_path=str(path), **HIDDEN)
    other = {"w": np.zeros((4, 5), np.float32)}  # C = min(10, 20) = 10, the checkpoint has 3
    with pytest.raises(AggregationError, match=r"input width C=3 but this model needs C=10"):
        rule.init_state(other)


def test_missing_checkpoint_and_unsafe_file_are_errors(tmp_path) -> None:
    with pytest.raises(AggregationError, match="found neither"):
        AttackAdaptive(attention_model_path="no/such/file.pt")
    required = r"^attack_adaptive: hyperparameter 'attention_model_path' must be a checkpoint path \(.*\), got None$"
    with pytest.raises(AggregationError, match=required):
        AttackAdaptive()
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"format": "attack_adaptive.attention/1", "x": logging.getLogger("x")}, unsafe)
    with pytest.raises(AggregationError, match="cannot be loaded safely"):
        AttackAdaptive(attention_model_path=str(unsafe))


def test_random_attention_needs_the_flag_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    rule = AttackAdaptive(allow_random_attention=True)
    with caplog.at_level(logging.WARNING, logger="fedalg.attack_adaptive"):
        rule.aggregate(GLOBAL, _updates(), rule.init_state(GLOBAL), CONTEXT)
    assert "RANDOM attention" in caplog.text


def test_capture_writes_rounds_with_labels_only_when_asked(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    plain = AttackAdaptive(allow_random_attention=True)
    plain.aggregate(GLOBAL, _updates(), plain.init_state(GLOBAL), CONTEXT)
    assert list(tmp_path.iterdir()) == []  # nothing written when dataset_capture_dir is unset
    rule = AttackAdaptive(allow_random_attention=True, dataset_capture_dir=str(tmp_path / "cap"))
    state = rule.init_state(GLOBAL)
    rule.aggregate(GLOBAL, _updates(), state, CONTEXT)
    metadata, rounds = read_capture(tmp_path / "cap")
    assert metadata["input_width"] == 3 and metadata["layer_shapes"] == {"w": [3]}
    (record,) = rounds
    assert record.round_num == 3 and record.sites == ("site-1", "site-2", "site-3", "site-4")
    np.testing.assert_array_equal(record.malicious, [False, False, False, True])
    np.testing.assert_array_equal(record.num_samples, [10, 20, 30, 40])
    assert record.projections.shape == (4, 3)


def test_shipped_checkpoint_fits_lenet5_and_refuses_another_model() -> None:
    from lightning_modules.classifier import FLClassifier

    rule = build_rule("attack_adaptive", attention_model_path=SHIPPED_CHECKPOINT)  # relative: inside the package
    lenet = {k: v.numpy() for k, v in FLClassifier(arch="lenet5").state_dict().items()}
    rule.init_state(lenet)
    cnn = {k: v.numpy() for k, v in FLClassifier(arch="simple_cnn").state_dict().items()}
    with pytest.raises(AggregationError, match="does not fit this model"):
        rule.init_state(cnn)
