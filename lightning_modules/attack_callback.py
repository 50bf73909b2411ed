"""The Lightning glue of the simulated attacks (lightning_modules/attacks.py has the math): a callback that alters
the weights a malicious site is about to send and reports what it did in the round's meta."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import Tensor

from aggregators.contracts import meta_keys
from lightning_modules.attacks import UPDATE_ATTACKS, AttackConfig, attacked_params


class AttackCallback(pl.Callback):
    """Applies an update attack to the weights NVFlare is about to send, and reports what it did in the meta.

    Register it after `FederatedRoundCallback` and before ``flare.patch``: its ``on_train_end`` then runs
    after the round meta is set and before NVFlare's FLCallback sends the model. Set ``round_num`` before each fit.
    """

    def __init__(self, config: AttackConfig, site: str, site_index: int) -> None:
        self.config = config
        self.site = site
        self.site_index = site_index
        self.round_num = 0
        self._global: dict[str, Tensor] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._global = None

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The first epoch starts after FLCallback loaded the global weights: snapshot them once per round.
        if self._global is None and self.config.active(self.site, self.round_num):
            self._global = {n: p.detach().clone() for n, p in pl_module.named_parameters() if p.requires_grad}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.config.name == "none":
            return  # jobs without an attack send exactly the meta they always sent
        active = self.config.active(self.site, self.round_num)
        if active and self.config.name in UPDATE_ATTACKS and self._global is not None:
            named = dict(pl_module.named_parameters())
            current = {key: named[key].detach() for key in self._global}
            new = attacked_params(
                current, self._global, self.config, self.config.generator(self.site_index, self.round_num)
            )
            with torch.no_grad():
                for key, value in new.items():
                    named[key].copy_(value)
        meta = getattr(pl_module, "__fl_meta__", None)
        if isinstance(meta, dict):
            meta[meta_keys.ATTACK_APPLIED] = bool(active)
            meta[meta_keys.ATTACK_NAME] = self.config.name if active else "none"
