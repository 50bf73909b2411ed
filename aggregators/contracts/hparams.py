"""The one declaration of typed, ranged settings: server rules, client algorithms and job settings alike.

A setting is a field of a frozen dataclass. Its type says what a value may be (``float``: a finite real number,
``int``: an integer, ``int | float``: a finite real number kept as given, ``bool``: true or false, ``str``: text,
``dict[str, Any]``: a JSON object, ``Literal[...]``: one of the options, ``... | None``: may also be left unset);
its metadata holds the interval a number must lie in (`interval`). From that declaration one reader
(`declared_fields`, `kind_of`) gives each field's `Kind`, one checker (`fits`) says whether a value is allowed and
one wording (`allowed_text`) says, in words, what is. The three declarations built on it:

- a server rule (``aggregators/*.py``) and a client algorithm's hyperparameters
  (``lightning_modules/algorithms/*.py``) subclass `HParams` and give numbers with `hparam` (range plus a note on
  what the value means). Constructing the dataclass checks every field, then `HParams.check_together` runs the rules
  across fields; a refusal is one line raised as the declaration's `HParams.error` (``AggregationError`` for rules,
  ``ClientAlgorithmError`` for client algorithms)::

      <name>: hyperparameter '<field>' must be <allowed> (<note>), got <value>

  The same declaration tells the registries which keys a rule or an algorithm takes (`HParams.names`);
- the job settings (`aggregators.contracts.job_settings`, read by ``jobs`` and ``controllers``) give fields with
  ``setting`` (help text, side, interval) and are refused as ``<setting> must be <allowed>, got <value>``.

Neither torch nor NVFlare: every layer imports it (``lightning_modules``, ``jobs`` and ``controllers`` import
``aggregators``, never the reverse).
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

Interval = tuple[float, float, bool, bool]  # low, high, low_open, high_open
UNBOUNDED: Interval = (-math.inf, math.inf, False, False)
#: Metadata of a field that ``reported()`` leaves out (an operational choice, not part of the method):
#: ``field(default=..., metadata=NOT_REPORTED)``.
NOT_REPORTED = {"reported": False}
#: Metadata of a field whose type no field check covers (a mapping, say): ``check_together`` checks it instead.
CHECKED_TOGETHER = {"checked_together": True}
#: The kind of an ``int | float`` field: any finite real number, kept as given (3 sites or a 0.5 fraction).
REAL = numbers.Real


def interval(
    low: float = -math.inf, high: float = math.inf, low_open: bool = False, high_open: bool = False
) -> dict[str, Interval]:
    """Field metadata: the interval a number must lie in (closed ends unless ``*_open``; an integer's ``low`` is its
    minimum). `hparam` and ``job_settings.setting`` both store it under this one key."""
    return {"interval": (low, high, low_open, high_open)}


def hparam(
    default: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
) -> Any:
    """A numeric hyperparameter field: its default, its `interval` and a ``note`` added to a refusal (what the value
    means)."""
    return field(default=default, metadata={**interval(low, high, low_open, high_open), "note": note})


@dataclass(frozen=True)
class Kind:
    """What a field's type allows: ``base`` (float, int, bool, str, dict, `REAL` for ``int | float``, or None for a
    ``Literal`` or a field that ``check_together`` checks), its options, whether None is allowed."""

    base: type | None
    choices: tuple[Any, ...] | None = None
    optional: bool = False


def kind_of(hint: Any) -> Kind:
    """The `Kind` of a field's type; other types are a programming error in the declaration."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [arg for arg in args if arg is not type(None)]
        optional = len(rest) < len(args)
        if set(rest) == {int, float}:
            return Kind(REAL, None, optional)
        if len(rest) != 1:
            raise TypeError(f"a setting is one type (or int | float), optionally | None, got {hint!r}")
        hint = rest[0]
    if typing.get_origin(hint) is Literal:
        return Kind(None, typing.get_args(hint), optional)
    if hint in (float, int, bool, str):
        return Kind(hint, None, optional)
    if hint is dict or (typing.get_origin(hint) is dict and typing.get_args(hint) == (str, Any)):
        return Kind(dict, None, optional)  # a JSON object: its values are whatever its user checks
    raise TypeError(
        f"settings are float, int, int | float, bool, str, dict[str, Any] or Literal[...] (optionally | None), got "
        f"{hint!r}; declare other types with metadata=CHECKED_TOGETHER and check them in check_together"
    )


@functools.cache
def declared_fields(declaration: type) -> tuple[tuple[dataclasses.Field, Kind], ...]:
    """Every constructor field of a settings dataclass with its kind, in declaration order (computed once per
    class); a ``CHECKED_TOGETHER`` field has a kind with neither base nor options."""
    hints = typing.get_type_hints(declaration)
    return tuple(
        (spec_field, Kind(None) if spec_field.metadata.get("checked_together") else kind_of(hints[spec_field.name]))
        for spec_field in dataclasses.fields(declaration)
        if spec_field.init
    )


