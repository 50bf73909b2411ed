"""The example in the genomics consortium's architecture (examples/genomics_consortium) and its committed job
jobs/snp_consortium: the pieces of the model (closed forms), the job as the builder makes it, and one federated
round in process on the 1000 Genomes panel."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch


def test_the_focal_loss_is_the_cross_entropy_at_gamma_0_and_down_weights_easy_examples():
    from genomics_consortium.model import focal_loss

    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]]))
    target = torch.tensor([0, 1])
    assert focal_loss(logits, target, 0.0).item() == pytest.approx(-(math.log(0.5) + math.log(0.6)) / 2, abs=1e-6)
    expected = -(0.5**2 * math.log(0.5) + 0.4**2 * math.log(0.6)) / 2
    assert focal_loss(logits, target, 2.0).item() == pytest.approx(expected, abs=1e-6)


def test_each_haploblock_has_its_own_embedding_and_the_last_block_is_padded_with_missing():
    from genomics_consortium.model import MISSING, HaploblockEmbedding

    torch.manual_seed(0)
    embed = HaploblockEmbedding(n_snps=10, block_size=4, embed_dim=3)  # blocks: SNPs 0-3, 4-7, 8-9 + 2 missing
    states = torch.zeros(1, 10, dtype=torch.long)
    changed = states.clone()
    changed[0, 5] = 2
    moved = (embed(changed) - embed(states)).abs().sum(dim=2)[0]
    assert moved[1] > 0 and moved[0] == 0 and moved[2] == 0  # only SNP 5's block moves
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 0, MISSING, MISSING]), 4).float().reshape(-1)
    last = one_hot @ embed.weight[2] + embed.bias[2]
    assert torch.allclose(embed(states)[0, 2], last, atol=1e-6)
    same_states_other_block = one_hot @ embed.weight[1] + embed.bias[1]
    assert not torch.allclose(last, same_states_other_block)  # blocks share no weights


def test_the_construction_is_seeded_and_task_loss_at_params_is_task_loss_at_the_weights():
    from genomics_consortium.model import HaploblockClassifier

    torch.manual_seed(1)
    first = HaploblockClassifier(seed=3)
    torch.manual_seed(2)
    second = HaploblockClassifier(seed=3)
    assert all(
        torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True)
    )
    assert any(isinstance(m, torch.nn.BatchNorm1d) for m in first.modules())
    assert any(isinstance(m, torch.nn.TransformerEncoder) for m in first.modules())
    first.eval()
    batch = (torch.randint(0, 4, (6, 127)), torch.randint(0, 5, (6,)))
    at_params, _ = first.task_loss(batch, dict(first.named_parameters()))
    assert at_params.item() == pytest.approx(first.task_loss(batch)[0].item(), abs=1e-6)


def test_the_optimizer_is_adamw_with_cosine_warm_restarts_every_step():
    from genomics_consortium.model import HaploblockClassifier

    configured = HaploblockClassifier(restart_steps=4).configure_optimizers()
    assert isinstance(configured["optimizer"], torch.optim.AdamW)
    schedule = configured["lr_scheduler"]
    assert isinstance(schedule["scheduler"], torch.optim.lr_scheduler.CosineAnnealingWarmRestarts)
    assert schedule["interval"] == "step" and schedule["scheduler"].T_0 == 4


def test_the_committed_job_carries_no_copy_of_the_installed_examples_and_builds_the_seeded_model(tmp_path):
    """The bundle installs both example packages, so the job ships neither (no copy of them in the repository) and
    its site requirements say where they come from; the sites import them from the bundle's install."""
    from jobs.assembly import export_job
    from jobs.presets import PRESETS

    job = export_job(PRESETS["snp_consortium"], tmp_path)
    custom = job / "app" / "custom"
    assert [p.name for p in custom.iterdir() if p.is_dir()] == []  # no package folder copied into the job
    requirements = (custom / "site_requirements.txt").read_text()
    assert "# Installed with nvflare-noniid above (nothing to ship or install): genomics.data, " in requirements
    assert "Must be importable" not in requirements and "Shipped with the job" not in requirements
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    model = server["components"][0]["args"]["model"]
    assert model["args"]["model"] == "genomics_consortium.model:HaploblockClassifier" and model["args"]["seed"] == 0
    assert "controllers.fedalg_controller.FedAlgController" in json.dumps(server)
    assert server["workflows"][0]["args"]["settings"]["server"] == "fedavg"


def test_one_round_trains_in_process_and_moves_the_batchnorm_statistics(tmp_path):
    from benchmarks.in_process import initial_params, quiet_lightning, run_in_process
    from jobs.presets import PRESETS

    spec = dataclasses.replace(PRESETS["snp_consortium"], name="consortium_one_round", num_rounds=1)
    with quiet_lightning():
        run = run_in_process(spec, tmp_path)
    accuracy = run.rounds[-1]["site_eval"]["val_accuracy"]  # the sites scored the received model
    assert set(accuracy["per_site"]) == {"site-1", "site-2", "site-3"}
    start = initial_params(spec)
    assert not (run.params["net.norm.running_mean"] == start["net.norm.running_mean"]).all()
    assert any(not (run.params[k] == start[k]).all() for k in start if k.endswith("weight"))
