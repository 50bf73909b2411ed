"""Smoke test of the aggregation benchmark: tiny models, every registered rule, a well-formed markdown table."""

from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import numpy as np
import pytest

from aggregators.registry import RULES
from benchmarks.aggregation import (
    DEFAULT_RULES,
    main,
    make_model,
    make_updates,
    peak_bytes,
    rule_meta,
    weighted_sum_baseline,
)


def test_the_default_rules_are_the_registry_and_other_names_are_refused(capsys):
    assert tuple(sorted(RULES)) == DEFAULT_RULES
    with pytest.raises(SystemExit) as refused:
        main(["--sizes", "2000", "--rules", "fedavg", "nosuchrule"])
    assert refused.value.code == 2 and "nosuchrule" in capsys.readouterr().err


def test_a_rule_requiring_meta_the_benchmark_cannot_report_stops_it_by_name():
    model = make_model(100)
    rule = SimpleNamespace(name="newrule", required_meta=("newrule.secret",))
    with pytest.raises(SystemExit, match=r"rule 'newrule' requires \['newrule.secret'\]"):
        rule_meta(rule, model, make_updates(model, 2))


@pytest.fixture
def frozen_heap():
    """The benchmark runs gc.collect() before every timing and memory peak (about 100 times here); with what the test
    session already holds frozen (gc.freeze), each collection scans only the benchmark's own objects, not the whole
    heap of torch, Lightning and NVFlare the suite has imported (0.3 s a collection on a busy 2-core machine)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.usefixtures("frozen_heap")
def test_table_has_the_baseline_and_every_rule_per_size(capsys):
    # 4 clients: Krum needs n - f - 2 >= 1 with its default f = 1.
    assert main(["--sizes", "2000", "5000", "--clients", "4", "--repeats", "1"]) == 0
    machine, _, *lines = capsys.readouterr().out.strip().splitlines()
    assert machine.startswith(f"{os.cpu_count()} CPUs, load average")
    assert lines[0].startswith("| params | rule (4 clients)")
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
