"""``HaploblockClassifier``: the consortium's cnn_transformer in the shape its description gives, small enough for CPUs.

Input: int64 genotype states (people x SNPs; 0/1/2 copies of the alternative allele, 3 = missing call).

1. **Per-haploblock embeddings.** The SNPs are cut into consecutive blocks of ``block_size`` (a stand-in for
   haploblocks: SNPs inherited together; the last block is padded with "missing"). Each block has its own
   embedding: the one-hot states of its SNPs (``block_size x 4``) times that block's own matrix, plus its own bias,
   give one ``embed_dim`` vector per block. Blocks do not share weights: the same genotype means different things
   in different regions of the genome.
2. **Conv1d + BatchNorm1d** over the sequence of blocks (kernel 3: each block sees its neighbours), then GELU.
3. **A transformer encoder** (``layers`` x ``heads``, learned position embedding per block) mixes the blocks; the mean
   over blocks, then LayerNorm and a linear head, gives the class logits.
4. **Focal loss** (``gamma``; 0 is cross-entropy): rare, hard classes weigh more than easy ones.
5. **AdamW with cosine warm restarts** (``torch.optim.lr_scheduler.CosineAnnealingWarmRestarts``, stepped every
   batch, first period ``restart_steps``). The bundle re-creates the optimizer (and so the schedule) every round,
   as FedAvg's clients do: each round starts at ``lr``.
6. **Seeded construction** (``seed``): the server and every site build the same initial weights even without the
   job's ``--seed`` (which seeds the construction as well).

BatchNorm's running mean and variance are buffers of the state_dict: they travel and are averaged with the weights
(docs/algorithms.md says how each server rule averages them).

``task_loss(batch, params=None)`` is the bundle's protocol for FedMoS and SCAFFOLD Option I (docs/own_model.md).
"""

from __future__ import annotations

import math

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

#: Genotype states: 0, 1, 2 copies of the alternative allele, 3 = missing call (data_prep.genomics).
STATES = 4
MISSING = 3


def focal_loss(logits: torch.Tensor, target: torch.Tensor, gamma: float) -> torch.Tensor:
    """Mean of ``-(1 - p_t)^gamma log p_t`` over the batch (p_t: the probability of the true class); ``gamma = 0``
    is the cross-entropy."""
    log_p = F.log_softmax(logits.float(), dim=1).gather(1, target[:, None]).squeeze(1)
    return (-((1 - log_p.exp()) ** gamma) * log_p).mean()


class HaploblockEmbedding(nn.Module):
    """One embedding per block of ``block_size`` SNPs: (B, SNPs) states -> (B, blocks, embed_dim)."""

    def __init__(self, n_snps: int, block_size: int, embed_dim: int) -> None:
        super().__init__()
        self.block_size, self.num_blocks = block_size, math.ceil(n_snps / block_size)
        fan_in = block_size * STATES
        self.weight = nn.Parameter(torch.randn(self.num_blocks, fan_in, embed_dim) / math.sqrt(fan_in))
        self.bias = nn.Parameter(torch.zeros(self.num_blocks, embed_dim))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        padded = F.pad(states, (0, self.num_blocks * self.block_size - states.shape[1]), value=MISSING)
        one_hot = F.one_hot(padded, STATES).to(self.weight.dtype)  # (B, blocks * block_size, 4)
        blocks = one_hot.reshape(states.shape[0], self.num_blocks, self.block_size * STATES)
        return torch.einsum("bki,kio->bko", blocks, self.weight) + self.bias


class HaploblockNet(nn.Module):
    def __init__(
        self,
        n_snps: int,
        num_classes: int,
        block_size: int,
        embed_dim: int,
        d_model: int,
        heads: int,
        layers: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.embedding = HaploblockEmbedding(n_snps, block_size, embed_dim)
        self.conv = nn.Conv1d(embed_dim, d_model, kernel_size=3, padding=1)
        self.norm = nn.BatchNorm1d(d_model)
        self.position = nn.Parameter(torch.randn(1, self.embedding.num_blocks, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=2 * d_model, dropout=dropout, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, num_classes))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        blocks = self.embedding(states).transpose(1, 2)  # (B, embed_dim, blocks): Conv1d wants channels first
        features = F.gelu(self.norm(self.conv(blocks))).transpose(1, 2) + self.position  # (B, blocks, d_model)
        return self.head(self.encoder(features).mean(dim=1))


class HaploblockClassifier(pl.LightningModule):
    """Population classifier on genotype states in the consortium's architecture (module docstring)."""

    def __init__(
        self,
        n_snps: int = 127,
        num_classes: int = 5,
        block_size: int = 8,
        embed_dim: int = 16,
        d_model: int = 32,
        heads: int = 4,
        layers: int = 2,
        dropout: float = 0.1,
        gamma: float = 2.0,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        restart_steps: int = 10,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)  # the server and every site build the same initial weights
            self.net = HaploblockNet(n_snps, num_classes, block_size, embed_dim, d_model, heads, layers, dropout)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.net(states)

    def task_loss(self, batch, params=None):
        """Focal loss and logits of a batch, at this module's weights or at ``params`` (FedMoS, SCAFFOLD Option I)."""
        states, target = batch
        logits = self(states) if params is None else torch.func.functional_call(self, dict(params), (states,))
        return focal_loss(logits, target, self.hparams.gamma), logits

    def training_step(self, batch, batch_idx):
        loss, _ = self.task_loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logits = self.task_loss(batch)
        self.log("val_loss", loss, on_epoch=True)
        self.log("val_accuracy", (logits.argmax(dim=1) == batch[1]).float().mean(), on_epoch=True)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)
        schedule = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=hp.restart_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
