"""Per-step kernels of the client algorithms: every correction in as few passes over the parameters as possible.

Why this file exists: on a memory-bound model (e.g. a 10M-parameter MLP at batch 64) every element-wise pass over
the fp32 parameters costs a noticeable share of a training step (a pass reads two model-sized tensors and writes
one), so the per-step price of SCAFFOLD, FedProx and FedDyn is essentially the number of passes they add on top of
the optimizer's own update (``benchmarks/step_overhead.py`` measures it).

Two tools:

- `plain_sgd_step_lrs` recognises a step that is exactly ``p <- p - lr * grad``: ``torch.optim.SGD`` itself
  without momentum, weight decay or ``maximize``, inside a Lightning fit whose gradient clipping is off. Only then
  is a gradient term that is linear in the parameters (FedProx's ``mu * (p - w_t)``, FedDyn's
  ``alpha_k * (p - (theta_server - H_k))``) the same as pulling the parameters towards a fixed point BEFORE the
  step, ``p <- p + lr * c * (target - p)``, which is one ``lerp`` pass instead of two passes on ``.grad``:

      p - lr * (g + c * (p - target)) = lerp(p, target, lr * c) - lr * g      (exact in real arithmetic)

  With momentum the term must enter the momentum buffer, with weight decay the decay must see the un-pulled
  weights, and clipping must clip the sum; without a trainer nobody can promise that nothing reads the gradient
  between ``correct_gradients`` and the step. In all those cases the algorithms keep editing ``.grad``.
- `foreach_by_dtype` groups tensors so that ``torch._foreach_*`` calls see matching dtypes and devices.

What the fold changes and what it does not: the optimizer step, the step count, the learning rates and the state
the algorithms keep are the same; the weights after the step agree with the gradient form to rounding (tested at
1e-6). What a ``Callback.on_before_optimizer_step`` observes differs: the gradient then holds the task gradient
alone and the weights already hold the pull.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn


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
