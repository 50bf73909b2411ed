"""Smoke test of the aggregation benchmark: tiny models, every default rule, a well-formed markdown table."""

from __future__ import annotations

import os

import numpy as np

from benchmarks.aggregation import DEFAULT_RULES, main, make_model, make_updates, peak_bytes, weighted_sum_baseline


def test_table_has_the_baseline_and_every_rule_per_size(capsys):
    assert main(["--sizes", "2000", "5000", "--clients", "3", "--repeats", "1"]) == 0
    machine, _, *lines = capsys.readouterr().out.strip().splitlines()
    assert machine.startswith(f"{os.cpu_count()} CPUs, load average")
    assert lines[0].startswith("| params | rule (3 clients)")
    rows = [line.split("|")[1:-1] for line in lines[2:]]
    assert len(rows) == 2 * (1 + len(DEFAULT_RULES))
    assert [r[1].strip() for r in rows[: 1 + len(DEFAULT_RULES)]] == ["numpy weighted sum", *DEFAULT_RULES]
    assert all(float(r[3]) > 0 and float(r[5]) >= 0 for r in rows)
    assert rows[0][3].strip() == "1.00"


def test_baseline_is_the_weighted_mean_and_peak_memory_is_measured():
    model = make_model(10_000)
    updates = make_updates(model, 4)
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    result = weighted_sum_baseline(updates, weights)
    key = "layer0.weight"
    expected = sum(w * u.params[key].astype(np.float64) for w, u in zip(weights, updates, strict=True))
    np.testing.assert_allclose(result[key], expected, rtol=1e-5)
    assert peak_bytes(lambda: np.ones(1_000_000)) >= 8_000_000
