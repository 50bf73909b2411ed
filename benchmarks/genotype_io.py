"""Genotype I/O at consortium scale: ``python -m benchmarks.genotype_io``.

Measures, on a random cohort (people x SNPs, genotypes 0/1/2 with 1 % missing calls, a table by position):

1. read + harmonise seconds per format (VCF, VCF.gz, BCF, PLINK 1, PLINK 2, BGEN 8-bit) at ``--format-people`` x
   each SNP count, the file written first by the libraries (not timed; BGEN by ``data_prep.genotypes.bgen``);
2. the streaming loader's samples/s over a memory-mapped int8 matrix of ``--people`` x each SNP count (shuffled
   int8 rows -> int8 batch -> the device -> int64 there; ``open_matrix`` maps a harmonised ``.npz`` the same way),
   in all and split into the host's part and the device's, with the process's peak RSS before and after (the pages
   of the mapped file it touched count in it);
3. the ``cnn_transformer`` training step's samples/s at each SNP count (forward, loss, backward, AdamW step; the
   GPU settings of docs/genomics.md, ``--precision``), so the two rates can be compared: the loader keeps up when
   its rate is well above the step's;
4. ``harmonise``: reading + harmonising ``--harmonise-people`` x ``--harmonise-snps`` per format, each run in a
   fresh process (what ``python -m data_prep.genotypes harmonise`` does before writing: the table read, the file
   read and harmonised), its seconds and its peak RSS. With ``--compare-with DIR`` (another checkout of the
   repository, e.g. ``git worktree add /tmp/geno_base <commit>``) the same files are harmonised by that checkout's
   code too, the two alternating, ``--repeats`` times each, and every run must give the same matrix.

Every timed row carries the 1-minute load average before and after it (``load_before``, ``load_after``): on a shared
machine the figures move with it. Prints one line per measurement and writes them as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from data_prep.genotypes.harmonise import ReferenceTable, harmonise_file
from data_prep.genotypes.loader import GenotypeRows, as_tokens, genotype_loader, open_matrix
from data_prep.genotypes.writers import Sites, write_genotype_file

FORMATS = ("vcf", "vcf.gz", "bcf", "bed", "pgen", "bgen")
ALLELES = ("A", "C", "G", "T")


def cohort(people: int, snps: int, seed: int = 0) -> tuple[np.ndarray, Sites, ReferenceTable]:
    """Random genotypes (1 % missing) at SNPs without strand-ambiguous allele pairs, and their table."""
    genotypes = np.empty((people, snps), np.int8)
    fill_random(genotypes, seed)
    ref = [ALLELES[j % 2] for j in range(snps)]  # A or C ...
    alt = [ALLELES[2 + (j % 2)] for j in range(snps)]  # ... against G or T: A/G and C/T, never A/T or C/G
    pos = list(range(1000, 1000 + 10 * snps, 10))
    sites = Sites(["chr1"] * snps, pos, [f"s{j}" for j in range(snps)], ref, alt)
    table = ReferenceTable(tuple(f"rs{j}" for j in range(snps)), tuple(ref), tuple(alt), ("1",) * snps, tuple(pos))
    return genotypes, sites, table


def fill_random(out: np.ndarray, seed: int, rows: int = 256) -> None:
    """Genotypes 0/1/2 with 1 % missing calls, a block of rows at a time (no float copy of the whole matrix)."""
    rng = np.random.default_rng(seed)
    for start in range(0, len(out), rows):
        block = rng.integers(0, 3, size=out[start : start + rows].shape, dtype=np.int8)
        block[rng.random(block.shape, dtype=np.float32) < 0.01] = 3
        out[start : start + rows] = block


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def time_formats(people: int, snps: int, folder: Path) -> list[dict]:
    genotypes, sites, table = cohort(people, snps)
    samples = [f"p{i}" for i in range(people)]
    rows = []
    for fmt in FORMATS:
        path = write_genotype_file(folder / f"cohort_{snps}.{fmt}", genotypes, samples, sites)
        load = os.getloadavg()[0]
        start = time.perf_counter()
        result = harmonise_file(path, table)
        seconds = time.perf_counter() - start
        assert np.array_equal(result.genotypes, genotypes), fmt  # the round trip is exact
        rows.append({"what": "read+harmonise", "format": fmt, "people": people, "snps": snps, "seconds": seconds,
                     "load_before": load, "load_after": os.getloadavg()[0]})  # fmt: skip
    return rows


def time_loader(people: int, snps: int, folder: Path, batch_size: int, device: torch.device, batches: int) -> dict:
    """The loader over a memory-mapped int8 matrix written block by block (this process never holds all of it):
    int8 batches on the host, moved to ``device`` and widened to int64 there (``as_tokens``, as training does).
    ``samples_per_s`` is the whole pipeline; ``host_samples_per_s`` the loader alone (gather + int8 batch) and
    ``widen_samples_per_s`` the move and widening on the device."""
    path = folder / f"site_{snps}.npy"
    matrix = np.lib.format.open_memmap(path, mode="w+", dtype=np.int8, shape=(people, snps))
    fill_random(matrix, seed=1)
    matrix.flush()
    del matrix
    before = peak_rss_mib()
    matrix = open_matrix(path)
    data = GenotypeRows(matrix, np.zeros(people, np.int64))
    batches_left, seen, host, widen = iter(genotype_loader(data, batch_size, shuffle=True, seed=0)), 0, 0.0, 0.0
    for _ in range(batches):
        start = time.perf_counter()
        batch = next(batches_left, None)
        host += time.perf_counter() - start
        if batch is None:
            break
        start = time.perf_counter()
        x, _ = as_tokens((batch[0].to(device, non_blocking=True), batch[1]))
        if device.type == "cuda":
            torch.cuda.synchronize()
        widen += time.perf_counter() - start
        seen += len(x)
    return {"what": "loader", "people": people, "snps": snps, "batch_size": batch_size,
            "samples_per_s": seen / (host + widen), "host_samples_per_s": seen / host,
            "widen_samples_per_s": seen / widen, "peak_rss_mib": peak_rss_mib(), "peak_rss_mib_before": before,
            "matrix_mib": people * snps / 2**20, "memmap": isinstance(matrix, np.memmap)}  # fmt: skip


def time_step(snps: int, patch: int, batch_size: int, device: torch.device, precision: str, steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from genomics.model import SnpClassifier

    model = SnpClassifier(n_snps=snps, num_classes=5, d_model=256, layers=4, heads=8, patch=patch).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 4, (batch_size, snps), device=device)
    y = torch.randint(0, 5, (batch_size,), device=device)
    dtype = torch.bfloat16 if precision == "bf16-mixed" else None
    for step in range(steps + 1):  # the first step warms up (kernels, allocator) and is not timed
        if step == 1:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row = {"what": "train_step", "snps": snps, "patch": patch, "batch_size": batch_size, "precision": precision,
           "samples_per_s": steps * batch_size / seconds}  # fmt: skip
    if device.type == "cuda":
        row["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return row


_HARMONISE_CHILD = """
import hashlib, json, sys, time
sys.path.insert(0, sys.argv[1])
from data_prep.genotypes.harmonise import harmonise_file, read_snp_table

