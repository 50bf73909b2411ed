"""The NVFlare controller's round settings come from their one declaration (jobs/settings.py): the same defaults,
and a bad value refused when the controller is built, with one line naming the setting, the value and what is
allowed (before, clients_per_round=1.5 was accepted and ended the job at round 1)."""

from __future__ import annotations

import inspect

import pytest

from controllers.fedalg_controller import FedAlgController
from jobs.settings import DataSettings, JobBuildError, RoundSettings

#: controller argument -> the declared setting it is (jobs/settings.py)
DECLARED_AS = {
    "num_rounds": "num_rounds",
    "rule": "server",
    "clients_per_round": "clients_per_round",
    "min_responses": "min_responses",
    "min_accepted": "min_accepted",
    "train_timeout": "train_timeout",
    "save_client_updates": "save_client_updates",
    "resume_from": "resume_from",
    "final_site_eval": "final_site_eval",
}


def test_defaults_are_the_declared_ones():
    parameters = inspect.signature(FedAlgController).parameters
    declared = RoundSettings()
    for argument, name in DECLARED_AS.items():
        assert parameters[argument].default == getattr(declared, name), argument
    assert parameters["seed"].default == DataSettings().seed
    assert parameters["rule_args"].default is None and declared.server_args == {}  # None means no arguments
    assert FedAlgController().num_rounds == declared.num_rounds == 10


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
        ({"rule_args": [1]}, "rule_args (job setting 'server_args') must be a JSON object, got [1]"),
        ({"rule": 3}, "rule (job setting 'server') must be text, got 3"),
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
        FedAlgController(**arguments)
    assert str(caught.value) == message
    assert isinstance(caught.value, ValueError)  # what NVFlare reports when a component cannot be built


@pytest.mark.parametrize(
    "arguments",
    [
        {},
        {"clients_per_round": 0.5, "min_responses": 2, "min_accepted": 2},
        {"clients_per_round": 3, "train_timeout": 30, "seed": 7, "num_rounds": 1},
        {"rule": "scaffold", "rule_args": {"server_lr": 0.5}, "clients_per_round": 1.0},
    ],
)
def test_good_settings_are_kept_as_given(arguments):
    controller = FedAlgController(**arguments)
    for name, value in arguments.items():
        assert getattr(controller, name) == value
