"""The client script's options come from the one declaration of the settings: every committed job's command line
parses back to the job's values, and a hand-written bad value is refused like the builder refuses it."""

from __future__ import annotations

import json

import pytest

from jobs.client import build_parser
from jobs.presets import PRESETS
from jobs.settings import CLIENT, JSON_FIELDS, setting_fields
from jobs.spec import client_script_args


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_committed_job_command_line_parses_back_to_its_settings(name):
    spec = PRESETS[name]
    args = build_parser().parse_args(client_script_args(spec).split())
    for spec_field, _ in setting_fields():
        if spec_field.metadata["side"] != CLIENT or spec_field.name in {"malicious_sites", "arch_args"}:
            continue
        parsed = getattr(args, spec_field.name)
        if spec_field.name in JSON_FIELDS:
            parsed = json.loads(parsed)
        assert parsed == getattr(spec, spec_field.name), spec_field.name


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "nan"], "lr must be a finite number > 0, got nan"),
        (["--epochs", "0"], "epochs must be an integer >= 1, got 0"),
        (["--momentum", "1"], "momentum must be a finite number in [0, 1), got 1.0"),
        (["--client-args", "[1]"], "--client-args: expected a JSON object"),
    ],
)
def test_a_hand_written_bad_value_is_refused_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err
