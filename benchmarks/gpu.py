"""bf16-mixed vs 32-true: training throughput and final accuracy of FedAvg and SCAFFOLD, with the algorithm state fp32.

    python -m benchmarks.gpu                  # on a machine with a CUDA GPU (Lightning's accelerator "auto" picks it)
    python -m benchmarks.gpu --quick          # a smoke run (also on CPU, where bf16-mixed is emulated and slow)

Cases: LeNet-5 on Fashion-MNIST (the bundle's classifier) and the genomics consortium's ``cnn_transformer`` on the
1000 Genomes panel (``examples/genomics``, by import path), each with FedAvg and SCAFFOLD under 32-true and
bf16-mixed, through the in-process round engine (the sites' Lightning rounds as the NVFlare jobs run them).
Throughput is training samples per second of the sites' ``trainer.fit`` (``train.fit_seconds``, so start-up and
aggregation are not counted); accuracy is the global test accuracy (LeNet-5) or the sites' mean validation accuracy
of the final model (genomics). Every client state file is checked to hold float32 tensors only: the algorithm
state stays fp32 under bf16-mixed. Results: a table on stdout and ``--out`` JSON. The device is named in both. A run
that records fewer rounds than planned, or none that updated the global model, is named with the reason and makes
the command exit 1 (:func:`benchmarks.compare.require_rounds`): its throughput and accuracy would measure nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PRECISIONS = ("32-true", "bf16-mixed")
ALGORITHMS = {"fedavg": {}, "scaffold": {"client": "scaffold", "server": "scaffold"}}


def case_specs(quick: bool) -> dict[str, dict[str, Any]]:
    from benchmarks.genomics import DATA, MODEL, examples_importable

    examples_importable()
    rounds = 2 if quick else 10
    return {
        "lenet5_fmnist": {"num_rounds": rounds, "max_train_samples": 600 if quick else 30000, "batch_size": 64},
        "cnn_transformer_1kg": {
            "num_rounds": rounds,
            "model": MODEL,
            "model_args": {"arch": "cnn_transformer", "n_snps": 127, "num_classes": 5, "lr": 1e-3},
            "data": DATA,
            "data_args": {"source": "1kg", "split": "dirichlet", "alpha": 1.0, "batch_size": 128},
        },
    }


def run_case(name: str, settings: dict[str, Any], algorithm: str, precision: str) -> dict[str, Any]:
    """One run's row; :class:`benchmarks.compare.IncompleteFederation` when it did not complete its rounds."""
    from benchmarks.compare import require_rounds
    from controllers.in_process import quiet_lightning, run_in_process
    from jobs.spec import JobSpec
    from lightning_modules.state_store import ClientStateStore

    spec = JobSpec(name=f"{name}_{algorithm}", precision=precision, **settings, **ALGORITHMS[algorithm])
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedalg_gpu_") as root, quiet_lightning():
        run = run_in_process(spec, Path(root))
        dtypes = sorted(
            {
                str(value.dtype)
                for site in Path(root).iterdir()
                for file in site.iterdir()
                for value in (ClientStateStore(root, site.name).latest(file.stem) or _empty()).state.values()
                if hasattr(value, "dtype")
            }
        )
    rounds = run.rounds
    require_rounds(rounds, settings["num_rounds"])
    samples = sum(sum(r["site_num_samples"].values()) for r in rounds)
    fit_seconds = sum(m.get("train.fit_seconds", 0.0) for r in rounds for m in r["site_meta"].values())
    final = rounds[-1]
    accuracy = final.get("test_accuracy")
    if accuracy is None and run.final_site_scores:
        accuracy = sum(s["val_accuracy"] for s in run.final_site_scores.values()) / len(run.final_site_scores)
    return {
        "case": name,
        "algorithm": algorithm,
        "precision": precision,
        "samples_per_s": samples / fit_seconds if fit_seconds else float("nan"),
        "final_accuracy": accuracy,
        "state_dtypes": dtypes,
        "wall_s": time.monotonic() - started,
    }


def _empty() -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(state={})


def format_row(row: dict[str, Any]) -> str:
    """One table line; an accuracy that is None (no test set and no site scores) shows as "-"."""
    accuracy = "-" if row["final_accuracy"] is None else f"{row['final_accuracy']:.4f}"
    return (
        f"{row['case']:22s} {row['algorithm']:9s} {row['precision']:11s} {row['samples_per_s']:10.0f} samples/s  "
        f"accuracy {accuracy}  state {','.join(row['state_dtypes']) or '-'}"
    )


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "CPU (no CUDA device; bf16-mixed is emulated)"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds on small data: checks the script runs")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    from benchmarks.compare import IncompleteFederation

    rows, incomplete = [], []
    for name, settings in case_specs(args.quick).items():
        for algorithm in ALGORITHMS:
            for precision in PRECISIONS:
                try:
                    rows.append(run_case(name, settings, algorithm, precision))
                except IncompleteFederation as exc:  # the other runs still measure; the exit status says so
                    incomplete.append(f"{name} {algorithm} {precision}: {exc}")
                    print(f"{name} {algorithm} {precision}: did not complete", file=sys.stderr, flush=True)
                    continue
                print(format_row(rows[-1]), flush=True)
    print(f"device: {device_name()}")
    bad = [r for r in rows if any(d != "torch.float32" for d in r["state_dtypes"])]
    if args.out:
        args.out.write_text(json.dumps({"device": device_name(), "rows": rows}, indent=1))
    if bad:
        print(f"error: algorithm state not fp32 in {[(r['case'], r['algorithm'], r['precision']) for r in bad]}")
    for failure in incomplete:
        print(f"error: run did not complete: {failure}", file=sys.stderr)
    return 1 if bad or incomplete else 0


if __name__ == "__main__":
    raise SystemExit(main())
