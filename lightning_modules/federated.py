"""Client algorithms on any LightningModule: one Lightning callback, used together with NVFlare's ``flare.patch``.

    from lightning_modules.federated import FederatedAlgorithm

    callback = FederatedAlgorithm("scaffold", site=flare.get_site_name(), state_store=store)
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback])   # the callback before NVFlare's, which patch appends
    flare.patch(trainer, restore_state=False)
    trainer.fit(my_module, datamodule=my_data)                  # the user's own module, optimizer and data

Where each hook of `lightning_modules.algorithms.base.ClientAlgorithm` runs:

- ``on_round_start``: at the first training epoch of the fit; NVFlare's FLCallback has loaded the global weights
  (its ``on_train_start``) and the server meta of the round is read from NVFlare;
- ``on_batch``: Lightning's ``on_train_batch_start``, with the batch ``training_step`` receives (the algorithms that
  evaluate the task loss at other weights take their batch from here, not from the module's ``training_step``);
- ``correct_gradients``: Lightning's ``on_before_optimizer_step``, i.e. after backward (and after gradient
  accumulation) and before gradient clipping and the optimizer step. It adds the algorithm's gradient term to
  ``.grad``, so a callback placed after this one sees the corrected gradient. The one fused fast path: a term
  linear in the weights (FedProx, FedDyn; ``ClientAlgorithm.linear_term``) is folded into a plain SGD step
  (one pass on the weights instead of two on ``.grad``) when no later callback and no module hook overrides
  ``on_before_optimizer_step`` (`lightning_modules.algorithms.kernels.gradient_observers`), and by the same decision
  (``ClientAlgorithm.fused_step_allowed``) SCAFFOLD's c - c_i is applied after such a step; ``fuse_plain_sgd=False``
  turns it off;
- ``after_step``: a post-step hook on the module's optimizer (``torch.optim.Optimizer.register_step_post_hook``), so
  it runs once per step that was taken, whatever optimizer the module configures;
- ``loss_terms`` (MOON): only a module can add to its own loss. A module used with such an algorithm calls
  `algorithm_loss` in ``training_step`` and adds the result; the callback refuses to go on after the first
  step if it did not;
- the global model's scores on the site's validation split, when ``trainer.validate`` runs before ``trainer.fit``
  (NVFlare's FLCallback loads the received weights for it): sent as ``eval.<metric>`` meta;
- the site's personal model (docs/personalization.md, "Scores at the sites"), at the end of the fit, after the round's
  local work and before NVFlare sends the result: the ``personal_weights`` of an algorithm that declares
  a personal model of kind ``weights`` (Ditto's v_i, APFL's mixed model) scored by
  ``personal_scorer``, and scores the site round handed over (`FederatedAlgorithm.add_personal_scores`: local
  fine-tuning), sent as ``eval.personal_<metric>`` meta;
- ``on_round_end``: at the end of the fit; its meta, the round's step count, mean training loss, the trainable keys
  and FedNova's report go to ``pl_module.__fl_meta__``, where NVFlare's FLCallback picks them up.

Gradient-level algorithms (FedAvg, SCAFFOLD Option II, FedProx, FedDyn) need nothing from the module. What the others
need (the task loss at other weights, MOON's representation, a plain SGD optimizer) and what a FedNova server needs
(an optimizer its a_i describes) are declared on their classes and checked by `lightning_modules.protocols`, at
set-up and when the round starts; each refusal says what to add or change. What every algorithm does with
Adam/AdamW, momentum and schedules is in docs/own_model.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.trainer.states import TrainerFn

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import FedNovaReport
from aggregators.fednova import normalizer_l1
from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError, check_server_meta
from lightning_modules.algorithms.kernels import fold_linear_term_, gradient_observers
from lightning_modules.fl_callback import MetaSource, nvflare_meta_source
from lightning_modules.personalization.partial_sharing import LocalEntries, local_entries_for
from lightning_modules.protocols import (  # sgd_step_settings: also imported from here by its users
    module_problem,
    needs_task_loss,
    optimizer_problem,
    sgd_step_settings,
)
from lightning_modules.state_store import ClientStateStore

_ALGORITHM_ATTRIBUTE = "__fl_algorithm__"
#: The personal model's scores travel as ``eval.personal_<metric>`` (lightning_modules/personal_scores.py).
PERSONAL_PREFIX = "personal_"
#: ``personal_scorer(module, weights) -> {metric: value}``: the site's module with ``weights`` loaded, scored on the
#: site's validation split (lightning_modules/personal_scores.py).
PersonalScorer = Callable[[pl.LightningModule, Mapping[str, torch.Tensor]], Mapping[str, float]]
#: Wall seconds of a round's candidate work (lightning_modules/keep_best.py): not in ``train.fit_seconds``.
CANDIDATE_SECONDS = "train.candidate_seconds"
#: Set by the bundle's client script before it runs a user's own training script (``--script``).
CLIENT_ENV, CLIENT_ARGS_ENV = "FEDALG_CLIENT", "FEDALG_CLIENT_ARGS"


def adds_loss_terms(algorithm: ClientAlgorithm) -> bool:
    return type(algorithm).loss_terms is not ClientAlgorithm.loss_terms


def algorithm_loss(module: pl.LightningModule, batch: Any, logits: torch.Tensor) -> torch.Tensor | float:
    """The client algorithm's extra loss for this batch (0 without one): ``loss = task + algorithm_loss(...)``."""
    algorithm = getattr(module, _ALGORITHM_ATTRIBUTE, None)
    if algorithm is None:
        return 0.0
    module.__fl_loss_called__ = True
    extra = algorithm.loss_terms(module, batch, logits)
    # Remembered so that the round's training loss is the task loss alone, as with the bundle's own classifier.
    module.__fl_extra_loss__ = 0.0 if extra is None else float(extra.detach())
    return 0.0 if extra is None else extra


