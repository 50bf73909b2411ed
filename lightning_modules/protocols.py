"""What a client algorithm or a server rule needs from the user's module and optimizer, and the checks that say so.

The needs are declarations on the classes (no algorithm is special-cased by name), read the same way by the site's
set-up (`lightning_modules.federated.FederatedAlgorithm`) and by the job builder (`jobs.user_checks`),
so a problem knowable from the model is refused when the job is built and, for jobs built otherwise (a user's own
script, the in-process runner), when the round starts. Each check returns one line saying what to add or change.

Client algorithm declarations (on the class; a property where it depends on hyperparameters):

- ``needs_task_loss``: the algorithm evaluates the task loss at other weights (FedMoS; SCAFFOLD Option I), through
  `lightning_modules.algorithms.task_gradient.task_gradient` on a batch the callback hands it; the module's
  ``training_step`` needs nothing for it (only an algorithm that overrides ``loss_terms``, MOON, needs
  ``algorithm_loss`` there);
- ``needs_representation``: the algorithm contrasts the module's projected representation (MOON);
- ``needs_plain_sgd``: the algorithm applies its update as one plain SGD step (FedMoS).

Server rules: a rule whose ``required_meta`` holds FedNova's report (``fednova.tau``, ``fednova.a_norm``) needs
every site's update described as SGD steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from aggregators.compose import LINEAR_SOLVER_META

#: What an algorithm that evaluates the task loss at other weights (FedMoS; SCAFFOLD Option I's full-batch
#: gradient) needs from the module.
TASK_LOSS_PROTOCOL = (
    "task_loss(batch, params=None) -> (loss, logits): the mean task loss of a batch, at the module's own weights "
    "or, when params (a dict keyed like the module's state_dict) is given, at those weights via "
    "torch.func.functional_call"
)
#: What MOON needs: a network it can copy (the global model and the site's previous models) whose projected
#: representation it reads, plus its contrastive term in the loss.
MOON_PROTOCOL = (
    "an attribute net (an nn.Module) whose forward goes through net.projection (the projection head, whose output "
    "z MOON contrasts) and a method net.embed(x) -> z; and a training_step that returns loss + "
    "lightning_modules.federated.algorithm_loss(self, batch, logits). lightning_modules.models' networks built "
    'with arch_args {"projection_dim": 256} have both'
)


# -- declarations ---------------------------------------------------------------------------------------------------
def declared(algorithm: Any, need: str) -> bool:
    """The algorithm's declaration ``need`` (module docstring); an object that declares nothing needs nothing."""
    return bool(getattr(algorithm, need, False))


def needs_task_loss(algorithm: Any) -> bool:
    return declared(algorithm, "needs_task_loss")


def needs_representation(algorithm: Any) -> bool:
    return declared(algorithm, "needs_representation")


def needs_plain_sgd(algorithm: Any) -> bool:
    return declared(algorithm, "needs_plain_sgd")


def needs_sgd_report(rule_cls: Any) -> bool:
    """True for a server rule that normalises by the sites' FedNova report (it needs ``fednova.*`` meta)."""
    return bool(set(LINEAR_SOLVER_META) & set(getattr(rule_cls, "required_meta", ())))


# -- the module -----------------------------------------------------------------------------------------------------
def representation_gap(module: nn.Module) -> str | None:
    """What ``module`` lacks of what MOON copies and contrasts (``module.net``, its ``embed`` and projection head)."""
    net = getattr(module, "net", None)
    if not isinstance(net, nn.Module):
        return "it has no attribute net that is an nn.Module"
    if not callable(getattr(net, "embed", None)):
        return "its net has no method embed(x)"
    if not isinstance(getattr(net, "projection", None), nn.Module):
        return "its net.projection is missing or None (a model built without a projection head: check its arguments)"
    return None


