"""Attack-adaptive aggregation (AAA): a pretrained attention network weights the client deltas.

Reference: Wan & Chen, "Robust Federated Learning with Attack-Adaptive Aggregation", FTL-IJCAI'21, arXiv:2102.05257
(docs/robustness.md, attack-adaptive aggregation). Per round, with the attention core of `aggregators.attention`:

1. Delta_j = y_j - x over the robust entries (float, not BatchNorm statistics); clients with NaN/Inf deltas are
   dropped first;
2. P = per-layer uncentred truncated-SVD projections with canonical signs, (n, C);
3. w = attention weights (median query, ``attention_loops`` loops, ``scaling_factor``, hard ``threshold``, L1
   renormalisation, all-thresholded guard);
4. x <- x + sum_j w_j Delta_j. Sample counts are not used for the deltas (the paper's weights are the attention
   weights); BatchNorm statistics and integer buffers are the sample-weighted mean (aggregators/robust.py).

The attention network is frozen here. ``attention_model_path`` names a checkpoint written by
``python -m aggregators.pretrain_attention``; a relative path is looked up in the installed ``aggregators`` package
first (the shipped ``checkpoints/attention_lenet5.pt``), then in the server's working directory. It is loaded with
``torch.load(weights_only=True)`` and must match this model: input width C = sum_l min(pca_components, d_l), the
same layers, PCA size and hidden width — otherwise the job fails at start with the mismatch named. Random weights
are used only with ``allow_random_attention=True`` (experiments; logged as a warning every round).

Capture (the pretraining data): with ``dataset_capture_dir`` set, every round writes the projections, the
benign/malicious labels and sample counts (aggregators/capture.py). The labels come from the clients' meta
``attack.applied`` (set by the experiment's attack simulation, lightning_modules/attacks.py); the aggregation never
reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from aggregators.attention import (
    AttentionCheckpointError,
    AttentionNet,
    attention_weights,
    checkpoint_problems,
    load_attention_checkpoint,
    project_deltas,
    projection_width,
)
from aggregators.capture import CapturedRound, capture_labels, new_run_dir, write_round
from aggregators.contracts import meta_keys
from aggregators.contracts.hparams import hparam
from aggregators.deltas import model_trainable_keys, trainable_keys
from aggregators.robust import assemble, finite_updates
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)

LOG = logging.getLogger("fedalg.attack_adaptive")
PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED_CHECKPOINT = "checkpoints/attention_lenet5.pt"


def resolve_checkpoint(path: str) -> Path:
    """An absolute path as given; a relative one inside the ``aggregators`` package first, then the working dir."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute():
        return candidate
    for base in (PACKAGE_DIR, Path.cwd()):
        if (base / candidate).is_file():
            return base / candidate
    raise AggregationError(
        f"attack_adaptive: attention_model_path '{path}' found neither in {PACKAGE_DIR} nor in {Path.cwd()}; "
        "train one with `python -m aggregators.pretrain_attention` or use the shipped "
        f"'{SHIPPED_CHECKPOINT}'"
    )


def layer_shapes(global_params: Mapping[str, np.ndarray]) -> dict[str, list[int]]:
    """Shapes of the entries AAA projects, in model order (what a checkpoint must have been trained for)."""
    return {key: list(np.shape(global_params[key])) for key in model_trainable_keys(global_params)}


