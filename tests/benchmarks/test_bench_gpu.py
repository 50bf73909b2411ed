"""The bf16/fp32 GPU benchmark without training (the in-process federation is replaced by a stand-in): a run that
updated no global model is named with the reason and makes the command exit 1, and a missing accuracy prints."""

from __future__ import annotations

import benchmarks.in_process as in_process
from benchmarks import gpu


def test_a_missing_accuracy_prints_as_a_dash():
    row = {"case": "c", "algorithm": "fedavg", "precision": "32-true", "samples_per_s": 10.0, "state_dtypes": []}
    assert gpu.format_row({**row, "final_accuracy": None}).endswith("samples/s  accuracy -  state -")
    assert gpu.format_row({**row, "final_accuracy": 0.25}).endswith("samples/s  accuracy 0.2500  state -")


def test_a_run_in_which_no_round_aggregated_is_named_and_the_command_exits_1(monkeypatch, capsys):
    def never_aggregates(spec, state_root, **_):
        failed = {"stage": "round", "status": "failed", "failure": "rule 'fedavg': no valid result"}
        records = [{"stage": "initial", "num_rounds": 2}, *({**failed, "round": r} for r in range(2))]
        return in_process.InProcessRun(params={}, state={}, records=records)

    monkeypatch.setattr(in_process, "run_in_process", never_aggregates)
    monkeypatch.setattr(gpu, "case_specs", lambda quick: {"lenet5_fmnist": {"num_rounds": 2, "batch_size": 64}})
    assert gpu.main(["--quick"]) == 1
    err = capsys.readouterr().err
    reason = "no round updated the global model (last failure: rule 'fedavg': no valid result)"
    for run in ("fedavg 32-true", "fedavg bf16-mixed", "scaffold 32-true", "scaffold bf16-mixed"):
        assert f"error: run did not complete: lenet5_fmnist {run}: {reason}" in err


def test_integer_buffers_pass_the_fp32_state_check_and_half_precision_does_not():
    assert gpu.fp32_or_integer("torch.float32") and gpu.fp32_or_integer("torch.int64")
    assert not gpu.fp32_or_integer("torch.bfloat16") and not gpu.fp32_or_integer("torch.float16")


def test_personalization_settings_follow_the_harnesses_and_fedbn_needs_the_built_in_data():
    built_in, genomics = {"num_rounds": 1}, {"num_rounds": 1, "model": "genomics.model:SnpClassifier"}
    assert gpu.algorithm_settings(built_in, "fedbn") == {
        "arch": "bn_cnn",
        "local_keys": "batchnorm",
        "site_val_fraction": gpu.SITE_VAL_FRACTION,
    }
    assert gpu.algorithm_settings(genomics, "fedbn") is None
    assert gpu.algorithm_settings(genomics, "ditto")["client_args"]["personal_lr"] == 0.01
    assert gpu.algorithm_settings(built_in, "scaffold") == {"client": "scaffold", "server": "scaffold"}


def test_a_personal_accuracy_prints_beside_the_global_one():
    row = {"case": "c", "algorithm": "ditto", "precision": "bf16-mixed", "samples_per_s": 1.0, "state_dtypes": []}
    line = gpu.format_row({**row, "final_accuracy": 0.5, "personal_accuracy": 0.75})
    assert line.endswith("accuracy 0.5000  personal 0.7500  state -")