def interval_text(low: float, high: float, low_open: bool = False, high_open: bool = False) -> str:
    """What a real-valued setting accepts, in words: ``a finite number >= 0``, ``a finite number in (0, 1]``."""
    if math.isinf(low) and math.isinf(high):
        return "a finite number"
    if math.isinf(high):
        return f"a finite number {'>' if low_open else '>='} {low:g}"
    if math.isinf(low):
        return f"a finite number {'<' if high_open else '<='} {high:g}"
    return f"a finite number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def integer_text(low: float, high: float, low_open: bool = False, high_open: bool = False) -> str:
    """What an integer setting accepts, in words: ``an integer``, ``an integer >= 1``, ``an integer in [0, 9]``."""
    if math.isinf(high):
        if math.isinf(low):
            return "an integer"
        return f"an integer {'>' if low_open else '>='} {low:g}"
    return "an integer " + interval_text(low, high, low_open, high_open).removeprefix("a finite number ")


PLAIN_TEXT = {bool: "true or false", str: "text", dict: "a JSON object"}


def allowed_text(kind: Kind, bounds: Interval = UNBOUNDED) -> str:
    """What a field of this kind and interval accepts, in words: the refusals and ``--help`` of every declaration."""
    if kind.choices is not None:
        text = f"one of {list(kind.choices)}"
    elif kind.base is int:
        text = integer_text(*bounds)
    elif kind.base in (float, REAL):
        text = interval_text(*bounds)
    else:
        text = PLAIN_TEXT[kind.base]
    return f"{text} or none" if kind.optional else text


def in_interval(value: float, bounds: Interval) -> bool:
    low, high, low_open, high_open = bounds
    return low <= value <= high and not (low_open and value == low) and not (high_open and value == high)


def fits(kind: Kind, bounds: Interval, value: Any) -> bool:
    """Whether ``value`` is allowed: the one checker of every declaration. A bool is never a number; an integer is a
    Python or numpy integer (not 2.0); a real number is a finite int or float."""
    if value is None or kind.choices is not None:
        return kind.optional if value is None else value in kind.choices
    if kind.base is int:
        return not isinstance(value, bool) and isinstance(value, numbers.Integral) and in_interval(value, bounds)
    if kind.base in (float, REAL):
        real = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
        return real and in_interval(value, bounds)
    return isinstance(value, kind.base)


def field_bounds(spec_field: dataclasses.Field) -> Interval:
    return spec_field.metadata.get("interval", UNBOUNDED)


def refusal(name: str, field_name: str, allowed: str, value: Any, note: str = "") -> str:
    """The wording of a refused hyperparameter, for rules and client algorithms alike."""
    meaning = f" ({note})" if note else ""
    return f"{name}: hyperparameter '{field_name}' must be {allowed}{meaning}, got {value!r}"


def checked(
    name: str, field_name: str, kind: Kind, bounds: Interval, value: Any, note: str, error: type[Exception]
) -> Any:
    """``value`` as its declared type (a float field's 1 becomes 1.0: JSON's 1 and 1.0 give the same bits), else
    ``error`` with the `refusal` naming ``name``, the field, what is allowed and the value."""
    if not fits(kind, bounds, value):
        raise error(refusal(name, field_name, allowed_text(kind, bounds), value, note))
    if value is None or kind.base not in (float, int):
        return value
    return kind.base(value)


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
    """A real-valued hyperparameter as a float (a finite int/float, not a bool, inside the interval)."""
    return checked(name, field_name, Kind(float), (low, high, low_open, high_open), value, note, error)


def check_int(
    name: str,
    field_name: str,
    value: Any,
    minimum: float = -math.inf,
    note: str = "",
    error: type[Exception] = ValueError,
) -> int:
    """An integer hyperparameter (a Python or numpy integer; not a bool, not 2.0) of at least ``minimum``."""
    return checked(name, field_name, Kind(int), (minimum, math.inf, False, False), value, note, error)


def check_choice(
    name: str,
    field_name: str,
    value: Any,
    choices: tuple[Any, ...],
    note: str = "",
    error: type[Exception] = ValueError,
) -> Any:
    """One of the options of a ``Literal`` hyperparameter, else one line listing them."""
    return checked(name, field_name, Kind(None, choices), UNBOUNDED, value, note, error)


def check_field(name: str, spec_field: dataclasses.Field, kind: Kind, value: Any, error: type[Exception]) -> Any:
    """One field's value, checked against its type and interval (numbers come back as float or int)."""
    if kind.base is None and kind.choices is None:  # CHECKED_TOGETHER: check_together's job
        return value
    note = spec_field.metadata.get("note", "")
    return checked(name, spec_field.name, kind, field_bounds(spec_field), value, note, error)


@dataclass(frozen=True)
class HParams:
    """Base of every hyperparameter declaration: a server rule (through `aggregators.types.RuleHParams`) or a client
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
