"""The consortium's genotype models as LightningModules: ``cnn_transformer`` and an MLP baseline.

Input: int64 genotype states (people x SNPs; 0/1/2 copies of the alternative allele, 3 = missing call).

``cnn_transformer``: each state is embedded (``embed_dim``, the consortium's "genotype encoding dimension" 8), a
1-D convolution with stride ``patch`` turns runs of ``patch`` neighbouring SNPs into ``d_model``-wide patches, a
learned position embedding is added, a pre-norm transformer encoder (``layers`` x ``heads``) mixes the patches, and
the mean over patches (then LayerNorm) is the representation. ``mlp``: the same embedding, flattened, then two
hidden layers. A linear head gives class logits (``target="population"``) or the logits of the ancestry
proportions (``target="proportions"``: softmax = the predicted proportions, trained with the soft-label
cross-entropy, scored by the mean absolute error of the proportions).

Only LayerNorm (no BatchNorm): per-sample normalisation has no running statistics that sites with different
populations would pull apart, and nothing that FedAvg would average across sites other than weights.

The bundle's protocols (docs/own_model.md): ``task_loss`` (FedMoS, SCAFFOLD Option I), ``net.embed`` /
``net.projection`` (MOON, with ``projection_dim > 0``), and ``algorithm_loss`` added to the training loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from data_prep.errors import DataPrepError
from data_prep.genomics import GENOTYPE_STATES
from lightning_modules.federated import algorithm_loss

ARCHS = ("cnn_transformer", "mlp")


class Position(nn.Module):
    """A learned position embedding in a module of its own: DP-SGD (Opacus) differentiates a module without a
    per-sample rule over its whole forward, which must then hold no dropout (docs/privacy.md)."""

    def __init__(self, num_patches: int, d_model: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, num_patches, d_model) * 0.02)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return patches + self.weight


class LinearAttentionLayer(nn.Module):
    """A pre-norm transformer encoder layer (as ``nn.TransformerEncoderLayer(norm_first=True)`` computes it) built
    from ``nn.Linear`` and ``nn.LayerNorm`` only, which DP-SGD can take per-sample gradients of; PyTorch's fused
    ``nn.MultiheadAttention`` has none."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.ff = nn.Sequential(
            nn.Linear(d_model, 2 * d_model), nn.ReLU(), nn.Dropout(dropout), nn.Linear(2 * d_model, d_model)
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        weights = self.dropout(torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1))
        x = x + self.dropout(self.out((weights @ v).transpose(1, 2).reshape(batch, length, width)))
        return x + self.dropout(self.ff(self.norm2(x)))


