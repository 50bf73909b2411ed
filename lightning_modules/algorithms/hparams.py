"""The client algorithms' side of the one hyperparameter declaration (`aggregators.contracts.hparams`).

Every client algorithm declares its hyperparameters as a frozen, keyword-only dataclass subclassing `HParams`
(the algorithm's ``hparams_class``), exactly as a server rule declares its own: fields typed ``float``, ``int``,
``bool``, ``str`` or ``Literal[...]`` (optionally ``| None``), numbers given with `hparam` (range and note),
rules across fields in ``check_together``. A bad value is refused with the one wording of both sides, raised as a
`ClientAlgorithmError`. The algorithm is built from it, as a server rule is its dataclass: ``ClientAlgorithm``'s
constructor takes the fields as keywords and builds the dataclass (no algorithm restates its fields in a constructor
of its own). The same declaration tells the registry which keys an algorithm takes (``client_args`` with any other
key is refused before anything is built) and gives ``ClientAlgorithm.hparams()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from aggregators.contracts import hparams as declaration
from aggregators.contracts.hparams import NOT_REPORTED, declared_fields, hparam
from lightning_modules.algorithms.errors import ClientAlgorithmError

__all__ = ["NOT_REPORTED", "HParams", "declared_fields", "hparam"]


@dataclass(frozen=True, kw_only=True)
class HParams(declaration.HParams):
    """Base of every client algorithm's hyperparameters. The base itself is FedAvg's local SGD, which has none of its
    own (the learning rate, epochs and batch size are job settings)."""

    name: ClassVar[str] = "fedavg"
    error: ClassVar[type[Exception]] = ClientAlgorithmError
