"""benchmarks.partition_specs: the harnesses' partition names and what they stand for."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.partition_specs import PartitionNameError, argparse_partition, partition_settings


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("iid", {"scheme": "iid"}),
        ("dir0.3", {"scheme": "dirichlet", "alpha": 0.3}),
        ("dir2", {"scheme": "dirichlet", "alpha": 2.0}),
        ("dir.05", {"scheme": "dirichlet", "alpha": 0.05}),
        ("qty0.3", {"scheme": "small_sites", "alpha": 0.3}),
        ("C2", {"scheme": "shards", "classes_per_site": 2}),
        ("C3nb", {"scheme": "label_quantity", "classes_per_site": 3}),
    ],
)
def test_names_of_the_built_in_harness(name, settings):
    assert partition_settings(name) == settings


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("iid", {"split": "iid"}),
        ("population", {"split": "population"}),
        ("dir1.0", {"split": "dirichlet", "alpha": 1.0}),
        ("qty0.4", {"split": "small_sites", "alpha": 0.4}),
    ],
)
def test_names_of_the_genomics_harness(name, settings):
    assert partition_settings(name, genomics=True) == settings


@pytest.mark.parametrize(
    ("name", "genomics", "message"),
    [
        ("dir0", False, r"alpha in dir<alpha> must be > 0"),
        ("dir", False, r"unknown partition 'dir'; use iid, dir<alpha>, qty<beta>, C<k>, C<k>nb"),
        ("dir-1", False, r"unknown partition"),
        ("qty1", False, r"beta in qty<beta> is the share of small sites, in \(0, 1\)"),
        ("qty0", False, r"in \(0, 1\)"),
        ("C2.5", False, r"k in C<k> must be a whole number >= 1"),
        ("C0", False, r"k in C<k> must be a whole number >= 1"),
        ("dir0.3nb", False, r"unknown partition"),
        ("population", False, r"unknown partition 'population'"),
        ("C2", True, r"unknown partition 'C2'; use iid, dir<alpha>, qty<beta>, population"),
        ("DIR0.3", True, r"unknown partition"),
        (" dir0.3", False, r"unknown partition"),
    ],
)
def test_a_bad_name_is_refused_in_one_line_naming_what_is_allowed(name, genomics, message):
    with pytest.raises(PartitionNameError, match=message) as caught:
        partition_settings(name, genomics=genomics)
    assert "\n" not in str(caught.value)


def test_argparse_type_keeps_the_name_and_reports_a_bad_one_as_a_usage_error():
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", nargs="+", type=argparse_partition())
    assert parser.parse_args(["--partitions", "dir0.3", "qty0.3"]).partitions == ["dir0.3", "qty0.3"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--partitions", "qty2"])
