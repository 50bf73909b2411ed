"""One hyperparameter declaration for server rules and client algorithms (aggregators/hparams.py): every registered
rule and every registered client algorithm declares its settings as fields, the registries take the accepted keys
from that declaration, and a bad value of any field is refused with the one wording

    <name>: hyperparameter '<field>' must be <allowed> (<note>), got <value>

as an ``AggregationError`` for a rule and a ``ClientAlgorithmError`` for a client algorithm."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest

from aggregators import RULES, AggregationError, build_rule
from aggregators.hparams import HParams, Kind, declared_fields, kind_of, refusal
from aggregators.registry import rule_settings
from lightning_modules.algorithms import CLIENT_ALGORITHMS, ClientAlgorithmError, build_client_algorithm


def _bad_values(spec_field: dataclasses.Field, kind: Kind) -> list[Any]:
    """Values a field of this kind must refuse: wrong types, non-finite numbers and the first value outside its
    interval on each bounded side."""
    if kind.choices is not None:
        return ["nope", 3]
    if kind.base is bool:
        return ["true", 1]
    if kind.base is str:
        return [3, b"path"]
    low, high, low_open, high_open = spec_field.metadata.get("interval", (-math.inf, math.inf, False, False))
    if kind.base is int:
        outside = [low - 1] if math.isfinite(low) else []
        return [1.5, True, "2", *outside]
    outside = [low if low_open else low - 1] if math.isfinite(low) else []
    outside += [high if high_open else high + 1] if math.isfinite(high) else []
    return [math.nan, math.inf, True, "0.1", *outside]


def _cases(declarations: dict[str, type]) -> list[tuple[str, str, Any]]:
    return [
        (name, spec_field.name, value)
        for name, declared in sorted(declarations.items())
        for spec_field, kind in declared_fields(declared)
        if kind.base is not None or kind.choices is not None
        for value in _bad_values(spec_field, kind)
    ]


def _one_wording(name: str, field_name: str, value: Any) -> str:
    return rf"^{re.escape(name)}: hyperparameter '{field_name}' must be .+, got {re.escape(repr(value))}$"


ALGORITHM_HPARAMS = {name: cls.hparams_class for name, cls in CLIENT_ALGORITHMS.items()}


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_rule_declares_its_hyperparameters_and_the_registry_takes_its_keys_from_it(name):
    rule_cls = RULES[name]
    assert issubclass(rule_cls, HParams) and rule_cls.error is AggregationError and rule_cls.name == name
    assert rule_settings(rule_cls) == rule_cls.names()
    assert rule_cls.names() == tuple(f.name for f in dataclasses.fields(rule_cls) if f.init)


@pytest.mark.parametrize(("name", "field_name", "value"), _cases(RULES))
def test_every_rule_refuses_a_bad_value_of_every_field_with_the_one_wording(name, field_name, value):
    with pytest.raises(AggregationError, match=_one_wording(name, field_name, value)):
        build_rule(name, **{field_name: value})


@pytest.mark.parametrize(("name", "field_name", "value"), _cases(ALGORITHM_HPARAMS))
def test_every_client_algorithm_refuses_a_bad_value_of_every_field_with_the_one_wording(name, field_name, value):
    with pytest.raises(ClientAlgorithmError, match=_one_wording(name, field_name, value)):
        build_client_algorithm(name, **{field_name: value})


def test_the_cases_cover_every_numeric_field_of_both_sides():
    """The two tests above are not vacuous: each side has numeric fields, and every one of them is exercised."""
    for declarations in (RULES, ALGORITHM_HPARAMS):
        numeric = {
            (name, f.name)
            for name, declared in declarations.items()
            for f, kind in declared_fields(declared)
            if kind.base in (float, int)
        }
        assert numeric and numeric <= {(name, field_name) for name, field_name, _ in _cases(declarations)}
    assert ("fedadam", "tau") in {(n, f) for n, f, _ in _cases(RULES)}


def test_the_wording_names_the_owner_the_field_what_is_allowed_the_note_and_the_value():
    assert refusal("krum", "num_selected", "a positive integer", 0, "m") == (
        "krum: hyperparameter 'num_selected' must be a positive integer (m), got 0"
    )
    assert refusal("fedprox", "mu", "a finite number >= 0", "x") == (
        "fedprox: hyperparameter 'mu' must be a finite number >= 0, got 'x'"
    )


def test_a_value_in_range_comes_back_as_its_declared_type():
    rule = build_rule("fedatt", epsilon=1, seed=3)
    assert rule.epsilon == 1.0 and isinstance(rule.epsilon, float) and rule.seed == 3
    assert build_rule("fedadam").server_lr == 0.01 and build_rule("fedavgm").beta1 == 0.9  # variant defaults


def test_a_field_type_outside_the_declaration_is_a_programming_error():
    with pytest.raises(TypeError, match="CHECKED_TOGETHER"):
        kind_of(dict[str, int])
    with pytest.raises(TypeError, match="one type"):
        kind_of(int | str | None)
