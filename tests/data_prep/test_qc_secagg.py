"""The federated QC's counts under SecAgg+ (``qc-job --secure-aggregation secagg``), in-process: three sites'
`QcSecAggSite` and the server's `unmask_counts`, with every message the server receives recorded (its whole view).
Checked as a curious server would look: no site's counts, nor any row of them, appear in what it received; the
unmasked sum equals the clear sum exactly (integers, no quantisation), so the keep-mask equals the clear QC's; noisy
(negative) counts sum exactly too; the protocol's refusals (two sites, a replayed unmask, a replaced key) and the
exported job's arguments and egress declarations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")

from data_prep.errors import DataPrepError
from data_prep.genotypes import secagg_qc as sq
from data_prep.genotypes.federated_qc import export_qc_job, global_qc, qc_releases
from data_prep.genotypes.qc import QcThresholds

THRESHOLDS = QcThresholds(min_call_rate=0.9, min_maf=0.05)
SITES = ("site-1", "site-2", "site-3")


def random_counts(rng: np.random.Generator, people: int, snps: int) -> np.ndarray:
    return rng.multinomial(people, [0.5, 0.3, 0.15, 0.05], size=snps).astype(np.int64)


def run_protocol(counts: dict[str, np.ndarray], noisy: bool = False) -> tuple[np.ndarray, list[object]]:
    """The four steps as federated_qc's controller and sites run them; the sum and everything the server received."""
    sites = {s: sq.QcSecAggSite(s) for s in SITES}
    seen: list[object] = []
    threshold = sq.check_secagg_sites(len(SITES), "test")
    keys = {s: site.advertise({"sites": list(SITES), "threshold": threshold}) for s, site in sites.items()}
    seen += list(keys.values())
    public = {
        s: [sq.to_text(sq.from_wire(k["channel_pk"])), sq.to_text(sq.from_wire(k["mask_pk"]))] for s, k in keys.items()
    }
    shares = {s: site.share({"public": public}) for s, site in sites.items()}
    seen += list(shares.values())
    sealed = {s: sq.read_answer(a["sealed"]) for s, a in shares.items()}
    masked = {s: site.mask(counts[s], {"sealed": sealed}) for s, site in sites.items()}
    seen += list(masked.values())
    returned = {s: site.unmask({"summed": list(SITES)}) for s, site in sites.items()}
    seen += list(returned.values())
    held = {h: sq.read_shares(a["shares"]) for h, a in returned.items()}
    mask_pks = {s: sq.from_wire(k["mask_pk"]) for s, k in keys.items()}
    packed = {s: m[sq.MASKED_COUNTS] for s, m in masked.items()}
    snps = len(next(iter(counts.values())))
    return sq.unmask_counts(SITES, packed, held, mask_pks, threshold, snps, noisy=noisy), seen


def test_the_server_sees_no_sites_counts_and_keeps_what_the_clear_qc_keeps() -> None:
    rng = np.random.default_rng(0)
    counts = {s: random_counts(rng, 60 + 20 * i, 300) for i, s in enumerate(SITES)}
    total, seen = run_protocol(counts)
    clear = sum(counts.values())
    np.testing.assert_array_equal(total, clear)
    snps = [f"rs{i}" for i in range(300)]
    keep, _ = global_qc(snps, total, THRESHOLDS, SITES)
    clear_keep, _ = global_qc(snps, clear, THRESHOLDS, SITES)
    np.testing.assert_array_equal(keep, clear_keep)
    # The server's whole view: no answer carries a site's counts in any encoding it could read without the seeds.
    for site, own in counts.items():
        encoded = sq.encode_counts(site, own).reshape(-1)
        for answer in seen:
            for value in answer.values():
                raw = np.asarray(value, dtype=np.uint8).tobytes()
                assert own.astype(np.int64).tobytes() not in raw and own.astype(np.int32).tobytes() not in raw
                if value.size == 6 * encoded.size:  # a masked vector: unpack it as the server would
                    unpacked = sq.secagg.unpack({"x": value}, {"x": encoded.shape})["x"]
                    assert np.mean(unpacked == encoded) < 0.01  # uniform modulo 2^48: no coordinate left bare


def test_noisy_counts_may_be_negative_and_sum_exactly() -> None:
    rng = np.random.default_rng(1)
    counts = {s: random_counts(rng, 50, 40) + rng.integers(-30, 30, size=(40, 4)) for s in SITES}
    assert min(c.min() for c in counts.values()) < 0
    total, _ = run_protocol(counts, noisy=True)
    np.testing.assert_array_equal(total, sum(counts.values()))
    with pytest.raises(DataPrepError, match="not genotype counts"):
        run_protocol(counts, noisy=False)


def test_two_sites_or_a_minority_threshold_are_refused() -> None:
    with pytest.raises(DataPrepError, match="at least 3 sites"):
        sq.check_secagg_sites(2, "--num-sites")
    with pytest.raises(DataPrepError, match="not a majority"):
        sq.check_secagg_sites(4, "test", threshold=2)
    site = sq.QcSecAggSite("site-1")
    with pytest.raises(DataPrepError, match=r"site-1: secagg.*at least 3 sites"):
        site.advertise({"sites": ["site-1", "site-2"], "threshold": 2})


