"""Job knobs of the simulated attacks and the attack_adaptive preset (jobs/build.py)."""

from __future__ import annotations

import dataclasses

import pytest

from jobs.build import PRESETS, JobBuildError, JobSpec, client_script_args


def test_no_attack_adds_no_client_option() -> None:
    assert "--attack" not in client_script_args(JobSpec(name="plain"))


def test_share_or_explicit_sites_reach_the_client_script() -> None:
    by_share = client_script_args(JobSpec(name="a", num_sites=10, attack="gaussian", malicious_fraction=0.2))
    assert "--attack gaussian --attack-start-round 0 --malicious-sites site-" in by_share
    assert by_share.split("--malicious-sites ")[1].split()[0].count("site-") == 2
    explicit = JobSpec(name="b", attack="scale", attack_strength=5.0, attack_start_round=3, malicious_sites="site-2")
    assert client_script_args(explicit).endswith(
        "--attack scale --attack-start-round 3 --malicious-sites site-2 --attack-strength 5.0"
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"attack": "backdoor", "malicious_sites": "site-1"}, "unknown attack"),
        ({"attack": "sign_flip"}, "needs malicious sites"),
        ({"attack": "sign_flip", "malicious_sites": "site-9"}, "site-9"),
        ({"attack": "sign_flip", "malicious_fraction": 1.5}, "malicious_fraction"),
    ],
)
def test_bad_attack_settings_are_refused_at_build_time(changes, message) -> None:
    with pytest.raises(JobBuildError, match=message):
        JobSpec(name="bad", **changes)


def test_preset_uses_the_shipped_checkpoint_with_ten_sites() -> None:
    preset = PRESETS["attack_adaptive"]
    assert preset.server == "attack_adaptive" and preset.num_sites == 10 and preset.arch == "lenet5"
    assert preset.server_args == {"attention_model_path": "checkpoints/attention_lenet5.pt"}
    with_attack = dataclasses.replace(preset, attack="label_flip", malicious_fraction=0.2)
    assert "--attack label_flip" in client_script_args(with_attack)
