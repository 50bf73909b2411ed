"""The genomics table harness: a tiny grid end to end (federated cells and both baselines), and resuming."""

from __future__ import annotations

import json

import pytest

from benchmarks import genomics


def test_every_cell_of_the_table_is_a_valid_job():
    algorithms, splits, seeds, protocol = genomics.GRIDS["table"]("1kg")
    assert {"fedavg", "fedprox", "scaffold", "feddyn", "fednova", "local", "pooled"} <= set(algorithms)
    assert set(splits) == {"iid", "dir1.0", "dir0.1", "population"} and len(seeds) >= 3
    for algorithm in genomics.ALGORITHMS:
        spec = genomics.cell_spec(genomics.Cell(algorithm, "dir0.1", 0), protocol)
        assert spec.model == genomics.MODEL and spec.data_args["alpha"] == 0.1
    assert genomics.model_args(protocol, "fednova", 0)["optimizer"] == "sgd"  # FedNova describes SGD steps only


@pytest.mark.slow
def test_smoke_grid_writes_a_report_and_resumes(tmp_path, capsys):
    assert genomics.main(["--grid", "smoke", "--out", str(tmp_path), "--workers", "1"]) == 0
    cells = sorted((tmp_path / "cells").glob("*.json"))
    assert len(cells) == 4
    scaffold = json.loads((tmp_path / "cells" / "scaffold__dir0.1__s0.json").read_text())
    assert len(scaffold["curve"]) == 2 and all(v > 0 for v in scaffold["control_global_norm"])
    pooled = json.loads((tmp_path / "cells" / "pooled__dir0.1__s0.json").read_text())
    assert set(pooled["site_val_accuracy"]) == {"site-1", "site-2", "site-3"}
    report = (tmp_path / "report.md").read_text()
    assert "| scaffold | 1 |" in report and "| pooled | 1 |" in report
    assert (tmp_path / "curves.png").is_file() and (tmp_path / "scaffold_controls.png").is_file()
    capsys.readouterr()
    assert genomics.main(["--grid", "smoke", "--out", str(tmp_path), "--workers", "1"]) == 0
    assert "4 already done, 0 to run" in capsys.readouterr().out


def test_a_federation_in_which_no_round_aggregated_fails_its_cell_and_the_command_exits_1(
    tmp_path, monkeypatch, capsys
):
    """The round engine records failed rounds too: a federation none of whose rounds updated the global model is no
    table entry (its curve would be the initial model's)."""
    import benchmarks.in_process as in_process

    def never_aggregates(spec, state_root, *, run_id, **_):
        failed = {"stage": "round", "status": "failed", "failure": "rule 'fedavg': no valid result"}
        records = [{"stage": "initial", "num_rounds": 2}, *({**failed, "round": r} for r in range(2))]
        return in_process.InProcessRun(params={}, state={}, records=records)

    monkeypatch.setattr(in_process, "run_in_process", never_aggregates)
    argv = ["--grid", "smoke", "--algorithms", "fedavg", "--out", str(tmp_path), "--workers", "1"]
    assert genomics.main(argv) == 1
    err = capsys.readouterr().err
    reason = "IncompleteFederation: no round updated the global model (last failure: rule 'fedavg': no valid result)"
    assert f"cell fedavg__dir0.1__s0 failed: {reason}" in err
    assert not list((tmp_path / "cells").glob("*.json"))


def test_every_cell_of_the_personalization_grid_is_a_valid_job_and_gets_the_personalization_report():
    from benchmarks.personalization import write_folder_report

    algorithms, splits, seeds, protocol = genomics.GRIDS["personalization"]("1kg")
    assert algorithms == ("fedavg", "finetune", "fedper", "fedrep", "ditto", "local") and len(seeds) == 3
    assert set(splits) == {"iid", "dir0.1", "population"}
    specs = {a: genomics.cell_spec(genomics.Cell(a, "population", 0), protocol) for a in algorithms}
    assert specs["fedper"].local_keys == specs["fedrep"].local_keys == "net.head.bias,net.head.weight"
    assert specs["finetune"].finetune_epochs == 1 and specs["ditto"].client_args["personal_lr"] == 0.01
    assert genomics.report_writer("table", protocol) is genomics.write_report
    writer = genomics.report_writer("personalization", protocol)
    assert writer.func is write_folder_report and writer.keywords["dataset"] == "genomics (1000 Genomes)"
