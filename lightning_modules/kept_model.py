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
   stored (`KEPT_STORE`), unless the store holds that model already (`already_stored`: kept again, no write).

Reported (``eval.`` keys; ``<view>`` is ``test`` and, with a pooled test set, ``pooled_test``):

- ``{global,personal,local_last}_<view>_{accuracy,loss}``: the round's models;
- ``local_<view>_*``, ``local_val_*``, ``local_round``: the own model (what the site would keep alone);
- ``kept_<view>_*``, ``kept_val_*``, ``kept_candidate`` (index into keep_best.CANDIDATES), ``kept_round``,
  ``kept_weight`` (the federated model's share, mixtures only), ``kept_own`` (1: the own model, gain 0 by
  construction);
- ``kept_minus_local_<view>_accuracy`` and ``..._se``: per-sample paired difference on that view.

With ``keep_view pooled`` (``select`` ``pooled_val``) steps 2 and 4 compare losses on the pooled validation split
instead of the site's own: every model's ``pooled_val_*`` scores are reported beside the others and
``kept_on_pooled_val`` is 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from aggregators.contracts import meta_keys
from lightning_modules.site_choice import (
    KINDS,
    MIXTURE_WEIGHTS,
    Candidate,
    early_stopped,
    keep,
    mixture_scores,
    paired_mean_se,
    scores_from_tables,
)
from lightning_modules.split_scores import SplitBatches, model_tables
from lightning_modules.state_store import ClientStateStore

OWN_STORE = "local_best"
KEPT_STORE = "kept_model"
#: Benchmark instrumentation (benchmarks/keep_rule_study.py): where set, every site writes each round's split tables
#: and labels to ``<dir>/<run id>/<site>_r<round>.npz`` so that keep rules can be replayed offline. Off by default;
#: the tables stay on the machine that runs the site (a simulation), nothing is sent.
RECORD_ENV = "FL_RECORD_CANDIDATE_TABLES"
RUN_KEY = "__run_id__"
#: Reported views: the split name in the tables -> the name in the meta.
VIEWS = {"test": "test", "pooled": "pooled_test"}

Tables = dict[str, np.ndarray]


def view_meta(prefix: str, candidate: Candidate) -> dict[str, float]:
    """``eval.<prefix><view>_{accuracy,loss}`` for every reported view the candidate was scored on, and its
    validation scores as ``eval.<prefix>val_*``."""
    out = {}
    for split, view in (("val", "val"), ("pooled_val", "pooled_val"), *VIEWS.items()):
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

    def __init__(
        self,
        store: ClientStateStore | None,
        splits: Mapping[str, SplitBatches],
        margin: float,
        site: str = "",
        select: str = "val",
    ) -> None:
        self.store, self.splits, self.margin, self.site = store, dict(splits), margin, site
        self.select = select  # the split both the own and the kept model are chosen on (site_choice.SELECT_SPLITS)
        self.labels = {name: batches.labels for name, batches in self.splits.items()}

    def record(self, tables: Mapping[str, Tables], round_num: int, run_id: str) -> None:
        """Writes the round's tables where `RECORD_ENV` names a folder (benchmarks only; module constant)."""
        folder = os.environ.get(RECORD_ENV)
        if not folder:
            return
        target = Path(folder) / (run_id or "run")
        target.mkdir(parents=True, exist_ok=True)
        arrays = {f"{name}__{split}": t.astype(np.float32) for name, by in tables.items() for split, t in by.items()}
        arrays.update({f"labels__{split}": y for split, y in self.labels.items()})
        np.savez_compressed(target / f"{self.site or 'site'}_r{round_num}.npz", **arrays)

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
        return candidate_of(kind, round_num, tables, self.labels, weight)

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
        self.record(tables, round_num, run_id)
        out: dict[str, float] = {}
        latest = {
            name: Offer(self._candidate(name, round_num, t), t, models[name].state_dict) for name, t in tables.items()
        }
        for name, offer in latest.items():
            out.update(view_meta(f"{'local_last' if name == 'local' else name}_", offer.candidate))
        own = self._own(latest.get("local"), run_id)
        if own is not None:
            out.update(view_meta("local_", own.candidate))
            out[meta_keys.eval_key("local_round")] = float(own.candidate.round_num)
        if choose:
            federated = [latest[name] for name in ("global", "personal") if name in latest]
            if not eligible_global:
                federated = [offer for offer in federated if offer.candidate.kind != "global"]
            out.update(self._keep(federated, own, round_num, run_id))
        return out

    def _own(self, latest: Offer | None, run_id: str) -> Offer | None:
        """The early-stopped local-only model after this round (stored when new)."""
        if latest is None or self.select not in latest.tables:  # nothing to stop on: the latest model
            return latest
        stored = self._stored(OWN_STORE, run_id)
        incumbent = None if stored is None else self._stored_offer("local", stored)
        own = latest if incumbent is None else early_stopped_offer(incumbent, latest, self.select)
        if own is latest and self.store is not None:
            record = {"round": own.candidate.round_num, "tables": _tensors(own.tables), "state": own.weights()}
            self.store.save(OWN_STORE, {**record, RUN_KEY: run_id}, round_num=own.candidate.round_num)
        return own

    def _stored_offer(self, kind: str, stored: Mapping[str, Any]) -> Offer:
        tables = _arrays(stored["tables"])
        candidate = self._candidate(kind, int(stored["round"]), tables, stored.get("weight"))
        return Offer(candidate, tables, lambda: stored["state"], from_store=True)

    def _keep(self, federated: list[Offer], own: Offer | None, round_num: int, run_id: str) -> dict[str, float]:
        """Choose among the own model and the challengers (module docstring, step 3), store and report the kept one."""
        stored = self._stored(KEPT_STORE, run_id)
        # The own model kept earlier is no challenger (`challengers`): its stored copy is not read back for nothing.
        earlier = None if stored is None or stored["kind"] == "local" else self._stored_offer(stored["kind"], stored)
        challengers = round_challengers(own, federated, earlier, round_num, self.labels, self.select)
        own_candidate = None if own is None else own.candidate
        kept = keep(own_candidate, [c.candidate for c in challengers], self.margin, self.select)
        chosen = (
            own if own is not None and kept is own.candidate else next(c for c in challengers if c.candidate is kept)
        )
        if self.store is not None and not already_stored(stored, chosen):
            record = {"kind": kept.kind, "round": kept.round_num, "weight": kept.weight, "state": chosen.weights()}
            self.store.save(
                KEPT_STORE, {**record, "tables": _tensors(chosen.tables), RUN_KEY: run_id}, round_num=round_num
            )
        out = view_meta("kept_", kept)
        out[meta_keys.eval_key("kept_candidate")] = float(KINDS.index(kept.kind))
        out[meta_keys.eval_key("kept_round")] = float(kept.round_num)
        out[meta_keys.eval_key("kept_own")] = float(chosen is own)
        if kept.weight is not None:
            out[meta_keys.eval_key("kept_weight")] = float(kept.weight)
        if self.select != "val":
            out[meta_keys.eval_key(f"kept_on_{self.select}")] = 1.0
        if own is not None:
            out.update(gain_meta(kept, own.candidate))
        return out


