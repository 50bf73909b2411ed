"""MOON, client side: model-contrastive learning against the global model and the site's previous local models.

Reference: Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021, arXiv:2103.16257, Eq. (2)-(4)
(docs/fedmos_moon.md, MOON). The local loss of a batch is

    l = CE(logits, y) + mu * l_con
    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + sum_j exp(sim(z, z_prev_j)/tau)) )

sim is the cosine similarity, z the projected representation of the model being trained, z_glob that of the frozen
global model received this round (the positive), z_prev_j those of the site's frozen previous *local* models (the
negatives, oldest first, at most ``history_size``). It is computed as a cross-entropy over
[sim_pos, sim_neg_1, ...] / tau with target 0 and averaged over the batch; gradients flow through z only.

Model. z is the output of the projection head (Linear(d, d) → ReLU → Linear(d, ``projection_dim``)) and the classifier
reads z, as in the authors' ``ModelFedCon``; the head is part of the federated model (aggregated, evaluated). The
job builder adds ``projection_dim`` (default 256) to the job's model arguments for this algorithm, so clients, the
server's initial model and its test-set evaluator all build the same architecture. z of the model being trained is
captured by a forward hook on the projection head during the task forward pass of ``training_step``, so the
contrastive term costs no second forward of the trained model.

Frozen models (the global one and the negatives) are deep copies of the network in ``eval()`` mode with
``requires_grad=False``, evaluated under ``no_grad``, held in plain Python attributes of this object (which is not an
``nn.Module``): they are never registered as submodules, so they never enter the ``state_dict`` sent to the server nor
the optimizer (tested).

History. After every round the site's trained model (the one it sends) is appended to its history and the oldest
entries beyond ``history_size`` are dropped (FIFO). The history is written to the site's state store, tagged with the
run id, so it survives process restarts (``nvflare simulator -n N`` with one thread starts a process per
client-round) and rounds the site sits out: "previous" is the last round the site took part in. A site with no
history yet (its first participation) uses a copy of the model it received as its negative, as the authors'
pre-filled pool does in round 1, so l_con is never identically zero; in such a round the positive and the negative
are the same model, so l_con = log 2 at every step and its gradient is zero (as in the authors' round 1). A history
written by another run of the job is ignored with a warning. A corrupt history file, or one whose models do not
match this network (keys, shapes, dtypes), raises an error naming the site and file; ``on_bad_history="reset"``
instead discards it with a warning that says so and starts again as a first participation. The store refuses a
file written for another site, so models of different sites are never mixed.

Hyperparameters: ``mu`` (default 5: the published protocol's value for the CIFAR-10 image model; the authors use 1 for
CIFAR-100 / Tiny-ImageNet and their code default is 1), ``temperature`` tau (0.5), ``history_size`` (1).
Cost per step: 1 + 1 + history_size forward passes (the last ones without autograd); memory: 1 + history_size frozen
copies of the network (measured in ``benchmarks/client_algorithms.py``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import (
    RUN_ID_KEY,
    ClientAlgorithm,
    ClientAlgorithmError,
    refuse_non_finite_state,
    settle_state,
)
from lightning_modules.algorithms.capabilities import DPSGD, PER_SITE_STATE, Released
from lightning_modules.algorithms.hparams import NOT_REPORTED, HParams, hparam
from lightning_modules.state_store import StateStoreError

LOG = logging.getLogger(__name__)

DEFAULT_MU = 5.0
DEFAULT_TEMPERATURE = 0.5
DEFAULT_HISTORY_SIZE = 1
DEFAULT_PROJECTION_DIM = 256
BadHistoryAction = Literal["error", "reset"]
HISTORY_KEY = "models"

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class MoonHParams(HParams):
    """MOON's hyperparameters: the contrastive weight ``mu``, the temperature tau and how many previous local models
    are the negatives; ``on_bad_history`` is what a site does with an unusable history file (not part of the
    method, so ``hparams()`` leaves it out)."""

    name: ClassVar[str] = "moon"

    mu: float = hparam(DEFAULT_MU, low=0)
    temperature: float = hparam(DEFAULT_TEMPERATURE, low=0, low_open=True)
    history_size: int = hparam(DEFAULT_HISTORY_SIZE, low=1)
    on_bad_history: BadHistoryAction = field(default="error", metadata=NOT_REPORTED)


def contrastive_loss(
    z: torch.Tensor, z_global: torch.Tensor, z_negatives: Sequence[torch.Tensor], temperature: float
) -> torch.Tensor:
    """Mean over the batch of -log(e^{s+/tau} / (e^{s+/tau} + sum_j e^{s_j/tau})), s = cosine similarity."""
    similarities = [F.cosine_similarity(z, z_global, dim=-1)]
    similarities += [F.cosine_similarity(z, z_neg, dim=-1) for z_neg in z_negatives]
    logits = torch.stack(similarities, dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def frozen_copy(net: nn.Module, state: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """A deep copy of ``net`` (optionally loaded with ``state``) in eval mode with no trainable parameters."""
    frozen = copy.deepcopy(net)
    if state is not None:
        frozen.load_state_dict(state, strict=True)
    frozen.eval()
    frozen.requires_grad_(False)
    return frozen


def storable_state(net: nn.Module) -> StateDict:
    """The network's state_dict as detached CPU copies, floats in float32 (the store refuses bf16/fp16)."""
    return {
        key: value.detach().to("cpu", torch.float32 if value.is_floating_point() else value.dtype).clone()
        for key, value in net.state_dict().items()
    }


