"""Typed hyperparameters of the client algorithms: declared once per algorithm, checked in one place.

Every client algorithm declares its hyperparameters as a frozen dataclass subclassing :class:`HParams` (the
algorithm's ``hparams_class``). A field's type says what a value may be (``float``: a finite real number, ``int``:
an integer, ``Literal[...]``: one of the options, ``... | None``: may also be left unset); a number's default is
given with :func:`hparam`, which adds its range and a note on what it means, an option's as a plain default (its
``Literal`` is the whole check). Constructing the dataclass checks every field with
:func:`check_number`, :func:`check_int` or :func:`check_choice` (the client-side twins of
:mod:`aggregators.validation`, raising :class:`ClientAlgorithmError`), then :meth:`HParams.check_together` for rules
across fields, so a bad value is refused with one line naming the algorithm, the setting, the value and what is
allowed. The same declaration tells the registry which keys an algorithm takes (``client_args`` with any other key
is refused before anything is built) and gives ``ClientAlgorithm.hparams()``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from lightning_modules.algorithms.errors import ClientAlgorithmError

Interval = tuple[float, float, bool, bool]  # low, high, low_open, high_open
UNBOUNDED: Interval = (-math.inf, math.inf, False, False)
#: Metadata of a field that ``hparams()`` leaves out (an operational choice, not part of the method):
#: ``field(default=..., metadata=NOT_REPORTED)``.
NOT_REPORTED = {"reported": False}


def hparam(
    default: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
) -> Any:
    """A numeric hyperparameter field: its default, the interval it must lie in (closed ends unless ``*_open``; for
    an integer ``low`` is its minimum) and a ``note`` added to a refusal (what the value means)."""
    metadata = {"interval": (low, high, low_open, high_open), "note": note}
    return field(default=default, metadata=metadata)


def _refuse(algorithm: str, name: str, allowed: str, value: Any, note: str = "") -> typing.NoReturn:
    meaning = f" ({note})" if note else ""
    raise ClientAlgorithmError(f"{algorithm}: hyperparameter '{name}' must be {allowed}{meaning}, got {value!r}")


def interval_text(low: float, high: float, low_open: bool = False, high_open: bool = False) -> str:
    """What a real-valued hyperparameter accepts, in words: ``a finite number >= 0``, ``a number in (0, 1]``."""
    if math.isinf(low) and math.isinf(high):
        return "a finite number"
    if math.isinf(high):
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if math.isinf(low):
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_number(
    algorithm: str,
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
) -> float:
    """A real-valued hyperparameter as a float: a finite int/float (not a bool) inside the interval, else a
    :class:`ClientAlgorithmError` naming the algorithm, the setting, the value and the interval."""
    finite = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not finite or value < low or value > high or (low_open and value == low) or (high_open and value == high):
        _refuse(algorithm, name, interval_text(low, high, low_open, high_open), value, note)
    return float(value)  # JSON's 1 and 1.0 give the same float: the same bits either way


def check_int(algorithm: str, name: str, value: Any, minimum: float = -math.inf, note: str = "") -> int:
    """An integer hyperparameter (not a bool, not 2.0) of at least ``minimum``, else one line saying so."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "an integer" if math.isinf(minimum) else f"an integer >= {minimum:g}"
        _refuse(algorithm, name, "a positive integer" if minimum == 1 else allowed, value, note)
    return value


def check_choice(algorithm: str, name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """One of the options of a ``Literal`` hyperparameter, else one line listing them."""
    if value not in choices:
        raise ClientAlgorithmError(f"{algorithm}: {name} must be one of {list(choices)}, got {value!r}")
    return value


@dataclass(frozen=True)
class Kind:
    """What a field's type allows: ``base`` float or int (None for a ``Literal``), its options, whether None is."""

    base: type | None
    choices: tuple[Any, ...] | None = None
    optional: bool = False


def kind_of(hint: Any) -> Kind:
    """The :class:`Kind` of a field's type; other types are a programming error in the declaration."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a hyperparameter is one type, optionally | None, got {hint!r}")
        hint, optional = rest[0], True
    if typing.get_origin(hint) is Literal:
        return Kind(None, typing.get_args(hint), optional)
    if hint in (float, int):
        return Kind(hint, None, optional)
    raise TypeError(f"hyperparameters are float, int or Literal[...] (optionally | None), got {hint!r}")


@functools.cache
def declared_fields(hparams_cls: type[HParams]) -> tuple[tuple[dataclasses.Field, Kind], ...]:
    """Every field of a hyperparameter dataclass with its kind, in declaration order (computed once per class)."""
    hints = typing.get_type_hints(hparams_cls)
    return tuple((spec_field, kind_of(hints[spec_field.name])) for spec_field in dataclasses.fields(hparams_cls))


def check_field(algorithm: str, spec_field: dataclasses.Field, kind: Kind, value: Any) -> Any:
    """One field's value, checked against its type and interval (numbers come back as float or int)."""
    if value is None and kind.optional:
        return None
    if kind.choices is not None:
        return check_choice(algorithm, spec_field.name, value, kind.choices)
    low, high, low_open, high_open = spec_field.metadata.get("interval", UNBOUNDED)
    note = spec_field.metadata.get("note", "")
    if kind.base is int:
        return check_int(algorithm, spec_field.name, value, low, note)
    return check_number(algorithm, spec_field.name, value, low, high, low_open, high_open, note)


@dataclass(frozen=True, kw_only=True)
class HParams:
    """Base of every client algorithm's hyperparameters; subclasses are frozen, keyword-only dataclasses whose fields
    are declared with :func:`hparam`. The base itself is FedAvg's local SGD, which has none of its own (the
    learning rate, epochs and batch size are job settings)."""

    #: The algorithm's registry name, which every refusal starts with.
    algorithm: ClassVar[str] = "fedavg"

    def __post_init__(self) -> None:
        for spec_field, kind in declared_fields(type(self)):
            value = check_field(self.algorithm, spec_field, kind, getattr(self, spec_field.name))
            object.__setattr__(self, spec_field.name, value)
        self.check_together()

    def check_together(self) -> None:
        """Rules across fields, after each field passed its own check; raise :class:`ClientAlgorithmError`."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings the algorithm takes, in declaration order (what ``client_args`` may contain)."""
        return tuple(spec_field.name for spec_field in dataclasses.fields(cls))

    def reported(self) -> dict[str, Any]:
        """The values ``hparams()`` reports (logs, reports): every field not declared with ``reported=False``."""
        return {
            spec_field.name: getattr(self, spec_field.name)
            for spec_field in dataclasses.fields(self)
            if spec_field.metadata.get("reported", True)
        }
