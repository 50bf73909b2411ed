"""The attention core of attack-adaptive aggregation: per-layer "PCA" projections and the shared attention network.

Reference: Wan & Chen, "Robust Federated Learning with Attack-Adaptive Aggregation", FTL-IJCAI'21,
arXiv:2102.05257 (docs/robustness.md, attack-adaptive aggregation, steps 1-6).

Projections (numpy, float64, CPU, deterministic):

* per layer l, the clients' flattened deltas form X_l (d_l x n, column j = client j);
* truncated SVD WITHOUT centering, X_l = U S V^T, projection P_l = S_k V_k^T (k x n): each client's coordinates on
  the top-k left singular vectors (= U_k^T X_l);
* singular vectors are defined only up to sign and the network is not odd (LeakyReLU), so every right singular
  vector is flipped to make its largest-|.| entry positive (first such entry on ties), the same rule at training and
  at aggregation time;
* k = pca_components rows per layer, or d_l for smaller layers. With fewer clients than k the SVD yields only n
  components; the missing rows are zeros (they ARE the projections onto singular values 0), so the width
  C = sum_l min(k, d_l) depends on the architecture only, never on how many clients answered a round.

Attention (torch, shared by aggregation and pretraining; batched over leading dimensions):

* phi = 1x1-conv MLP C -> 2C -> H without bias, LeakyReLU between; a 1x1 convolution over one position is a linear
  map, so phi is written with ``nn.Linear(bias=False)``. phi is positively homogeneous (phi(a x) = a phi(x), a > 0),
  so the cosine scores below do not depend on the scale of the projections;
* query beta_0 = coordinate-wise median of the clients' projections (numpy's median: mean of the two middle values);
* T loops: q = phi(beta)/||.||, k_j = phi(P_j)/||.||, s_j = scale <q, k_j>, w = softmax(s),
  w_j <- 0 where w_j <= threshold, beta <- sum_j w_j P_j;
* guard: if a loop thresholds every weight away (possible only when threshold >= 1/n) that loop keeps its
  softmax weights unthresholded;
* finally w <- w / ||w||_1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

NEGATIVE_SLOPE = 0.01  # LeakyReLU slope (torch's default, as in the authors' network)
_NORM_FLOOR = 1e-12  # a zero feature vector has no direction; keep the division finite


def canonicalize_signs(vt: np.ndarray) -> np.ndarray:
    """Flip each row (a right singular vector) so that its largest-|.| entry is positive; returns a copy."""
    vt = np.array(vt, dtype=np.float64, copy=True)
    if vt.size == 0:
        return vt
    pivots = np.argmax(np.abs(vt), axis=1)
    signs = np.sign(vt[np.arange(vt.shape[0]), pivots])
    signs[signs == 0] = 1.0
    return vt * signs[:, None]


def pca_project(columns: np.ndarray, k: int) -> np.ndarray:
    """Top-k uncentred SVD coordinates of the columns of ``columns`` (d x n) -> (min(k, d) x n), canonical signs."""
    x = np.asarray(columns, dtype=np.float64)
    d, n = x.shape
    rows = min(k, d)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    r = min(rows, s.size)
    projection = np.zeros((rows, n), dtype=np.float64)
    projection[:r] = s[:r, None] * canonicalize_signs(vt[:r])
    return projection


def projection_width(shapes: Mapping[str, Sequence[int]], k: int) -> int:
    """C = sum over layers of min(k, d_l): the attention network's input width for this architecture."""
    return int(sum(min(k, int(np.prod(shape, dtype=np.int64))) for shape in shapes.values()))


def project_deltas(deltas: Sequence[Mapping[str, np.ndarray]], keys: Sequence[str], k: int) -> np.ndarray:
    """Stacked per-layer projections of the clients' deltas: shape (n, C), one row per client."""
    blocks = [pca_project(np.stack([np.ravel(d[key]) for d in deltas], axis=1), k) for key in keys]
    return np.concatenate(blocks, axis=0).T