def personal_eval_meta(scores: Mapping[str, float]) -> dict[str, float]:
    """``eval.personal_<metric>`` for every validation metric of the site's personal model."""
    return {meta_keys.eval_key(PERSONAL_PREFIX + name): float(value) for name, value in scores.items()}


def distributed_refusal(algorithm: ClientAlgorithm) -> str | None:
    """Why ``algorithm`` cannot run under DDP (several processes per site), or ``None``.

    DDP averages the gradients of ``loss.backward()`` over the ranks, so every rank takes the same step and the
    gradient-level algorithms (SCAFFOLD Option II, FedProx, FedDyn) and MOON's loss term stay identical on every
    rank. An extra gradient pass on a rank's own batch (FedMoS's previous iterate, SCAFFOLD Option I's full-batch
    gradient) is not averaged: the ranks would drift apart."""
    if needs_task_loss(algorithm):
        return (
            f"client algorithm '{algorithm.name}' takes extra gradient passes on each rank's own batch, which DDP "
            "does not average, so the ranks would drift apart; train this site with devices=1"
        )
    return None


def rank_zero_first(trainer: pl.Trainer, action: Any) -> None:
    """Run ``action`` on global rank 0, then on the other ranks: rank 0 settles the site's state files (commits or
    discards the last round's pending state) before the others read them."""
    if trainer.world_size == 1:
        action()
        return
    if trainer.global_rank != 0:
        trainer.strategy.barrier("fedalg-state-settled")
    action()
    if trainer.global_rank == 0:
        trainer.strategy.barrier("fedalg-state-settled")


def attach_algorithm(module: pl.LightningModule, algorithm: ClientAlgorithm | None) -> None:
    """Make ``algorithm`` the one `algorithm_loss` asks inside the module's ``training_step`` (``None``: none)."""
    setattr(module, _ALGORITHM_ATTRIBUTE, algorithm)


def check_module_protocol(algorithm: ClientAlgorithm, module: pl.LightningModule) -> None:
    """Refuse a module that lacks what ``algorithm`` declares it needs (`lightning_modules.protocols`)."""
    problem = module_problem(algorithm, module)
    if problem:
        raise ClientAlgorithmError(f"{algorithm.site}: {problem}")


def check_round_optimizer(algorithm: ClientAlgorithm, meta: Mapping[str, Any], optimizer: Any) -> None:
    """Refuse, when the round starts, an optimizer the client algorithm or the server's rule (named in the meta)
    cannot work with: otherwise FedNova's report is silently left out and the server rejects every round with a
    message about a missing key, not about the optimizer."""
    from aggregators.registry import RULES

    rule_cls = RULES.get(str(meta.get(meta_keys.AGGREGATION_RULE)))
    problem = optimizer_problem(algorithm, rule_cls, optimizer)
    if problem:
        raise ClientAlgorithmError(f"{algorithm.site}: {problem}")


