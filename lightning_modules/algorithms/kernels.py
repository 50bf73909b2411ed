"""Per-step kernels of the client algorithms, and the one fused fast path that a plain SGD step allows.

Every client algorithm states its correction as a gradient term: ``correct_gradients`` adds it to ``.grad`` and
never moves a weight, so a ``Callback.on_before_optimizer_step`` placed after the algorithm's callback sees the
task gradient plus the term. Why this file exists: on a memory-bound model (e.g. a 10M-parameter MLP at batch 64)
every element-wise pass over the fp32 parameters costs a noticeable share of a training step (a pass reads two
model-sized tensors and writes one), so the per-step price of SCAFFOLD, FedProx and FedDyn is essentially the
number of passes they add on top of the optimizer's own update (``benchmarks/step_overhead.py`` measures it).

- `LinearTerm` / `add_linear_term_`: a term ``c * (p - target)`` that is linear in the parameters (FedProx's
  ``mu * (p - w_t)``, FedDyn's ``alpha_k * (p - (theta_server - H_k))``), declared by the algorithm
  (``ClientAlgorithm.linear_term``) and added to ``.grad`` in two fused passes.
- The fused fast path, used only by `lightning_modules.federated.FederatedAlgorithm` (never by an algorithm):
  `plain_sgd_step_lrs` recognises a step that is exactly ``p <- p - lr * grad`` (``torch.optim.SGD`` itself
  without momentum, weight decay or ``maximize``, inside a Lightning fit whose gradient clipping is off). Only then
  is a linear term the same as pulling the parameters towards a fixed point BEFORE the step, which is one ``lerp``
  pass instead of two passes on ``.grad`` (`pull_before_plain_sgd_step_`):

      p - lr * (g + c * (p - target)) = lerp(p, target, lr * c) - lr * g      (exact in real arithmetic)

  The callback takes it only when nobody can see the difference in ``on_before_optimizer_step``
  (`gradient_observers`: no callback after it and no module hook reads the gradient there); otherwise, and with
  momentum, weight decay, clipping or no trainer, the term goes to ``.grad``. The weights after the step agree with
  the gradient form to rounding (tested at 1e-6). What the fold leaves different: ``.grad`` read AFTER the step
  (``on_train_batch_end``, an optimizer post-hook) holds the task gradient alone; ``FederatedAlgorithm(...,
  fuse_plain_sgd=False)`` switches the fold off. The same decision (``ClientAlgorithm.fused_step_allowed``, set by
  the callback) lets SCAFFOLD apply its constant term c - c_i after a plain SGD step instead of on ``.grad``.
- `foreach_by_dtype` groups tensors so that ``torch._foreach_*`` calls see matching dtypes and devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

#: A callback that overrides ``on_before_optimizer_step`` without reading ``.grad`` there may set this class
#: attribute to False, so that the fused step stays available (`gradient_observers`).
OBSERVES_GRADIENTS_ATTRIBUTE = "observes_gradients"


@dataclass(frozen=True)
class LinearTerm:
    """The gradient term ``coefficient * (p - targets[name])`` for every parameter of ``params`` (fp32 targets).

    ``every_parameter``: the term is added to a parameter without a task gradient too (FedDyn's regulariser depends
    on every parameter); otherwise such a parameter is left alone (FedProx: the step skips it, so p - w_t stays 0).
    """

    params: Mapping[str, nn.Parameter]
    targets: Mapping[str, torch.Tensor]
    coefficient: float
    every_parameter: bool


def add_linear_term_(term: LinearTerm) -> None:
    """``.grad += coefficient * (p - target)``: two fused in-place passes for dense fp32 gradients (no temporaries),
    a per-tensor fp32 computation otherwise (a missing gradient is created when ``every_parameter``)."""
    pairs = [(p, term.targets[name]) for name, p in term.params.items() if term.every_parameter or p.grad is not None]
    with torch.no_grad():
        if all(p.grad is not None and p.grad.dtype == p.dtype == torch.float32 for p, _ in pairs):
            grads = [p.grad for p, _ in pairs]
            torch._foreach_add_(grads, [p for p, _ in pairs], alpha=term.coefficient)
            torch._foreach_add_(grads, [target for _, target in pairs], alpha=-term.coefficient)
            return
        for p, target in pairs:
            step = (p.detach().to(torch.float32) - target).mul_(term.coefficient)
            if p.grad is None:
                p.grad = step.to(p.dtype)
            else:
                p.grad.add_(step.to(p.grad.dtype))


def _gradient_clipping_is_off(module: nn.Module) -> bool:
    """True only for a LightningModule attached to a trainer that will not clip this step's gradients."""
    try:
        trainer = module.trainer  # a LightningModule not attached to a trainer raises RuntimeError
    except (AttributeError, RuntimeError):
        return False
    if trainer is None or not hasattr(trainer, "gradient_clip_val"):
        return False
    clip_hook = getattr(type(module), "configure_gradient_clipping", None)
    default_hook = _default_clipping_hook()
    if default_hook is None or clip_hook is not default_hook:
        return False  # a module-defined clipping hook may clip whatever the trainer's settings say
    return not trainer.gradient_clip_val