def module_problem(algorithm: Any, module: nn.Module) -> str | None:
    """What ``module`` lacks for ``algorithm``, as one line that says what to add; ``None`` when nothing."""
    who = f"client algorithm '{algorithm.name}' needs the module {type(module).__name__}"
    if needs_task_loss(algorithm) and not callable(getattr(module, "task_loss", None)):
        return f"{who} to define {TASK_LOSS_PROTOCOL}"
    gap = representation_gap(module) if needs_representation(algorithm) else None
    if gap:
        return f"{who} to have {MOON_PROTOCOL}; {gap}"
    return None


# -- the optimizer --------------------------------------------------------------------------------------------------
def sgd_step_settings(optimizer: Any) -> tuple[float, float, float] | None:
    """(lr, momentum, dampening) of a plain or heavy-ball ``torch.optim.SGD`` step with one lr for every group;
    ``None`` for anything FedNova's normaliser does not model (other optimizers, Nesterov, maximize, unequal lrs)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return None
    groups = optimizer.param_groups
    settings = {(float(g["lr"]), float(g["momentum"]), float(g["dampening"])) for g in groups}
    if len(settings) != 1 or any(g.get("nesterov") or g.get("maximize") for g in groups):
        return None
    return settings.pop()


def sgd_extras(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The settings that make an SGD step more than ``w <- w - lr * grad`` (empty: a plain step)."""
    keys = ("momentum", "weight_decay", "nesterov", "maximize")
    return {k: g[k] for g in optimizer.param_groups for k in keys if g.get(k)}


def describe(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer as the user wrote it: ``AdamW``, ``SGD with nesterov=True``, ``SGD with per-group lrs``."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, torch.optim.SGD):
        return name
    unmodelled = {k: v for k, v in sgd_extras(optimizer).items() if k in ("nesterov", "maximize")}
    if unmodelled:
        return f"{name} with " + ", ".join(f"{k}={v}" for k, v in unmodelled.items())
    if len({float(g["lr"]) for g in optimizer.param_groups}) > 1:
        return f"{name} with different learning rates per param group"
    return name


def optimizer_problem(algorithm: Any, rule_cls: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot serve ``algorithm`` under the server rule ``rule_cls`` (``None``: it can)."""
    if needs_plain_sgd(algorithm) and (not isinstance(optimizer, torch.optim.SGD) or sgd_extras(optimizer)):
        got = type(optimizer).__name__ if not isinstance(optimizer, torch.optim.SGD) else f"SGD {sgd_extras(optimizer)}"
        return (
            f"client algorithm '{algorithm.name}' applies its update as one plain SGD step with its own momentum, so "
            f"it needs torch.optim.SGD with momentum=0 and weight_decay=0; got {got}: change configure_optimizers() "
            "or use another client algorithm"
        )
    if rule_cls is not None and needs_sgd_report(rule_cls) and sgd_step_settings(optimizer) is None:
        return (
            f"server rule '{rule_cls.name}': FedNova's normalisation describes SGD steps (a_i); {describe(optimizer)} "
            "cannot be described — use torch.optim.SGD (momentum allowed, one lr for all param groups) or another "
            "server rule"
        )
    return None


def configured_optimizer(module: Any) -> torch.optim.Optimizer | None:
    """The one optimizer ``module.configure_optimizers()`` returns without a trainer; ``None`` when that cannot be
    known here (it needs the trainer, or returns several optimizers): the site then checks it at set-up."""
    try:
        configured = module.configure_optimizers()
    except Exception:  # user code: whatever it raises without a trainer (self.trainer, ...) means "not knowable"
        return None
    optimizers = _optimizers(configured)
    return optimizers[0] if len(optimizers) == 1 else None


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    """The optimizers of every form Lightning accepts: one, a dict, a list of either, ([optimizers], [schedulers])."""
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, list | tuple):
        if len(configured) == 2 and isinstance(configured[0], list):  # ([optimizers], [schedulers])
            return _optimizers(configured[0])
        return [opt for item in configured for opt in _optimizers(item)]
    return []
