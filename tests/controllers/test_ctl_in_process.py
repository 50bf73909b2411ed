"""The in-process runner: a JobSpec's federation through the round engine with the client script's site round.

Uses scikit-learn's digits (offline, tiny) with the MLP. Bit-identity with ``nvflare simulator`` is checked end to
end in ``tests/e2e/test_e2e_engine_equivalence.py``; here: the site round loads the global model it is given,
reruns are bit-identical, and SCAFFOLD's client state survives between rounds in the site's state store.
"""

from __future__ import annotations

import numpy as np
import pytest

from aggregators.contracts import meta_keys
from benchmarks.in_process import initial_params, quiet_lightning, run_in_process, site_rounds
from jobs.build import JobSpec

SPEC = JobSpec(
    name="tiny",
    dataset="digits",
    arch="mlp",
    num_rounds=2,
    max_test_samples=100,
    batch_size=32,
    lr=0.1,
)


@pytest.fixture(autouse=True)
def _quiet():
    with quiet_lightning():
        yield


def test_site_round_trains_from_the_global_model_it_is_given(tmp_path):
    site = site_rounds(SPEC, tmp_path)["site-1"]
    start = initial_params(SPEC)
    meta = {meta_keys.ROUND: 0, meta_keys.RUN_ID: "r"}
    first, sent_meta = site.train(0, start, meta)
    # The module now holds the trained weights; a second call from the same global model must load it again.
    second, _ = site.train(0, start, meta)
    assert set(first) == set(start)
    for key in start:
        np.testing.assert_array_equal(first[key], second[key])
    assert not np.array_equal(first["net.hidden.0.weight"], start["net.hidden.0.weight"])
    assert sent_meta[meta_keys.NUM_SAMPLES] == len(site.y) and sent_meta[meta_keys.NUM_STEPS] > 0
    assert site.round_callback.meta_source is not None  # restored after the in-process round


def test_reruns_are_bit_identical_and_every_round_aggregates(tmp_path):
    runs = [run_in_process(SPEC, tmp_path / f"state{i}", run_id="same") for i in range(2)]
    digests = [[r["global_sha256"] for r in run.records] for run in runs]
    assert digests[0] == digests[1] and len(set(digests[0])) == SPEC.num_rounds + 1
    assert [r["status"] for r in runs[0].rounds] == ["aggregated"] * SPEC.num_rounds
    assert runs[0].records[-1]["test_accuracy"] > runs[0].records[0]["test_accuracy"]


def test_scaffold_client_state_persists_between_rounds(tmp_path):
    spec = JobSpec(
        name="tiny_scaffold",
        client="scaffold",
        server="scaffold",
        dataset="digits",
        arch="mlp",
        num_rounds=2,
        max_test_samples=50,
    )
    run = run_in_process(spec, tmp_path, evaluate=False)
    assert [r["status"] for r in run.rounds] == ["aggregated", "aggregated"]
    assert sorted(p.parent.name for p in tmp_path.glob("site-*/scaffold.state")) == ["site-1", "site-2", "site-3"]
    assert any(np.any(v != 0) for v in run.state["control"].values())