def _default_clipping_hook() -> object | None:
    try:
        import pytorch_lightning as pl
    except ImportError:  # pragma: no cover - the bundle depends on Lightning
        return None
    return pl.LightningModule.configure_gradient_clipping


def plain_sgd_step_lrs(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[float] | None:
    """The lr of every param group when the coming step is exactly ``p <- p - lr * grad``, else ``None``.

    Exactly: ``type(optimizer) is torch.optim.SGD`` (a subclass may step differently), momentum 0, weight decay 0,
    no ``maximize``, and a Lightning trainer with gradient clipping off drives ``module``.
    """
    if type(optimizer) is not torch.optim.SGD or not _gradient_clipping_is_off(module):
        return None
    lrs = []
    for group in optimizer.param_groups:
        if group.get("momentum", 0) != 0 or group.get("weight_decay", 0) != 0 or group.get("maximize", False):
            return None
        lrs.append(float(group["lr"]))
    return lrs


def dense_fp32(tensor: torch.Tensor | None) -> bool:
    return tensor is not None and tensor.dtype == torch.float32 and tensor.layout == torch.strided


def pull_before_plain_sgd_step_(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, nn.Parameter],
    targets: Mapping[str, torch.Tensor],
    coefficient: float,
    require_all_grads: bool,
) -> bool:
    """Fold the gradient term ``coefficient * (p - target)`` into the coming plain SGD step; True when done.

    The callback's fused fast path (module docstring); an algorithm's ``correct_gradients`` never calls it.

    Does ``p <- lerp(p, target, lr * coefficient)`` in one ``torch._foreach_lerp_`` per param group, for every
    parameter of ``params`` that the step will move (it has a gradient; ``require_all_grads``: every parameter must
    have one, else nothing is done). Returns False, having changed nothing, when the step is not a plain SGD step
    (`plain_sgd_step_lrs`) or a parameter, gradient or target is not a dense fp32 tensor: the caller then
    adds the term to ``.grad``.
    """
    lrs = plain_sgd_step_lrs(module, optimizer)
    if lrs is None:
        return False
    names_by_id = {id(p): name for name, p in params.items()}
    batches: list[tuple[float, list[torch.Tensor], list[torch.Tensor]]] = []
    covered = 0
    for lr, group in zip(lrs, optimizer.param_groups, strict=True):
        moved, ends = [], []
        for p in group["params"]:
            name = names_by_id.get(id(p))
            if name is None:
                continue
            covered += 1
            if p.grad is None:
                if require_all_grads:
                    return False
                continue  # the step skips it, so the gradient form would not move it either
            if not (dense_fp32(p) and dense_fp32(p.grad) and dense_fp32(targets[name])):
                return False
            moved.append(p)
            ends.append(targets[name])
        batches.append((lr * coefficient, moved, ends))
    if covered != len(params):
        return False  # a trainable parameter the optimizer does not step: let the general path decide
    with torch.no_grad():
        for weight, moved, ends in batches:
            for group_params, group_ends in foreach_by_dtype(moved, ends):
                torch._foreach_lerp_(group_params, group_ends, weight)
    return True


