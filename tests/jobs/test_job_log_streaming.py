"""NVFlare 2.9's log streaming (jobs/log_streaming.py): the bundle's provisioning keeps every site's logs at the site,
and a DP job that asks to stream logs to the server is refused when it is built, nothing written."""

from __future__ import annotations

import json

import pytest
import yaml
from nvflare.app_common.logging.constants import ALLOW_LOG_STREAMING_VAR
from nvflare.app_common.logging.job_log_streamer import JobLogStreamer
from nvflare.lighter.constants import PropKey

from jobs.build import JobBuildError
from jobs.log_streaming import ALLOW_LOG_STREAMING, log_streaming_problem, streamed_logs
from jobs.provision.loopback import PROJECT_TEMPLATE, write_project
from jobs.recipe import FedAlgRecipe

DP_SGD = {"dp_noise_multiplier": 1.0, "dp_max_grad_norm": 1.0}
DIGITS = {"dataset": "digits", "arch": "mlp"}


def test_the_bundles_provisioning_turns_log_streaming_off_at_every_site(tmp_path):
    """NVFlare's own names: the participant property its StaticFileBuilder renders into resources.json, and the
    variable its SiteLogStreamer and JobLogStreamer read there (default true: every job's error_log.txt streams)."""
    assert ALLOW_LOG_STREAMING == PropKey.ALLOW_LOG_STREAMING == ALLOW_LOG_STREAMING_VAR
    for project in (
        yaml.safe_load(PROJECT_TEMPLATE.read_text()),
        yaml.safe_load(write_project(tmp_path / "p.yml", 8002, ["a", "b"]).read_text()),
    ):
        clients = [p for p in project["participants"] if p["type"] == "client"]
        assert clients and all(p[ALLOW_LOG_STREAMING] is False for p in clients)


@pytest.mark.parametrize("private", [DP_SGD, {"server": "dp_fedavg"}])
def test_a_dp_job_that_asks_to_stream_logs_is_refused_in_one_line(private):
    recipe = FedAlgRecipe(name="dp", num_rounds=1, **DIGITS, **private)
    with pytest.raises(JobBuildError, match=r"^log streaming \['log.json'\] under DP: NVFlare's JobLogStreamer") as err:
        recipe.enable_log_streaming()
    assert "\n" not in str(err.value)


def test_a_streamer_added_another_way_is_refused_at_export_and_nothing_is_left(tmp_path):
    recipe = FedAlgRecipe(name="dp", num_rounds=1, **DIGITS, **DP_SGD)
    recipe._add_to_client_apps(JobLogStreamer(log_file_name="log.txt"))  # NVFlare's own path, past our override
    with pytest.raises(JobBuildError, match=r"^log streaming \['log.txt'\] under DP"):
        recipe.export(str(tmp_path))
    assert not (tmp_path / "dp").exists()


def test_without_dp_log_streaming_is_the_jobs_choice(tmp_path):
    recipe = FedAlgRecipe(name="plain", num_rounds=1, **DIGITS)
    recipe.enable_log_streaming("log.txt")
    recipe.export(str(tmp_path))
    assert streamed_logs(tmp_path / "plain") == ["log.txt"]
    assert log_streaming_problem(recipe.spec, ["log.txt"]) is None


def test_the_bundles_dp_jobs_stream_nothing(tmp_path):
    recipe = FedAlgRecipe(name="dp", num_rounds=1, **DIGITS, **DP_SGD)
    recipe.export(str(tmp_path))
    configs = list((tmp_path / "dp").glob("**/config_fed_client.json"))
    assert configs and streamed_logs(tmp_path / "dp") == []
    assert all("LogStreamer" not in json.dumps(json.loads(c.read_text())) for c in configs)
