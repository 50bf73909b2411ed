"""Which state_dict entries never leave the site (``--local-keys``): FedPer, FedBN and FedRep's head.

Partial sharing splits a model's state_dict entries into the shared ones S and the local ones L. Every round a site
loads the global model x on S, keeps its own L, trains, and sends S only; the server aggregates S only and never
touches L. Two published instances:

- FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, 2019): L = the last layer(s), the personal classifier head;
- FedBN (Li, Jiang, Zhang, Kamp, Dou, ICLR 2021): L = every BatchNorm weight, bias, ``running_mean``,
  ``running_var`` and ``num_batches_tracked``, the per-site feature normalisation.

With w = (w_S, w_L), site i's round t is ``w_S <- x_S^t; w_L <- w_L,i; (w_S', w_L,i) <- LocalTrain_i(w_S, w_L);
send w_S'`` and the server's rule maps the {w_S'} to ``x_S^{t+1}`` exactly as it maps full models without L.

This module is the pure part: the patterns (comma-separated `fnmatch` globs over state_dict names, plus the
word ``batchnorm`` for every entry of every ``torch.nn.modules.batchnorm._BatchNorm`` submodule, and the word ``head``
for the head the module declares with ``fl_head_keys()``: FedPer without typing its names) and a module ->
the sorted tuple of local names, refused in one line when a pattern matches nothing or the patterns cover every
entry (nothing would be federated). The job builder resolves them once, against the job's model, and writes the
explicit names into the client and server configs (docs/personalization.md, "Partial sharing").
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from aggregators.deltas import leaked_local_keys, shared_entries

__all__ = [
    "BATCHNORM",
    "HEAD",
    "HEAD_METHOD",
    "LocalKeysError",
    "declared_head_keys",
    "leaked_local_keys",  # the server side's half, from aggregators.deltas
    "local_keys_problem",
    "parse_local_keys",
    "resolve_local_keys",
    "shared_entries",
]

#: The pattern that stands for every entry (affine weight and bias, running statistics, batch counter) of every
#: BatchNorm layer: FedBN.
BATCHNORM = "batchnorm"
#: The method a module may define to declare its personal head (FedRep without --local-keys): returns the head's
#: state_dict names relative to the module that defines it.
HEAD_METHOD = "fl_head_keys"
#: The word that stands for the declared head in ``--local-keys`` (FedPer without typing the head's names).
HEAD = "head"


class LocalKeysError(ValueError):
    """The local-keys patterns cannot be used with this model (one line naming the pattern or the model)."""


def parse_local_keys(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """The patterns of a ``--local-keys`` value: comma-separated, blanks dropped, order kept."""
    if text is None:
        return ()
    parts = text.split(",") if isinstance(text, str) else list(text)
    return tuple(p.strip() for p in parts if p.strip())


def batchnorm_keys(module: nn.Module) -> list[str]:
    """Every state_dict name of every BatchNorm submodule of ``module`` (parameters and buffers alike)."""
    names = []
    for prefix, sub in module.named_modules():
        if isinstance(sub, _BatchNorm):
            names += [f"{prefix}.{key}" if prefix else key for key in sub.state_dict()]
    return names


def pattern_matches(pattern: str, names: Iterable[str], module: nn.Module) -> list[str]:
    """The names one pattern selects (``batchnorm``: `batchnorm_keys`; ``head``: the head the module declares,
    `declared_head_keys`, when it declares one; otherwise a case-sensitive glob)."""
    if pattern == BATCHNORM:
        return batchnorm_keys(module)
    if pattern == HEAD and declared_head_keys(module):
        return list(declared_head_keys(module))
    return [name for name in names if fnmatch.fnmatchcase(name, pattern)]


def resolve_local_keys(patterns: str | Sequence[str], module: nn.Module) -> tuple[str, ...]:
    """The sorted local state_dict names of ``module`` that ``patterns`` select (module docstring).

    Raises `LocalKeysError` naming the first pattern that matches no entry (a typo would silently federate
    what was meant to stay), and when the patterns cover every entry (no model would be federated at all).
    """
    names = list(module.state_dict())
    chosen: set[str] = set()
    for pattern in parse_local_keys(patterns):
        matched = pattern_matches(pattern, names, module)
        if not matched:
            hint = (
                "the model has no BatchNorm layer"
                if pattern == BATCHNORM
                else f"the model declares no head ({HEAD_METHOD}()); its entries are e.g. {names[-2:]}"
                if pattern == HEAD
                else f"entries are e.g. {names[:4]}"
            )
            raise LocalKeysError(f"local_keys: pattern {pattern!r} matches no state_dict entry of the model ({hint})")
        chosen.update(matched)
    if names and chosen >= set(names):
        raise LocalKeysError(
            f"local_keys: the patterns {list(parse_local_keys(patterns))} cover all {len(names)} state_dict entries: "
            "nothing would be shared with the server; keep at least one entry out of them"
        )
    return tuple(sorted(chosen))


def local_keys_problem(keys: Iterable[str], state_keys: Iterable[str]) -> str | None:
    """Why explicit local ``keys`` (already resolved by the builder) do not fit a model with ``state_keys``."""
    known = set(state_keys)
    unknown = sorted(set(keys) - known)
    if unknown:
        return f"local_keys names entries the model does not have: {unknown[:5]}; the job was built for another model"
    if known and set(keys) >= known:
        return "local_keys cover every entry of the model: nothing would be shared"
    return None


def declared_head_keys(module: nn.Module) -> tuple[str, ...]:
    """The head the module declares: ``fl_head_keys()`` of the outermost submodule that defines it (its names
    prefixed with that submodule's path), or ``()`` when none does."""
    for prefix, sub in module.named_modules():
        hook = getattr(sub, HEAD_METHOD, None)
        if callable(hook):
            return tuple(sorted(f"{prefix}.{key}" if prefix else key for key in hook()))
    return ()
