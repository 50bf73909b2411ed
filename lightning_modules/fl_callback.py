"""The Lightning glue between one ``trainer.fit`` and one federated round.

Register it in ``Trainer(callbacks=[...])`` *before* ``flare.patch(trainer)``: NVFlare's FLCallback is appended
after it, so

- our ``on_train_end`` runs before FLCallback's, which is when FLCallback sends ``pl_module.__fl_meta__``;
- our ``on_train_start`` would run before FLCallback loads the global weights, so the round starts lazily at the
  first ``on_train_epoch_start``, when the module holds the global model.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import pytorch_lightning as pl

from aggregators import meta_keys

MetaSource = Callable[[], Mapping[str, Any]]


def nvflare_meta_source() -> Mapping[str, Any]:
    """The server meta of the model received this round (NVFlare caches it for the whole fit)."""
    import nvflare.client as flare

    received = flare.receive()
    return dict(received.meta or {}) if received is not None else {}


class FederatedRoundCallback(pl.Callback):
    """Starts the client algorithm's round after the global weights are loaded and hands its meta to NVFlare."""

    def __init__(self, num_samples: int, site: str = "local", meta_source: MetaSource = nvflare_meta_source) -> None:
        self.num_samples = num_samples
        self.site = site
        self.meta_source = meta_source
        self._round_started = False
        self.last_meta: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._round_started = False
        self._fit_started = time.monotonic()

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._round_started:
            pl_module.start_round(self.meta_source(), site=self.site)
            self._round_started = True

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        meta = pl_module.end_round()
        meta[meta_keys.NUM_SAMPLES] = self.num_samples
        meta[meta_keys.FIT_SECONDS] = round(time.monotonic() - getattr(self, "_fit_started", time.monotonic()), 4)
        self.last_meta = meta
        pl_module.__fl_meta__ = meta
