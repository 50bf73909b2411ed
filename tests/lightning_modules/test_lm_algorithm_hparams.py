"""Every client algorithm declares its hyperparameters once, as a frozen dataclass (lightning_modules/algorithms/
hparams.py, on the declaration the server rules share: aggregators/contracts/hparams.py): the constructor, the
registry's key check and ``hparams()`` all come from it, and a bad value or an unknown key is refused with one line
naming the algorithm, the setting, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import typing

import pytest

from aggregators.contracts.hparams import check_choice, check_int, check_number
from lightning_modules.algorithms import CLIENT_ALGORITHMS, ClientAlgorithmError, HParams, build_client_algorithm
from lightning_modules.algorithms.hparams import declared_fields
from lightning_modules.algorithms.registry import client_args_problem, declared_hparams

ALGORITHMS = sorted(CLIENT_ALGORITHMS)


def _float_fields(name: str, optional: bool | None = None) -> list[str]:
    """The real-valued fields of an algorithm (only those that may, or may not, be None when ``optional`` says)."""
    hparams_cls = CLIENT_ALGORITHMS[name].hparams_class
    return [
        f.name for f, kind in declared_fields(hparams_cls) if kind.base is float and optional in (None, kind.optional)
    ]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_declares_a_frozen_dataclass_named_after_it(name):
    algorithm_cls = CLIENT_ALGORITHMS[name]
    hparams_cls = declared_hparams(algorithm_cls)
    assert hparams_cls is algorithm_cls.hparams_class and issubclass(hparams_cls, HParams)
    assert dataclasses.is_dataclass(hparams_cls) and hparams_cls.__dataclass_params__.frozen
    assert hparams_cls.name == algorithm_cls.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        hparams_cls().algorithm_is_frozen = 1


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_constructor_takes_exactly_the_declared_fields_with_their_defaults(name):
    algorithm_cls = CLIENT_ALGORITHMS[name]
    hparams_cls = algorithm_cls.hparams_class
    parameters = list(inspect.signature(algorithm_cls).parameters.values())
    assert [p.name for p in parameters] == list(hparams_cls.names())
    defaults = hparams_cls()
    assert {p.name: p.default for p in parameters} == {n: getattr(defaults, n) for n in hparams_cls.names()}
    # The signature is what the constructor takes: every declared field by keyword, and nothing else.
    built = algorithm_cls(**{n: getattr(defaults, n) for n in hparams_cls.names()})
    assert built.hyperparameters == defaults
    with pytest.raises(TypeError, match="undeclared"):
        algorithm_cls(undeclared=1)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_algorithm_is_built_from_its_dataclass_without_restating_its_fields(name):
    """As a server rule is its dataclass: the base constructor builds ``hparams_class``; a constructor of the
    algorithm's own would restate every field (and drift from the declaration)."""
    algorithm_cls = CLIENT_ALGORITHMS[name]
    own = [klass.__name__ for klass in algorithm_cls.__mro__[:-2] if "__init__" in vars(klass)]
    assert own == [], f"{name}: {own} define __init__; declare hparams_class and override init_state instead"


@pytest.mark.parametrize("name", ALGORITHMS)
def test_hparams_are_derived_from_the_declaration(name):
    algorithm = build_client_algorithm(name)
    assert algorithm.hparams() == algorithm.hyperparameters.reported()
    for field_name in algorithm.hparams_class.names():
        assert getattr(algorithm, field_name) == getattr(algorithm.hyperparameters, field_name)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_unknown_key_is_refused_naming_the_allowed_ones(name):
    allowed = CLIENT_ALGORITHMS[name].hparams_class.names()
    problem = client_args_problem(name, {"zzz": 1})
    assert problem == f"{name} has no setting 'zzz'; " + (
        f"allowed: {', '.join(allowed)}" if allowed else "it takes none"
    )
    message = f"bad hyperparameters for client algorithm '{name}': {problem}"
    with pytest.raises(ClientAlgorithmError, match=re.escape(message)):
        build_client_algorithm(name, zzz=1)
    assert client_args_problem(name, dict.fromkeys(allowed, None)) is None


