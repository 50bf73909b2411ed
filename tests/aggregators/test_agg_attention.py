"""Attention core of attack-adaptive aggregation (docs/robustness.md, attack-adaptive aggregation): PCA projections,
sign canonicalisation,
and the attention loop on an identity-like feature map, against a few lines of independent numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aggregators.attention import (
    NEGATIVE_SLOPE,
    AttentionNet,
    attention_weights,
    canonicalize_signs,
    pca_project,
    project_deltas,
    projection_width,
)


def identity_like_net(width: int) -> AttentionNet:
    """phi(x) = (1 + slope) x exactly: W1 = [I; -I], W2 = [I, -I] (LeakyReLU(x) - LeakyReLU(-x) = (1+a) x)."""
    net = AttentionNet(width, hidden=width)
    eye = torch.eye(width, dtype=torch.float64)
    with torch.no_grad():
        net.inner.weight.copy_(torch.cat([eye, -eye], dim=0))
        net.outer.weight.copy_(torch.cat([eye, -eye], dim=1))
    return net.double().requires_grad_(False)


def reference_weights(p: np.ndarray, loops: int, scale: float, threshold: float) -> np.ndarray:
    """Independent numpy: cosine scores to the query, softmax, hard threshold, new query; L1 at the end."""
    unit = p / np.linalg.norm(p, axis=1, keepdims=True)
    beta = np.median(p, axis=0)
    for _ in range(loops):
        s = scale * unit @ (beta / np.linalg.norm(beta))
        w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
        w = np.where(w > threshold, w, 0.0)
        beta = w @ p
    return w / w.sum()


def test_identity_like_feature_map_is_exactly_linear() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    torch.testing.assert_close(identity_like_net(3)(x), (1 + NEGATIVE_SLOPE) * x, rtol=0, atol=1e-12)


def test_obvious_outlier_gets_weight_zero_and_the_rest_match_numpy() -> None:
    p = np.array([[1.0, 0.2], [0.9, 0.1], [0.8, -0.3], [-2.0, 5.0]])
    weights, final = attention_weights(identity_like_net(2), torch.from_numpy(p), loops=5, scale=10.0, threshold=0.005)
    expected = reference_weights(p, 5, 10.0, 0.005)
    assert expected[3] == 0.0 and weights[3].item() == 0.0
    np.testing.assert_allclose(weights.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(final.numpy(), expected @ p, atol=1e-6)
    assert weights.sum().item() == pytest.approx(1.0, abs=1e-12)


def test_hand_computed_two_equal_clients_and_an_opposite_one() -> None:
    # cos = (1, 1, -1); softmax(10, 10, -10) = (1/(2+e^-20), same, e^-20/(2+e^-20)); the third <= 0.005 -> 0
    p = torch.tensor([[1.0, 0.0], [2.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    weights, _ = attention_weights(identity_like_net(2), p, loops=1, scale=10.0, threshold=0.005)
    np.testing.assert_allclose(weights.numpy(), [0.5, 0.5, 0.0], atol=1e-12)


def test_guard_keeps_soft_weights_when_the_threshold_drops_everybody() -> None:
    p = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    weights, _ = attention_weights(identity_like_net(2), p, loops=2, scale=0.0, threshold=0.9)
    np.testing.assert_allclose(weights.numpy(), [0.5, 0.5], atol=1e-12)


def test_batched_call_equals_one_by_one() -> None:
    rng = np.random.default_rng(0)
    batch = torch.from_numpy(rng.normal(size=(3, 5, 4)))
    net = AttentionNet(4, 6).double().requires_grad_(False)
    together, _ = attention_weights(net, batch)
    for i in range(3):
        alone, _ = attention_weights(net, batch[i])
        torch.testing.assert_close(together[i], alone, rtol=0, atol=1e-12)


def test_canonical_signs_make_the_largest_entry_positive_and_undo_flips() -> None:
    rng = np.random.default_rng(1)
    vt = rng.normal(size=(4, 6))
    canonical = canonicalize_signs(vt)
    rows = np.arange(4)
    assert np.all(canonical[rows, np.argmax(np.abs(canonical), axis=1)] > 0)
    flips = np.array([1.0, -1.0, -1.0, 1.0])[:, None]
    np.testing.assert_array_equal(canonicalize_signs(vt * flips), canonical)


def test_projection_is_stable_when_the_svd_returns_flipped_vectors(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 5))
    reference = pca_project(x, 3)
    real_svd = np.linalg.svd

    def flipped_svd(a, full_matrices=True):
        u, s, vt = real_svd(a, full_matrices=full_matrices)
        signs = np.where(np.arange(s.size) % 2 == 0, -1.0, 1.0)  # another backend's equally valid answer
        return u * signs, s, vt * signs[:, None]

    monkeypatch.setattr(np.linalg, "svd", flipped_svd)
    np.testing.assert_allclose(pca_project(x, 3), reference, atol=1e-12)


def test_projection_equals_top_left_singular_vectors_times_x_uncentred() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(7, 4)) + 5.0  # a large common offset: centring would remove it, this PCA keeps it
    u, _, vt = np.linalg.svd(x, full_matrices=False)
    signs = np.sign(vt[np.arange(2), np.argmax(np.abs(vt[:2]), axis=1)])
    np.testing.assert_allclose(pca_project(x, 2), (u[:, :2] * signs).T @ x, atol=1e-10)


def test_projection_of_orthogonal_columns_is_their_norms_on_the_diagonal() -> None:
    # columns 3 e1, -2 e2, 1 e3 in R^4: singular values 3, 2, 1, right singular vectors e1, e2, e3 (signs canonical)
    x = np.array([[3.0, 0, 0], [0, -2.0, 0], [0, 0, 1.0], [0, 0, 0]])
    expected = np.array([[3.0, 0, 0], [0, 2.0, 0], [0, 0, 1.0], [0, 0, 0]])
    np.testing.assert_allclose(pca_project(x, 10), expected, atol=1e-12)


def test_fewer_clients_than_components_pad_with_zero_rows() -> None:
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    projection = pca_project(x, 3)
    assert projection.shape == (3, 2)
    np.testing.assert_array_equal(projection[2], [0.0, 0.0])


def test_width_depends_on_the_architecture_only() -> None:
    shapes = {"conv.weight": (6, 1, 5, 5), "conv.bias": (6,), "fc.weight": (10, 84)}
    assert projection_width(shapes, 10) == 10 + 6 + 10
    deltas = [
        {k: np.full(s, float(i + 1)) + np.arange(np.prod(s)).reshape(s) * 0.01 for k, s in shapes.items()}
        for i in range(3)
    ]
    assert project_deltas(deltas, list(shapes), 10).shape == (3, 26)
