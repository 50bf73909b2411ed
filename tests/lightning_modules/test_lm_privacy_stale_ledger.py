"""The stale-ledger attack through the round engine in process: the server's real broadcast (``server.released_steps``)
and the sites' real DP-SGD rounds. Site-2's ledger is backed up after round 1 and restored before round 3, as a site
restores a backup after losing its disk: site-2 stops before training (it sends nothing), site-1 goes on, and the
epsilon the server records for site-2 never goes below what it released. The attack itself, without the server's
record, is in tests/lightning_modules/test_lm_privacy.py (the stale ledger is then accepted)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("opacus")

from aggregators.contracts import meta_keys
from benchmarks.in_process import quiet_lightning, run_in_process
from jobs.spec import JobSpec
from lightning_modules.privacy.ledger import LEDGER_NAME

SPEC = {
    "dataset": "digits",
    "arch": "mlp",
    "num_sites": 2,
    "num_rounds": 3,
    "batch_size": 32,
    "max_train_samples": 200,
    "dp_noise_multiplier": 1.0,
    "dp_max_grad_norm": 1.0,
}


class RestoringTransport:
    """The sites' transport, with site-2's ledger file replaced by its round-1 backup before round 3."""

    def __init__(self, inner, state_root: Path) -> None:
        self.inner, self.state_root, self.backup = inner, state_root, None

    def ledger(self) -> Path:
        (found,) = [p for p in self.state_root.rglob(f"{LEDGER_NAME}.state") if "site-2" in p.parts]
        return found

    def train(self, round_num, targets, params, meta):
        if round_num == 1:
            self.backup = self.ledger().read_bytes()  # the ledger after round 1 (index 0)
        if round_num == 2:
            self.ledger().write_bytes(self.backup)
        return self.inner.train(round_num, targets, params, meta)


def test_a_site_on_a_restored_old_ledger_sends_nothing_and_the_others_go_on(tmp_path):
    transports = []

    def wrap(inner):
        transports.append(RestoringTransport(inner, tmp_path / "state"))
        return transports[0]

    with quiet_lightning():
        run = run_in_process(JobSpec(name="stale", **SPEC), tmp_path / "state", evaluate=False, wrap_transport=wrap)
    failures = transports[0].inner.failures
    assert [(r, site) for r, site, _ in failures] == [(2, "site-2")]
    assert "LedgerError: site-2: privacy ledger" in failures[0][2] and "is stale" in failures[0][2]
    per_round = run.rounds[0]["privacy"]["site-2"]["steps"]
    assert f"it holds {per_round} DP-SGD steps" in failures[0][2] and f"after {2 * per_round} steps" in failures[0][2]
    last = run.rounds[-1]
    assert last["status"] == "aggregated" and sorted(last["privacy"]) == ["site-1"]
    assert last["privacy"]["site-1"]["steps"] == 3 * run.rounds[0]["privacy"]["site-1"]["steps"]
    assert meta_keys.RELEASED_STEPS == "server.released_steps"