class CnnTransformer(nn.Module):
    def __init__(
        self,
        n_snps: int,
        embed_dim: int,
        d_model: int,
        patch: int,
        heads: int,
        layers: int,
        dropout: float,
        attention: str = "torch",
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(GENOTYPE_STATES, embed_dim)
        self.patch = patch
        self.num_patches = math.ceil(n_snps / patch)
        self.patchify = nn.Conv1d(embed_dim, d_model, kernel_size=patch, stride=patch)
        if attention == "linear":  # DP-SGD-ready (docs/privacy.md); other state_dict names than "torch"
            self.position: nn.Module | nn.Parameter = Position(self.num_patches, d_model)
            self.encoder = nn.Sequential(*(LinearAttentionLayer(d_model, heads, dropout) for _ in range(layers)))
        else:
            self.position = nn.Parameter(torch.randn(1, self.num_patches, d_model) * 0.02)
            layer = nn.TransformerEncoderLayer(
                d_model, heads, dim_feedforward=2 * d_model, dropout=dropout, batch_first=True, norm_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.width = d_model

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        tokens = self.embedding(states).transpose(1, 2)  # (B, embed_dim, SNPs)
        tokens = F.pad(tokens, (0, self.num_patches * self.patch - tokens.shape[-1]))
        patches = self.patchify(tokens).transpose(1, 2)  # (B, patches, d_model)
        patches = self.position(patches) if isinstance(self.position, nn.Module) else patches + self.position
        return self.norm(self.encoder(patches).mean(dim=1))


class Mlp(nn.Module):
    def __init__(self, n_snps: int, embed_dim: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.embedding = nn.Embedding(GENOTYPE_STATES, embed_dim)
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(n_snps * embed_dim, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.width = hidden

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.layers(self.embedding(states))


class SnpNet(nn.Module):
    """encoder -> (optional projection head, for MOON) -> linear head; ``embed`` is what MOON contrasts."""

    def __init__(self, encoder: nn.Module, num_outputs: int, projection_dim: int = 0) -> None:
        super().__init__()
        self.encoder = encoder
        self.projection = nn.Linear(encoder.width, projection_dim) if projection_dim else None
        self.head = nn.Linear(projection_dim or encoder.width, num_outputs)

    def fl_head_keys(self) -> list[str]:
        """The personal head (FedPer's ``--local-keys head``, FedRep without ``--local-keys``): the final linear
        layer, ``net.head.*`` in the classifier's state_dict (lightning_modules/personalization/local_keys.py)."""
        return [f"head.{name}" for name in self.head.state_dict()]

    def embed(self, states: torch.Tensor) -> torch.Tensor:
        h = self.encoder(states)
        return self.projection(h) if self.projection is not None else h

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(states))


def data_shape_problem(hparams: Mapping[str, Any], data: object) -> str | None:
    """Why a model built with ``hparams`` cannot train on ``data`` (one line naming the setting and the fix), or
    ``None``. ``data`` is the site's data module (or a wrapper holding it in ``.datamodule``, as DP-SGD's does); one
    without ``num_snps`` and ``classes`` is not checked. Without this a ``cnn_transformer`` pads a smaller file up to
    ``n_snps`` and trains without a word, and the MLP fails deep inside a matrix product."""
    data = getattr(data, "datamodule", data)
    snps, classes = getattr(data, "num_snps", None), getattr(data, "classes", None)
    if snps is None or classes is None:
        return None
    site, source = getattr(data, "site", "site"), getattr(data, "data_source", "its data module")
    for setting, built, found, what in (
        ("n_snps", hparams["n_snps"], int(snps), "SNPs"),
        ("num_classes", hparams["num_classes"], len(classes), "classes"),
    ):
        if built != found:
            return (
                f"{site}: the job's model_args {setting}={built}, but the site's data has {found} {what} ({source}); "
                f"rebuild the job with {setting}={found} (python -m jobs.build --snp-table <the table this site "
                "harmonised against> takes n_snps from the table and num_classes from the agreed classes); nothing "
                "trained"
            )
    return None


class SnpClassifier(pl.LightningModule):
    """Population classifier (or ancestry-proportion estimator) on genotype states, trained with AdamW by default.

    ``optimizer="sgd"`` gives plain SGD, for the algorithms that describe SGD steps only (FedNova, FedMoS).
    """

    #: Its training_step and configure_optimizers need nothing of a Trainer: a site's local-only model (the bundle's
    #: --local-baseline) trains without building one every round, on the CPU in fp32 (the same steps, tested).
    fl_plain_training = True

    def __init__(
        self,
        arch: str = "cnn_transformer",
        n_snps: int = 127,
        num_classes: int = 5,
        target: str = "population",
        lr: float = 1e-4,
        optimizer: str = "adamw",
        weight_decay: float = 0.0,
        embed_dim: int = 8,
        d_model: int = 32,
        patch: int = 8,
        heads: int = 4,
        layers: int = 2,
        hidden: int = 128,
        dropout: float = 0.1,
        projection_dim: int = 0,
        seed: int = 0,
        attention: str = "torch",
    ) -> None:
        super().__init__()
        if arch not in ARCHS:
            raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
        if target not in ("population", "proportions"):
            raise ValueError(f"target must be 'population' or 'proportions', got {target!r}")
        if attention not in ("torch", "linear"):
            raise ValueError(f"attention must be 'torch' or 'linear' (DP-SGD-ready), got {attention!r}")
        if optimizer not in ("adamw", "adam", "sgd"):
            raise ValueError(f"optimizer must be 'adamw', 'adam' or 'sgd', got {optimizer!r}")
        self.save_hyperparameters()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the server and every site build the same initial weights
            if arch == "cnn_transformer":
                encoder: nn.Module = CnnTransformer(
                    n_snps, embed_dim, d_model, patch, heads, layers, dropout, attention
                )
            else:
                encoder = Mlp(n_snps, embed_dim, hidden, dropout)
            self.net = SnpNet(encoder, num_classes, projection_dim)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.net(states)

    def setup(self, stage: str) -> None:
        """Before the site scores or trains anything: the model's size must be its data's (`data_shape_problem`)."""
        problem = data_shape_problem(self.hparams, getattr(self.trainer, "datamodule", None))
        if problem:
            raise DataPrepError(problem)

    def task_loss(self, batch, params=None):
        """Mean loss and logits of a batch, at this module's weights or at ``params`` (FedMoS, SCAFFOLD Option I)."""
        states, target = batch
        logits = self(states) if params is None else torch.func.functional_call(self, dict(params), (states,))
        logits = logits.float()  # the loss in fp32 under bf16-mixed
        if self.hparams.target == "proportions":
            return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean(), logits
        return F.cross_entropy(logits, target), logits

    def training_step(self, batch, batch_idx):
        loss, logits = self.task_loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss + algorithm_loss(self, batch, logits)

    def _score(self, batch, stage: str) -> None:
        loss, logits = self.task_loss(batch)
        self.log(f"{stage}_loss", loss, on_epoch=True)
        target = batch[1]
        if self.hparams.target == "proportions":
            error = (logits.softmax(dim=1) - target).abs().mean()
            self.log(f"{stage}_mae", error, on_epoch=True)
            target = target.argmax(dim=1)  # the majority ancestry
        self.log(f"{stage}_accuracy", (logits.argmax(dim=1) == target).float().mean(), on_epoch=True)

    def validation_step(self, batch, batch_idx):
        self._score(batch, "val")

    def test_step(self, batch, batch_idx):
        self._score(batch, "test")

    def configure_optimizers(self):
        hp = self.hparams
        if hp.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=hp.lr)
        if hp.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        return torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
