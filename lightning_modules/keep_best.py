"""Every candidate model a site has, scored on its test split, and the one it keeps (``--keep best``).

The candidates of a round (`CANDIDATES`; ``eval.kept_candidate`` is the index into it):

0. ``global``: the global model the site received this round (scored before its training, as ``eval.<metric>``);
1. ``personal``: the site's personal model after the round's local work: the fine-tuned copy (``--finetune-epochs``),
   Ditto's v_i, or FedPer/FedBN/FedRep's trained module with the site's own entries (whichever the job has); on
   the classifier path (below), an algorithm without a personal model offers its round's trained model (the
   received global model after the site's local epochs: the global model fine-tuned on the site, selected over
   rounds on validation like every candidate);
2. ``local``: the local-only model (``--local-baseline``, lightning_modules/local_baseline.py).

With a test split (``--site-test-fraction``, or a user data module's ``test_dataloader`` with the module's
``test_step``) every candidate the site has is scored on it each round: ``eval.global_<test metric>``,
``eval.personal_<test metric>``, ``eval.local_<test metric>`` (built-in: ``test_accuracy``, ``test_loss``; a user
module: the names its ``test_step`` logs).

``--keep best`` (default ``last``: the site keeps nothing itself, as before) makes the site keep, every round, the
candidate whose **validation** score is best (`choose`): the metric ``--keep-metric`` (default ``val_loss``;
lower is better for names containing loss or error, higher otherwise). Validation loss by default because it is a
continuous, proper score: on validation splits of a hundred samples accuracy moves in steps of a point and ties
often, and a model that is confidently wrong is penalised. Ties, and candidates whose score is missing or not
finite, go to the earlier candidate in the order above: the global model is kept unless something is strictly
better on validation. The kept model (its whole state_dict, its candidate name and the round) is written to the
site's private state store (``kept_model``), never sent, and is scored only on the test split, which selected
nothing: ``eval.kept_<test metric>`` and ``eval.kept_<selection metric>``.

With the local-only model on, the site also reports how sure its gain over training alone is, on the same test
samples: per sample, kept correct minus local correct (1, 0 or -1), their mean and the standard error of that mean
(`paired_difference`): ``eval.kept_minus_local_test_accuracy`` and ``eval.kept_minus_local_test_accuracy_se``.
Per-sample correctness needs batches ``(x, y)`` with integer labels and a module whose forward returns class logits
(the built-in classifier, the genomics models); for other modules these two are left out.

Under DP-SGD all of these are ``eval.*`` scores: they stay at the site unless the job releases them
(``--dp-release-site-scores``). Scoring runs on copies with fresh single-process Trainers under forked random
streams: the round's training and the result it sends are the same bits with and without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import ClientAlgorithmError
from lightning_modules.kept_model import KEPT_STORE, KeptModel
from lightning_modules.local_baseline import LocalBaseline, local_seed, matched_steps
from lightning_modules.personal_scores import own_random_stream, single_process_trainer, site_copy, with_weights
from lightning_modules.site_choice import DEFAULT_MARGIN, KINDS, lower_is_better, paired_mean_se
from lightning_modules.split_scores import SplitBatches, classifier_batches, log_probs
from lightning_modules.state_store import ClientStateStore

#: The candidates in preference order (ties go to the earlier); ``eval.kept_candidate`` is the index (3: the mixture of
#: the own and the federated model, lightning_modules/site_choice.py).
CANDIDATES = KINDS
KEPT_MINUS_LOCAL = "kept_minus_local_test_accuracy"
Scorer = Callable[[pl.LightningModule], dict[str, float]]


def choose(scores: Mapping[str, float | None], metric: str) -> str:
    """The candidate of ``scores`` (name -> validation score) to keep: the best finite score, ties and missing or
    non-finite scores going to the earlier candidate of `CANDIDATES`. ``scores`` must hold ``global``."""
    if "global" not in scores:
        raise ValueError("keep best: the global model is always a candidate")
    sign = 1.0 if lower_is_better(metric) else -1.0
    best = "global"
    for name in CANDIDATES[1:]:
        value, incumbent = scores.get(name), scores.get(best)
        if value is None or not math.isfinite(value):
            continue
        if incumbent is None or not math.isfinite(incumbent) or sign * value < sign * incumbent:
            best = name
    return best


#: Mean and standard error of a per-sample paired difference (kept minus local-only correctness).
paired_difference = paired_mean_se


def prefixed(prefix: str, scores: Mapping[str, float]) -> dict[str, float]:
    """``eval.<prefix><metric>`` for every metric."""
    return {meta_keys.eval_key(prefix + name): float(value) for name, value in scores.items()}


def scores_on_test(module: pl.LightningModule, trainer: pl.Trainer, **data: Any) -> dict[str, float]:
    """``trainer.test`` of ``module`` (``data``: ``dataloaders=`` or ``datamodule=``), its scalar metrics."""
    with own_random_stream():
        results = trainer.test(module, verbose=False, **data)
    return {name: float(value) for name, value in (results[0] if results else {}).items()}


def sample_correct(
    module: pl.LightningModule, batches: Iterable[Any], transfer: Callable[[Any], Any] | None = None
) -> np.ndarray | None:
    """Per test sample, whether ``module`` classifies it right (fp32 forward in eval mode); ``None`` when the batches
    are not ``(x, y)`` with integer labels or the module's output is not ``(N, classes)`` logits."""
    split = classifier_batches(batches, transfer)
    table = None if split is None else log_probs(module, split)
    return None if table is None else table.argmax(axis=1) == split.labels


