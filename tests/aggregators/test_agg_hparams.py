"""One declaration for server rules, client algorithms and job settings (aggregators/contracts/hparams.py): every
registered rule and every registered client algorithm declares its settings as fields, the registries take the accepted
keys from that declaration, and a bad value of any field is refused with the one wording

    <name>: hyperparameter '<field>' must be <allowed> (<note>), got <value>

as an ``AggregationError`` for a rule and a ``ClientAlgorithmError`` for a client algorithm. The job settings
(aggregators/contracts/job_settings.py) are read by the same reader and checker and say what is allowed in the same
words (``<setting> must be <allowed>, got <value>``)."""

from __future__ import annotations

import dataclasses
import math
import re
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from aggregators.contracts.hparams import (
    REAL,
    HParams,
    Kind,
    allowed_text,
    declared_fields,
    field_bounds,
    hparam,
    kind_of,
    refusal,
)
from aggregators.contracts.job_settings import JOB_GROUPS, JobBuildError, SiteSettings, check_settings, setting
from aggregators.registry import RULES, build_rule, rule_settings
from aggregators.types import AggregationError
from lightning_modules.algorithms import CLIENT_ALGORITHMS, ClientAlgorithmError, build_client_algorithm


def _bad_values(spec_field: dataclasses.Field, kind: Kind) -> list[Any]:
    """Values a field of this kind must refuse: wrong types, non-finite numbers and the first value outside its
    interval on each bounded side."""
    if kind.choices is not None:
        return ["nope", 3]
    if kind.base is dict:
        return [[1], "{}"]
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
    return [math.nan, math.inf, True, "0.1", *outside, *([] if kind.optional else [None])]


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


@pytest.mark.parametrize(
    ("spec_field", "kind", "value"),
    [
        pytest.param(spec_field, kind, value, id=f"{spec_field.name}={value!r}")
        for group in (*JOB_GROUPS, SiteSettings)
        for spec_field, kind in declared_fields(group)
        for value in _bad_values(spec_field, kind)
    ],
)
def test_every_job_setting_is_checked_and_worded_by_the_one_declaration(spec_field, kind, value):
    with pytest.raises(JobBuildError) as info:
        check_settings(SimpleNamespace(**{spec_field.name: value}), (*JOB_GROUPS, SiteSettings), registries=None)
    if kind.choices is not None and value is not None:
        assert str(info.value) == f"unknown {spec_field.name} {value!r}; choose one of {list(kind.choices)}"
    else:
        allowed = allowed_text(kind, field_bounds(spec_field))
        assert str(info.value) == f"{spec_field.name} must be {allowed}, got {value!r}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ProbeHParams(HParams):
    name: ClassVar[str] = "probe"
    count: int = hparam(1, low=1)
    share: float = hparam(0.0, low=0, high=1, high_open=True)
    seed: int | None = hparam(None, low=0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ProbeSettings:
    count: int = setting(1, "a count", low=1)
    share: float = setting(0.0, "a share", low=0, high=1, high_open=True)
    seed: int | None = setting(None, "a seed", low=0)


@pytest.mark.parametrize(
    ("field_name", "value", "allowed"),
    [
        ("count", 0, "an integer >= 1"),
        ("count", 2.0, "an integer >= 1"),
        ("share", 1.0, "a finite number in [0, 1)"),
        ("share", math.nan, "a finite number in [0, 1)"),
        ("seed", -1, "an integer >= 0 or none"),
    ],
)
def test_a_setting_declared_alike_is_refused_alike_as_a_hyperparameter_and_as_a_job_setting(field_name, value, allowed):
    """The same type and interval, declared with `hparam` and with `setting`: one checker, one text of what is
    allowed (before, the job side said 'at least 1 (an integer)' where the rule side said 'a positive integer' and
    the engine 'an integer >= 1')."""
    with pytest.raises(ValueError) as as_hparam:
        _ProbeHParams(**{field_name: value})
    with pytest.raises(JobBuildError) as as_setting:
        check_settings(SimpleNamespace(**{field_name: value}), (_ProbeSettings,), registries=None)
    assert str(as_hparam.value) == refusal("probe", field_name, allowed, value)
    assert str(as_setting.value) == f"{field_name} must be {allowed}, got {value!r}"


def test_the_job_settings_kinds_come_from_the_one_reader():
    kinds = {f.name: kind for group in JOB_GROUPS for f, kind in declared_fields(group)}
    assert kinds["clients_per_round"] == Kind(REAL, None, True)  # a count or a fraction, kept as given
    assert kinds["client_args"] == Kind(dict) and kinds["num_rounds"] == Kind(int)
    assert kind_of(dict[str, Any]) == Kind(dict)
