"""A site's round of choosing on the classifier path: the own (early-stopped local-only) model and the kept model,
carried over rounds in the site's private state store, and the ``eval.*`` meta that reports them
(lightning_modules/site_choice.py has the rule, lightning_modules/split_scores.py the scoring).

Per round, with ``T`` the split tables of a model (log-probabilities on ``val``, ``test`` and ``pooled``):

1. the round's models (the received global model where the site could use it, the personal model, the local-only
   model after this round's training) are scored once per split;
2. the own model is the early-stopped local-only model: this round's, if its validation loss is below the stored
   one's (`OWN_STORE`, state and tables);
3. the challengers are the round's federated models, their mixtures with the own model at `MIXTURE_WEIGHTS`, and
   the model kept so far when it was a federated one (its tables stored with it);
4. `site_choice.keep` picks; the kept model (state; for a mixture both states and the weight) and its tables are
   stored (`KEPT_STORE`).

Reported (``eval.`` keys; ``<view>`` is ``test`` and, with a pooled test set, ``pooled_test``):

- ``{global,personal,local_last}_<view>_{accuracy,loss}``: the round's models;
- ``local_<view>_*``, ``local_val_*``, ``local_round``: the own model (what the site would keep alone);
- ``kept_<view>_*``, ``kept_val_*``, ``kept_candidate`` (index into keep_best.CANDIDATES), ``kept_round``,
  ``kept_weight`` (the federated model's share, mixtures only), ``kept_own`` (1: the own model, gain 0 by
  construction);
- ``kept_minus_local_<view>_accuracy`` and ``..._se``: per-sample paired difference on that view.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from aggregators import meta_keys
from lightning_modules.site_choice import (
    KINDS,
    MIXTURE_WEIGHTS,
    Candidate,
    early_stopped,
    keep,
    mixture_scores,
    paired_mean_se,
    split_scores,
)
from lightning_modules.split_scores import SplitBatches, model_tables
from lightning_modules.state_store import ClientStateStore

OWN_STORE = "local_best"
KEPT_STORE = "kept_model"
RUN_KEY = "__run_id__"
#: Reported views: the split name in the tables -> the name in the meta.
VIEWS = {"test": "test", "pooled": "pooled_test"}

Tables = dict[str, np.ndarray]


def cpu_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.detach().cpu().clone() for key, value in module.state_dict().items()}


def view_meta(prefix: str, candidate: Candidate) -> dict[str, float]:
    """``eval.<prefix><view>_{accuracy,loss}`` for every reported view the candidate was scored on, and its
    validation scores as ``eval.<prefix>val_*``."""
    out = {}
    for split, view in (("val", "val"), *VIEWS.items()):
        if split in candidate.scores.log_prob:
            out[meta_keys.eval_key(f"{prefix}{view}_accuracy")] = candidate.scores.accuracy(split)
            out[meta_keys.eval_key(f"{prefix}{view}_loss")] = candidate.scores.loss(split)
    return out


def gain_meta(kept: Candidate, own: Candidate) -> dict[str, float]:
    """Kept minus own, per sample, on every reported view: mean and standard error."""
    out = {}
    for split, view in VIEWS.items():
        if split in kept.scores.correct and split in own.scores.correct:
            mean, se = paired_mean_se(kept.scores.correct[split], own.scores.correct[split])
            out[meta_keys.eval_key(f"kept_minus_local_{view}_accuracy")] = mean
            out[meta_keys.eval_key(f"kept_minus_local_{view}_accuracy_se")] = se
    return out


class KeptModel:
    """One site's choosing on the classifier path (module docstring)."""

    def __init__(self, store: ClientStateStore | None, splits: Mapping[str, SplitBatches], margin: float) -> None:
        self.store, self.splits, self.margin = store, dict(splits), margin
        self.labels = {name: batches.labels for name, batches in self.splits.items()}

    def tables(self, models: Mapping[str, pl.LightningModule]) -> dict[str, Tables] | None:
        """Every model's split tables, or ``None`` when one is not a classifier."""
        out = {}
        for name, model in models.items():
            tables = model_tables(model, self.splits)
            if tables is None:
                return None
            out[name] = tables
        return out

    def _stored(self, name: str, run_id: str) -> dict[str, Any] | None:
        if self.store is None:
            return None
        stored = self.store.load(name)
        if stored is None or stored.state.get(RUN_KEY) != run_id:
            return None
        return dict(stored.state)

    def _candidate(self, kind: str, round_num: int, tables: Tables, weight: float | None = None) -> Candidate:
        return Candidate(kind, round_num, split_scores(tables, self.labels), weight)

    def round(
        self,
        models: Mapping[str, pl.LightningModule],
        round_num: int,
        run_id: str,
        choose: bool,
        eligible_global: bool = True,
    ) -> dict[str, float] | None:
        """The round's meta (module docstring); ``choose``: pick and store the kept model (``--keep best``);
        ``eligible_global`` False: the received model is scored and reported but never kept."""
        tables = self.tables(models)
        if tables is None:
            return None
        out: dict[str, float] = {}
        latest = {name: self._candidate(name, round_num, t) for name, t in tables.items()}
        for name, candidate in latest.items():
            out.update(view_meta(f"{'local_last' if name == 'local' else name}_", candidate))
        own, own_tables, own_state = self._own(latest.get("local"), tables.get("local"), models, run_id)
        if own is not None:
            out.update(view_meta("local_", own))
            out[meta_keys.eval_key("local_round")] = float(own.round_num)
        if choose:
            offered = {name: c for name, c in latest.items() if eligible_global or name != "global"}
            out.update(self._keep(offered, tables, models, own, own_tables, own_state, round_num, run_id))
        return out

    def _own(
        self, latest: Candidate | None, tables: Tables | None, models: Mapping[str, Any], run_id: str
    ) -> tuple[Candidate | None, Tables | None, dict[str, torch.Tensor] | None]:
        """The early-stopped local-only model after this round, with its tables and weights (stored when new)."""
        if latest is None or tables is None:
            return None, None, None
        if "val" not in tables:  # nothing to stop on: the latest model
            return latest, tables, cpu_state(models["local"])
        stored = self._stored(OWN_STORE, run_id)
        incumbent = None
        if stored is not None:
            incumbent = self._candidate("local", int(stored["round"]), _arrays(stored["tables"]))
        own = early_stopped(incumbent, latest)
        if own is incumbent:
            return own, _arrays(stored["tables"]), stored["state"]
        state = cpu_state(models["local"])
        if self.store is not None:
            record = {"round": own.round_num, "tables": _tensors(tables), "state": state, RUN_KEY: run_id}
            self.store.save(OWN_STORE, record, round_num=own.round_num)
        return own, tables, state

    def _keep(
        self,
        latest: Mapping[str, Candidate],
        tables: Mapping[str, Tables],
        models: Mapping[str, pl.LightningModule],
        own: Candidate | None,
        own_tables: Tables | None,
        own_state: Mapping[str, torch.Tensor] | None,
        round_num: int,
        run_id: str,
    ) -> dict[str, float]:
        federated = [latest[name] for name in ("global", "personal") if name in latest]
        challengers = list(federated)
        states: dict[int, Any] = {id(c): cpu_state(models[c.kind]) for c in federated}
        candidate_tables: dict[int, Tables] = {id(c): tables[c.kind] for c in federated}
        if own is not None and own_tables is not None and federated:
            fed = min(federated, key=lambda c: c.val_loss)
            for weight in MIXTURE_WEIGHTS:
                mixed = mixture_scores(own_tables, tables[fed.kind], weight)
                mixture = self._candidate("mixture", round_num, mixed, weight)
                challengers.append(mixture)
                states[id(mixture)] = {"own": dict(own_state or {}), "federated": states[id(fed)], "weight": weight}
                candidate_tables[id(mixture)] = mixed
        stored = self._stored(KEPT_STORE, run_id)
        if stored is not None and stored["kind"] != "local":  # an earlier federated choice stays a challenger
            earlier = self._candidate(stored["kind"], int(stored["round"]), _arrays(stored["tables"]))
            earlier.weight = stored.get("weight")
            challengers.append(earlier)
            states[id(earlier)], candidate_tables[id(earlier)] = stored["state"], _arrays(stored["tables"])
        kept = keep(own, challengers, self.margin)
        is_own = kept is own
        if is_own:
            states[id(kept)], candidate_tables[id(kept)] = dict(own_state or {}), own_tables or {}
        if self.store is not None:
            record = {
                "kind": kept.kind,
                "round": kept.round_num,
                "weight": kept.weight,
                "tables": _tensors(candidate_tables[id(kept)]),
                "state": states[id(kept)],
                RUN_KEY: run_id,
            }
            self.store.save(KEPT_STORE, record, round_num=round_num)
        out = view_meta("kept_", kept)
        out[meta_keys.eval_key("kept_candidate")] = float(KINDS.index(kept.kind))
        out[meta_keys.eval_key("kept_round")] = float(kept.round_num)
        out[meta_keys.eval_key("kept_own")] = float(is_own)
        if kept.weight is not None:
            out[meta_keys.eval_key("kept_weight")] = float(kept.weight)
        if own is not None:
            out.update(gain_meta(kept, own))
        return out


def _tensors(tables: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(table, dtype=np.float64)) for name, table in tables.items()}


def _arrays(tables: Mapping[str, Any]) -> Tables:
    return {
        name: np.asarray(table.numpy() if isinstance(table, torch.Tensor) else table, dtype=np.float64)
        for name, table in tables.items()
    }


__all__ = ["KEPT_STORE", "OWN_STORE", "KeptModel", "gain_meta", "view_meta"]
