"""``aggregators.registry.build_rule``: names, hyperparameters and the errors a job builder shows."""

from __future__ import annotations

import re

import pytest

from aggregators.fedavg import FedAvg
from aggregators.registry import RULES, build_rule
from aggregators.types import AggregationError


def test_fedavg_is_registered_under_its_name():
    assert RULES["fedavg"] is FedAvg
    for name, rule_cls in RULES.items():
        assert rule_cls.name == name


def test_build_rule_with_defaults_and_with_hyperparameters():
    # Execute
    default = build_rule("fedavg")
    tuned = build_rule("fedavg", server_lr=0.5)

    # Assert
    assert isinstance(default, FedAvg) and default.server_lr == 1.0
    assert isinstance(tuned, FedAvg) and tuned.server_lr == 0.5


@pytest.mark.parametrize("name", ["fedfoo", "FedAvg", "", "fed avg"])
def test_unknown_rule_lists_every_valid_name(name):
    # Execute
    with pytest.raises(AggregationError) as info:
        build_rule(name)

    # Assert
    message = str(info.value)
    assert f"'{name}'" in message
    for valid in RULES:
        assert valid in message


@pytest.mark.parametrize(
    ("kwargs", "mentions"),
    [
        ({"lr": 0.1}, "lr"),  # unknown hyperparameter
        ({"server_lr": "fast"}, "fedavg"),  # wrong type (TypeError inside the rule); the message names only the rule
        ({"server_lr": 0.0}, "server_lr"),  # invalid value (the rule's own check)
        ({"server_lr": -2.0}, "server_lr"),
    ],
)
def test_bad_hyperparameters_are_an_aggregation_error(kwargs, mentions):
    # Execute
    with pytest.raises(AggregationError) as info:
        build_rule("fedavg", **kwargs)

    # Assert
    message = str(info.value)
    assert "fedavg" in message
    assert re.search(rf"\b{mentions}\b", message)


def test_aggregation_error_is_a_value_error():
    assert issubclass(AggregationError, ValueError)
