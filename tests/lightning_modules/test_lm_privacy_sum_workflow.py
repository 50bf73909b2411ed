"""DP-SGD under the sum workflow (``--secure-aggregation he|plain``: NVFlare's ScatterAndGather, which sends none of the
bundle controller's round meta): the site's filter gives its round the run id (the site's NVFlare job id), the round
and the planned rounds from NVFlare's task headers; the privacy ledger counts every round of the job, sigma is
calibrated for the planned rounds, and a site without a ledger may start only in the job's first round
(lightning_modules/privacy/ledger.py, docs/privacy.md)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from torch import nn

pytest.importorskip("opacus")

from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.app_constant import AppConstants

from aggregators.contracts import meta_keys
from controllers.secure_aggregation import ReleasedStepsBroadcast, RoundRecorder, SumWorkflowRound
from lightning_modules.federated import FederatedAlgorithm
from lightning_modules.privacy import PrivacyConfig
from lightning_modules.privacy.dp_sgd import DPSGD, poisson_loader
from lightning_modules.privacy.ledger import LEDGER_NAME, LedgerError, read_ledger, trained_before
from lightning_modules.state_store import ClientStateStore

SITE, JOB = "site-1", "5f1c2a9e-job"


class Linear(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(5, 3)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def received_meta(round_num: int, num_rounds: int, job_id: str = JOB) -> dict[str, Any]:
    """What the site's round reads from a ScatterAndGather task after the site's filter: the DXO meta the client API
    hands over (NVFlare's ``FLModel.meta``)."""
    task = DXO(DataKind.WEIGHTS, data={"layer.weight": np.zeros((3, 5))}).to_shareable()
    task.set_header(AppConstants.CURRENT_ROUND, round_num)
    task.set_header(AppConstants.NUM_ROUNDS, num_rounds)
    fl_ctx = FLContext()
    fl_ctx.set_prop(ReservedKey.RUN_NUM, job_id, private=False, sticky=False)
    filtered = SumWorkflowRound().process(task, fl_ctx)
    return dict(from_shareable(filtered).meta)


def site_round(root, meta: dict[str, Any], target: float = 4.0) -> dict[str, Any]:
    """One DP-SGD round as a site runs it, with everything built afresh (a new process every round)."""
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 5, generator=g), torch.randint(0, 3, (40,), generator=g))
    loader = poisson_loader(torch.utils.data.DataLoader(dataset, batch_size=8))
    store = ClientStateStore(root, SITE, per_run=True)
    privacy = DPSGD(PrivacyConfig(max_grad_norm=1.0, noise_multiplier=None, target_epsilon=target), SITE, store)
    callback = FederatedAlgorithm("fedavg", site=SITE, state_store=store, meta_source=lambda: meta, privacy=privacy)
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False)
    trainer.fit(Linear(), train_dataloaders=loader)
    return callback.last_meta


def test_the_sites_filter_gives_the_round_its_job_id_round_and_planned_rounds():
    meta = received_meta(2, 5)
    assert meta[meta_keys.RUN_ID] == JOB and meta[meta_keys.ROUND] == 2 and meta[meta_keys.NUM_ROUNDS] == 5
    assert meta_keys.LAST_RELEASED not in meta and meta_keys.LAST_AGGREGATED not in meta
    task = DXO(DataKind.WEIGHTS, data={"w": np.zeros(2)}).to_shareable()  # no round headers
    with pytest.raises(ValueError, match="lacks the job id or ScatterAndGather's round headers"):
        SumWorkflowRound().process_dxo(from_shareable(task), task, FLContext())


def test_the_ledger_counts_every_round_of_the_job_and_sigma_covers_the_planned_rounds(tmp_path):
    rounds, target = 3, 4.0
    spent = []
    for round_num in range(rounds):
        meta = site_round(tmp_path, received_meta(round_num, rounds), target)
        spent.append((meta[meta_keys.PRIVACY_STEPS], meta[meta_keys.PRIVACY_EPSILON]))
    assert [steps for steps, _ in spent] == [5, 10, 15]  # q = 8/40: 5 steps a round, counted across rounds
    assert spent[0][1] < spent[1][1] < spent[2][1] and target * 0.99 < spent[2][1] <= target
    ledger = tmp_path / JOB / SITE / f"{LEDGER_NAME}.state"  # the job id is the run the ledger belongs to
    assert ledger.is_file() and not (tmp_path / SITE).exists()


