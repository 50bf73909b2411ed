"""The genotype I/O benchmark end to end at a toy size: every format round-trips exactly, every row is written."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("cyvcf2")

from benchmarks import genotype_io


def test_the_benchmark_measures_every_format_the_loader_and_the_step(tmp_path) -> None:
    out = tmp_path / "io.json"
    # The harmonise step at toy size too: at its defaults (2,000 people x 100,000 SNPs, every format twice, each in a
    # new process) this test ran for over 18 minutes on the loaded 2-core machine.
    argv = ["--snps", "40", "--people", "64", "--format-people", "6", "--patch", "8", "--batch-size", "8",
            "--loader-batches", "3", "--steps", "1", "--harmonise-people", "6", "--harmonise-snps", "40",
            "--out", str(out)]  # fmt: skip
    assert genotype_io.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows if r["what"] == "read+harmonise"] == list(genotype_io.FORMATS)
    harmonised = [(r["round"], r["format"]) for r in rows if r["what"] == "harmonise"]
    assert harmonised == [(k, f) for k in range(2) for f in genotype_io.FORMATS]  # every format, --repeats 2 times
    assert all(r["load_before"] >= 0 and r["load_after"] >= 0 for r in rows if r["what"] == "harmonise")
    loader = next(r for r in rows if r["what"] == "loader")
    assert loader["memmap"] is True and loader["samples_per_s"] > 0
    # The whole pipeline is the host's part and the device's part in sequence: its rate lies below both.
    assert loader["samples_per_s"] <= min(loader["host_samples_per_s"], loader["widen_samples_per_s"])
    assert next(r for r in rows if r["what"] == "train_step")["samples_per_s"] > 0


def test_the_cohort_has_no_strand_ambiguous_snps() -> None:
    _, sites, table = genotype_io.cohort(5, 10)
    assert all({r, a} not in ({"A", "T"}, {"C", "G"}) for r, a in zip(table.ref, table.alt, strict=True))
    assert list(sites.ref) == list(table.ref)