def high_water_mib():  # VmHWM starts afresh with the process image; ru_maxrss would keep the forking parent's
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024

imported = high_water_mib()
start = time.perf_counter()
result = harmonise_file(sys.argv[2], read_snp_table(sys.argv[3]))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_rss_mib": high_water_mib(), "rss_after_import_mib": imported,
                  "sha1": hashlib.sha1(result.genotypes.tobytes()).hexdigest(),
                  "imported_from": __import__("data_prep").__file__}))
"""
REPO = Path(__file__).resolve().parent.parent


def time_harmonise(
    people: int, snps: int, formats: Sequence[str], folder: Path, compare_with: Path | None, repeats: int
) -> list[dict]:
    """Harmonise the same files with this checkout's code (and ``compare_with``'s), each run in a new process,
    alternating the two codes (the first code of each round alternates too), ``repeats`` rounds."""
    genotypes, sites, table = cohort(people, snps)
    table_path = table.write(folder / "table.csv")
    samples = [f"p{i}" for i in range(people)]
    paths = {fmt: write_genotype_file(folder / f"cohort.{fmt}", genotypes, samples, sites) for fmt in formats}
    del genotypes
    codes = {"this": REPO} | ({"compared": Path(compare_with).resolve()} if compare_with else {})
    rows = []
    for round_ in range(repeats):
        for fmt, path in paths.items():
            order = list(codes.items())
            for label, root in order[::-1] if round_ % 2 else order:
                load = os.getloadavg()[0]
                done = subprocess.run(
                    [sys.executable, "-c", _HARMONISE_CHILD, str(root), str(path), str(table_path)],
                    capture_output=True, text=True, check=True, env=os.environ | {"PYTHONPATH": str(root)},
                )  # fmt: skip
                measured = json.loads(done.stdout.strip().splitlines()[-1])
                if not measured["imported_from"].startswith(str(root)):
                    raise RuntimeError(f"the {label} run imported {measured['imported_from']}, not code under {root}")
                rows.append({"what": "harmonise", "code": label, "root": str(root), "round": round_, "format": fmt,
                             "people": people, "snps": snps, "file_mb": path.stat().st_size / 1e6, **measured,
                             "load_before": load,
                             "load_after": os.getloadavg()[0]})  # fmt: skip
    for fmt in formats:
        found = {r["sha1"] for r in rows if r["format"] == fmt}
        if len(found) != 1:
            raise RuntimeError(f"{fmt}: the runs gave {len(found)} different matrices")
    return rows


def harmonise_summary(rows: list[dict]) -> list[dict]:
    """Per format and code: the median seconds and the largest peak RSS, and this code's ratios to the compared."""
    summary = []
    for fmt in dict.fromkeys(r["format"] for r in rows):
        row: dict[str, object] = {"what": "harmonise_summary", "format": fmt}
        loads = [r[key] for r in rows if r["format"] == fmt for key in ("load_before", "load_after")]
        row["load_min"], row["load_max"] = min(loads), max(loads)
        for code in ("this", "compared"):
            runs = [r for r in rows if r["format"] == fmt and r["code"] == code]
            if runs:
                row[f"{code}_seconds"] = statistics.median(r["seconds"] for r in runs)
                row[f"{code}_peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
        if "compared_seconds" in row:
            row["seconds_ratio"] = row["this_seconds"] / row["compared_seconds"]
            row["rss_ratio"] = row["this_peak_rss_mib"] / row["compared_peak_rss_mib"]
        summary.append(row)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.genotype_io", description=__doc__.split("\n\n")[0])
    parser.add_argument("--snps", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--people", type=int, default=10_000, help="people of the loader's matrix")
    parser.add_argument("--format-people", type=int, default=1_000, help="people of the files read per format")
    parser.add_argument("--format-snps", type=int, nargs="*", default=None, help="SNP counts per format (--snps)")
    parser.add_argument("--patch", type=int, nargs="+", default=[16, 64], help="cnn_transformer patch per SNP count")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--loader-batches", type=int, default=40)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--harmonise-people", type=int, default=2_000)
    parser.add_argument("--harmonise-snps", type=int, default=100_000)
    parser.add_argument("--harmonise-formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--compare-with", type=Path, default=None, help="another checkout to harmonise with as well")
    parser.add_argument("--repeats", type=int, default=2, help="harmonise runs per format and code")
    parser.add_argument("--skip", nargs="*", default=[], choices=["formats", "loader", "step", "harmonise"])
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    patches = dict(zip(args.snps, args.patch + [args.patch[-1]] * len(args.snps), strict=False))
    rows: list[dict] = []
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}", flush=True)
    with tempfile.TemporaryDirectory(prefix="genotype_io_") as scratch:
        for snps in args.snps:
            if "formats" not in args.skip and snps in (args.format_snps or args.snps):
                rows += _show(time_formats(args.format_people, snps, Path(scratch)))
            if "loader" not in args.skip:
                rows += _show([time_loader(args.people, snps, Path(scratch), args.batch_size, device,
                                           args.loader_batches)])  # fmt: skip
            if "step" not in args.skip:
                rows += _show([time_step(snps, patches[snps], args.batch_size, device, args.precision, args.steps)])
            for leftover in Path(scratch).iterdir():
                leftover.unlink()
        if "harmonise" not in args.skip:
            runs = time_harmonise(args.harmonise_people, args.harmonise_snps, args.harmonise_formats, Path(scratch),
                                  args.compare_with, args.repeats)  # fmt: skip
            rows += _show(runs) + _show(harmonise_summary(runs))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": str(device), "rows": rows}, indent=2) + "\n")
    return 0


def _show(rows: list[dict]) -> list[dict]:
    for row in rows:
        print("  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
