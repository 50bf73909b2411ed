"""The per-site guarantee's cost benchmark: per-round costs skip round 1 and read every site's fit and candidate
seconds; the table's ratios are against the baseline variant."""

from __future__ import annotations

from benchmarks.site_gain_cost import ratio_table, round_costs


def test_round_costs_skip_the_first_round_and_read_every_site():
    records = [
        {"stage": "initial"},
        {"stage": "round", "elapsed_s": 9.0, "site_meta": {"a": {"train.fit_seconds": 5.0}}},
        {
            "stage": "round",
            "elapsed_s": 2.0,
            "site_meta": {
                "a": {"train.fit_seconds": 1.0, "train.candidate_seconds": 0.5},
                "b": {"train.fit_seconds": 1.5},
            },
        },
    ]
    assert round_costs(records) == {"round": [2.0], "fit": [1.0, 1.5], "candidates": [0.5, 0.0]}


def test_ratios_are_against_the_baseline():
    medians = {
        "base": {"fit": 1.0, "candidates": 0.0, "round": 2.0},
        "more": {"fit": 1.0, "candidates": 1.5, "round": 5.0},
    }
    rows = ratio_table(medians, "base")
    assert rows[2].endswith("| 1.00 | 2.00 | 1.00 |")
    assert rows[3].endswith("| 2.50 | 5.00 | 2.50 |")


def test_the_v4_protocol_is_the_pre_registered_one_without_its_stopping_rule():
    from dataclasses import replace

    from benchmarks.site_gain_cost import VARIANTS, cell_spec, task_protocol

    for task in ("fmnist", "genomics"):
        protocol = task_protocol(task, "site_gain_v4", "1kg", num_sites=4, rounds=3)
        assert (protocol.batch_size, protocol.keep_margin, protocol.stop_patience) == (16, 1.0, None)
        assert (protocol.num_sites, protocol.rounds) == (4, 3)
        for fields in VARIANTS.values():
            spec = cell_spec(task, "fedavg", "dir0.3", 1, replace(protocol, **fields))
            assert (spec.keep, spec.local_baseline, spec.num_rounds, spec.seed) == (
                fields["keep"],
                fields["local_baseline"],
                3,
                1,
            )
    assert task_protocol("fmnist", "site_gain", "1kg", 7, 4).batch_size != 16
