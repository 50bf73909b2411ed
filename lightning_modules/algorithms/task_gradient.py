"""The task loss and its gradient at other weights on a given batch: the one extra pass that FedMoS (the previous
iterate on the current batch) and SCAFFOLD Option I (the full local gradient at the received model) take.

One policy for every such pass, so that it measures the loss the training optimises and changes nothing else:

- **buffers** (BatchNorm running statistics, ``num_batches_tracked``, any other buffer) are left exactly as they were:
  the training step's own forward updates them once per step; an extra pass that updated them again would count
  every batch twice. At other weights the pass runs on copies of the buffers; every buffer is also restored after
  the pass, which covers a ``task_loss`` that reads the module's own buffers.
- **dropout is off** during the pass (each dropout layer in training mode is switched to eval and back): the pass
  is a gradient of the loss, not of one random mask, and it draws nothing from the random number generator, so the
  training's own masks are those of a run without the extra pass. Only dropout changes mode; BatchNorm stays in
  training mode, normalising by the batch's statistics as in the training step.
- **precision**: the pass runs inside the trainer's precision context (``trainer.precision_plugin.forward_context()``:
  autocast under ``bf16-mixed``), the numerics of the training step's forward. Gradients are returned in float32.

FedMoS copied the buffers and kept dropout as it was, SCAFFOLD Option I restored the buffers and turned dropout off;
both are now this policy (the bundled models have no dropout, so FedMoS's numbers on them are unchanged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from lightning_modules.algorithms.errors import ClientAlgorithmError

Tensors = dict[str, torch.Tensor]


def task_gradient(
    module: nn.Module,
    batch: Any,
    params: Mapping[str, torch.Tensor] | None = None,
    *,
    names: Iterable[str] | None = None,
) -> tuple[torch.Tensor, Tensors]:
    """The task loss of ``batch`` and its float32 gradient by parameter name, at ``params`` or at the module's own
    weights (``params=None``), under the module docstring's policy (buffers untouched, dropout off, trainer
    precision).

    ``params``: weights keyed like the trainable parameters (float32 copies, e.g. FedMoS's previous iterate); the
    module's ``task_loss(batch, params=...)`` then gets them together with copies of its buffers (a dict keyed like
    its ``state_dict``). ``names``: the parameters to differentiate by (default: every key of ``params``, or every
    trainable parameter of the module). A parameter outside the loss's graph gets a zero gradient. The returned loss
    is detached.
    """
    leaves = _differentiated(module, params, names)
    buffers = dict(module.named_buffers())  # one walk of the module for the copies, the saving and the restoring
    with torch.enable_grad(), extra_pass(module, buffers):
        if params is None:
            loss, _ = module.task_loss(batch)
        else:
            copies = {name: buffer.clone() for name, buffer in buffers.items()}
            loss, _ = module.task_loss(batch, params={**copies, **leaves})
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return loss.detach(), {
        name: torch.zeros_like(leaf, dtype=torch.float32) if grad is None else grad.to(torch.float32)
        for (name, leaf), grad in zip(leaves.items(), grads, strict=True)
    }


def _differentiated(
    module: nn.Module, params: Mapping[str, torch.Tensor] | None, names: Iterable[str] | None
) -> dict[str, torch.Tensor]:
    """The tensors to differentiate by, by name: the module's own parameters, or fresh leaves on ``params``."""
    if params is None:
        own = dict(module.named_parameters())
        chosen = [n for n, p in own.items() if p.requires_grad] if names is None else list(names)
        return {name: _named(own, name, "parameter of the module") for name in chosen}
    chosen = list(params) if names is None else list(names)
    return {name: _named(params, name, "entry of params").detach().requires_grad_(True) for name in chosen}


def _named(tensors: Mapping[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
    if name not in tensors:
        raise ClientAlgorithmError(f"task_gradient: '{name}' is no {what} (known: {sorted(tensors)[:5]} ...)")
    return tensors[name]


@contextlib.contextmanager
def extra_pass(module: nn.Module, buffers: Mapping[str, torch.Tensor] | None = None) -> Iterator[None]:
    """The context of an extra pass (module docstring): every buffer restored afterwards, dropout off during it,
    inside the trainer's precision context. ``buffers``: the module's ``named_buffers()`` when the caller has them
    already (one walk of the module fewer)."""
    current = dict(module.named_buffers()) if buffers is None else buffers
    saved = {name: buffer.detach().clone() for name, buffer in current.items()}
    dropouts = [m for m in module.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    for dropout in dropouts:
        dropout.eval()
    try:
        with precision_context(module):
            yield
    finally:
        if saved:  # restored by name from a fresh walk: a buffer the pass re-assigned is restored too
            with torch.no_grad():
                for name, buffer in module.named_buffers():
                    buffer.copy_(saved[name])
        for dropout in dropouts:
            dropout.train()


def precision_context(module: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """Lightning's precision context of the trainer driving ``module`` (autocast under ``bf16-mixed``); none without
    a trainer."""
    trainer = getattr(module, "_trainer", None)
    plugin = getattr(trainer, "precision_plugin", None) if trainer is not None else None
    return plugin.forward_context() if plugin is not None else contextlib.nullcontext()