@pytest.mark.parametrize(
    ("name", "field_name"), [(name, field) for name in ALGORITHMS for field in _float_fields(name)]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "0.1"])
def test_every_real_valued_hyperparameter_must_be_a_finite_number(name, field_name, value):
    with pytest.raises(ClientAlgorithmError, match=rf"^{name}: hyperparameter '{field_name}' must be .*, got "):
        build_client_algorithm(name, **{field_name: value})


@pytest.mark.parametrize(
    ("name", "field_name"), [(name, field) for name in ALGORITHMS for field in _float_fields(name, optional=False)]
)
def test_a_real_valued_hyperparameter_may_be_none_only_when_declared_optional(name, field_name):
    with pytest.raises(ClientAlgorithmError, match=rf"^{name}: hyperparameter '{field_name}' must be .*, got None$"):
        build_client_algorithm(name, **{field_name: None})


@pytest.mark.parametrize(
    ("name", "field_name"),
    [
        (name, f.name)
        for name in ALGORITHMS
        for f, kind in declared_fields(CLIENT_ALGORITHMS[name].hparams_class)
        if kind.choices is not None
    ],
)
def test_every_option_is_refused_outside_its_literal(name, field_name):
    hint = typing.get_type_hints(CLIENT_ALGORITHMS[name].hparams_class)[field_name]
    choices = list(typing.get_args(hint))
    with pytest.raises(ClientAlgorithmError) as info:
        build_client_algorithm(name, **{field_name: "nope"})
    assert str(info.value) == f"{name}: hyperparameter '{field_name}' must be one of {choices}, got 'nope'"


def test_whole_numbers_become_floats_so_json_1_and_1_0_train_alike():
    mu = build_client_algorithm("fedprox", mu=1).mu
    assert mu == 1.0 and isinstance(mu, float)
    assert build_client_algorithm("moon", mu=2).hparams() == {"mu": 2.0, "temperature": 0.5, "history_size": 1}


def test_shared_checks_word_the_interval():
    error = ClientAlgorithmError
    with pytest.raises(error, match=r"^x: hyperparameter 'a' must be a finite number in \(0, 1\] \(why\), got 0$"):
        check_number("x", "a", 0, 0, 1, low_open=True, note="why", error=error)
    with pytest.raises(error, match=r"^x: hyperparameter 'b' must be a finite number > 0, got -1$"):
        check_number("x", "b", -1, 0, low_open=True, error=error)
    with pytest.raises(error, match=r"^x: hyperparameter 'c' must be an integer >= 2, got 2.0$"):
        check_int("x", "c", 2.0, 2, error=error)
    with pytest.raises(error, match=r"^x: hyperparameter 'd' must be an integer >= 1, got True$"):
        check_int("x", "d", True, 1, error=error)
    with pytest.raises(error, match=r"^x: hyperparameter 'e' must be one of \['p', 'q'\], got \['p'\]$"):
        check_choice("x", "e", ["p"], ("p", "q"), error=error)
    assert check_number("x", "f", 1, 0, 1) == 1.0 and check_int("x", "g", 3, 1) == 3


def test_cross_field_rules_run_after_each_field():
    needed = r"'population_size' must be a positive integer \(alpha_weighting='samples' needs it\), got None$"
    with pytest.raises(ClientAlgorithmError, match=needed):
        build_client_algorithm("feddyn", alpha_weighting="samples", total_samples=10)
    unused = r"^feddyn: hyperparameter 'total_samples' must be left unset \(used only with .*\), got 10$"
    with pytest.raises(ClientAlgorithmError, match=unused):
        build_client_algorithm("feddyn", total_samples=10)
    algorithm = build_client_algorithm("feddyn", alpha_weighting="samples", population_size=3, total_samples=9)
    assert algorithm.hparams() == {"alpha_weighting": "samples", "population_size": 3, "total_samples": 9}


def test_operational_choices_are_settings_but_not_reported():
    algorithm = build_client_algorithm("moon", on_bad_history="reset")
    assert algorithm.on_bad_history == "reset" and "on_bad_history" not in algorithm.hparams()
    assert "on_bad_history" in CLIENT_ALGORITHMS["moon"].hparams_class.names()
