"""Three splits at every built-in site (``site_val_fraction``, ``site_test_fraction``) and fixed site data across
training seeds (``partition_seed``); the build-time refusals of splits that cannot hold a guarantee."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from data_prep import SiteDataConfig
from data_prep.splits import site_holdout_indices
from jobs.build import JobSpec
from jobs.settings import JobBuildError
from jobs.spec import client_script_args
from lightning_modules.site import builtin_split_sizes, hold_out, split_seed

SPEC = JobSpec(name="tiny", dataset="digits", arch="mlp", num_rounds=1, batch_size=32)


def test_three_disjoint_splits_cover_the_shard_and_validation_ignores_the_test_split() -> None:
    train, val, test = site_holdout_indices(200, 0.1, 0.2, seed=3, site_index=1)
    assert (len(train), len(val), len(test)) == (140, 20, 40)
    assert sorted([*train, *val, *test]) == list(range(200))
    # Adding a test split moves samples out of training only: the validation split (what selects) is unchanged.
    assert np.array_equal(val, site_holdout_indices(200, 0.1, 0.0, seed=3, site_index=1)[1])
    assert not np.array_equal(test, site_holdout_indices(200, 0.1, 0.2, seed=4, site_index=1)[2])
    assert [len(p) for p in site_holdout_indices(2, 0.4, 0.4, 0, 0)] == [1, 1, 0]  # a sample always trains


class Args:
    seed, partition_seed, site_val_fraction, site_test_fraction = 7, 1, 0.1, 0.2
    dataset, scheme, num_sites = "digits", "dirichlet", 3


def test_partition_seed_fixes_the_site_data_while_the_seed_varies_training() -> None:
    other = Args()
    other.seed = 8
    assert SiteDataConfig.from_namespace(Args()).seed == SiteDataConfig.from_namespace(other).seed == 1
    assert split_seed(Args()) == split_seed(other) == 1
    x, y = np.zeros((50, 2), dtype=np.float32), np.arange(50) % 10
    a, b = hold_out(Args(), x, y, 0), hold_out(other, x, y, 0)
    assert np.array_equal(a.y, b.y) and np.array_equal(a.test.tensors[1], b.test.tensors[1])
    other.partition_seed = None  # none: the job seed, as before the option existed
    assert split_seed(other) == 8 and SiteDataConfig.from_namespace(other).seed == 8


def test_the_new_options_reach_the_sites_only_when_set() -> None:
    assert "--site-test-fraction" not in client_script_args(SPEC) and "--partition-seed" not in client_script_args(SPEC)
    spec = dataclasses.replace(SPEC, site_test_fraction=0.2, partition_seed=5)
    assert "--site-test-fraction 0.2" in client_script_args(spec) and "--partition-seed 5" in client_script_args(spec)


def test_builtin_sizes_are_what_the_sites_hold() -> None:
    spec = dataclasses.replace(SPEC, site_val_fraction=0.1, site_test_fraction=0.2)
    sizes = builtin_split_sizes(spec)
    assert len(sizes) == 3 and all(test >= 10 and train > test for train, _, test in sizes.values())


FEDBN = {"dataset": "fashion_mnist", "arch": "bn_cnn", "local_keys": "batchnorm"}


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"site_test_fraction": 0.005}, r"site_test_fraction 0.005 leaves site-\d \d test samples .*at least 10"),
        ({"client": "ditto"}, "client 'ditto' makes a personal model .*set site_val_fraction"),
        # Partial sharing: the site's personal model is its trained module with its own entries; without a
        # validation split it trains one every round and can never report it against the global model.
        ({"client": "fedrep"}, "client 'fedrep' makes a personal model .*set site_val_fraction"),
        ({"local_keys": "net.classifier.*"}, r"local_keys \(2 entries kept .*\) makes a personal model .*set site_val"),
        (FEDBN, r"local_keys \(10 entries kept .*\) makes a personal model .*set site_val_fraction"),
        ({"site_holdout": "stratified"}, "site_holdout 'stratified' stratifies .* holds out none: set site_val_fr"),
        ({"site_holdout": "by_label"}, r"unknown site_holdout 'by_label'; choose one of \['random', 'stratified'\]"),
    ],
)
def test_refused_at_build_time_in_one_line(changes: dict, message: str) -> None:
    with pytest.raises(JobBuildError, match=message) as refusal:
        dataclasses.replace(SPEC, **changes)
    assert "\n" not in str(refusal.value)


def test_the_genomics_data_module_holds_out_the_sites_own_test_split(monkeypatch) -> None:
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    from genomics.data import SnpSites

    plain = SnpSites(site="site-2", num_sites=3, val_fraction=0.2)
    split = SnpSites(site="site-2", num_sites=3, val_fraction=0.2, test_fraction=0.2)
    assert len(split.train) + len(split.test) == len(plain.train)  # the test split comes out of training only
    assert np.array_equal(plain.val.tensors[0].numpy(), split.val.tensors[0].numpy())
    assert len(split.test) == round(0.2 * (len(plain.train) + len(plain.val)))
    with pytest.raises(Exception, match="test_fraction must be in"):
        SnpSites(site="site-2", num_sites=3, val_fraction=0.6, test_fraction=0.45)
    with pytest.raises(Exception, match=r"site-2: test_fraction 0.01 leaves \d test people of \d+; .*at least 10"):
        SnpSites(site="site-2", num_sites=3, val_fraction=0.2, test_fraction=0.01)
