"""Local fine-tuning: every site adapts a copy of the global model it received to its own data.

Reference: Yu, Bagdasaryan, Shmatikov, "Salvaging Federated Learning by Local Adaptation", arXiv:2002.04758, 2020
(docs/personalization.md, Fine-tuning). After receiving w^t, site i copies it, trains the copy K epochs on its own
training split with its own optimizer,

    v_i^t = LocalSGD_i(w^t, K epochs)      (the module's configure_optimizers, a fresh optimizer)

and scores v_i^t on its own validation split (``eval.personal_*``). The copy never leaves the site and nothing of
it enters the federated training: the round trains and sends the received model exactly as it would without
fine-tuning (tested bit for bit). The simplest personalization baseline, and often hard to beat.

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

from collections.abc import Callable
from typing import Any

import numpy as np
import pytorch_lightning as pl

from lightning_modules.personal_scores import own_random_stream, single_process_trainer, site_copy


def finetune_seed(seed: int, site_index: int, round_num: int) -> int:
    """The seed of a site's fine-tuning in a round: a stream apart from the round's own (`round_seed`)."""
    return int(np.random.SeedSequence([seed, site_index, round_num, 3]).generate_state(1)[0])


def finetuned_copy(
    module: pl.LightningModule,
    epochs: int,
    seed: int,
    fit: Callable[[pl.Trainer, pl.LightningModule], Any],
    precision: Any = "32-true",
    accelerator: str = "auto",
) -> pl.LightningModule:
    """A copy of ``module`` trained ``epochs`` epochs by ``fit(trainer, copy)`` (which passes the site's training
    data) with a fresh Trainer, on a random stream seeded with ``seed``; ``module`` is untouched."""
    duplicate = site_copy(module)
    with own_random_stream(seed):
        trainer = single_process_trainer(precision, accelerator, epochs)
        fit(trainer, duplicate)
    duplicate.__fl_steps__ = int(trainer.global_step)  # the local-only model's matched compute counts them
    return duplicate
