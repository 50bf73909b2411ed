"""DP-SGD jobs refused at build time: one line, exit code 2, nothing written (docs/privacy.md)."""

from __future__ import annotations

import pytest

pytest.importorskip("opacus")

from jobs.build import main
from jobs.presets import EXAMPLES, PRESETS
from jobs.spec import JobBuildError, JobSpec

DP = ["--dp-noise-multiplier", "1.0", "--dp-max-grad-norm", "1.0"]
DIGITS = ["--dataset", "digits", "--arch", "mlp"]
SNP = {
    "model": "genomics.model:SnpClassifier",
    "data": "genomics.data:SnpSites",
    "ship": str(EXAMPLES / "genomics"),
    "dp_noise_multiplier": 1.0,
    "dp_max_grad_norm": 1.0,
}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--dp-noise-multiplier", "-1", "--dp-max-grad-norm", "1"],
            "dp_noise_multiplier must be a finite number >= 0",
        ),
        (["--dp-noise-multiplier", "1", "--dp-max-grad-norm", "0"], "dp_max_grad_norm must be a finite number > 0"),
        (["--dp-noise-multiplier", "1"], "dp_max_grad_norm (C) must be a finite number > 0 when DP-SGD is on"),
        ([*DP, "--dp-delta", "1"], "dp_delta must be a finite number in (0, 1)"),
        ([*DP, "--dp-delta", "0"], "dp_delta must be a finite number in (0, 1)"),
        (["--dp-max-grad-norm", "1"], "dp_max_grad_norm is set but DP-SGD is off"),
        (["--dp-target-epsilon", "0", "--dp-max-grad-norm", "1"], "dp_target_epsilon must be a finite number > 0"),
        (
            ["--dp-noise-multiplier", "0.5", "--dp-max-grad-norm", "1", "--dp-target-epsilon", "0.5", *DIGITS],
            "dp_target_epsilon 0.5: site-1's first round alone",
        ),
        (["--dp-noise-multiplier", "0", "--dp-max-grad-norm", "1", "--dp-target-epsilon", "3"], "without noise"),
        ([*DP, "--client", "fedmos", "--server", "fedmos"], "client 'fedmos' cannot run under DP-SGD: FedMoS takes"),
        ([*DP, "--client", "ditto"], "client 'ditto' cannot run under DP-SGD"),
        ([*DP, "--client", "fedrep"], "client 'fedrep' cannot run under DP-SGD"),
        (
            [*DP, "--client", "scaffold", "--server", "scaffold", "--client-args", '{"option":"I"}'],
            "client 'scaffold' with option I sends a control computed from a full gradient",
        ),
        ([*DP, "--arch", "bn_cnn"], "BatchNorm2d mixes the samples of a batch (net.bn1, net.bn2): use GroupNorm"),
        ([*DP, "--site-val-fraction", "0.1", "--finetune-epochs", "1"], "finetune_epochs 1 under DP-SGD"),
    ],
)
def test_refused_in_one_line_with_nothing_written(tmp_path, capsys, argv, message):
    out = tmp_path / "jobs"
    assert main(["--output-dir", str(out), "--name", "dp", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert message in err
    assert not out.exists()


def test_a_model_opacus_cannot_handle_is_refused_with_what_to_change():
    with pytest.raises(JobBuildError, match=r"parameters \['position'\] of net.encoder .* leaf nn.Module"):
        JobSpec(name="snp", **SNP, model_args={"arch": "cnn_transformer", "n_snps": 127, "num_classes": 5})
    JobSpec(name="snp", **SNP, model_args={"arch": "cnn_transformer", "attention": "linear", "num_classes": 5})


def test_every_kind_of_problem_is_named_once_with_the_modules_that_have_it():
    from torch import nn

    from lightning_modules.privacy.dp_sgd import model_problem

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.BatchNorm1d(4), nn.MultiheadAttention(4, 1))
    message = model_problem(model)
    assert message.count("mixes the samples of a batch") == 1 and message.count("nn.MultiheadAttention") == 1
    assert message.startswith("BatchNorm1d mixes the samples of a batch (1, 2): use GroupNorm or LayerNorm; ")
    assert "; nn.MultiheadAttention has no per-sample gradient in Opacus (3): build" in message
    assert model_problem(nn.Sequential(nn.Linear(4, 4), nn.GroupNorm(2, 4))) is None


def test_ddp_sites_are_refused():
    with pytest.raises(JobBuildError, match="devices 2: DP-SGD under DDP is not implemented"):
        JobSpec(name="snp", **SNP, model_args={"arch": "mlp", "num_classes": 5}, devices=2)


def test_the_dp_presets_build():
    for name in ("fedavg_dp", "snp_scaffold_dp"):
        spec = PRESETS[name]
        assert spec.dp_target_epsilon == 8.0 and spec.dp_max_grad_norm == 1.0 and spec.dp_noise_multiplier is None
