"""One declaration of hyperparameters for the server rules and the client algorithms, one checker, one wording.

A rule (``aggregators/*.py``) or a client algorithm's hyperparameters (``lightning_modules/algorithms/*.py``) are a
frozen dataclass subclassing `HParams`. A field's type says what a value may be (``float``: a finite real
number, ``int``: an integer, ``bool``: true or false, ``str``: text, ``Literal[...]``: one of the options,
``... | None``: may also be left unset); a number's default is given with `hparam`, which adds its range and a
note on what it means. Constructing the dataclass checks every field, then `HParams.check_together` runs the
rules across fields, so a bad value is refused with one line, worded alike on both sides::

    <name>: hyperparameter '<field>' must be <allowed> (<note>), got <value>

raised as the declaration's `HParams.error` (``AggregationError`` for rules, ``ClientAlgorithmError`` for
client algorithms). The same declaration tells the registries which keys a rule or an algorithm takes
(`HParams.names`): any other key is refused before anything is built.

Neither torch nor NVFlare: both sides import it (``lightning_modules`` imports ``aggregators``, never the reverse).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from aggregators.types import AggregationError

Interval = tuple[float, float, bool, bool]  # low, high, low_open, high_open
UNBOUNDED: Interval = (-math.inf, math.inf, False, False)
#: Metadata of a field that ``reported()`` leaves out (an operational choice, not part of the method):
#: ``field(default=..., metadata=NOT_REPORTED)``.
NOT_REPORTED = {"reported": False}
#: Metadata of a field whose type no field check covers (a mapping, say): ``check_together`` checks it instead.
CHECKED_TOGETHER = {"checked_together": True}


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


def refusal(name: str, field_name: str, allowed: str, value: Any, note: str = "") -> str:
    """The one wording of a refused hyperparameter, for rules and client algorithms alike."""
    meaning = f" ({note})" if note else ""
    return f"{name}: hyperparameter '{field_name}' must be {allowed}{meaning}, got {value!r}"


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
    name: str,
    field_name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
    error: type[Exception] = ValueError,
) -> float:
    """A real-valued hyperparameter as a float: a finite int/float (not a bool) inside the interval, else ``error``
    naming the rule or algorithm, the field, the value and the interval."""
    finite = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not finite or value < low or value > high or (low_open and value == low) or (high_open and value == high):
        raise error(refusal(name, field_name, interval_text(low, high, low_open, high_open), value, note))
    return float(value)  # JSON's 1 and 1.0 give the same float: the same bits either way


def check_int(
    name: str,
    field_name: str,
    value: Any,
    minimum: float = -math.inf,
    note: str = "",
    error: type[Exception] = ValueError,
) -> int:
    """An integer hyperparameter (a Python or numpy integer; not a bool, not 2.0) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        allowed = "an integer" if math.isinf(minimum) else f"an integer >= {minimum:g}"
        raise error(refusal(name, field_name, "a positive integer" if minimum == 1 else allowed, value, note))
    return int(value)


def check_choice(
    name: str,
    field_name: str,
    value: Any,
    choices: tuple[Any, ...],
    note: str = "",
    error: type[Exception] = ValueError,
) -> Any:
    """One of the options of a ``Literal`` hyperparameter, else one line listing them."""
    if value not in choices:
        raise error(refusal(name, field_name, f"one of {list(choices)}", value, note))
    return value


@dataclass(frozen=True)
class Kind:
    """What a field's type allows: ``base`` float, int, bool or str (None for a ``Literal`` or a field that
    ``check_together`` checks), its options, whether None is."""

    base: type | None
    choices: tuple[Any, ...] | None = None
    optional: bool = False


def kind_of(hint: Any) -> Kind:
    """The `Kind` of a field's type; other types are a programming error in the declaration."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a hyperparameter is one type, optionally | None, got {hint!r}")
        hint, optional = rest[0], True
    if typing.get_origin(hint) is Literal:
        return Kind(None, typing.get_args(hint), optional)
    if hint in (float, int, bool, str):
        return Kind(hint, None, optional)
    raise TypeError(
        f"hyperparameters are float, int, bool, str or Literal[...] (optionally | None), got {hint!r}; "
        "declare other types with metadata=CHECKED_TOGETHER and check them in check_together"
    )


@functools.cache
def declared_fields(hparams_cls: type[HParams]) -> tuple[tuple[dataclasses.Field, Kind], ...]:
    """Every constructor field of a hyperparameter dataclass with its kind, in declaration order (computed once per
    class); a ``CHECKED_TOGETHER`` field has a kind with neither base nor options."""
    hints = typing.get_type_hints(hparams_cls)
    return tuple(
        (spec_field, Kind(None) if spec_field.metadata.get("checked_together") else kind_of(hints[spec_field.name]))
        for spec_field in dataclasses.fields(hparams_cls)
        if spec_field.init
    )


def check_field(name: str, spec_field: dataclasses.Field, kind: Kind, value: Any, error: type[Exception]) -> Any:
    """One field's value, checked against its type and interval (numbers come back as float or int)."""
    note = spec_field.metadata.get("note", "")
    if (value is None and kind.optional) or (kind.base is None and kind.choices is None):
        return value
    if kind.choices is not None:
        return check_choice(name, spec_field.name, value, kind.choices, note, error)
    if kind.base is bool or kind.base is str:
        if not isinstance(value, kind.base):
            raise error(refusal(name, spec_field.name, "true or false" if kind.base is bool else "text", value, note))
        return value
    low, high, low_open, high_open = spec_field.metadata.get("interval", UNBOUNDED)
    if kind.base is int:
        return check_int(name, spec_field.name, value, low, note, error)
    return check_number(name, spec_field.name, value, low, high, low_open, high_open, note, error)


@dataclass(frozen=True)
class HParams:
    """Base of every hyperparameter declaration: a server rule (through `RuleHParams`) or a client
    algorithm's hyperparameters (``lightning_modules.algorithms.hparams.HParams``). Subclasses are frozen
    dataclasses whose fields are the hyperparameters."""

    #: The registry name of the rule or algorithm, which every refusal starts with.
    name: ClassVar[str] = ""
    #: What a refusal raises.
    error: ClassVar[type[Exception]] = ValueError

    def __post_init__(self) -> None:
        for spec_field, kind in declared_fields(type(self)):
            value = check_field(self.name, spec_field, kind, getattr(self, spec_field.name), self.error)
            object.__setattr__(self, spec_field.name, value)
        self.check_together()

    def check_together(self) -> None:
        """Rules across fields (or on a ``CHECKED_TOGETHER`` field), after each field passed its own check; refuse
        with `refuse`."""

    def refuse(self, field_name: str, allowed: str, value: Any, note: str = "") -> typing.NoReturn:
        """Raise the one-line refusal of ``field_name`` (from `check_together`)."""
        raise self.error(refusal(self.name, field_name, allowed, value, note))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The settings the constructor takes, in declaration order (the keys a job's arguments may contain)."""
        return tuple(spec_field.name for spec_field in dataclasses.fields(cls) if spec_field.init)

    def reported(self) -> dict[str, Any]:
        """The values worth reporting (logs, reports): every setting not declared with ``NOT_REPORTED``."""
        return {
            spec_field.name: getattr(self, spec_field.name)
            for spec_field in dataclasses.fields(self)
            if spec_field.init and spec_field.metadata.get("reported", True)
        }


@dataclass(frozen=True)
class RuleHParams(HParams):
    """Base of the server rules (and companions) that declare their hyperparameters as dataclass fields: a bad value
    is an `AggregationError`."""

    error: ClassVar[type[Exception]] = AggregationError
