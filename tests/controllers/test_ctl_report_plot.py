"""The report's plot fits the job: a panel for each thing the job logged (SCAFFOLD's control norms only for SCAFFOLD,
personal vs global only for personalization, epsilon per site only for DP-SGD), every value drawn at the table's
round number (0 for the starting model, r + 1 for the record of round r), integer round ticks. One test per kind of
job, on records shaped as the controller writes them."""

from __future__ import annotations

import pytest

from controllers import report
from tests.controllers.test_ctl_report import initial, round_record, summary

SITES = ("site-1", "site-2")
GLOBAL = "Global model: test accuracy, sites' val_accuracy"
LOSS = "Loss: global test, sites' training"


def fedavg_round(i: int, **extra) -> dict:
    evaluation = {"val_accuracy": summary({"site-1": 0.4 + 0.1 * i, "site-2": 0.2 + 0.1 * i}, "site-2")}
    return round_record(
        i, site_eval=evaluation, test_loss=2.0 - i, site_train_loss={"site-1": 1.0, "site-2": 3.0}, **extra
    )


def fedavg(num_rounds: int = 3) -> list[dict]:
    return [initial(num_rounds), *(fedavg_round(i) for i in range(num_rounds))]


def table_rows(records: list[dict]) -> list[int]:
    """The round column of the report's table, 'init' read as 0 (the starting model)."""
    rows = [line.split()[0] for line in report.format_table(records).splitlines()[1:]]
    return [0 if row == "init" else int(row) for row in rows]


def test_fedavg_has_the_global_model_and_the_loss_and_nothing_of_other_algorithms() -> None:
    records = fedavg()
    panels = report.plot_panels({"fedavg": records})
    assert list(panels) == [GLOBAL, LOSS]
    lines = {line.label: line for line in panels[GLOBAL]}
    assert lines["fedavg test accuracy"].x == (0, 1, 2, 3) == tuple(table_rows(records))
    # The sites' scores of round r's record sit in the table's row r + 1, and so on the plot.
    assert lines["fedavg sites' val_accuracy mean"].x == (1, 2, 3)
    assert lines["fedavg sites' val_accuracy mean"].y == pytest.approx((0.3, 0.4, 0.5), abs=1e-9)
    assert lines["fedavg worst site"].y == pytest.approx((0.2, 0.3, 0.4), abs=1e-9)
    assert {line.label: line.y for line in panels[LOSS]}["fedavg mean site train loss"] == (2.0, 2.0, 2.0)


def test_the_global_model_chosen_on_validation_is_marked_at_its_row() -> None:
    records = fedavg()
    records[2]["best_global"] = {"sent_in_round": 2, "metric": "val_loss", "mean_over_sites": 0.3}
    records[1]["test_accuracy"] = 0.7  # the model round 1 produced (row 1), sent in round 2
    lines = {line.label: line for line in report.plot_panels({"fedavg": records})[GLOBAL]}
    assert lines["fedavg chosen on validation"].x == (1,) and lines["fedavg chosen on validation"].y == (0.7,)
    unchosen = report.plot_panels({"fedavg": fedavg()})[GLOBAL]
    assert "fedavg chosen on validation" not in {line.label for line in unchosen}


def test_scaffold_adds_its_control_norms() -> None:
    def scaffold_round(i: int) -> dict:
        meta = {site: {report.DIFF_NORM: 1.0 + i} for site in SITES}
        return fedavg_round(i, rule_diagnostics={report.GLOBAL_CONTROL_NORM: 10.0 * (i + 1)}, site_meta=meta)

    records = [initial(2), scaffold_round(0), scaffold_round(1)]
    panels = report.plot_panels({"scaffold": records})
    assert list(panels) == [GLOBAL, LOSS, "SCAFFOLD control norms"]
    norms = {line.label: line for line in panels["SCAFFOLD control norms"]}
    assert norms["scaffold ||c||"].x == (1, 2) and norms["scaffold ||c||"].y == (10.0, 20.0)
    assert norms["scaffold mean ||dc_i||"].y == (1.0, 2.0)


