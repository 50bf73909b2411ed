"""The site's personal model, scored on the site's own validation split (docs/personalization.md, "Scores at the
sites").

Every round a site with a validation split scores the global model it received (``eval.<metric>``, before its
training). When a personalization method is on, the site also scores its **personal model** on the same split with
the same ``validation_step``, after the round's local work and before the result is sent, and reports it under the
same metric names prefixed with ``personal_`` (``eval.personal_val_accuracy``, ...;
`lightning_modules.federated.personal_eval_meta`). The server summarises both alike (``site_eval`` in
round_metrics.jsonl: per site, weighted mean, worst site, spread); ``python -m controllers.report`` shows them side
by side with the gain per site.

The personal model is whatever the method on provides, never sent to the server:

- a client algorithm that declares a personal model of kind ``weights`` (``personal_model``,
  lightning_modules/algorithms/capabilities.py) and returns it from ``personal_weights(module)`` (Ditto's v_i,
  APFL's mixture): the site's module, copied, with those entries loaded, scored by the callback's
  ``personal_scorer`` at the end of the round;
- a model the site round builds itself (local fine-tuning: the copy fine-tuned from the received model), whose scores
  the round hands to the callback with `lightning_modules.federated.FederatedAlgorithm.add_personal_scores`.

With none, no ``personal_`` metric is sent. Scoring runs on a copy (the trained module and its trainer are untouched)
with a fresh single-process Trainer at the job's precision, under a forked random generator, so the result the site
sends is bit-identical with and without it."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from typing import Any

import pytorch_lightning as pl
import torch

from lightning_modules.federated import _ALGORITHM_ATTRIBUTE, attach_algorithm


def site_copy(module: pl.LightningModule) -> pl.LightningModule:
    """A deep copy of the site's module without its trainer and without the client algorithm attached to it (so
    ``algorithm_loss`` adds nothing in the copy's training and no algorithm state is duplicated)."""
    memo: dict[int, Any] = {}
    for attribute in ("_trainer", _ALGORITHM_ATTRIBUTE):
        value = getattr(module, attribute, None)
        if value is not None:
            memo[id(value)] = None  # deepcopy maps references to these onto None
    duplicate = copy.deepcopy(module, memo)
    attach_algorithm(duplicate, None)
    return duplicate


def with_weights(module: pl.LightningModule, weights: Mapping[str, torch.Tensor]) -> pl.LightningModule:
    """A `site_copy` of ``module`` with ``weights`` (a subset of its state_dict keys) loaded."""
    duplicate = site_copy(module)
    state = duplicate.state_dict()
    unknown = sorted(set(weights) - set(state))
    if unknown:
        raise KeyError(f"personal weights {unknown[:5]} are not entries of {type(module).__name__}")
    with torch.no_grad():
        for name, value in weights.items():
            state[name].copy_(value.to(device=state[name].device, dtype=state[name].dtype))
    return duplicate


def single_process_trainer(
    precision: Any, accelerator: str, epochs: int = 1, steps: int = -1, validate: bool = True
) -> pl.Trainer:
    """A bare Trainer for the site's own side work (fine-tuning, scoring, the local-only model): no NVFlare
    callback, no logger, one process, the job's precision; ``steps`` > 0 stops after that many optimizer steps;
    ``validate`` False: a fit given a data module skips its validation loop after each epoch."""
    return pl.Trainer(
        max_epochs=epochs,
        max_steps=steps,
        limit_val_batches=1.0 if validate else 0,
        accelerator=accelerator,
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


@contextlib.contextmanager
def own_random_stream(seed: int | None = None) -> Iterator[None]:
    """Run side work on a forked torch generator (CPU and every CUDA device), optionally seeded: the round's own
    draws are those of a site without the side work."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        if seed is not None:
            torch.manual_seed(seed)
        yield


def validation_scores(module: pl.LightningModule, trainer: pl.Trainer, **data: Any) -> dict[str, float]:
    """``trainer.validate`` of ``module`` (``data``: ``dataloaders=`` or ``datamodule=``), its scalar metrics."""
    with own_random_stream():
        results = trainer.validate(module, verbose=False, **data)
    return {name: float(value) for name, value in (results[0] if results else {}).items()}


def validation_scorer(precision: Any, accelerator: str, **data: Any) -> Any:
    """A ``personal_scorer`` for `lightning_modules.federated.FederatedAlgorithm`: the site's module with the
    personal weights loaded, validated on ``data`` (``dataloaders=`` or ``datamodule=``) by a fresh Trainer."""

    def score(module: pl.LightningModule, weights: Mapping[str, torch.Tensor]) -> dict[str, float]:
        trainer = single_process_trainer(precision, accelerator)
        return validation_scores(with_weights(module, weights), trainer, **data)

    return score
