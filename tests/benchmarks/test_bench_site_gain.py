"""The per-site guarantee grid of benchmarks.compare: harness options instead of code edits, site data fixed across
training seeds, and a cell that cannot show a site's gain fails instead of writing an empty table."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import compare


def _grid(*argv):
    return compare.grid_from_args(compare.parser().parse_args(["--out", "unused", *argv]))


def test_options_reach_the_grid_and_every_cell_gets_the_partition_seed():
    grid = _grid("--grid", "site_gain", "--num-sites", "7", "--partitions", "dir0.3", "--partition-seeds", "2")
    assert grid.protocol.num_sites == 7 and grid.partitions == ("dir0.3",) and grid.partition_seeds == (0, 1)
    assert grid.protocol.keep == "best" and grid.protocol.local_baseline and grid.protocol.site_test_fraction == 0.2
    off = _grid("--grid", "site_gain", "--no-local-baseline", "--keep", "last")
    assert not off.protocol.local_baseline and off.protocol.keep == "last"


def test_a_bad_partition_name_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        _grid("--partitions", "qty1.5")
    assert "beta in qty<beta> is the share of small sites" in capsys.readouterr().err


def test_cells_without_a_partition_seed_keep_their_old_names_so_committed_folders_resume():
    assert compare.Cell("fedrep", "C2", 1.0, 2).key == "fedrep__C2__p1__s2"
    assert compare.Cell("fedrep", "C2", 1.0, 2, 0).key == "fedrep__C2__d0__p1__s2"


def test_the_pool_starts_the_longest_methods_first(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(compare, "cell_spec", lambda cell, protocol: None)
    monkeypatch.setattr(compare, "run_cells", lambda cells, run, cells_dir, workers: started.extend(cells) or [])
    grid = compare.Grid(("fedavg", "fedrep", "finetune", "ditto"), ("dir0.3",), (1.0,), (0,), compare.SITE_GAIN, (0,))
    compare.run_grid(grid, tmp_path, 2)
    assert [c.algorithm for c in started] == ["fedrep", "ditto", "finetune", "fedavg"]


def _site_data(spec):
    from benchmarks.in_process import site_args
    from data_prep import SiteDataConfig
    from data_prep.sites import partition_sites

    return partition_sites(SiteDataConfig.from_namespace(site_args(spec)))[1]


def test_the_training_seed_varies_training_not_the_site_data():
    """Hostile: seeds 0 and 1 of one partition seed must hold the same samples at every site (a pair), and another
    partition seed must not."""
    from dataclasses import replace

    protocol = replace(compare.GRIDS["site_gain_smoke"]().protocol, keep="last", local_baseline=False)
    spec = {
        (seed, data): compare.cell_spec(compare.Cell("fedavg", "dir0.3", 1.0, seed, data), protocol)
        for seed, data in ((0, 0), (1, 0), (0, 1))
    }
    assert spec[(0, 0)].seed != spec[(1, 0)].seed
    same, other = _site_data(spec[(0, 0)]), _site_data(spec[(1, 0)])
    assert all(np.array_equal(a, b) for a, b in zip(same, other, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(same, _site_data(spec[(0, 1)]), strict=True))
    sizes = compare.builtin_site_sizes(spec[(0, 0)])
    assert sizes == compare.builtin_site_sizes(spec[(1, 0)])
    assert all(s["test"] >= 1 and s["val"] >= 1 for s in sizes.values())
    assert [sum(s.values()) for s in sizes.values()] == [len(part) for part in same]


def test_a_cell_whose_sites_report_no_test_scores_fails():
    from types import SimpleNamespace

    run = SimpleNamespace(records=[{"stage": "round", "site_meta": {"site-1": {"eval.val_accuracy": 0.5}}}])
    spec = SimpleNamespace(site_test_fraction=0.2)
    with pytest.raises(compare.MissingSiteScores, match=r"no eval\.local_test_accuracy"):
        compare.cell_site_scores(spec, None, run)


# --------------------------------------------------------------------------------------------------------------------
# benchmarks.genomics: the same options
# --------------------------------------------------------------------------------------------------------------------
def _genomics(*argv):
    from benchmarks import genomics

    return genomics.grid_from_args(genomics.parser().parse_args(["--out", "unused", *argv]))


def test_genomics_options_and_the_data_seed_apart_from_the_training_seed():
    from benchmarks import genomics

    argv = ("--grid", "site_gain", "--source", "sim", "--splits", "qty0.5", "dir0.3", "--num-sites", "6")
    protocol, cells = _genomics(*argv, "--samples-per-population", "2000", "--seeds", "2")
    assert protocol.num_sites == 6 and protocol.samples_per_population == 2000 and protocol.keep == "best"
    assert {c.partition_seed for c in cells} == {0} and {c.seed for c in cells} == {0, 1}
    assert {c.split for c in cells} == {"qty0.5", "dir0.3"}
    cell = next(c for c in cells if c.split == "qty0.5" and c.seed == 1)
    args = genomics.data_args(protocol, cell.split, genomics.data_seed(cell))
    assert args["split"] == "small_sites" and args["alpha"] == 0.5 and args["seed"] == 0  # the data's seed, fixed
    assert args["test_fraction"] == 0.2  # the data module holds out the site's test split (JobSpec's: built-in only)
    spec = genomics.cell_spec(cell, protocol)
    assert spec.keep == "best" and spec.local_baseline and spec.data_args["seed"] == 0 and spec.seed == 1
    assert genomics.model_args(protocol, cell.algorithm, cell.seed)["seed"] == 1  # the training seed
    _, table = _genomics("--grid", "table")
    assert {c.partition_seed for c in table} == {None}  # the committed grids keep their rule and cell names


def test_genomics_refuses_a_label_count_partition(capsys):
    with pytest.raises(SystemExit):
        _genomics("--splits", "C2")
    assert "unknown partition 'C2'; use iid, dir<alpha>, qty<beta>, population" in capsys.readouterr().err


@pytest.mark.slow
def test_site_gain_smoke_grid_end_to_end_reports_every_sites_kept_model_against_its_local_only_model(tmp_path):
    """The per-site grid in the in-process engine on tiny data: 2 methods x 2 seeds, keep best, local baseline."""
    import json

    assert compare.main(["--grid", "site_gain_smoke", "--out", str(tmp_path), "--workers", "1"]) == 0
    cells = [json.loads(p.read_text()) for p in sorted((tmp_path / "cells").glob("*.json"))]
    assert len(cells) == 4 and all(c["cell"]["partition_seed"] == 0 for c in cells)
    for cell in cells:
        assert set(cell["site_test"]) >= {"global", "local", "kept"}
        assert set(cell["site_test"]["kept"]) == set(cell["site_sizes"]) == {"site-1", "site-2", "site-3"}
        for site, kept in cell["site_test"]["kept"].items():  # the kept model is one of the candidates, scored alike
            chosen = cell["kept_candidate"][site]
            assert kept == pytest.approx(cell["site_test"][chosen][site])
    sizes = {json.dumps(c["site_sizes"], sort_keys=True) for c in cells}
    assert len(sizes) == 1  # fixed site data across seeds and methods
    report = (tmp_path / "report.md").read_text()
    assert "Target for fedavgm (the pre-registered default)" in report
    assert report.count("Per site, ") == 4 and report.count(", the pooled view (all labels; the next patient)") == 2


def test_keep_view_pooled_reaches_both_harnesses_jobs_and_the_default_grids_build_the_jobs_they_built():
    from dataclasses import asdict

    from benchmarks import genomics

    grid = _grid("--grid", "site_gain_v4", "--partitions", "C2", "--keep-view", "pooled")
    assert grid.protocol.keep_view == "pooled" and grid.protocol.site_pooled_val == 1000
    cell = compare.Cell("fedavgm", "C2", 1.0, 0, 0)
    spec = compare.cell_spec(cell, grid.protocol)
    assert spec.keep_view == "pooled" and spec.site_pooled_val == 1000 and spec.site_pooled_test == 1000
    default = _grid("--grid", "site_gain_v4", "--partitions", "C2")
    assert "keep_view" not in compare.site_gain_fields(default.protocol, cell)
    assert asdict(compare.cell_spec(cell, default.protocol)) == asdict(
        compare.cell_spec(cell, compare.GRIDS["site_gain_v4"]().protocol)
    )
    protocol, cells = _genomics("--grid", "site_gain_v4", "--keep-view", "pooled")
    assert protocol.keep_view == "pooled" and protocol.pooled_val_fraction == 0.5
    spec = genomics.cell_spec(cells[0], protocol)
    assert spec.keep_view == "pooled" and spec.data_args["pooled_val_fraction"] == 0.5
    protocol, cells = _genomics("--grid", "site_gain_v4")
    assert "pooled_val_fraction" not in genomics.data_args(protocol, "dir0.5", 0)
    assert genomics.cell_spec(cells[0], protocol).keep_view == "own"


def test_the_report_names_the_split_the_sites_chose_on():
    from benchmarks.site_report import chosen_on, legend

    own, pooled = {"protocol": {"keep_view": "own"}}, {"protocol": {"keep_view": "pooled"}}
    assert chosen_on([own, {"protocol": {}}]) == "the site's validation split"  # older cells: no keep_view
    assert chosen_on([pooled]).startswith("a pooled validation split")
    text = legend([0], {"method": "fedavgm", "keep": "best", "local_baseline": True}, 0.02, chosen_on([pooled]))[0]
    assert "kept (the candidate best on a pooled validation split" in text


@pytest.mark.parametrize(("grid", "margin"), [("site_gain", 1.645), ("site_gain_v3", 1.645), ("site_gain_v4", 1.0)])
def test_each_site_gain_grid_builds_its_jobs_with_the_keep_margin_it_ran_with(grid, margin):
    # The job default moved from 1.645 to 1.0 with v4: a grid that relied on the default would no longer reproduce
    # its committed page. Every site-gain grid names its own, in both harnesses.
    from benchmarks import genomics

    cell = compare.Cell("fedavgm", "dir0.3", 1.0, 0, 0)
    assert compare.cell_spec(cell, compare.GRIDS[grid]().protocol).keep_margin == margin
    protocol, cells = _genomics("--grid", grid)
    assert genomics.cell_spec(cells[0], protocol).keep_margin == margin


@pytest.mark.parametrize(
    ("grid", "holdout"),
    [("site_gain", "random"), ("site_gain_v3", "random"), ("site_gain_v4", "random"), ("site_gain_v5", "stratified")],
)
def test_each_site_gain_grid_builds_its_jobs_with_the_hold_outs_it_ran_with(grid, holdout):
    # v5 differs from v4 in the sites' hold-outs alone: stratified by label (built-in sites) or by population (the
    # genomics data module); the earlier grids keep the label-blind ones their committed pages were run with.
    from dataclasses import asdict

    from benchmarks import genomics

    cell = compare.Cell("fedavgm", "dir0.3", 1.0, 0, 0)
    assert compare.cell_spec(cell, compare.GRIDS[grid]().protocol).site_holdout == holdout
    protocol, cells = _genomics("--grid", grid)
    assert genomics.cell_spec(cells[0], protocol).data_args.get("holdout", "random") == holdout
    if grid == "site_gain_v5":
        v4 = asdict(compare.cell_spec(cell, compare.GRIDS["site_gain_v4"]().protocol))
        v5 = asdict(compare.cell_spec(cell, compare.GRIDS[grid]().protocol))
        assert {k for k in v4 if v4[k] != v5[k]} == {"site_holdout"}