def history_problems(models: Any, reference: Mapping[str, torch.Tensor]) -> list[str]:
    """Why a stored history cannot be used with a network whose state_dict is ``reference`` (empty: it can)."""
    if not isinstance(models, list) or not models:
        return [f"'{HISTORY_KEY}' must be a non-empty list of state dicts, got {type(models).__name__}"]
    problems = []
    for index, model in enumerate(models):
        if not isinstance(model, dict) or set(model) != set(reference):
            keys = set(model) if isinstance(model, dict) else set()
            missing, extra = sorted(set(reference) - keys)[:3], sorted(keys - set(reference))[:3]
            problems.append(f"model {index}: keys differ from this network (missing {missing}, unexpected {extra})")
            continue
        for key, value in model.items():
            want = reference[key]
            dtype = torch.float32 if want.is_floating_point() else want.dtype
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(want.shape) or value.dtype != dtype:
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                problems.append(f"model {index}: {key} is {got}, this network needs {(tuple(want.shape), dtype)}")
    return problems


class Moon(ClientAlgorithm):
    """MOON client: adds mu * l_con (positive: received global model; negatives: previous local models)."""

    name: ClassVar[str] = "moon"
    needs_representation: ClassVar[bool] = True
    sent_meta: ClassVar[tuple[str, ...]] = (
        meta_keys.MOON_MU,
        meta_keys.MOON_TEMPERATURE,
        meta_keys.MOON_NUM_NEGATIVES,
        meta_keys.MOON_HISTORY_MODELS,
    )
    default_arch_args: ClassVar[Mapping[str, Any]] = {"projection_dim": DEFAULT_PROJECTION_DIM}
    hparams_class: ClassVar[type[HParams]] = MoonHParams
    local_update: ClassVar[str] = "gradient"  # the contrastive term is part of the local loss
    secure_sum: ClassVar[str | None] = PER_SITE_STATE
    dp_sgd: ClassVar[DPSGD] = DPSGD(
        True, "its contrastive term is part of each sample's loss, so it is clipped and noised with it"
    )
    released: ClassVar[tuple[Released, ...]] = (
        Released("moon.*", "MOON's settings and how many past models it contrasted with", "public"),
    )
    mu: float
    temperature: float
    history_size: int
    on_bad_history: BadHistoryAction

    def init_state(self) -> None:
        self.global_model: nn.Module | None = None
        self.negatives: list[nn.Module] = []
        self.history_models = 0
        self._hook: Any = None
        self._z: torch.Tensor | None = None
        self._run_id = ""
        self._round = 0

    # -- round start ---------------------------------------------------------------------------------------------
    def on_round_start(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        net = module.net
        if getattr(net, "projection", None) is None:
            raise ClientAlgorithmError(
                f"{self.site}: moon needs a model with a projection head; build it with arch_args "
                f'{{"projection_dim": {DEFAULT_PROJECTION_DIM}}} (python -m jobs.build --client moon adds it)'
            )
        self._remove_hook()
        settle_state(self, meta)
        self._round = int(meta.get(meta_keys.ROUND, 0))
        self._run_id = str(meta.get(meta_keys.RUN_ID, ""))
        # Copies first, hook second: a deep copy would otherwise carry the hook along.
        self.global_model = frozen_copy(net)
        history = self._load_history(net)
        self.history_models = len(history)
        # The frozen copies are the only in-memory copy of the history during the round (1 + history_size models).
        self.negatives = [frozen_copy(net, state) for state in history] or [self.global_model]
        del history
        self._hook = net.projection.register_forward_hook(self._capture)

    def _capture(self, head: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        self._z = output

    def _remove_hook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._z = None

    # -- per step ------------------------------------------------------------------------------------------------
    def loss_terms(self, module: nn.Module, batch: Any, logits: torch.Tensor) -> torch.Tensor | None:
        z, self._z = self._z, None
        x = batch[0]
        if z is None or self.global_model is None or len(z) != len(x):
            raise ClientAlgorithmError(
                f"{self.site}: moon found no projection of this batch from the task forward pass; was the round "
                "started (on_round_start) and does the module's forward go through net.projection?"
            )
        with torch.no_grad():
            z_global = self.global_model.embed(x)
            # The same frozen model twice (first participation) is evaluated once.
            z_negatives = [z_global if neg is self.global_model else neg.embed(x) for neg in self.negatives]
        return self.mu * contrastive_loss(z, z_global, z_negatives, self.temperature)

    # -- round end -----------------------------------------------------------------------------------------------
    def on_round_end(self, module: nn.Module) -> dict[str, Any]:
        self._remove_hook()
        meta = {
            meta_keys.MOON_MU: self.mu,
            meta_keys.MOON_TEMPERATURE: self.temperature,
            meta_keys.MOON_NUM_NEGATIVES: len(self.negatives),
            meta_keys.MOON_HISTORY_MODELS: self.history_models,
        }
        previous = [storable_state(negative) for negative in self.negatives] if self.history_models else []
        local = storable_state(module.net)
        refuse_non_finite_state(self, local)  # a diverged local model never enters the history
        history = [*previous, local][-self.history_size :]
        self._store().save(
            self.name, {RUN_ID_KEY: self._run_id, HISTORY_KEY: history}, round_num=self._round, pending=True
        )
        self.global_model, self.negatives = None, []
        return meta

    # -- persistence ---------------------------------------------------------------------------------------------
    def _load_history(self, net: nn.Module) -> list[StateDict]:
        """The site's previous local models of this run (oldest first), or [] for a first participation."""
        store = self._store()
        try:
            stored = store.load(self.name)
            if stored is None:
                return []
            if stored.state.get(RUN_ID_KEY) != self._run_id:
                LOG.warning(
                    "%s: ignoring the MOON history in %s: it was written by another run of a job (run %s, now %s); "
                    "starting as a first participation",
                    self.site,
                    stored.path,
                    stored.state.get(RUN_ID_KEY),
                    self._run_id,
                )
                return []
            models = stored.state.get(HISTORY_KEY)
            problems = history_problems(models, net.state_dict())
            if problems:
                raise ClientAlgorithmError(
                    f"{self.site}: the MOON history in {stored.path} does not match this model "
                    f"({'; '.join(problems[:3])}); was the job's architecture changed?"
                )
        except (StateStoreError, ClientAlgorithmError) as exc:
            if self.on_bad_history == "error":
                raise
            LOG.warning(
                "%s: DISCARDING the MOON history of this site and starting again as a first participation "
                "(on_bad_history='reset'): %s",
                self.site,
                exc,
            )
            return []
        return list(models)[-self.history_size :]

    def _store(self) -> Any:
        if self.state_store is None:
            raise ClientAlgorithmError(
                f"{self.site}: moon has no state store bound; its model history would be lost after the round"
            )
        return self.state_store