@dataclass
class Offer:
    """A candidate with its split tables and its weights, read only for the model that is stored (a state_dict;
    the state store copies it to the CPU when it writes)."""

    candidate: Candidate
    tables: Tables
    weights: Callable[[], Any]
    #: Read back from the state store (the kept or the own model of an earlier round), not built this round.
    from_store: bool = False


def already_stored(stored: Mapping[str, Any] | None, chosen: Offer) -> bool:
    """Whether the stored kept model (`KEPT_STORE`'s record of this run, or ``None``) is ``chosen`` already, so that
    writing it again would store the same model: ``chosen`` was read back from the store, and the record names the
    same kind, round and weight with the same tables bit for bit. A model built this round is always written."""
    if stored is None or not chosen.from_store:
        return False
    c = chosen.candidate
    if (stored["kind"], int(stored["round"]), stored.get("weight")) != (c.kind, c.round_num, c.weight):
        return False
    tables = _arrays(stored["tables"])
    return tables.keys() == chosen.tables.keys() and all(np.array_equal(tables[k], chosen.tables[k]) for k in tables)


def candidate_of(
    kind: str, round_num: int, tables: Tables, labels: Mapping[str, np.ndarray], weight: float | None = None
) -> Candidate:
    """A candidate scored from its split tables and the splits' labels."""
    return Candidate(kind, round_num, scores_from_tables(tables, labels), weight)


def mixture_offer(own: Offer, fed: Offer, weight: float, round_num: int, labels: Mapping[str, np.ndarray]) -> Offer:
    """``(1 - weight) p_own + weight p_fed``; its stored weights are both models' and the weight."""
    tables = mixture_scores(own.tables, fed.tables, weight)
    candidate = candidate_of("mixture", round_num, tables, labels, weight)
    return Offer(candidate, tables, lambda: {"own": own.weights(), "federated": fed.weights(), "weight": weight})


def round_challengers(
    own: Offer | None,
    federated: Sequence[Offer],
    earlier: Offer | None,
    round_num: int,
    labels: Mapping[str, np.ndarray],
    select: str = "val",
) -> list[Offer]:
    """The round's challengers of the own model (module docstring, step 3): the federated models, their mixtures
    with the own model (the federated one best on the ``select`` split) at `MIXTURE_WEIGHTS`, and ``earlier``, the
    model kept so far, when it was a federated one."""
    out = list(federated)
    if own is not None and federated:
        fed = min(federated, key=lambda offer: offer.candidate.scores.loss(select))
        out += [mixture_offer(own, fed, weight, round_num, labels) for weight in MIXTURE_WEIGHTS]
    if earlier is not None and earlier.candidate.kind != "local":
        out.append(earlier)
    return out


def early_stopped_offer(incumbent: Offer, latest: Offer, split: str = "val") -> Offer:
    """`site_choice.early_stopped` over offers, on the validation ``split``."""
    return latest if early_stopped(incumbent.candidate, latest.candidate, split) is latest.candidate else incumbent


def _tensors(tables: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(np.ascontiguousarray(table, dtype=np.float64)) for name, table in tables.items()}


def _arrays(tables: Mapping[str, Any]) -> Tables:
    return {
        name: np.asarray(table.numpy() if isinstance(table, torch.Tensor) else table, dtype=np.float64)
        for name, table in tables.items()
    }


__all__ = [
    "KEPT_STORE",
    "OWN_STORE",
    "KeptModel",
    "Offer",
    "candidate_of",
    "early_stopped_offer",
    "gain_meta",
    "round_challengers",
    "view_meta",
]
