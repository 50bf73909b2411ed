"""The NVFlare controller's round settings come from their one declaration (jobs/settings.py): the same defaults,
and a bad value refused when the controller is built, with one line naming the setting, the value and what is
allowed (before, clients_per_round=1.5 was accepted and ended the job at round 1)."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from controllers.fedalg_controller import ControllerSettings, FedAlgController
from jobs.settings import DataSettings, JobBuildError, RoundSettings


def test_defaults_are_the_declared_ones():
    parameters = inspect.signature(FedAlgController).parameters
    assert set(parameters) == {"settings", "evaluator_id", "persistor_id", "task_check_period"}  # one settings value
    declared, settings = RoundSettings(), FedAlgController().round_settings
    for spec_field in dataclasses.fields(RoundSettings):  # every round setting, by its job name
        assert getattr(settings, spec_field.name) == getattr(declared, spec_field.name), spec_field.name
    assert settings.seed == DataSettings().seed
    assert settings.server_args == declared.server_args == {}  # no arguments
    assert FedAlgController().round_settings.num_rounds == declared.num_rounds == 10


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"min_responses": 0}, "min_responses must be an integer >= 1 or none, got 0"),
        ({"train_timeout": -5}, "train_timeout must be an integer >= 0, got -5"),
        ({"num_rounds": 0}, "num_rounds must be an integer >= 1, got 0"),
        ({"num_rounds": True}, "num_rounds must be an integer >= 1, got True"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"min_accepted": 2.0}, "min_accepted must be an integer >= 1, got 2.0"),
        ({"clients_per_round": float("nan")}, "clients_per_round must be a finite number > 0 or none, got nan"),
        (
            {"clients_per_round": 1.5},
            "clients_per_round must be none (all sites), an integer count >= 1 or a fraction in (0, 1] written "
            "with a dot, got 1.5",
        ),
        ({"server_args": [1]}, "server_args must be a JSON object, got [1]"),
        ({"server": 3}, "server must be text, got 3"),
        (
            {"clients_per_round": 2, "min_responses": 3},
            "min_responses must be at most the 2 site(s) sampled per round (clients_per_round), got 3",
        ),
        (
            {"min_responses": 2, "min_accepted": 3},
            "min_accepted must be at most the 2 result(s) a round waits for, got 3",
        ),
    ],
)
def test_a_bad_setting_is_refused_at_construction_with_one_line(arguments, message):
    with pytest.raises(JobBuildError) as caught:
        FedAlgController(settings=arguments)
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError)  # what NVFlare reports when a component cannot be built


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"clients_per_round": 0.5, "min_responses": 2, "min_accepted": 2},
        {"clients_per_round": 3, "train_timeout": 30, "seed": 7, "num_rounds": 1},
        {"server": "scaffold", "server_args": {"server_lr": 0.5}, "clients_per_round": 1.0},
    ],
)
def test_good_settings_are_kept_as_given(arguments):
    controller = FedAlgController(settings=arguments)
    for name, value in arguments.items():
        assert getattr(controller.round_settings, name) == value


def test_the_settings_are_one_typed_value_whose_plain_form_round_trips():
    """What the builder passes, what NVFlare writes into config_fed_server.json and what the controller reads back
    are the same value: the plain form (JSON) turns back into an equal typed value, and the typed value is taken as
    it is."""
    typed = ControllerSettings(
        server="fedyogi",
        server_args={"server_lr": 0.05},
        num_rounds=3,
        clients_per_round=0.5,
        seed=7,
        stop_patience=2,
        local_keys=("net.classifier.weight", "net.classifier.bias"),
        companions={"scaffold_control": {}},
    )
    plain = typed.as_dict()
    assert json.loads(json.dumps(plain)) == plain
    assert ControllerSettings.from_dict(plain) == typed
    assert FedAlgController(settings=typed).round_settings is typed
    controller = FedAlgController(settings=plain)
    assert controller.round_settings == typed and controller.settings == plain
    # The rounds' settings are always written, the opt-in ones only when used.
    assert set(ControllerSettings().as_dict()) == set(ControllerSettings.ALWAYS_WRITTEN)


def test_a_name_that_is_not_a_setting_is_refused_in_one_line():
    with pytest.raises(JobBuildError, match=r"^unknown controller setting\(s\) \['rule'\]; the settings are \["):
        FedAlgController(settings={"rule": "fedavg"})