def test_a_site_without_its_ledger_may_start_only_in_the_jobs_first_round(tmp_path):
    site_round(tmp_path, received_meta(0, 3))
    store = ClientStateStore(tmp_path, SITE, per_run=True)
    store.use_run(JOB)
    store.path(LEDGER_NAME).unlink()  # lost after round 0 released a result
    with pytest.raises(LedgerError, match=r"site-1: privacy ledger .* is missing although this is round 1 of a server"):
        site_round(tmp_path, received_meta(1, 3))
    assert not store.path(LEDGER_NAME).exists()  # nothing trained, nothing written
    # Another job (its own id) starts from its first round with an empty ledger.
    assert site_round(tmp_path, received_meta(0, 3, job_id="another-job"))[meta_keys.PRIVACY_STEPS] == 5


def test_the_rule_for_a_server_that_tracks_no_releases_leaves_the_bundles_controller_as_it_was(tmp_path):
    store = ClientStateStore(tmp_path, SITE, per_run=True)
    untracked = {meta_keys.RUN_ID: JOB, meta_keys.ROUND: 4, meta_keys.NUM_ROUNDS: 5}
    assert trained_before(SITE, untracked) and not trained_before(SITE, {**untracked, meta_keys.ROUND: 0})
    assert trained_before(SITE, {meta_keys.RUN_ID: JOB})  # no round at all: not known to be the first
    # The bundle's controller sends last_released every round: a site it does not name never released.
    tracked = {**untracked, meta_keys.LAST_RELEASED: {"site-2": 3}, meta_keys.LAST_AGGREGATED: {"site-2": 3}}
    assert not trained_before(SITE, tracked) and read_ledger(store, SITE, tracked, 1e-5).steps == 0
    assert trained_before(SITE, {**tracked, meta_keys.LAST_RELEASED: {SITE: 2}})


def broadcast_meta(round_num: int, num_rounds: int, recorder: RoundRecorder) -> dict[str, Any]:
    """A ScatterAndGather task through the server's `ReleasedStepsBroadcast` (the recorder's released steps), then
    through the site's filter: the meta the site's round reads."""
    task = DXO(DataKind.WEIGHTS, data={"layer.weight": np.zeros((3, 5))}).to_shareable()
    server = FLContext()
    server.set_prop(ReservedKey.ENGINE, SimpleNamespace(get_component=lambda cid: {"rounds": recorder}.get(cid)))
    task = ReleasedStepsBroadcast().process(task, server)
    task.set_header(AppConstants.CURRENT_ROUND, round_num)
    task.set_header(AppConstants.NUM_ROUNDS, num_rounds)
    site = FLContext()
    site.set_prop(ReservedKey.RUN_NUM, JOB, private=False, sticky=False)
    return dict(from_shareable(SumWorkflowRound().process(task, site)).meta)


def test_under_the_sum_workflow_a_site_on_a_restored_old_ledger_stops(tmp_path):
    """The stale-ledger attack under ``--secure-aggregation``: the server's round recorder keeps each site's last
    ``privacy.steps`` and its task-data filter broadcasts them; a site whose ledger was restored from a backup one
    round old stops before training and writes nothing."""
    recorder = RoundRecorder(num_rounds=3, secure_aggregation="plain")
    assert meta_keys.RELEASED_STEPS not in broadcast_meta(0, 3, recorder)  # nothing released yet
    meta = site_round(tmp_path, broadcast_meta(0, 3, recorder))
    recorder.note_result(SITE, meta)
    store = ClientStateStore(tmp_path, SITE, per_run=True)
    store.use_run(JOB)
    backup = store.path(LEDGER_NAME).read_bytes()
    recorder.note_result(SITE, site_round(tmp_path, broadcast_meta(1, 3, recorder)))
    assert recorder.released_steps == {SITE: 10}
    store.path(LEDGER_NAME).write_bytes(backup)
    with pytest.raises(LedgerError, match=r"site-1: privacy ledger .* is stale: it holds 5 DP-SGD steps .* after 10"):
        site_round(tmp_path, broadcast_meta(2, 3, recorder))
    assert store.path(LEDGER_NAME).read_bytes() == backup
    recorder.note_result(SITE, {meta_keys.PRIVACY_STEPS: 5})  # a lower count never lowers the record
    assert recorder.released_steps == {SITE: 10}