def fold_linear_term_(module: nn.Module, optimizer: torch.optim.Optimizer, term: LinearTerm) -> bool:
    """`pull_before_plain_sgd_step_` for a declared `LinearTerm`; True when the coming step now applies it."""
    return pull_before_plain_sgd_step_(
        module, optimizer, term.params, term.targets, term.coefficient, require_all_grads=term.every_parameter
    )


def gradient_observers(trainer: Any, module: nn.Module, driver: object) -> list[str]:
    """Who may read ``.grad`` in ``on_before_optimizer_step`` after ``driver`` (a callback) corrected it: the
    callbacks after it in ``trainer.callbacks`` (all of them when it is not in the list) that override the hook,
    and the module's own hook. A callback before ``driver`` sees the task gradient whatever ``driver`` does.

    Not counted: a callback whose class sets ``observes_gradients = False``, and NVFlare's ``FLCallback`` while none
    of its built-in algorithm handlers is on (its hook then only loops over an empty dict). Whatever this cannot
    vouch for counts as an observer, so the answer errs towards the gradient form.
    """
    import pytorch_lightning as pl

    callbacks = list(getattr(trainer, "callbacks", None) or [])
    position = next((i for i, callback in enumerate(callbacks) if callback is driver), -1)
    found = [type(callback).__name__ for callback in callbacks[position + 1 :] if _reads_gradients(callback, pl)]
    hook = getattr(type(module), "on_before_optimizer_step", None)
    if hook is not None and hook is not pl.LightningModule.on_before_optimizer_step:
        found.append(f"{type(module).__name__}.on_before_optimizer_step")
    return found


def _reads_gradients(callback: object, pl: Any) -> bool:
    if getattr(type(callback), "on_before_optimizer_step", None) in (None, pl.Callback.on_before_optimizer_step):
        return False
    if getattr(callback, OBSERVES_GRADIENTS_ATTRIBUTE, True) is False:
        return False
    return not _inert_nvflare_callback(callback)


def _inert_nvflare_callback(callback: object) -> bool:
    """NVFlare's FLCallback runs its built-in SCAFFOLD/FedProx handlers in the hook; none is on unless the server
    meta switched one on (``scaffold_c_global``, ``fedprox_mu``), which this project's rules never send."""
    handlers = getattr(getattr(callback, "_algorithm_handler_manager", None), "_handlers", None)
    return type(callback).__module__.startswith("nvflare.") and isinstance(handlers, dict) and not handlers


def foreach_by_dtype(
    tensors: Sequence[torch.Tensor], others: Sequence[torch.Tensor]
) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Pairs split into lists of one (device, dtype) each, in first-seen order, for ``torch._foreach_*`` calls."""
    buckets: dict[tuple[torch.device, torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for tensor, other in zip(tensors, others, strict=True):
        key = (tensor.device, tensor.dtype, other.dtype)
        bucket = buckets.setdefault(key, ([], []))
        bucket[0].append(tensor)
        bucket[1].append(other)
    return list(buckets.values())


def add_in_own_dtype_(tensors: Sequence[torch.Tensor], terms: Sequence[torch.Tensor], alpha: float) -> None:
    """``tensors[i] += alpha * terms[i]``, each term cast to its tensor's dtype; one fused call per (device, dtype).

    Bit for bit the per-tensor ``tensor.add_(term.to(tensor.dtype), alpha=alpha)`` loop, in fewer kernel launches.
    """
    for targets, others in foreach_by_dtype(tensors, terms):
        if targets[0].dtype != others[0].dtype:
            others = [other.to(targets[0].dtype) for other in others]
        torch._foreach_add_(targets, others, alpha=alpha)