class FederatedAlgorithm(pl.Callback):
    """Runs a client algorithm inside the fit of any LightningModule (module docstring).

    Args:
        algorithm: a `ClientAlgorithm` or a registered name (``scaffold``, ``fedprox``, ...).
        algorithm_args: hyperparameters when ``algorithm`` is a name.
        site: the site name (errors and state files name it); default: the one the algorithm is bound to.
        state_store: where the algorithm keeps its state between rounds (SCAFFOLD's c_i, FedDyn's H_k, ...);
            default: the one the algorithm is bound to (none: state lives only in memory).
        num_samples: the FedAvg weight sent to the server; default: the size of the training dataset.
        meta_source: where the server meta of the round comes from (NVFlare's received model by default).
        local_keys: state_dict names that never leave the site (``--local-keys`` as the job builder resolved them:
            FedPer's head, FedBN's BatchNorm entries, FedRep's head; docs/personalization.md, "Partial sharing").
        fuse_plain_sgd: allow the one fused fast path (module docstring); False: every correction goes to
            ``.grad``, also where nobody watches it.
    """

    def __init__(
        self,
        algorithm: ClientAlgorithm | str = "fedavg",
        *,
        algorithm_args: Mapping[str, Any] | None = None,
        site: str | None = None,
        state_store: ClientStateStore | None = None,
        num_samples: int | None = None,
        meta_source: MetaSource = nvflare_meta_source,
        local_keys: str | Sequence[str] | None = None,
        privacy: Any = None,
        fuse_plain_sgd: bool = True,
    ) -> None:
        if isinstance(algorithm, str):
            from lightning_modules.algorithms import build_client_algorithm

            algorithm = build_client_algorithm(algorithm, **dict(algorithm_args or {}))
        if isinstance(algorithm, torch.nn.Module):
            raise ClientAlgorithmError("a client algorithm must not be an nn.Module: it would enter the state_dict")
        # An algorithm already bound to its site and store (by the caller) keeps them unless told otherwise.
        site = site or algorithm.site
        algorithm.bind(site, state_store if state_store is not None else algorithm.state_store)
        self.algorithm = algorithm
        self.site = site
        self.num_samples = num_samples
        self.meta_source = meta_source
        self.local_entries = LocalEntries(site, (), algorithm.state_store)
        self._local_keys = local_keys
        #: Sample-level DP-SGD (lightning_modules/privacy/dp_sgd.py ``DPSGD``), or ``None``.
        self.privacy = privacy
        self._round_meta: Mapping[str, Any] = {}
        self.last_meta: dict[str, Any] = {}
        self._site_eval: dict[str, float] = {}
        #: Scores the site's personal model (set by the site round when the site has a validation split).
        self.personal_scorer: PersonalScorer | None = None
        self._personal_eval: dict[str, float] = {}
        #: The site's candidates (lightning_modules/keep_best.py ``SiteCandidates``): the local-only model, test
        #: scores, --keep best; set by the site round, run at the end of the fit, before the result is sent.
        self.candidates: Any = None
        self._reset_round()
        self._step_hook: Any = None
        #: The fused fast path (module docstring); blocked while ``_gradient_observers`` names anyone.
        self.fuse_plain_sgd = fuse_plain_sgd
        self._gradient_observers: list[str] = []

    def _reset_round(self) -> None:
        self._round_started = False
        self._trained_round: Any = None
        self._steps = 0
        self._losses: list[float] = []
        self._solver_steps: list[tuple[float, float, float] | None] = []
        self._fit_started = time.monotonic()

    # -- set-up -------------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_trainer_supports(self.algorithm, trainer, pl_module.automatic_optimization, check_optimizers=False)
            check_module_protocol(self.algorithm, pl_module)
            reason = distributed_refusal(self.algorithm) if trainer.world_size > 1 else None
            if reason:
                raise ClientAlgorithmError(f"{self.site}: {trainer.world_size} DDP processes: {reason}")
            attach_algorithm(pl_module, self.algorithm)
            self.local_entries = local_entries_for(self.algorithm, pl_module, self._local_keys)
            if self.privacy is not None:
                self.privacy.check_setup(trainer, pl_module, self.algorithm)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_trainer_supports(self.algorithm, trainer, pl_module.automatic_optimization)
        extra_epochs = self.algorithm.extra_epochs()  # FedRep's head phase precedes the job's epochs
        if extra_epochs and trainer.max_epochs is not None:
            trainer.fit_loop.max_epochs = trainer.max_epochs + int(extra_epochs)
        self._remove_step_hook()
        optimizer = trainer.optimizers[0]
        self._step_hook = optimizer.register_step_post_hook(lambda opt, *_: self.after_optimizer_step(pl_module, opt))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset_round()
        pl_module.__fl_loss_called__ = False

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._round_started:  # after NVFlare's FLCallback loaded the global weights (on_train_start)
            # Under DDP only rank 0 talks to NVFlare: every rank starts the round from rank 0's meta.
            meta = self.meta_source() if trainer.global_rank == 0 else None
            if trainer.world_size > 1:
                meta = trainer.strategy.broadcast(meta, src=0)
            check_server_meta(self.algorithm, meta, self.site)
            check_round_optimizer(self.algorithm, meta, trainer.optimizers[0])
            if self.algorithm.state_store is not None:  # a per-run store follows the server's run id
                self.algorithm.state_store.use_run(meta.get(meta_keys.RUN_ID))
            rank_zero_first(trainer, lambda: self._start_round(pl_module, meta))
            if self.privacy is not None:  # after the algorithm copied what it keeps: no copy carries Opacus's hooks
                self.privacy.start_round(trainer, pl_module, meta)
            self._trained_round = meta.get(meta_keys.ROUND)
            self._gradient_observers = gradient_observers(trainer, pl_module, self)  # NVFlare's handlers are set now
            self.algorithm.fused_step_allowed = self.fuse_plain_sgd and not self._gradient_observers
            self._round_started = True

    def _start_round(self, pl_module: pl.LightningModule, meta: Mapping[str, Any]) -> None:
        """The site's own local entries over the received ones first, so the algorithm starts from the model the
        site trains (docs/personalization.md, "Partial sharing")."""
        self._round_meta = meta
        if self.candidates is not None and self.candidates.active:  # the received model, before anything moves it
            self.candidates.begin_round(pl_module)
            self.candidates.global_eligible = not self.local_entries
        if self.local_entries:
            self.local_entries.restore(pl_module, meta)
        self.algorithm.on_round_start(pl_module, meta)

    # -- per step -----------------------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self.algorithm.on_batch(pl_module, batch)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self.privacy is not None:  # the noisy gradient first: the algorithm's correction is post-processing
            self.privacy.privatize()
        if not self._fold_linear_term(pl_module, optimizer):
            self.algorithm.correct_gradients(pl_module, optimizer)

    def _fold_linear_term(self, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> bool:
        """The fused fast path: the algorithm's whole correction is a linear term (it keeps the base
        ``correct_gradients``), nobody watches the gradient, and the coming step is plain SGD (kernels.py)."""
        if not self.algorithm.fused_step_allowed:
            return False
        if type(self.algorithm).correct_gradients is not ClientAlgorithm.correct_gradients:
            return False
        term = self.algorithm.linear_term()
        return term is not None and fold_linear_term_(pl_module, optimizer, term)

    def after_optimizer_step(self, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        """Runs once per optimizer step taken (a post-step hook on the module's optimizer)."""
        self._steps += 1
        self._solver_steps.append(sgd_step_settings(optimizer))
        self.algorithm.after_step(pl_module, optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self._losses.append(float(loss.detach()) - getattr(pl_module, "__fl_extra_loss__", 0.0))
        pl_module.__fl_extra_loss__ = 0.0
        if adds_loss_terms(self.algorithm) and not getattr(pl_module, "__fl_loss_called__", False):
            raise ClientAlgorithmError(
                f"{self.site}: client algorithm '{self.algorithm.name}' adds a term to the training loss; "
                f"{type(pl_module).__name__}.training_step must return loss + "
                "lightning_modules.federated.algorithm_loss(self, batch, logits)"
            )

    # -- evaluation of the received global model ----------------------------------------------------------------
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Only an explicit trainer.validate before fit scores the received global model (not in-fit validation).
        if trainer.state.fn == TrainerFn.VALIDATING and not self._round_started:
            self._site_eval = {
                meta_keys.eval_key(name): float(value)
                for name, value in trainer.callback_metrics.items()
                if isinstance(value, torch.Tensor) and value.numel() == 1
            }

    def forget_site_eval(self) -> None:
        """Drop the scores of the last ``trainer.validate`` (it scored a model outside a round)."""
        self._site_eval = {}

    # -- the site's personal model -------------------------------------------------------------------------------
    def add_personal_scores(self, scores: Mapping[str, float]) -> None:
        """Scores of a personal model the site round built itself (local fine-tuning), sent with this round's
        result as ``eval.personal_<metric>``."""
        self._personal_eval.update(personal_eval_meta(scores))

    def add_site_scores(self, scores: Mapping[str, float]) -> None:
        """Other site-evaluation values of this round (``eval.finetune_best_epoch``), sent as ``eval.<name>``."""
        self._personal_eval.update({meta_keys.eval_key(name): float(value) for name, value in scores.items()})

    def _personal_meta(self, pl_module: pl.LightningModule) -> dict[str, float]:
        """The round's ``eval.personal_*`` meta: handed-over scores, and the algorithm's personal weights scored."""
        meta, self._personal_eval = self._personal_eval, {}
        options = self.algorithm.personal_options(pl_module) if self.personal_scorer is not None else None
        if options:  # one method at several strengths: the site keeps what its validation prefers
            from lightning_modules.personalization.strength import preferred
            from lightning_modules.site_choice import lower_is_better

            scored = {option: self.personal_scorer(pl_module, weights) for option, weights in options.items()}
            metric = getattr(self.candidates, "keep_metric", "val_loss")
            option = preferred(scored, metric, lower_is_better(metric))
            meta.update(self.algorithm.choose_personal(option))
            return {**meta, **personal_eval_meta(scored[option])}
        weights = self._personal_weights(pl_module)
        if weights is not None and self.personal_scorer is not None:
            meta.update(personal_eval_meta(self.personal_scorer(pl_module, weights)))
        return meta

    def _personal_weights(self, pl_module: pl.LightningModule) -> Mapping[str, torch.Tensor] | None:
        """What the algorithm's personal model loads into a copy of the trained module (``None``: it has none)."""
        # Declared, not guessed: only an algorithm whose personal model is of kind "weights" returns any (base.py).
        declared = self.algorithm.personal_model
        weights = self.algorithm.personal_weights(pl_module) if declared and declared.kind == "weights" else None
        if weights is None and self.local_entries:
            # Partial sharing (FedPer, FedBN, FedRep): the personal model is the trained module itself, its shared
            # entries with the site's own local ones; no weights to load into the scored copy.
            weights = {}
        return weights

    # -- round end ----------------------------------------------------------------------------------------------
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._remove_step_hook()
        self._round_started = False  # the next trainer.validate scores the next round's global model
        meta: dict[str, Any] = {
            meta_keys.NUM_STEPS: self._steps,
            meta_keys.TRAIN_LOSS: self._mean_loss(trainer, pl_module),
            meta_keys.CLIENT_ALGORITHM: self.algorithm.name,
            meta_keys.PARAM_KEYS: [
                name
                for name, p in pl_module.named_parameters()
                if p.requires_grad and name not in self.local_entries.keys
            ],
            **fednova_meta(self.algorithm, self._solver_steps),
        }
        algorithm_meta = self.algorithm.on_round_end(pl_module)
        bad_keys = [k for k in algorithm_meta if not meta_keys.is_namespaced(k) or k in meta_keys.NVFLARE_RESERVED]
        if bad_keys:
            raise ClientAlgorithmError(
                f"client algorithm '{self.algorithm.name}' returned meta keys {bad_keys} that are not namespaced "
                "'<algorithm>.<name>' keys or are reserved by NVFlare's built-in handlers"
            )
        meta.update(algorithm_meta)
        meta.update(module_round_metrics(pl_module))
        meta.update(self._site_eval)
        self._site_eval = {}
        meta.update(self._personal_meta(pl_module))
        fit_seconds = round(time.monotonic() - self._fit_started, 4)
        if self.candidates is not None and self.candidates.active:
            personal = self._personal_weights(pl_module)
            meta.update(self.candidates.end_round(meta, self._round_meta, pl_module, personal))
            # The local-only model's training and the candidates' scoring, apart from the fit (the speed benchmark).
            meta[CANDIDATE_SECONDS] = round(time.monotonic() - self._fit_started - fit_seconds, 4)
        meta[meta_keys.NUM_SAMPLES] = self.num_samples if self.num_samples is not None else _dataset_size(trainer)
        meta[meta_keys.FIT_SECONDS] = fit_seconds
        if self._trained_round is not None:  # echoed so the server can refuse a result that arrives in another round
            meta[meta_keys.TRAINED_ROUND] = self._trained_round
        if self.privacy is not None:  # ledger written, unprotected statistics withheld (docs/privacy.md)
            meta = self.privacy.end_round(meta, self._trained_round)
        self.last_meta = meta
        pl_module.__fl_meta__ = meta
        if self.local_entries:  # after everything above read the state_dict; NVFlare's on_train_end comes next
            self.local_entries.save(pl_module, self._round_meta)
            self.local_entries.hide(pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.local_entries.show()  # the result is taken: the module's state_dict is whole again

    def _mean_loss(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
        """The round's mean training loss; under DDP the mean over the ranks (each saw its share of the batches)."""
        mean = float(sum(self._losses) / len(self._losses)) if self._losses else float("nan")
        if trainer.world_size > 1:
            mean = float(trainer.strategy.reduce(torch.tensor(mean, device=pl_module.device), reduce_op="mean"))
        return mean

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._remove_step_hook()
        if self.privacy is not None:
            self.privacy.close()
        self.local_entries.show()

    def _remove_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None


def fednova_meta(algorithm: ClientAlgorithm, steps: list[tuple[float, float, float] | None]) -> dict[str, Any]:
    """``fednova.tau`` and ``fednova.a_norm`` (docs/server_rules.md, FedNova) when this round's local update is eta * G
    a.

    Empty when it is not (a ``drift`` algorithm, an optimizer the normaliser does not model, momentum settings that
    changed within the round, no positive first lr): a FedNova server then rejects the result by name.
    """
    if algorithm.local_update == "drift" or not steps or any(step is None for step in steps):
        return {}
    if len({step[1:] for step in steps}) != 1 or steps[0][0] <= 0:
        return {}
    momentum, dampening = steps[0][1], steps[0][2]
    mu = algorithm.proximal_coefficient() if algorithm.local_update == "proximal" else 0.0
    a_norm = normalizer_l1([step[0] for step in steps], momentum=momentum, dampening=dampening, mu=mu)
    return FedNovaReport(len(steps), a_norm).to_meta()


def check_trainer_supports(
    algorithm: ClientAlgorithm, trainer: pl.Trainer, automatic_optimization: bool, check_optimizers: bool = True
) -> None:
    """Refuse set-ups under which client algorithms silently go wrong, with a message that says how to fix it."""
    who = f"{algorithm.site}: client algorithm '{algorithm.name}'"
    precision = str(trainer.precision)
    if precision not in algorithm.supported_precisions:
        raise ClientAlgorithmError(
            f"{who} does not support precision '{precision}'; use one of {list(algorithm.supported_precisions)} "
            "(fp16 GradScaler skips optimizer steps; bf16-true keeps no fp32 master weights)"
        )
    if not automatic_optimization:
        raise ClientAlgorithmError(
            f"{who} needs Lightning's automatic optimization; manual optimization bypasses optimizer_step, "
            "so corrections would never be applied"
        )
    if check_optimizers and len(trainer.optimizers) != 1:
        raise ClientAlgorithmError(f"{who} needs exactly one optimizer, got {len(trainer.optimizers)}")


def module_round_metrics(module: pl.LightningModule) -> dict[str, float]:
    """The module's own summary of the round, ``fl_round_metrics() -> {name: value}`` if it defines one (the
    built-in classifier's training accuracy), sent as ``train.<name>``."""
    hook = getattr(module, "fl_round_metrics", None)
    return {f"train.{name}": float(value) for name, value in (hook() if callable(hook) else {}).items()}


def job_algorithm() -> FederatedAlgorithm:
    """The job's client algorithm for a user's own training script (``jobs.build --script``), after
    ``flare.init()``: its name and hyperparameters as the job configured them, its state kept per site and
    federated run."""
    import json
    import os

    import nvflare.client as flare

    from lightning_modules.state_store import default_state_root

    site = flare.get_site_name()
    store = ClientStateStore(default_state_root(), site, per_run=True)
    args = json.loads(os.environ.get(CLIENT_ARGS_ENV) or "{}")
    return FederatedAlgorithm(os.environ.get(CLIENT_ENV, "fedavg"), algorithm_args=args, site=site, state_store=store)


def _dataset_size(trainer: pl.Trainer) -> int:
    dataset = getattr(trainer.train_dataloader, "dataset", None)
    try:
        return len(dataset)
    except TypeError:
        raise ClientAlgorithmError(
            "the training data has no length (an iterable dataset): pass num_samples= to FederatedAlgorithm, "
            "the weight FedAvg gives this site"
        ) from None
