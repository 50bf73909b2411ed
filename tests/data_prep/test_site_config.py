"""``data_prep.site_config``: where a site's training data comes from (env var > local config > simulation only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_prep import SiteDataConfig, site_split
from data_prep.site_config import (
    LOCAL_CONFIG,
    SITE_DATA_ENV,
    SiteDataError,
    is_simulated_site,
    resolve_site_data,
    seed_index,
    site_workspace,
    write_site_file,
)

SIM = SiteDataConfig("digits", "iid", num_sites=3, seed=0)
NUM_CLASSES = 10


def _site_workspace(tmp_path, provisioned: bool):
    (tmp_path / "startup").mkdir(parents=True)
    (tmp_path / "local").mkdir()
    if provisioned:
        (tmp_path / "startup" / "fed_client.json").write_text("{}")
    return tmp_path


def _data_file(path, n=5, offset=0.0):
    x = np.full((n, 64), offset, dtype=np.float32)
    y = np.arange(n) % NUM_CLASSES
    return write_site_file(path, x, y)


def test_simulator_site_without_configuration_derives_its_shard(tmp_path):
    workspace = _site_workspace(tmp_path, provisioned=False)

    data = resolve_site_data("site-2", workspace, SIM, NUM_CLASSES, environ={})

    assert data.source.startswith("simulation")
    expected_x, expected_y = site_split(SIM, "site-2")
    np.testing.assert_array_equal(data.x, expected_x)
    np.testing.assert_array_equal(data.y, expected_y)


def test_provisioned_site_without_configuration_is_a_clear_error(tmp_path):
    workspace = _site_workspace(tmp_path, provisioned=True)

    with pytest.raises(SiteDataError) as info:
        resolve_site_data("site-1", workspace, SIM, NUM_CLASSES, environ={})

    message = str(info.value)
    assert "site-1" in message and SITE_DATA_ENV in message and str(workspace / LOCAL_CONFIG) in message


def test_local_config_names_the_site_file_relative_to_itself(tmp_path):
    workspace = _site_workspace(tmp_path, provisioned=True)
    _data_file(workspace / "local" / "train.npz", n=7, offset=0.25)
    (workspace / LOCAL_CONFIG).write_text(json.dumps({"train": "train.npz"}))

    data = resolve_site_data("site-1", workspace, SIM, NUM_CLASSES, environ={})

    assert data.x.shape == (7, 64) and data.x.dtype == np.float32 and np.all(data.x == 0.25)
    assert data.y.dtype == np.int64 and data.y.tolist() == list(range(7))
    assert str(workspace / LOCAL_CONFIG) in data.source


def test_env_var_wins_over_local_config_and_simulation(tmp_path):
    workspace = _site_workspace(tmp_path, provisioned=False)
    _data_file(workspace / "local" / "train.npz", n=7)
    (workspace / LOCAL_CONFIG).write_text(json.dumps({"train": "train.npz"}))
    chosen = _data_file(tmp_path / "elsewhere.npz", n=3, offset=0.5)

    data = resolve_site_data("site-1", workspace, SIM, NUM_CLASSES, environ={SITE_DATA_ENV: str(chosen)})

    assert len(data.y) == 3 and np.all(data.x == 0.5)
    assert SITE_DATA_ENV in data.source


def test_env_var_may_name_a_json_config(tmp_path):
    workspace = _site_workspace(tmp_path, provisioned=True)
    _data_file(tmp_path / "d" / "train.npz", n=4)
    config = tmp_path / "d" / "site.json"
    config.write_text(json.dumps({"train": "train.npz"}))

    data = resolve_site_data("site-1", workspace, SIM, NUM_CLASSES, environ={SITE_DATA_ENV: str(config)})

    assert len(data.y) == 4


def test_a_site_may_opt_in_to_the_derived_shard(tmp_path):
    workspace = _site_workspace(tmp_path, provisioned=True)
    (workspace / LOCAL_CONFIG).write_text(json.dumps({"derive": True}))

    data = resolve_site_data("site-3", workspace, SIM, NUM_CLASSES, environ={})

    assert "opted in" in data.source
    np.testing.assert_array_equal(data.y, site_split(SIM, "site-3")[1])


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("not json", "cannot read"),
        ("[1, 2]", "JSON object"),
        ('{"path": "x.npz"}', "must contain"),
        ('{"train": "missing.npz"}', "does not exist"),
    ],
)
def test_broken_local_config_is_reported_by_name(tmp_path, content, match):
    workspace = _site_workspace(tmp_path, provisioned=True)
    (workspace / LOCAL_CONFIG).write_text(content)

    with pytest.raises(SiteDataError, match=match):
        resolve_site_data("site-1", workspace, SIM, NUM_CLASSES, environ={})


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({"x": np.zeros((2, 4), np.float32)}, "lacks"),
        ({"x": np.zeros((2, 4), np.float32), "y": np.array([0])}, "samples and"),
        ({"x": np.zeros((0, 4), np.float32), "y": np.zeros(0, np.int64)}, "at least one"),
        ({"x": np.zeros((2, 4), np.float32), "y": np.array([0, 10])}, "labels"),
        ({"x": np.zeros((2, 4), np.float32), "y": np.array([0.0, 1.0])}, "labels"),
        ({"x": np.array([[np.nan]] * 2, np.float32), "y": np.array([0, 1])}, "finite"),
        ({"x": np.zeros((2, 4), np.uint8), "y": np.array([0, 1])}, "floats"),
    ],
)
def test_bad_site_file_is_refused(tmp_path, arrays, match):
    np.savez(tmp_path / "bad.npz", **arrays)

    with pytest.raises(SiteDataError, match=match):
        resolve_site_data("site-1", tmp_path, SIM, NUM_CLASSES, environ={SITE_DATA_ENV: str(tmp_path / "bad.npz")})


def test_env_var_pointing_nowhere_or_to_another_format(tmp_path):
    with pytest.raises(SiteDataError, match="does not exist"):
        resolve_site_data("site-1", tmp_path, SIM, NUM_CLASSES, environ={SITE_DATA_ENV: str(tmp_path / "no.npz")})
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(SiteDataError, match=r"expected a \.npz"):
        resolve_site_data("site-1", tmp_path, SIM, NUM_CLASSES, environ={SITE_DATA_ENV: str(tmp_path / "data.csv")})


def test_workspace_is_found_above_the_working_directory(tmp_path):
    workspace = _site_workspace(tmp_path, provisioned=True)
    nested = workspace / "job-id" / "app_site-1"
    nested.mkdir(parents=True)

    assert site_workspace(nested) == workspace
    assert site_workspace(workspace) == workspace
    assert not is_simulated_site(workspace)
    assert is_simulated_site(_site_workspace(tmp_path / "sim", provisioned=False))


def test_seed_index_numbers_simulator_sites_and_hashes_other_names():
    assert [seed_index(f"site-{i}", 3) for i in (1, 2, 3)] == [0, 1, 2]
    assert seed_index("hospital-a", 3) == seed_index("hospital-a", 3)
    assert seed_index("hospital-a", 3) != seed_index("hospital-b", 3)