def test_ditto_draws_personal_against_global_in_the_same_rows_and_no_control_norms() -> None:
    def ditto_round(i: int) -> dict:
        record = fedavg_round(i)
        personal = summary({"site-1": 0.9, "site-2": 0.7}, "site-2")
        record["site_eval"]["personal_val_accuracy"] = personal
        return record

    records = [initial(2), ditto_round(0), ditto_round(1)]
    panels = report.plot_panels({"ditto": records})
    personal_title = "Personal vs global model: sites' val_accuracy"
    assert list(panels) == [GLOBAL, personal_title, LOSS]
    lines = {line.label: line for line in panels[personal_title]}
    assert lines["ditto personal model"].x == lines["ditto global model"].x == (1, 2)
    assert lines["ditto personal model"].y == pytest.approx((0.8, 0.8), abs=1e-9)
    assert all("personal" not in line.label for line in panels[GLOBAL])
    assert not any("SCAFFOLD" in title for title in panels)


def test_dp_sgd_draws_epsilon_per_site_at_its_delta() -> None:
    def dp_round(i: int) -> dict:
        privacy = {"site-1": {"epsilon": 1.0 + i, "delta": 1e-5}}  # site-2 did not train in round 1
        if i == 1:
            privacy["site-2"] = {"epsilon": 0.5, "delta": 1e-5}
        return fedavg_round(i, privacy=privacy)

    records = [initial(2), dp_round(0), dp_round(1)]
    panels = report.plot_panels({"dp": records})
    title = "DP-SGD: ε per site (δ 1e-05)"
    assert list(panels) == [GLOBAL, LOSS, title]
    lines = {line.label: line for line in panels[title]}
    assert lines["dp site-1"].x == (1, 2) and lines["dp site-1"].y == (1.0, 2.0)
    assert lines["dp site-2"].x == (2,) and lines["dp site-2"].y == (0.5,)


def test_a_job_without_a_server_test_set_has_no_test_lines() -> None:
    records = [
        {"stage": "initial", "round": None, "num_rounds": 1},
        {"stage": "round", "round": 0, "status": "aggregated", "site_train_loss": {"site-1": 0.5}},
    ]
    panels = report.plot_panels({"own": records})
    assert list(panels) == ["Loss: sites' training"]
    assert panels["Loss: sites' training"][0].x == (1,)


def test_a_resumed_job_numbers_its_rows_from_the_rounds_done_before() -> None:
    resumed = {"stage": "resumed", "round": None, "num_rounds": 5, "test_accuracy": 0.5}
    records = [resumed, round_record(3), round_record(4)]
    assert table_rows([{**resumed, "stage": "initial"}, *records[1:]]) == [0, 4, 5]
    assert report.format_table(records).splitlines()[1].split()[0] == "3"
    line = report.plot_panels({"resumed": records})["Global model: test accuracy"][0]
    assert line.x == (3, 4, 5)


def test_two_runs_share_the_panels_and_the_figure_has_integer_round_ticks(tmp_path) -> None:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    figure = report.draw_runs({"a": fedavg(3), "b": fedavg(2)})
    titles = [axis.get_title() for axis in figure.axes]
    assert titles == [GLOBAL, LOSS]
    for axis in figure.axes:
        ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        assert axis.get_xlabel() == "round (0: the starting model)"
    assert report.plot_runs({"a": fedavg(3)}, tmp_path / "p.png").stat().st_size > 0


def test_a_job_that_logged_no_values_gets_an_image_that_says_so(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    records = [{"stage": "initial", "round": None, "num_rounds": 1}, {"stage": "round", "round": 0}]
    assert report.plot_panels({"bare": records}) == {}
    assert report.plot_runs({"bare": records}, tmp_path / "p.png").stat().st_size > 0
