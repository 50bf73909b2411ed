"""The client-algorithm plug-in interface (docs/design.md, decision 2).

A client algorithm is a small object with hooks that `lightning_modules.federated.FederatedAlgorithm` (a
Lightning callback) drives on any LightningModule:

- ``on_round_start``  once per federated round, after the global weights are loaded, with the server meta;
- ``on_batch``        before every training batch's ``training_step`` (Lightning's ``on_train_batch_start``), with the
  batch as ``training_step`` receives it (on its device): an algorithm that needs the task loss or its gradient at
  other weights on the current batch keeps it here and evaluates it with
  `lightning_modules.algorithms.task_gradient.task_gradient` (FedMoS). Under gradient accumulation it runs
  once per micro-batch, so the batch kept when ``correct_gradients`` runs is the last micro-batch only (FedMoS
  refuses accumulation);
- ``loss_terms``      inside the module's ``training_step`` (via ``algorithm_loss``): extra differentiable terms (MOON);
  only an algorithm that adds a term overrides it, and the module must then call ``algorithm_loss``;
- ``correct_gradients`` in ``on_before_optimizer_step``, after backward and before the optimizer moves the weights:
  the algorithm's correction as a gradient term added to ``.grad``; it never moves a weight. An algorithm whose
  term is linear in the parameters declares it instead (``linear_term``): the base ``correct_gradients`` adds it,
  and the callback may fold it into a plain SGD step (kernels.py, the one fused fast path);
- ``after_step``      right after each optimizer step (post-step parameter corrections, step/lr bookkeeping);
- ``on_round_end``    returns the namespaced meta to send to the server with the model.

The base class is plain local SGD, i.e. the FedAvg client: every hook does nothing.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from aggregators.contracts import meta_keys
from aggregators.contracts.wire import round_meta_problems
from lightning_modules.algorithms.capabilities import DPSGD, PersonalModel, Released, declared_dp_sgd
from lightning_modules.algorithms.errors import ClientAlgorithmError
from lightning_modules.algorithms.hparams import HParams
from lightning_modules.algorithms.kernels import LinearTerm, add_linear_term_
from lightning_modules.state_store import ClientStateStore

LOG = logging.getLogger(__name__)
RUN_ID_KEY = "__run_id__"


class ClientAlgorithm:
    """Base client algorithm: FedAvg's plain local training. Subclasses override only the hooks they need."""

    name: ClassVar[str] = "fedavg"
    #: Lightning precisions the algorithm is correct under. fp16 GradScaler precisions skip optimizer steps,
    #: which breaks every algorithm that counts steps, and ``bf16-true`` has no fp32 master weights.
    supported_precisions: ClassVar[tuple[str, ...]] = ("32-true", "32", "bf16-mixed")
    #: Meta keys the algorithm needs from the server each round.
    required_server_meta: ClassVar[tuple[str, ...]] = ()
    #: Meta keys the algorithm sends to the server every round (checked against the rule at job build time).
    sent_meta: ClassVar[tuple[str, ...]] = ()
    #: Model arguments the algorithm needs (e.g. MOON's projection head); the job builder adds them to the job's
    #: ``arch_args`` unless given, so the clients and the server build the same architecture.
    default_arch_args: ClassVar[Mapping[str, Any]] = {}
    #: How the local update relates to the local gradients (FedNova normalises it): ``gradient`` (plain optimizer
    #: steps on the local objective, extra loss terms included), ``proximal`` (plus mu * (w - w_t) added to the
    #: gradient, see `proximal_coefficient`), ``drift`` (a correction that is no local gradient: SCAFFOLD,
    #: FedDyn, FedMoS; FedNova refuses those at build time). A capability, like ``dp_sgd``, ``released`` and
    #: ``secure_sum`` below (capabilities.CLIENT_CAPABILITIES): the values here are FedAvg's own, which a subclass
    #: never inherits (`aggregators.types.declared` reads each from the class's own body; undeclared: refused).
    local_update: ClassVar[str] = "gradient"
    #: The algorithm's hyperparameters, declared once as a frozen dataclass (hparams.py): the registry checks
    #: ``client_args`` against its fields, the constructor builds one (which checks every value) and
    #: `hparams` reports it. FedAvg's local SGD has none of its own.
    hparams_class: ClassVar[type[HParams]] = HParams
    #: What the algorithm needs from the module and optimizer (lightning_modules/protocols.py checks them):
    #: the task loss at other weights, the projected representation, one plain SGD step per update.
    needs_task_loss: ClassVar[bool] = False
    needs_representation: ClassVar[bool] = False
    needs_plain_sgd: ClassVar[bool] = False
    #: Capabilities (capabilities.py), read by the tables derived from the registry. ``dp_sgd``: whether the
    #: outputs can be accounted under sample-level DP-SGD and why (privacy/dp_sgd.py; `dp_sgd_problem` for a
    #: refusal that depends on a setting); ``released``: the items of ``sent_meta`` with their privacy status
    #: (privacy/release.py: a key no algorithm declares is withheld under DP).
    dp_sgd: ClassVar[DPSGD] = DPSGD(True, "plain DP-SGD")
    released: ClassVar[tuple[Released, ...]] = ()
    #: The site's personal model this algorithm keeps (capabilities.PersonalModel), ``None``: none. Kind
    #: ``weights``: its own, returned by `personal_weights` (Ditto, APFL); ``module``: the trained module with the
    #: site's local entries (FedRep's head). lightning_modules/personalization/methods.py makes it a method of
    #: the personalization axis, and the job builder refuses methods whose personal models would collide.
    personal_model: ClassVar[PersonalModel | None] = None
    #: Its personal model is a head the site keeps: the job's local keys, or without them the head the module
    #: declares (``fl_head_keys()``); the builder resolves and checks it (FedRep).
    needs_head: ClassVar[bool] = False
    #: Why the algorithm cannot run in secure aggregation's sum workflow (jobs/secure_aggregation.py), or ``None``:
    #: it needs nothing from the server but the global model and keeps no state between rounds. Read from the class
    #: itself (capabilities.declared_secure_sum): undeclared, a class with a personal model keeps per-site state,
    #: any other is refused.
    secure_sum: ClassVar[str | None] = None
    #: Set by `lightning_modules.federated.FederatedAlgorithm` every round: True when nobody watches the gradient
    #: in ``on_before_optimizer_step`` and the callback's fused fast path is allowed (kernels.py), so a term that is
    #: exact for a plain SGD step may be applied with the step instead of on ``.grad`` (SCAFFOLD's post-step
    #: correction). False wherever nobody said so (a hand-driven algorithm, a watching callback).
    fused_step_allowed: bool = False
    #: The checked values (set by `use_hparams`).
    hyperparameters: HParams = HParams()

    #: Set by `bind`: the site this algorithm runs on and where it may persist state between rounds.
    site: str = "local"
    state_store: ClientStateStore | None = None

    #: What help() and inspect show as the constructor's keywords: the declared fields (set for every subclass).
    __signature__ = inspect.signature(HParams)

    def __init__(self, **hparams: Any) -> None:
        """Built from the hyperparameter dataclass, as a server rule is its dataclass: ``hparams_class(**hparams)``
        checks every value (an undeclared key is a TypeError), `use_hparams` makes each an attribute, then
        `init_state` sets up the working state. A subclass declares ``hparams_class`` and overrides `init_state`; it
        never restates its fields in a constructor."""
        self.use_hparams(self.hparams_class(**hparams))
        self.init_state()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # help() and inspect show the declared fields as the constructor's keywords; a class with a constructor of
        # its own (a user's algorithm) keeps that constructor's signature.
        cls.__signature__ = None if "__init__" in vars(cls) else inspect.signature(cls.hparams_class)

    def init_state(self) -> None:
        """The working state the hooks keep between calls, set before the first round (the hyperparameters are
        attributes by now). FedAvg's local SGD keeps none."""

    def use_hparams(self, hyperparameters: HParams) -> None:
        """Keep the checked hyperparameters and expose each as an attribute (``self.mu``), which the hooks read."""
        self.hyperparameters = hyperparameters
        for spec_field in dataclasses.fields(hyperparameters):
            setattr(self, spec_field.name, getattr(hyperparameters, spec_field.name))

    def bind(self, site: str, state_store: ClientStateStore | None) -> None:
        """Attach the site name and its state store (called once by the client script)."""
        self.site = site
        self.state_store = state_store

    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        """Called once per round after the global weights were loaded into ``module``."""

    def on_batch(self, module: nn.Module, batch: Any) -> None:
        """Called before every training batch's ``training_step`` with that batch (module docstring)."""

    def loss_terms(self, module: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor | None:
        """Extra loss added to the task loss in ``training_step``; ``None`` adds nothing."""
        return None

    def linear_term(self) -> LinearTerm | None:
        """The gradient term c * (p - target) this algorithm adds at every step, when that is its whole correction
        (FedProx, FedDyn); ``None``: none, or a correction of another form (then override `correct_gradients`)."""
        return None

    def correct_gradients(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Add the algorithm's gradient term to ``.grad`` of the trainable parameters after backward, before
        ``optimizer.step``; never move a weight (a callback watching the gradient must see the term)."""
        term = self.linear_term()
        if term is not None:
            add_linear_term_(term)

    def after_step(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Called right after every optimizer step."""

    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        """Namespaced meta for the server; called once at the end of local training."""
        return {}

    def personal_weights(self, module: nn.Module) -> Mapping[str, torch.Tensor] | None:
        """The personal model's weights (fp32, keyed like the trainable parameters) the site loads into a copy of
        its module and scores, once a round has started; ``None``: none yet. Only algorithms whose
        ``personal_model`` is of kind ``weights`` override it."""
        return None

    def personal_options(self, module: nn.Module) -> Mapping[float, Mapping[str, torch.Tensor]] | None:
        """Several personal models of one method at different strengths (Ditto's ``lam_grid``), keyed by the
        strength: the site scores each on validation and keeps the one it prefers (`choose_personal`); ``None``:
        one personal model, `personal_weights`."""
        return None

    def choose_personal(self, option: float) -> dict[str, float]:
        """Make ``option`` of `personal_options` the model `personal_weights` returns this round; the ``eval.*``
        meta naming the choice."""
        raise ClientAlgorithmError(f"{self.name} offers no personal models to choose from, got a choice of {option}")

    def dp_sgd_problem(self) -> str | None:
        """Why this instance's outputs cannot be accounted under DP-SGD, or ``None`` (the class's ``dp_sgd``;
        an algorithm whose answer depends on a setting overrides it: SCAFFOLD's option I). Read from the instance's
        own class: a subclass that does not declare ``dp_sgd`` is refused."""
        declared = declared_dp_sgd(type(self))
        return None if declared.composes else declared.why

    def extra_epochs(self) -> int:
        """Epochs the round's fit runs on top of the job's ``--epochs`` (FedRep's head phase); 0: none."""
        return 0

    def proximal_coefficient(self) -> float:
        """mu of a proximal term mu * (w - w_t) this algorithm adds to every gradient (0: none)."""
        return 0.0

    def hparams(self) -> dict[str, Any]:
        """Hyperparameters for logs and reports, from the declared ones."""
        return self.hyperparameters.reported()


def check_server_meta(algorithm: ClientAlgorithm, meta: Mapping[str, Any], site: str) -> None:
    """Fail with one clear line when the server did not send what the algorithm needs."""
    missing = [key for key in algorithm.required_server_meta if key not in meta]
    if missing:
        raise ClientAlgorithmError(
            f"{site}: client algorithm '{algorithm.name}' needs server meta {missing}, which the server did not send; "
            "is the job's server rule the matching one?"
        )


#: Set on the module by `lightning_modules.federated.FederatedAlgorithm`: the site's local entries
#: (``--local-keys``), which every client algorithm leaves alone (docs/personalization.md, "Partial sharing").
LOCAL_KEYS_ATTRIBUTE = "__fl_local_keys__"


def local_keys_of(module: nn.Module) -> frozenset[str]:
    """The entries of ``module`` that never leave the site (empty without partial sharing)."""
    return frozenset(getattr(module, LOCAL_KEYS_ATTRIBUTE, ()) or ())


def trainable_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Named trainable parameters (``requires_grad``), keyed like the state_dict; buffers are never included, nor
    the site's local entries: SCAFFOLD's controls, FedProx's and FedDyn's terms, FedMoS and MOON's anchors are about
    the shared model only, so they are filtered here, once, for every algorithm."""
    local = local_keys_of(module)
    return {name: p for name, p in module.named_parameters() if p.requires_grad and name not in local}


def settle_state(algorithm: ClientAlgorithm, meta: Mapping[str, Any]) -> str | None:
    """At round start: commit the state this site wrote in its previous round if the server confirms that round's
    result was aggregated, else discard it (``ClientStateStore.settle``); the outcome is logged when discarded.

    The round index and the confirmations are checked first: a NaN round or a malformed map would otherwise
    commit or throw away the site's state on a value that means nothing, so the round is refused by key.
    """
    problems = round_meta_problems(meta)
    if problems:
        detail = "; ".join(f"'{key}' {problem}" for key, problem in problems.items())
        raise ClientAlgorithmError(
            f"{algorithm.site}: {algorithm.name} refuses the server's round meta ({detail}); its state is left as it "
            "was"
        )
    if algorithm.state_store is None:
        return None
    round_num = int(meta.get(meta_keys.ROUND, 0))
    confirmed = meta.get(meta_keys.LAST_AGGREGATED)
    outcome = algorithm.state_store.settle(algorithm.name, round_num, confirmed)
    if outcome == "discarded":
        LOG.warning(
            "%s: %s state of an earlier round discarded: the server did not aggregate that round's result (or the "
            "round is trained again); continuing from the last confirmed state",
            algorithm.site,
            algorithm.name,
        )
    return outcome


def load_run_state(
    algorithm: ClientAlgorithm, params: Mapping[str, nn.Parameter], run_id: str, what: str
) -> dict[str, torch.Tensor]:
    """The algorithm's per-parameter fp32 state persisted by this run of the job, or zeros when there is none.

    The run id is checked first: a file written by another run (a reused workspace) is ignored with a warning,
    whatever its shapes, and the site starts as one that never participated. A file of this run whose shapes or
    dtypes do not match the model, or a corrupt file, raises ``StateStoreError``. ``what`` names the state in the
    warning (e.g. ``"SCAFFOLD control c_i"``).
    """
    if algorithm.state_store is None:
        raise ClientAlgorithmError(
            f"{algorithm.site}: {algorithm.name} has no state store bound; its state would be lost after the round"
        )
    zeros = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in params.items()}
    expected = {name: (tuple(p.shape), torch.float32) for name, p in params.items()}
    stored = algorithm.state_store.load(algorithm.name)  # integrity only; shapes once we know it is this run's
    if stored is None:
        return zeros
    if stored.state.get(RUN_ID_KEY) != run_id:
        LOG.warning(
            "%s: ignoring %s in %s: it was written by another run of a job (run %s, now %s); starting from zero as "
            "a site that never participated",
            algorithm.site,
            what,
            stored.path,
            stored.state.get(RUN_ID_KEY),
            run_id,
        )
        return zeros
    stored = algorithm.state_store.load(algorithm.name, expected=expected)
    return {name: stored.state[name].to(p.device) for name, p in params.items()}


def refuse_non_finite_state(algorithm: ClientAlgorithm, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise, naming the site and the first keys, when state about to be saved holds a NaN or an Inf: one diverging
    round must not poison the site's state for the rest of the job, so the committed state is kept and this
    round's result is not sent."""
    bad = sorted(
        name for name, value in tensors.items() if value.is_floating_point() and not bool(torch.isfinite(value).all())
    )
    if bad:
        raise ClientAlgorithmError(
            f"{algorithm.site}: {algorithm.name} refuses to save non-finite state for {bad[:5]}; the previous state "
            "is kept and this round's result is not sent"
        )


def save_run_state(
    algorithm: ClientAlgorithm, tensors: Mapping[str, torch.Tensor], run_id: str, round_num: int
) -> None:
    """Persist per-parameter state atomically for the next round (tagged with the run that wrote it)."""
    if algorithm.state_store is None:
        raise ClientAlgorithmError(f"{algorithm.site}: {algorithm.name} has no state store bound")
    refuse_non_finite_state(algorithm, tensors)
    state: dict[str, Any] = {name: value.detach().cpu() for name, value in tensors.items()}
    state[RUN_ID_KEY] = run_id
    # Pending until the server confirms that this round's result was aggregated (settle_state, next round).
    algorithm.state_store.save(algorithm.name, state, round_num=round_num, pending=True)
