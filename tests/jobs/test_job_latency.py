"""Round latency and start-up settings of the exported jobs: the server's task request interval and task check period
(``jobs/assembly.py``), and the client script's in-process Client API poll periods and the simulated site's kept shard
(``jobs/client.py``: same bits as deriving it, only where the site would derive it)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from controllers.fedalg_controller import TASK_CHECK_PERIOD
from jobs import assembly, client
from jobs.build import JobSpec, export_job


def test_exported_job_carries_the_latency_settings(tmp_path):
    job_dir = export_job(JobSpec(name="latency"), tmp_path)
    config = json.loads((job_dir / "app" / "config" / "config_fed_server.json").read_text())
    assert config["server"] == {"task_request_interval": assembly.TASK_REQUEST_INTERVAL}
    assert config["workflows"][0]["args"]["task_check_period"] == TASK_CHECK_PERIOD


def test_task_request_interval_grows_with_the_sites_up_to_nvflare_default():
    assert assembly.task_request_interval(3) == assembly.TASK_REQUEST_INTERVAL
    assert assembly.task_request_interval(80) == 80 / assembly.MAX_IDLE_REQUESTS_PER_S
    assert assembly.task_request_interval(10_000) == assembly.NVFLARE_TASK_REQUEST_INTERVAL
    for sites in (1, 10, 40, 79, 200):  # idle requests per second stay within the budget (or NVFlare's own rate)
        interval = assembly.task_request_interval(sites)
        assert sites / interval <= max(assembly.MAX_IDLE_REQUESTS_PER_S, sites / assembly.NVFLARE_TASK_REQUEST_INTERVAL)


def test_poll_period_default_and_site_override():
    assert client.client_poll_seconds({}) == client.DEFAULT_CLIENT_POLL_S
    assert client.client_poll_seconds({client.CLIENT_POLL_ENV: " 0.2 "}) == 0.2


@pytest.mark.parametrize("raw", ["0", "-1", "nan", "inf", "fast", "60"])
def test_bad_poll_period_is_refused_in_one_line(raw):
    with pytest.raises(SystemExit, match=client.CLIENT_POLL_ENV):
        client.client_poll_seconds({client.CLIENT_POLL_ENV: raw})


def test_polls_untouched_outside_nvflare_client_process(monkeypatch):
    monkeypatch.delitem(sys.modules, client._IN_PROCESS_BACKEND, raising=False)
    assert client.shorten_client_polls(0.05) == []


def test_polls_shortened_inside_nvflare_in_process_mode(monkeypatch):
    from nvflare.app_common.executors.client_api import in_process_backend
    from nvflare.client.api_spec import CLIENT_API_KEY
    from nvflare.client.in_process.api import InProcessClientAPI
    from nvflare.fuel.data_event.data_bus import DataBus

    monkeypatch.setattr(in_process_backend, "_RESULT_POLL_INTERVAL", 0.5)  # restored after the test
    api = InProcessClientAPI(task_metadata={}, result_check_interval=0.5)
    bus = DataBus()
    previous = bus.get_data(CLIENT_API_KEY)
    bus.put_data(CLIENT_API_KEY, api)
    try:
        assert client.shorten_client_polls(0.05) == ["task pick-up", "result hand-back"]
    finally:
        bus.put_data(CLIENT_API_KEY, previous)
    assert api.result_check_interval == 0.05 and in_process_backend._RESULT_POLL_INTERVAL == 0.05


@pytest.fixture
def simulated_site(tmp_path, monkeypatch):
    """A simulator site workspace (an empty ``startup/``) as the working directory, no site data configured."""
    (tmp_path / "startup").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDALG_SITE_DATA", raising=False)
    return tmp_path


def test_shard_is_kept_only_where_the_site_derives_it(simulated_site, monkeypatch):
    assert client.derives_simulated_shard(simulated_site, {})
    assert not client.derives_simulated_shard(simulated_site, {"FEDALG_SITE_DATA": "/data/train.npz"})
    (simulated_site / "local").mkdir()
    (simulated_site / "local" / "fedalg_site_data.json").write_text(json.dumps({"derive": True}))
    assert not client.derives_simulated_shard(simulated_site, {})  # resolve_site_data's own opt-in path
    (simulated_site / "local" / "fedalg_site_data.json").unlink()
    (simulated_site / "startup" / "fed_client.json").write_text("{}")
    assert not client.derives_simulated_shard(simulated_site, {})  # a provisioned site never derives


def _digits_args(*extra: str):
    return client.build_parser().parse_args(["--dataset", "digits", "--arch", "mlp", "--num-sites", "3", *extra])


def test_kept_shard_gives_the_same_bits_as_deriving_it(simulated_site):
    from data_prep import SiteDataConfig
    from data_prep.site_config import resolve_site_data

    args = _digits_args()
    derived = resolve_site_data("site-2", simulated_site, SiteDataConfig.from_namespace(args), 10)
    first = client.site_training_data("site-2", args, 10)  # derives and keeps
    kept = client.site_training_data("site-2", args, 10)  # reads what the first client-round kept
    assert "kept in" in kept.source and "kept in" not in first.source
    for data in (first, kept):
        assert data.x.dtype == derived.x.dtype and data.y.dtype == derived.y.dtype
        assert np.array_equal(data.x, derived.x) and np.array_equal(data.y, derived.y)


def test_kept_shard_is_per_site_and_settings_and_a_broken_one_is_derived_again(simulated_site):
    from data_prep import SiteDataConfig

    args = _digits_args()
    for site, site_args in (("site-1", args), ("site-1", _digits_args("--seed", "1")), ("site-3", args)):
        client.site_training_data(site, site_args, 10)
    assert len(list((simulated_site / client.SHARD_CACHE_DIR).glob("*.npz"))) == 3
    path = client.shard_cache_path(simulated_site, "site-1", SiteDataConfig.from_namespace(args), 10)
    path.write_bytes(b"not an npz")  # e.g. a disk that filled up mid-write in an older version
    assert client.read_shard(path) is None
    again = client.site_training_data("site-1", args, 10)
    assert "kept in" not in again.source and client.read_shard(path) is not None