@dataclass(frozen=True)
class AttackAdaptive(RuleHParams, AggregationRule):
    """Attack-adaptive aggregation; defaults are the paper's aggregation settings (docs/robustness.md, attack-adaptive
    aggregation)."""

    attention_model_path: str | None = None
    allow_random_attention: bool = False
    pca_components: int = hparam(10, low=1, note="SVD components per layer")
    attention_hidden: int = hparam(32, low=1, note="the attention network's hidden width")
    attention_loops: int = hparam(5, low=1, note="attention loops, each refining the query")
    scaling_factor: float = hparam(10.0, low=0, note="the scale of the attention scores")
    threshold: float = hparam(0.005, low=0, note="weights at or below it are set to 0")
    dataset_capture_dir: str | None = None
    random_attention_seed: int = 0

    name: ClassVar[str] = "attack_adaptive"
    secure_sum: ClassVar[str] = "scores every individual update with its attention network"
    partial_sharing_refused: ClassVar[str | None] = (
        "its attention model was trained on whole LeNet-5 updates; it cannot score part of a model"
    )
    translation_equivariant: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = None

    _loaded: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def check_together(self) -> None:
        if self.attention_model_path is None and not self.allow_random_attention:
            self.refuse(
                "attention_model_path",
                "a checkpoint path",
                None,
                f"a pretrained attention network, e.g. '{SHIPPED_CHECKPOINT}' for LeNet-5; "
                "set allow_random_attention=true only for experiments",
            )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.attention_model_path is not None:
            # Load at construction: a bad path fails when the job starts, not after the first round.
            try:
                net, header = load_attention_checkpoint(resolve_checkpoint(self.attention_model_path))
            except AttentionCheckpointError as exc:
                raise AggregationError(f"{self.name}: {exc}") from None
            self._loaded.update(net=net, header=header)

    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        self.attention_net(global_params)  # fails now, by name, if the checkpoint does not fit this model
        if self.dataset_capture_dir is None:
            return {}
        return {"capture_run_dir": str(new_run_dir(self.dataset_capture_dir))}

    def attention_net(self, global_params: Mapping[str, np.ndarray]) -> AttentionNet:
        """The frozen network, checked against this model's layers (or, if allowed, a seeded random one)."""
        shapes = layer_shapes(global_params)
        if "header" not in self._loaded:
            width = projection_width(shapes, self.pca_components)
            if "net" not in self._loaded or self._loaded["net"].input_width != width:
                LOG.warning("attack_adaptive: RANDOM attention weights (allow_random_attention); meaningless results")
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(self.random_attention_seed)
                    self._loaded["net"] = AttentionNet(width, self.attention_hidden).double().eval()
            return self._loaded["net"]
        problems = checkpoint_problems(self._loaded["header"], shapes, self.pca_components, self.attention_hidden)
        if problems:
            raise AggregationError(
                f"{self.name}: attention checkpoint '{self.attention_model_path}' does not fit this model: "
                + "; ".join(problems)
            )
        return self._loaded["net"]

    def weights(self, projections: np.ndarray, net: AttentionNet) -> np.ndarray:
        """Attention weights for projections (n, C), float64, summing to 1."""
        if "header" not in self._loaded:
            LOG.warning("attack_adaptive: aggregating with RANDOM attention weights")
        with torch.no_grad():
            weights, _ = attention_weights(
                net,
                torch.from_numpy(projections),
                loops=self.attention_loops,
                scale=float(self.scaling_factor),
                threshold=float(self.threshold),
            )
        return weights.numpy()

    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        keys = trainable_keys(global_params, updates)
        kept, deltas, dropped = finite_updates(global_params, updates, keys, self.name)
        if dropped:
            LOG.warning(f"attack_adaptive: dropped clients with non-finite deltas: {dropped}")
        projections = project_deltas(deltas, keys, self.pca_components)
        weights = self.weights(projections, self.attention_net(global_params))
        step = {key: np.tensordot(weights, np.stack([d[key] for d in deltas]), axes=1) for key in keys}
        new_state = {**state, "weights": {u.site: float(w) for u, w in zip(kept, weights, strict=True)}}
        if self.dataset_capture_dir is not None:
            self._capture(state, context.round_num, kept, projections, global_params)
        return AggregationResult(params=assemble(global_params, step, kept), state=new_state)

    def _capture(self, state, round_num, updates, projections, global_params) -> None:
        run_dir = state.get("capture_run_dir") or str(new_run_dir(self.dataset_capture_dir))
        record = CapturedRound(
            round_num=round_num,
            projections=projections.astype(np.float32),
            malicious=capture_labels([u.meta for u in updates], meta_keys.ATTACK_APPLIED),
            num_samples=np.array([u.num_samples for u in updates], dtype=np.int64),
            sites=tuple(u.site for u in updates),
        )
        shapes = layer_shapes(global_params)
        metadata = {
            "input_width": projection_width(shapes, self.pca_components),
            "pca_components": self.pca_components,
            "layer_shapes": shapes,
            "rule_settings": {
                "attention_loops": self.attention_loops,
                "scaling_factor": self.scaling_factor,
                "threshold": self.threshold,
                "attention_model_path": self.attention_model_path,
            },
            "sign_convention": "largest-|.| entry of every right singular vector positive",
            "label_meta_key": meta_keys.ATTACK_APPLIED,
            "versions": {"torch": torch.__version__, "numpy": np.__version__},
        }
        write_round(run_dir, record, metadata)