def test_a_site_answers_the_unmask_step_once_and_refuses_a_replaced_key() -> None:
    rng = np.random.default_rng(2)
    counts = {s: random_counts(rng, 40, 10) for s in SITES}
    sites = {s: sq.QcSecAggSite(s) for s in SITES}
    keys = {s: site.advertise({"sites": list(SITES), "threshold": 2}) for s, site in sites.items()}
    public = {
        s: [sq.to_text(sq.from_wire(k["channel_pk"])), sq.to_text(sq.from_wire(k["mask_pk"]))] for s, k in keys.items()
    }
    forged = dict(public, **{"site-1": public["site-2"]})
    with pytest.raises(DataPrepError, match=r"site-1: secagg: .*own keys were replaced"):
        sites["site-1"].share({"public": forged})
    shares = {s: site.share({"public": public}) for s, site in sites.items()}
    sealed = {s: sq.read_answer(a["sealed"]) for s, a in shares.items()}
    for s, site in sites.items():
        site.mask(counts[s], {"sealed": sealed})
    sites["site-1"].unmask({"summed": list(SITES)})
    with pytest.raises(DataPrepError, match="a second time"):
        sites["site-1"].unmask({"summed": list(SITES)})
    with pytest.raises(DataPrepError, match="a QC sum is over every site"):
        sites["site-2"].unmask({"summed": ["site-1", "site-3"]})


def test_the_exported_job_runs_secagg_at_both_sides_and_declares_each_step(tmp_path: Path) -> None:
    with pytest.raises(DataPrepError, match=r"secagg.*2 sites.*at least 3"):
        export_qc_job(tmp_path, THRESHOLDS, num_sites=2, secure_aggregation="secagg")
    job = export_qc_job(tmp_path, THRESHOLDS, num_sites=3, secure_aggregation="secagg")
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    assert server["workflows"][0]["args"]["secure_aggregation"] == "secagg"
    client = (job / "app" / "config" / "config_fed_client.json").read_text()
    assert "--secure-aggregation secagg" in client
    tasks = {r.task: (r.data, r.meta) for r in qc_releases("secagg")}
    assert tasks == {
        "qc_counts": (("counts_masked",), ("snps",)),
        "qc_filter": (("none",), ("kept",)),
        sq.KEYS_STEP: (("channel_pk", "mask_pk"), ()),
        sq.SHARES_STEP: (("sealed",), ()),
        sq.UNMASK_STEP: (("shares",), ()),
    }
    for task in tasks:
        assert f'"{task}"' in client  # an egress gate on every task a QC site answers


def test_the_server_with_one_site_cannot_recover_anothers_counts() -> None:
    """Collusion below the threshold: the server (every answer) plus site-1 (its keys and opened shares) rebuild
    site-2's self-mask seed (site-1's share and site-3's unmask answer) and strip their own pairwise mask, yet
    site-2's counts stay under its pairwise mask with site-3; given that one missing seed they come out exactly."""
    rng = np.random.default_rng(3)
    counts = {s: random_counts(rng, 80, 50) for s in SITES}
    sites = {s: sq.QcSecAggSite(s) for s in SITES}
    keys = {s: site.advertise({"sites": list(SITES), "threshold": 2}) for s, site in sites.items()}
    public = sq.public_text({s: sq.read_public(k) for s, k in keys.items()})
    shares = {s: site.share({"public": public}) for s, site in sites.items()}
    sealed = {s: sq.read_answer(a["sealed"]) for s, a in shares.items()}
    masked = {s: site.mask(counts[s], {"sealed": sealed}) for s, site in sites.items()}
    held = {s: sq.read_shares(site.unmask({"summed": list(SITES)})["shares"]) for s, site in sites.items()}
    shape = {"x": (4 * 50,)}
    view = sq.secagg.unpack({"x": masked["site-2"][sq.MASKED_COUNTS]}, shape)
    b2 = sq.secagg.rebuild([held["site-1"]["site-2"], held["site-3"]["site-2"]], 2, "site-2's self-mask")
    sq.secagg._subtract(view, sq.secagg.prg(b2, sq.QC_ROUND, shape))
    insider = sites["site-1"]
    mask_pk = {s: sq.read_public(k)[1] for s, k in keys.items()}
    s12 = sq.secagg.pairwise_seed(insider.keys.mask_sk, mask_pk["site-2"])
    sq.secagg._add(view, sq.secagg.prg(s12, sq.QC_ROUND, shape))  # site-2 (index 1) subtracted its mask with site-1
    truth = sq.encode_counts("site-2", counts["site-2"]).reshape(-1)
    assert np.mean(view["x"] == truth) < 0.01
    s23 = sq.secagg.pairwise_seed(sites["site-3"].keys.mask_sk, mask_pk["site-2"])  # the seed they lack
    sq.secagg._subtract(view, sq.secagg.prg(s23, sq.QC_ROUND, shape))  # site-2 (index 1 < 2) added it
    np.testing.assert_array_equal(sq.decode_counts(view["x"], 50, noisy=False), counts["site-2"])