@dataclass
class SiteCandidates:
    """A site's candidates each round (module docstring): the site round hands over the received model and any
    fine-tuned copy; `end_round` (called by the algorithm callback at the end of the fit, before the result is
    sent) trains the local-only model, scores every candidate on the test split, keeps the best."""

    site: str
    site_index: int
    seed: int
    keep: str = "last"
    keep_metric: str = "val_loss"
    score_val: Scorer | None = None
    score_test: Scorer | None = None
    correct: Callable[[pl.LightningModule], np.ndarray | None] | None = None
    local: LocalBaseline | None = None
    store: ClientStateStore | None = None
    received: pl.LightningModule | None = field(default=None, repr=False)
    finetuned: pl.LightningModule | None = field(default=None, repr=False)
    finetune_steps: int = 0
    #: The classifier path (module docstring): the splits read once (``val``, ``test``, ``pooled``); ``None``: the
    #: Lightning path above.
    splits: dict[str, SplitBatches] | None = field(default=None, repr=False)
    #: Reads ``splits`` at the first round's end (a user's data module is set up by then); ``None``: nothing to read.
    split_source: Callable[[], dict[str, SplitBatches | None]] | None = field(default=None, repr=False)
    margin: float = DEFAULT_MARGIN
    #: The split the own and the kept model are chosen on (``keep_view``: site_choice.SELECT_SPLITS); other than
    #: ``val``, the classifier path only.
    select: str = "val"
    #: False under partial sharing (FedPer, FedBN, FedRep): the received model carries the server's copy of the
    #: site's own entries (the initial head), a model no site would use.
    global_eligible: bool = True

    @property
    def active(self) -> bool:
        classifier_path = self.splits is not None or self.split_source is not None
        return self.score_test is not None or self.local is not None or self.keep == "best" or classifier_path

    def begin_round(self, module: pl.LightningModule) -> None:
        """The received model (in ``module`` once it was loaded and scored), copied before training moves it."""
        self.received = site_copy(module) if self.active else None

    def hand_over(self, tuned: pl.LightningModule) -> None:
        """The round's fine-tuned copy (lightning_modules/finetune.py) is its personal candidate; the optimizer steps
        it took count in the local-only model's matched compute."""
        self.finetuned, self.finetune_steps = tuned, int(getattr(tuned, "__fl_steps__", 0))

    def end_round(
        self,
        meta: Mapping[str, Any],
        round_meta: Mapping[str, Any],
        module: pl.LightningModule,
        personal_weights: Mapping[str, torch.Tensor] | None,
    ) -> dict[str, float]:
        """The round's candidate meta (``eval.local_*``, ``eval.*_test_*``, ``eval.kept_*``); ``module`` is the
        trained module, ``personal_weights`` what the algorithm's personal model loads into a copy of it (Ditto's
        v_i; ``{}`` for partial sharing: the module itself; ``None``: no personal model from the algorithm)."""
        personal = None if personal_weights is None else with_weights(module, personal_weights)
        round_num = int(round_meta.get(meta_keys.ROUND, 0) or 0)
        run_id = str(round_meta.get(meta_keys.RUN_ID, ""))
        models = {"global": self.received, "personal": self.finetuned or personal}
        out: dict[str, float] = {}
        if self.local is not None:
            steps = matched_steps(meta, self.finetune_steps)
            models["local"] = self.local.train(
                round_num, run_id, steps, local_seed(self.seed, self.site_index, round_num)
            )
        present = {name: model for name, model in models.items() if model is not None}
        if self.split_source is not None and self.keep_metric == "val_loss":  # it selects on the cross-entropy
            read, self.split_source = self.split_source(), None
            # The classifier path needs validation batches of (x, integer y); anything else scores with Lightning.
            self.splits = {k: v for k, v in read.items() if v is not None} if read.get("val") is not None else None
            if self.select not in (self.splits or {}):
                self.splits = self._unselectable()
        if self.splits is not None:
            # Without a personal model of its own (FedAvg, SCAFFOLD, ...), the site's personal candidate is its
            # round's trained model: the received global model after this round's local epochs on the site's data
            # (fine-tuned, chosen over rounds on validation like every candidate). It is scored in place (the scorer
            # restores its mode and draws on a forked stream), never trained more, and not copied for it.
            trained = {} if "personal" in present else {"personal": module}
            chosen = self._classifier_round({**present, **trained}, round_num, run_id)
            if chosen is not None:
                self.received = self.finetuned = None
                self.finetune_steps = 0
                return chosen
        if self.local is not None and self.score_val is not None:
            out.update(prefixed("local_", self.score_val(models["local"])))
        tests = {name: self.score_test(model) for name, model in present.items()} if self.score_test else {}
        for name, scores in tests.items():
            out.update(prefixed(f"{name}_", scores))
        if self.keep == "best" and "global" in present:
            out.update(self._keep(present, tests, {**meta, **out}, round_num, run_id))
        self.received = self.finetuned = None
        self.finetune_steps = 0
        return out

    def _classifier_round(
        self, models: Mapping[str, pl.LightningModule], round_num: int, run_id: str
    ) -> dict[str, float] | None:
        """The classifier path (lightning_modules/kept_model.py); ``None`` (and the Lightning path from now on)
        when a model's forward is not a classifier's."""
        chooser = KeptModel(self.store, self.splits or {}, self.margin, self.site, self.select)
        choose = self.keep == "best" and self.select in chooser.splits
        out = chooser.round(models, round_num, run_id, choose, eligible_global=self.global_eligible)
        if out is None:
            self.splits = None if self.select == "val" else self._unselectable()
        return out

    def _unselectable(self) -> None:
        """Only the classifier path chooses on another split than ``val``: elsewhere the choice cannot be made."""
        if self.select == "val":
            return None
        raise ClientAlgorithmError(
            f"{self.site}: keep_view 'pooled' chooses on the {self.select} split, scored per sample from a "
            "classifier's logits on (x, integer label) batches; this site's model or that split is not one: set "
            "keep_view own"
        )

    def _keep(
        self,
        models: Mapping[str, pl.LightningModule],
        tests: Mapping[str, Mapping[str, float]],
        meta: Mapping[str, Any],
        round_num: int,
        run_id: str,
    ) -> dict[str, float]:
        prefix = {"global": "", "personal": "personal_", "local": "local_"}
        val = {name: meta.get(meta_keys.eval_key(prefix[name] + self.keep_metric)) for name in models}
        if val["global"] is None:  # a name the validation never logs would keep the global model silently
            prefixes = (*(f"{name}_" for name in CANDIDATES), "kept_")
            logged = sorted(
                name for key in meta if (name := meta_keys.eval_metric(key)) and not name.startswith(prefixes)
            )
            raise ClientAlgorithmError(
                f"{self.site}: keep best selects on validation metric {self.keep_metric!r}, which the site's "
                f"validation did not log (it logged {logged}); give --keep-metric one of them"
            )
        kept = choose(val, self.keep_metric)
        out = {meta_keys.eval_key("kept_candidate"): float(CANDIDATES.index(kept))}
        if val[kept] is not None:
            out[meta_keys.eval_key("kept_" + self.keep_metric)] = float(val[kept])
        out.update(prefixed("kept_", tests.get(kept, {})))
        if "local" in models and self.correct is not None:
            kept_right, local_right = self.correct(models[kept]), self.correct(models["local"])
            if kept_right is not None and local_right is not None:
                mean, se = paired_difference(kept_right, local_right)
                out[meta_keys.eval_key(KEPT_MINUS_LOCAL)] = mean
                out[meta_keys.eval_key(KEPT_MINUS_LOCAL + "_se")] = se
        if self.store is not None:
            state: dict[str, Any] = {key: value.detach().cpu() for key, value in models[kept].state_dict().items()}
            state.update({"__candidate__": kept, "__run_id__": run_id})
            self.store.save(KEPT_STORE, state, round_num=round_num)
        return out


def module_scorer(precision: Any, accelerator: str, stage: str, **data: Any) -> Scorer:
    """Scores a module on the site's validation (``stage="validate"``) or test split with a fresh Trainer."""
    from lightning_modules.personal_scores import validation_scores

    def score(module: pl.LightningModule) -> dict[str, float]:
        trainer = single_process_trainer(precision, accelerator)
        return (validation_scores if stage == "validate" else scores_on_test)(module, trainer, **data)

    return score


__all__ = [
    "CANDIDATES",
    "KEPT_MINUS_LOCAL",
    "KEPT_STORE",
    "SiteCandidates",
    "choose",
    "lower_is_better",
    "module_scorer",
    "paired_difference",
    "sample_correct",
    "scores_on_test",
]
