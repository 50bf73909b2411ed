"""Smoke test of benchmarks/dp_overhead.py: one private site's fit measures steps and memory; the table divides."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("opacus")

from benchmarks.dp_overhead import build, measure_one, table


def test_one_private_fit_is_measured():
    result = measure_one("lenet5", True, samples=64, batch_size=32, epochs=2)
    assert result["steps"] == 2 and result["seconds_per_step"] > 0 and result["peak_mib"] > 0


def test_the_table_shows_the_ratio_of_medians():
    rows = {
        ("lenet5", False): [{"seconds_per_step": 0.01, "peak_mib": 100}],
        ("lenet5", True): [{"seconds_per_step": 0.03, "peak_mib": 120}],
    }
    args = argparse.Namespace(
        models=["lenet5"], samples=64, batch_size=32, epochs=2, repeats=1, device="cpu", precision="32-true"
    )
    assert "| lenet5 | 10.00 | 30.00 | 3.00 | 100 | 120 |" in table(rows, args)


def test_the_noise_table_times_every_way_of_drawing_against_the_global_generator():
    from benchmarks.dp_overhead import NOISE_WAYS, noise_seconds, noise_table

    seconds = noise_seconds("lenet5", repeats=2)
    assert set(seconds) == set(NOISE_WAYS) and all(value > 0 for value in seconds.values())
    text = noise_table(["lenet5"], repeats=2, device="cpu")
    assert text.startswith("| model | ms/step, global generator |") and "| lenet5 |" in text


def test_the_large_genotype_model_takes_its_snp_count_and_the_dp_ready_attention():
    from benchmarks.snp_model import LARGE_SNP_MODEL

    module, dataset = build("cnn_transformer_large", 4, snps=40)
    x, y = dataset.tensors
    assert x.shape == (4, 40) and int(x.max()) <= 2 and int(y.max()) < LARGE_SNP_MODEL["num_classes"]
    hp = module.hparams
    assert (hp.n_snps, hp.attention, hp.d_model, hp.layers, hp.heads, hp.patch) == (40, "linear", 256, 4, 8, 16)
    small, _ = build("cnn_transformer", 1, snps=40)  # the consortium's model keeps its 127 SNPs
    assert small.hparams.n_snps == 127 and small.hparams.d_model == 32


def test_bad_sizes_and_a_missing_gpu_are_refused_by_name(capsys, monkeypatch):
    import torch

    from benchmarks.dp_overhead import parse_args

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for bad, says in ((["--snps", "0"], "--snps must be >= 1, got 0"), (["--device", "gpu"], "no CUDA GPU")):
        with pytest.raises(SystemExit):
            parse_args(bad)
        assert says in capsys.readouterr().err
