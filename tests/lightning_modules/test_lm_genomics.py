"""The genomics example's model (examples/genomics/model.py) honours the bundle's protocols, and SCAFFOLD's
diagnostics are what they claim to be."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aggregators.scaffold import Scaffold, ScaffoldControl, l2_norm
from aggregators.types import ClientUpdate, RoundContext

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from genomics.model import SnpClassifier


@pytest.mark.parametrize("arch", ["cnn_transformer", "mlp"])
def test_task_loss_at_given_params_equals_the_loss_at_the_modules_weights(arch: str) -> None:
    module = SnpClassifier(arch=arch, n_snps=21, num_classes=3, patch=4, d_model=16, hidden=8)
    module.eval()
    states = torch.randint(0, 4, (6, 21))
    batch = (states, torch.tensor([0, 1, 2, 0, 1, 2]))
    with torch.no_grad():
        loss, logits = module.task_loss(batch)
    params = {k: v.clone() for k, v in module.state_dict().items()}
    again, _ = module.task_loss(batch, params=params)
    assert logits.shape == (6, 3)
    assert float(again) == pytest.approx(float(loss), abs=1e-6)


def test_the_proportions_loss_is_the_soft_label_cross_entropy() -> None:
    module = SnpClassifier(arch="mlp", n_snps=5, num_classes=3, target="proportions", hidden=4)
    states = torch.randint(0, 4, (2, 5))
    target = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    loss, logits = module.task_loss((states, target))
    z = logits.detach().numpy().astype(np.float64)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    assert float(loss) == pytest.approx(float(-(target.numpy() * log_p).sum(axis=1).mean()), abs=1e-6)


def test_the_norm_of_the_global_control_is_the_euclidean_norm_of_all_its_entries() -> None:
    control = {"a": np.array([3.0, 0.0], np.float32), "b": np.array([[4.0]], np.float32)}
    assert ScaffoldControl().diagnostics({"control": control}) == {"scaffold.ctrl.global_norm": 5.0}
    assert Scaffold().diagnostics({"control": {}}) == {"scaffold.ctrl.global_norm": 0.0}
    assert l2_norm({"x": np.array([1.0, 2.0, 2.0])}) == 3.0


def test_scaffold_diagnostics_follow_the_control_update() -> None:
    rule = Scaffold()
    params = {"w": np.zeros(2, np.float32)}
    updates = [
        ClientUpdate(f"site-{i}", params, 10, {"scaffold.ctrl.diff": {"w": np.array(d, np.float32)}})
        for i, d in enumerate([[3.0, 0.0], [0.0, 4.0]])
    ]
    result = rule.aggregate(params, updates, rule.init_state(params), RoundContext(0, 1, ("site-0", "site-1")))
    # c = (1/2) * ([3, 0] + [0, 4]) = [1.5, 2]: ||c|| = 2.5
    assert rule.diagnostics(result.state)["scaffold.ctrl.global_norm"] == pytest.approx(2.5, abs=1e-6)


def test_a_real_site_reads_its_own_file_named_in_its_environment(tmp_path, monkeypatch) -> None:
    from genomics.data import SnpSites

    (tmp_path / "g.csv").write_text("sample,rs2,rs1,population\np1,CT,AG,GBR\np2,--,GG,CHB\np3,TT,AA,GBR\n")
    (tmp_path / "t.csv").write_text("snp,ref,alt\nrs1,A,G\nrs2,C,T\n")
    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(tmp_path / "g.csv"))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(tmp_path / "t.csv"))
    data = SnpSites(site="site-7", classes=["CHB", "GBR"], val_fraction=0.0)
    states, labels = data.train.tensors
    # Columns in the table's order (rs1, rs2); rows in the module's seeded shuffle, so compared as pairs.
    pairs = sorted(zip(map(tuple, states.tolist()), labels.tolist(), strict=True))
    assert pairs == [((0, 2), 1), ((1, 1), 1), ((2, 3), 0)]


def test_a_real_site_with_a_different_snp_set_is_refused_by_name(tmp_path) -> None:
    from genomics.data import SnpSites

    from data_prep import DataPrepError

    (tmp_path / "g.csv").write_text("sample,rs1,rs3,population\np1,AG,CT,GBR\n")
    (tmp_path / "t.csv").write_text("snp,ref,alt\nrs1,A,G\nrs2,C,T\n")
    with pytest.raises(DataPrepError, match=r"site-2: its SNP set differs.*missing rs2; not in the panel rs3"):
        SnpSites(site="site-2", data_file=str(tmp_path / "g.csv"), snp_table=str(tmp_path / "t.csv"), classes=["GBR"])


def test_ancestry_proportions_are_learned_federated_on_a_simulated_cohort(tmp_path, monkeypatch) -> None:
    """The second task (deconvolution): the sites score the mean absolute error of the proportions, and it falls."""
    pytest.importorskip("msprime")
    from benchmarks.in_process import quiet_lightning, run_in_process
    from jobs.spec import JobSpec

    monkeypatch.setenv("FEDALG_CACHE_DIR", str(tmp_path / "cache"))
    cohort = {"source": "sim", "n_snps": 200, "samples_per_population": 60, "split": "iid", "target": "proportions"}
    spec = JobSpec(
        name="deconvolution",
        num_sites=2,
        num_rounds=3,
        model="genomics.model:SnpClassifier",
        model_args={"arch": "mlp", "n_snps": 200, "num_classes": 4, "target": "proportions", "lr": 3e-3},
        data="genomics.data:SnpSites",
        data_args={**cohort, "batch_size": 32},
    )
    with quiet_lightning():
        run = run_in_process(spec, tmp_path / "state")
    initial = run.rounds[0]["site_eval"]["val_mae"]["mean"]  # the untrained model, scored in round 1
    final = np.mean([s["val_mae"] for s in run.final_site_scores.values()])
    assert final < 0.8 * initial