class AttentionNet(nn.Module):
    """phi: C -> 2C -> H, no bias, LeakyReLU in between (the 1x1-conv MLP shared by query and keys)."""

    def __init__(self, input_width: int, hidden: int = 32) -> None:
        super().__init__()
        if input_width < 1 or hidden < 1:
            raise ValueError(f"attention widths must be positive, got input_width={input_width}, hidden={hidden}")
        self.input_width = input_width
        self.hidden = hidden
        self.inner = nn.Linear(input_width, 2 * input_width, bias=False)
        self.outer = nn.Linear(2 * input_width, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.outer(nn.functional.leaky_relu(self.inner(x), NEGATIVE_SLOPE))


def _unit(features: Tensor) -> Tensor:
    return features / features.norm(dim=-1, keepdim=True).clamp_min(_NORM_FLOOR)


def median_query(projections: Tensor) -> Tensor:
    """Coordinate-wise median over the client axis (-2), averaging the two middle values for even n."""
    return torch.quantile(projections, 0.5, dim=-2)


def attention_weights(
    net: nn.Module, projections: Tensor, *, loops: int = 5, scale: float = 10.0, threshold: float = 0.005
) -> tuple[Tensor, Tensor]:
    """Attention weights (..., n) summing to 1 and the final query (..., C) for projections (..., n, C).

    Differentiable almost everywhere (the hard threshold is a mask), so pretraining uses the same function.
    """
    keys = _unit(net(projections))  # (..., n, H): keys depend on the raw projections only
    beta = median_query(projections)
    weights = torch.full(projections.shape[:-1], 1.0 / projections.shape[-2], dtype=projections.dtype)
    for _ in range(loops):
        query = _unit(net(beta))
        soft = torch.softmax(scale * torch.einsum("...nh,...h->...n", keys, query), dim=-1)
        kept = soft * (soft > threshold)
        # Guard: a loop that would drop everybody keeps its soft weights.
        weights = torch.where(kept.sum(dim=-1, keepdim=True) > 0, kept, soft)
        beta = torch.einsum("...n,...nc->...c", weights, projections)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, torch.einsum("...n,...nc->...c", weights, projections)


CHECKPOINT_FORMAT = "attack_adaptive.attention/1"


class AttentionCheckpointError(ValueError):
    """An attention checkpoint is missing, unreadable, or trained for another architecture."""


def save_attention_checkpoint(
    path: str | Path, net: AttentionNet, *, pca_components: int, layer_shapes: Mapping[str, Sequence[int]], **info: Any
) -> Path:
    """Write the network with what it was trained for (widths, PCA size, layer shapes) plus plain ``info``."""
    payload = {
        "format": CHECKPOINT_FORMAT,
        "input_width": net.input_width,
        "hidden": net.hidden,
        "pca_components": pca_components,
        "layer_shapes": {key: [int(v) for v in shape] for key, shape in layer_shapes.items()},
        "state_dict": {key: value.detach().cpu().float().clone() for key, value in net.state_dict().items()},
        "info": dict(info),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return path


def load_attention_checkpoint(path: str | Path) -> tuple[AttentionNet, dict[str, Any]]:
    """Load safely (``weights_only=True``) and return the network (float64, eval mode) and the checkpoint header."""
    path = Path(path)
    if not path.is_file():
        raise AttentionCheckpointError(f"attention checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a corrupt file or an unsafe pickle: never fall back to random weights
        raise AttentionCheckpointError(f"attention checkpoint {path} cannot be loaded safely: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise AttentionCheckpointError(f"{path} is not an attention checkpoint ({CHECKPOINT_FORMAT}), found {found!r}")
    net = AttentionNet(int(payload["input_width"]), int(payload["hidden"]))
    try:
        net.load_state_dict(payload["state_dict"])
    except RuntimeError as exc:
        raise AttentionCheckpointError(f"attention checkpoint {path} has inconsistent weights: {exc}") from None
    header = {key: value for key, value in payload.items() if key != "state_dict"}
    return net.double().eval(), header


def checkpoint_problems(
    header: Mapping[str, Any], layer_shapes: Mapping[str, Sequence[int]], pca_components: int, hidden: int
) -> list[str]:
    """Why a checkpoint does not fit this model (empty: it fits)."""
    expected = projection_width(layer_shapes, pca_components)
    problems = []
    if int(header["input_width"]) != expected:
        problems.append(
            f"input width C={header['input_width']} but this model needs C={expected} "
            f"({len(layer_shapes)} layers, pca_components={pca_components})"
        )
    if int(header["pca_components"]) != pca_components:
        problems.append(f"trained with pca_components={header['pca_components']}, the rule uses {pca_components}")
    if int(header["hidden"]) != hidden:
        problems.append(f"hidden width {header['hidden']}, the rule uses attention_hidden={hidden}")
    trained = {key: [int(v) for v in shape] for key, shape in dict(header.get("layer_shapes") or {}).items()}
    wanted = {key: [int(v) for v in shape] for key, shape in layer_shapes.items()}
    if trained and trained != wanted:
        differing = sorted(k for k in set(trained) | set(wanted) if trained.get(k) != wanted.get(k))
        problems.append(f"trained for other layers (differing: {differing[:5]})")
    return problems
