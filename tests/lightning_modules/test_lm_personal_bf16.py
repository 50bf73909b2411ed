"""FedPer, FedBN and FedRep sites under ``precision="bf16-mixed"`` with AdamW, on CPU (bf16 autocast runs there).

A two-site, two-round federation through the in-process engine (`benchmarks.in_process.run_in_process`,
the client script's own site round and Trainer) with the built-in BatchNorm CNN of ``jobs/fedbn`` as a user module
trained with AdamW (``personal_bf16_models.py``). For each method:

- autocast really computed in bf16 (the logits are bf16) while the weights stay fp32;
- no site ever sends a local entry, the global model keeps their initial values, every round aggregates both sites;
- the local entries persist at the site: round 1 starts from what round 0 ended with, not from the received values,
  and the state store holds them bit for bit, floats as float32;
- FedRep: in the head phase (epoch 0) every body parameter is bit-identical from start to end, in the body phase
  (epoch 1) every head parameter is, and the other part moved (AdamW with weight decay moves whatever it steps);
- every weight and every round's training loss are finite, and every round both sites report finite global and
  personal validation scores.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import in_process
from jobs.spec import JobSpec
from lightning_modules.personalization.partial_sharing import STORE_NAME
from lightning_modules.state_store import ClientStateStore

HERE = Path(__file__).resolve().parent
SITES = ("site-1", "site-2")
#: method -> (client algorithm, client args, --local-keys)
METHODS = {
    "fedper": ("fedavg", {}, "net.classifier.*"),
    "fedbn": ("fedavg", {}, "batchnorm"),
    "fedrep": ("fedrep", {"head_epochs": 1}, ""),  # the head the CNN declares: net.classifier
}


def run_method(method: str, tmp_path: Path, monkeypatch) -> tuple[JobSpec, object, dict, list]:
    """Two rounds of ``method``; returns the spec, the run, the site objects and what every site sent."""
    monkeypatch.syspath_prepend(str(HERE))
    client, client_args, local_keys = METHODS[method]
    spec = JobSpec(
        name=f"bf16_{method}",
        model="personal_bf16_models:AdamWBatchNormCNN",
        data="personal_bf16_models:RandomImages",
        client=client,
        client_args=client_args,
        local_keys=local_keys,
        precision="bf16-mixed",
        num_sites=len(SITES),
        num_rounds=2,
    )
    sites: dict = {}
    build_sites = in_process.site_rounds
    monkeypatch.setattr(in_process, "site_rounds", lambda *a: sites.update(build_sites(*a)) or sites)
    sent: list = []

    class Recording:
        def __init__(self, inner) -> None:
            self.inner = inner

        def train(self, round_num, targets, params, meta):
            results = self.inner.train(round_num, targets, params, meta)
            sent.extend((round_num, r.site, set(r.params)) for r in results)
            return results

    with in_process.quiet_lightning():
        run = in_process.run_in_process(spec, tmp_path, evaluate=False, run_id="bf16", wrap_transport=Recording)
    return spec, run, sites, sent


@pytest.mark.parametrize("method", list(METHODS))
def test_personal_sites_train_two_rounds_under_bf16_mixed_with_adamw(tmp_path, monkeypatch, method):
    spec, run, sites, sent = run_method(method, tmp_path, monkeypatch)
    local = spec.local_keys.split(",")
    initial = in_process.initial_params(spec)
    if method == "fedbn":
        assert len(local) == 10 and all(key.startswith(("net.bn1.", "net.bn2.")) for key in local)
    else:
        assert local == ["net.classifier.bias", "net.classifier.weight"]
    assert [(r["status"], r["aggregated"]) for r in run.rounds] == [("aggregated", list(SITES))] * 2
    losses = [loss for r in run.rounds for loss in r["site_train_loss"].values()]
    assert len(losses) == 4 and np.isfinite(losses).all()
    assert len(sent) == 4 and all(keys == set(initial) - set(local) for _, _, keys in sent)
    for key in local:  # no rule ever touched them
        np.testing.assert_array_equal(run.params[key], initial[key])
    assert all(np.isfinite(value).all() for value in run.params.values())
    for record in run.rounds:  # personal against global, scored under bf16 autocast like the training
        scores = record["site_eval"]
        assert {"val_loss", "personal_val_loss"} <= set(scores)
        assert all(
            set(s["per_site"]) == set(SITES) and np.isfinite(list(s["per_site"].values())).all()
            for s in scores.values()
        )

    for name, site in sites.items():
        module = site.module
        assert module.logit_dtypes == {torch.bfloat16}  # autocast ran
        assert module.device_types == {"cuda" if torch.cuda.is_available() else "cpu"}  # accelerator "auto"
        # The state the site ended its last epoch with: after the run the site scores the final global model on its
        # validation split, which loads that model (its local entries the initial ones) into the module.
        state = module.snapshots[-1][2]
        assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
        assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
        stored = ClientStateStore(tmp_path, name).latest(STORE_NAME).state
        for key in local:
            assert torch.equal(stored[key], state[key]), (name, key)
            assert stored[key].dtype == (torch.float32 if state[key].is_floating_point() else torch.int64)
            assert not np.array_equal(state[key].numpy(), initial[key]), (name, key)  # trained at the site
        # Round 1 started from the site's own local entries (round 0's end), not from the received initial ones.
        epochs_per_round = 2 if method == "fedrep" else 1
        end_of_round0 = module.snapshots[2 * epochs_per_round - 1][2]
        start_of_round1 = module.snapshots[2 * epochs_per_round][2]
        for key in local:
            assert torch.equal(start_of_round1[key], end_of_round0[key]), (name, key)
        if method == "fedrep":
            assert_phases_freeze(module, set(local))


def assert_phases_freeze(module, head: set[str]) -> None:
    """Head phase (epoch 0): the body parameters bit-identical from its start to its end, the head moved; body
    phase (epoch 1): the head bit-identical, the body moved. BatchNorm statistics are buffers and update in both."""
    parameters = [name for name, _ in module.named_parameters()]
    snapshots = module.snapshots
    assert [(epoch, when) for epoch, when, _ in snapshots] == [(0, "start"), (0, "end"), (1, "start"), (1, "end")] * 2
    for first in range(0, len(snapshots), 2):
        epoch, _, start = snapshots[first]
        end = snapshots[first + 1][2]
        frozen = [n for n in parameters if (n in head) == (epoch == 1)]
        trained = [n for n in parameters if n not in frozen]
        assert frozen and trained
        assert all(torch.equal(start[n], end[n]) for n in frozen), epoch
        assert all(not torch.equal(start[n], end[n]) for n in trained), epoch
