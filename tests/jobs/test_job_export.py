"""Exported job folders are generated, committed, and checked (docs/design.md, decision 10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.build import JOBS_DIR, PRESETS, JobBuildError, JobSpec, check_presets, export_job, main


def test_committed_job_folders_match_the_builder():
    differences = check_presets()
    assert differences == [], "regenerate with `python -m jobs.build --presets`:\n" + "\n".join(differences)


def test_check_detects_a_hand_edited_job(tmp_path):
    for spec in PRESETS.values():
        export_job(spec, tmp_path)
    config = tmp_path / "fedavg" / "app" / "config" / "config_fed_server.json"
    config.write_text(config.read_text().replace('"num_rounds": 10', '"num_rounds": 11'))
    assert check_presets(tmp_path) == ["fedavg: app/config/config_fed_server.json differs"]


def test_exported_job_uses_relative_paths_only(tmp_path):
    job_dir = export_job(JobSpec(name="relpaths"), tmp_path)
    for path in job_dir.rglob("*.json"):
        text = path.read_text()
        assert str(tmp_path) not in text and str(JOBS_DIR) not in text and "/work/" not in text, path


def test_exported_job_wires_our_controller_rule_and_sample_weights(tmp_path):
    job_dir = export_job(JobSpec(name="wiring", num_rounds=4, server_args={"server_lr": 1.0}), tmp_path)
    server = json.loads((job_dir / "app" / "config" / "config_fed_server.json").read_text())
    controller = server["workflows"][0]
    assert controller["path"] == "controllers.fedalg_controller.FedAlgController"
    assert controller["args"]["settings"]["num_rounds"] == 4
    assert controller["args"]["settings"]["server"] == "fedavg"
    assert controller["args"]["settings"]["server_args"] == {"server_lr": 1.0}
    client = json.loads((job_dir / "app" / "config" / "config_fed_client.json").read_text())
    args = client["executors"][0]["executor"]["args"]
    assert args["task_script_path"] == "client.py"
    assert "--client fedavg" in args["task_script_args"]
    assert (job_dir / "app" / "custom" / "client.py").is_file()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"client": "nope"}, "unknown client 'nope'"),
        ({"server": "nope"}, "unknown server 'nope'"),
        ({"dataset": "cifar10"}, "unknown dataset 'cifar10'"),
        ({"arch": "mlp"}, "does not fit dataset"),
        ({"precision": "16-mixed"}, "unknown precision '16-mixed'"),
        ({"num_rounds": 0}, "num_rounds must be an integer >= 1"),
    ],
)
def test_bad_specs_fail_at_build_time(overrides, message):
    with pytest.raises(JobBuildError, match=message):
        JobSpec(name="bad", **overrides)


def test_cli_reports_bad_input_in_one_line(capsys):
    assert main(["--client", "nope", "--output-dir", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown client 'nope'") and "\n" not in err


def test_cli_exports_a_composed_job(tmp_path, capsys):
    assert main(["--client", "fedavg", "--server", "fedavg", "--num-rounds", "2", "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "fedavg_fedavg" / "meta.json").is_file()
    assert "exported" in capsys.readouterr().out


def test_client_script_help_runs_without_nvflare_session():
    import subprocess
    import sys

    script = Path(JOBS_DIR) / "client.py"
    completed = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    assert "--client-args" in completed.stdout


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_committed_job_carries_the_thin_client_script(preset):
    """The job's client.py is the launcher of the installed bundle's client (jobs/site_script/client.py), not the
    client's code: at most 40 lines, calling jobs.client.main."""
    from jobs.assembly import SITE_SCRIPT

    text = (JOBS_DIR / preset / "app" / "custom" / "client.py").read_text()
    assert text == SITE_SCRIPT.read_text()
    assert len(text.splitlines()) <= 40
    assert "from jobs.client import main" in text and "main(client_script=__file__)" in text


def test_a_committed_jobs_client_script_shows_the_options_from_its_job_folder():
    import subprocess
    import sys

    custom = JOBS_DIR / "fedavg" / "app" / "custom"
    command = [sys.executable, "client.py", "--help"]
    completed = subprocess.run(command, cwd=custom, capture_output=True, text=True, timeout=120, check=False)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("usage: client.py") and "--client-args" in completed.stdout


def test_a_site_without_the_bundle_is_told_what_to_install(tmp_path):
    """-I -S: no site-packages (the bundle's install), no PYTHONPATH, no script folder on sys.path."""
    import subprocess
    import sys

    script = JOBS_DIR / "fedavg" / "app" / "custom" / "client.py"
    command = [sys.executable, "-I", "-S", str(script), "--help"]
    completed = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 1
    assert completed.stderr.startswith("error: this job's client needs the nvflare-noniid bundle installed")
    assert "site_requirements.txt" in completed.stderr and "jobs" in completed.stderr


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_client_command_line_parses_as_nvflare_passes_it(preset):
    """NVFlare splits ``task_script_args`` on whitespace (no shell quoting): the client must still parse it."""
    from jobs.build import client_script_args
    from jobs.client import build_parser

    spec = PRESETS[preset]
    args = build_parser().parse_args(client_script_args(spec).split())
    assert json.loads(args.client_args) == spec.client_args
    assert args.client == spec.client and args.num_sites == spec.num_sites


def test_client_args_with_whitespace_are_refused_at_build_time(tmp_path):
    with pytest.raises(JobBuildError, match="whitespace"):
        export_job(JobSpec(name="ws", client_args={"note": "two words"}), tmp_path)


def test_a_dp_job_asks_every_site_for_the_privacy_extra():
    # DP-SGD imports Opacus at the sites; the committed DP jobs say so, the others do not.
    import tomllib

    extra = tomllib.loads((JOBS_DIR.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"][
        "privacy"
    ]
    for name in ("fedavg_dp", "snp_scaffold_dp"):
        lines = (JOBS_DIR / name / "app/custom/site_requirements.txt").read_text().splitlines()
        assert all(requirement in lines for requirement in extra), name
    assert not any(
        "opacus" in line for line in (JOBS_DIR / "fedavg/app/custom/site_requirements.txt").read_text().splitlines()
    )
