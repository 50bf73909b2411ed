"""Local fine-tuning: every site adapts a copy of the global model it received to its own data.

Reference: Yu, Bagdasaryan, Shmatikov, "Salvaging Federated Learning by Local Adaptation", arXiv:2002.04758, 2020
(docs/personalization.md, Fine-tuning). After receiving w^t, site i copies it, trains the copy K epochs on its own
training split with its own optimizer,

    v_i^t = LocalSGD_i(w^t, K epochs)      (the module's configure_optimizers, a fresh optimizer)

and scores v_i^t on its own validation split (``eval.personal_*``). The copy never leaves the site and nothing of
it enters the federated training: the round trains and sends the received model exactly as it would without
fine-tuning (tested bit for bit). The simplest personalization baseline, and often hard to beat.

**Early-stopped within the round** (K >= 2): after each of its K epochs the copy is scored on the site's validation
split (`epoch_scorer`: the classifier path's one forward pass, lightning_modules/split_scores.py, where the module
is a classifier; else a fresh Trainer's validation of a copy, its ``val_loss``), and the copy keeps the weights of
the epoch with the lowest validation loss (`best_epoch`: ties to the earlier epoch; with no finite score, the last
epoch, as without early stopping). So each site picks its own number of fine-tuning epochs, 1..K, every round; the
choice is reported as ``eval.finetune_best_epoch`` (an ``eval.*`` score: withheld under DP like the others, where
fine-tuning is refused anyway). The copy still trains all K epochs (one optimizer, one fit), and all K epochs'
steps count in the local-only model's matched compute: the site did that work. The scoring runs on forked random
streams and restores the copy's mode, so the copy's K-epoch trajectory is the one without it.

How (``--finetune-epochs K``, K >= 1; 0 = off):

- the copy is `lightning_modules.personal_scores.site_copy` of the site's module right after the received
  model was loaded and scored, with no client algorithm attached (fine-tuning is plain local training whatever the
  job's client algorithm is) and a fresh single-process ``pl.Trainer`` at the job's precision, with no NVFlare
  callback;
- data: the site's training split (the built-in sites: shuffled by a seed of (job seed, site, round) apart from the
  round's own; a user's data module: its ``train_dataloader``), K epochs;
- it runs on a forked random generator, so the round's own shuffling and initialisation are unchanged;
- it is independent of the round's training, so it runs before it (the received model is then in the module) and
  costs K epochs per round on top of the round: ``benchmarks/client_algorithms.py`` reports the added seconds.

Refused when the job is built: without a validation split (nothing to score the copy on), with ``--script`` (the
user's own loop), with ``--devices`` > 1 (the copy trains in one process) and beside any other personal method
(a client algorithm that declares a personal model, ``--local-keys``): the site would have two personal models and
one set of ``personal_*`` scores (lightning_modules/personalization/methods.py, ``collision``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl

from lightning_modules.personal_scores import own_random_stream, single_process_trainer, site_copy
from lightning_modules.split_scores import SplitBatches, log_probs

#: ``score(module)``: the module's validation loss (lower is better), ``None`` where it cannot be scored.
EpochScore = Callable[[pl.LightningModule], float | None]
BEST_EPOCH = "finetune_best_epoch"


def finetune_seed(seed: int, site_index: int, round_num: int) -> int:
    """The seed of a site's fine-tuning in a round: a stream apart from the round's own (`round_seed`)."""
    return int(np.random.SeedSequence([seed, site_index, round_num, 3]).generate_state(1)[0])


def best_epoch(losses: Sequence[float | None]) -> int:
    """The epoch (1-based) with the lowest finite validation loss, ties to the earlier; the last epoch when none is
    finite (no choice: the copy as trained)."""
    finite = [(loss, epoch) for epoch, loss in enumerate(losses, 1) if loss is not None and math.isfinite(loss)]
    return min(finite)[1] if finite else len(losses)


def epoch_scorer(
    val: SplitBatches | None, validate: Callable[[pl.LightningModule], Mapping[str, float]] | None
) -> EpochScore:
    """The validation loss of a module: the mean cross-entropy of one fp32 forward over ``val`` where the module is
    a classifier (equal to a ``validation_step``'s ``val_loss``, lightning_modules/split_scores.py), else the
    ``val_loss`` that ``validate`` (a fresh Trainer's validation) reports for a copy of it; ``None``: neither."""

    def score(module: pl.LightningModule) -> float | None:
        table = None if val is None else log_probs(module, val)
        if table is not None:
            return float(-table[np.arange(len(val.labels)), val.labels].mean())
        if validate is None:
            return None
        value = validate(site_copy(module)).get("val_loss")
        return None if value is None else float(value)

    return score


class EpochKeeper(pl.Callback):
    """Scores the copy after each training epoch and keeps the weights of the best epoch so far (`best_epoch`)."""

    def __init__(self, score: EpochScore) -> None:
        self.score = score
        self.losses: list[float | None] = []
        self.best: dict[str, Any] | None = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with own_random_stream():  # the copy's own draws (shuffling, dropout) go on as without scoring
            self.losses.append(self.score(pl_module))
        if best_epoch(self.losses) == len(self.losses):
            self.best = {key: value.detach().clone() for key, value in pl_module.state_dict().items()}


def finetuned_copy(
    module: pl.LightningModule,
    epochs: int,
    seed: int,
    fit: Callable[[pl.Trainer, pl.LightningModule], Any],
    precision: Any = "32-true",
    accelerator: str = "auto",
    score: EpochScore | None = None,
) -> pl.LightningModule:
    """A copy of ``module`` trained ``epochs`` epochs by ``fit(trainer, copy)`` (which passes the site's training
    data) with a fresh Trainer, on a random stream seeded with ``seed``; ``module`` is untouched. With ``score``
    and ``epochs`` >= 2 the copy keeps the weights of its best epoch on validation (module docstring); the chosen
    epoch is ``copy.__fl_best_epoch__`` (``epochs`` without early stopping), the optimizer steps of all epochs
    ``copy.__fl_steps__``."""
    duplicate = site_copy(module)
    keeper = EpochKeeper(score) if score is not None and epochs >= 2 else None
    with own_random_stream(seed):
        trainer = single_process_trainer(precision, accelerator, epochs)
        if keeper is not None:
            trainer.callbacks.append(keeper)
        fit(trainer, duplicate)
    duplicate.__fl_steps__ = int(trainer.global_step)  # the local-only model's matched compute counts them all
    duplicate.__fl_best_epoch__ = epochs
    if keeper is not None and keeper.losses:
        duplicate.__fl_best_epoch__ = best_epoch(keeper.losses)
        if keeper.best is not None:
            duplicate.load_state_dict(keeper.best)
    return duplicate
