"""bf16-mixed vs 32-true: training throughput and final accuracy of FedAvg and SCAFFOLD, with the algorithm state fp32.

    python -m benchmarks.gpu                  # on a machine with a CUDA GPU (Lightning's accelerator "auto" picks it)
    python -m benchmarks.gpu --quick          # a smoke run (also on CPU, where bf16-mixed is emulated and slow)
    python -m benchmarks.gpu --algorithms fedavg fedper fedrep ditto finetune   # personalization under bf16-mixed

Cases: LeNet-5 on Fashion-MNIST (the bundle's classifier) and the genomics consortium's ``cnn_transformer`` on the
1000 Genomes panel (``examples/genomics``, by import path), each with FedAvg and SCAFFOLD (or the ``--algorithms``
given: also the personalization methods of docs/personalization.md with their benchmark settings; FedBN only on the
built-in data, whose BatchNorm CNN it needs) under 32-true and bf16-mixed, through the in-process round engine (the
sites' Lightning rounds as the NVFlare jobs run them). Personalization runs hold out a validation split per site
and also report the sites' mean personal-model accuracy of the last round (``personal``).
Throughput is training samples per second of the sites' ``trainer.fit`` (``train.fit_seconds``, so start-up and
aggregation are not counted); accuracy is the global test accuracy (LeNet-5) or the sites' mean validation accuracy
of the final model (genomics). Every client state file is checked to hold float32 tensors only (integer buffers such
as BatchNorm's step count aside): the algorithm state stays fp32 under bf16-mixed. Results: a table on stdout and
``--out`` JSON (rewritten after every run), the device named in both. A run that records fewer rounds than planned,
or none that updated the global model, is named with the reason and makes the command exit 1
(`benchmarks.compare.require_rounds`): its throughput and accuracy would measure nothing.
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
PERSONAL = ("fedper", "fedbn", "fedrep", "ditto", "finetune")
#: The share of every built-in site's shard held out as its validation split in personalization runs.
SITE_VAL_FRACTION = 0.2


def case_specs(quick: bool, rounds: int | None = None) -> dict[str, dict[str, Any]]:
    from benchmarks.genomics import DATA, MODEL, examples_importable

    examples_importable()
    rounds = rounds or (2 if quick else 10)
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


def algorithm_settings(settings: dict[str, Any], algorithm: str) -> dict[str, Any] | None:
    """JobSpec settings of ``algorithm`` on a case (``settings``), or None where it does not apply (FedBN on a user
    model: the cnn_transformer has no BatchNorm). Personalization methods take the benchmark harnesses' settings:
    `benchmarks.compare.PERSONALIZATION_METHODS` on the built-in data, `benchmarks.genomics.PERSONALIZATION`
    on the genomics model (whose data module holds out its own validation split)."""
    if algorithm in ALGORITHMS:
        return dict(ALGORITHMS[algorithm])
    if settings.get("model") is None:
        from benchmarks.compare import PERSONALIZATION_METHODS

        return {**PERSONALIZATION_METHODS[algorithm], "site_val_fraction": SITE_VAL_FRACTION}
    from benchmarks.genomics import PERSONALIZATION

    return dict(PERSONALIZATION[algorithm]) if algorithm in PERSONALIZATION else None


def run_case(name: str, settings: dict[str, Any], algorithm: str, precision: str) -> dict[str, Any]:
    """One run's row; `benchmarks.compare.IncompleteFederation` when it did not complete its rounds."""
    from benchmarks.compare import require_rounds
    from benchmarks.in_process import quiet_lightning, run_in_process
    from jobs.spec import JobSpec
    from lightning_modules.state_store import ClientStateStore

    extra = algorithm_settings(settings, algorithm) or {}
    spec = JobSpec(name=f"{name}_{algorithm}", precision=precision, **settings, **extra)
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
    personal = next((r["site_eval"]["personal_val_accuracy"]["mean"] for r in reversed(rounds) if _personal(r)), None)
    return {
        "case": name,
        "algorithm": algorithm,
        "precision": precision,
        "samples_per_s": samples / fit_seconds if fit_seconds else float("nan"),
        "final_accuracy": accuracy,
        "personal_accuracy": personal,
        "state_dtypes": dtypes,
        "wall_s": time.monotonic() - started,
    }


def fp32_or_integer(dtype: str) -> bool:
    """State must stay fp32 under bf16-mixed; integer buffers (BatchNorm's ``num_batches_tracked``, FedBN) are
    counts, not weights."""
    return dtype == "torch.float32" or dtype.startswith(("torch.int", "torch.uint", "torch.bool"))


def _personal(record: dict[str, Any]) -> bool:
    return "personal_val_accuracy" in (record.get("site_eval") or {})


def _empty() -> Any:
    from types import SimpleNamespace

    return SimpleNamespace(state={})


def format_row(row: dict[str, Any]) -> str:
    """One table line; an accuracy that is None (no test set and no site scores) shows as "-"."""
    accuracy = "-" if row["final_accuracy"] is None else f"{row['final_accuracy']:.4f}"
    personal = "" if row.get("personal_accuracy") is None else f"  personal {row['personal_accuracy']:.4f}"
    return (
        f"{row['case']:22s} {row['algorithm']:9s} {row['precision']:11s} {row['samples_per_s']:10.0f} samples/s  "
        f"accuracy {accuracy}{personal}  state {','.join(row['state_dtypes']) or '-'}"
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
    parser.add_argument(
        "--algorithms",
        nargs="+",
        choices=[*ALGORITHMS, *PERSONAL],
        default=list(ALGORITHMS),
        metavar="NAME",
        help=f"from {[*ALGORITHMS, *PERSONAL]} (default: fedavg scaffold)",
    )
    parser.add_argument("--cases", nargs="+", choices=["lenet5_fmnist", "cnn_transformer_1kg"], metavar="CASE")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--rounds", type=int, help="rounds per run (default: 10, --quick 2)")
    args = parser.parse_args(argv)
    from benchmarks.compare import IncompleteFederation

    rows, incomplete = [], []
    specs = case_specs(args.quick, args.rounds) if args.rounds else case_specs(args.quick)
    for name, settings in specs.items():
        if args.cases and name not in args.cases:
            continue
        for algorithm in args.algorithms:
            if algorithm_settings(settings, algorithm) is None:
                print(f"{name} {algorithm}: not applicable (no BatchNorm in this model)", flush=True)
                continue
            for precision in args.precisions:
                try:
                    rows.append(run_case(name, settings, algorithm, precision))
                except IncompleteFederation as exc:  # the other runs still measure; the exit status says so
                    incomplete.append(f"{name} {algorithm} {precision}: {exc}")
                    print(f"{name} {algorithm} {precision}: did not complete", file=sys.stderr, flush=True)
                    continue
                print(format_row(rows[-1]), flush=True)
                if args.out:  # after every run, so a run cut short keeps what it measured
                    args.out.write_text(json.dumps({"device": device_name(), "rows": rows}, indent=1))
    print(f"device: {device_name()}")
    bad = [r for r in rows if not all(map(fp32_or_integer, r["state_dtypes"]))]
    if args.out:
        args.out.write_text(json.dumps({"device": device_name(), "rows": rows}, indent=1))
    if bad:
        print(f"error: algorithm state not fp32 in {[(r['case'], r['algorithm'], r['precision']) for r in bad]}")
    for failure in incomplete:
        print(f"error: run did not complete: {failure}", file=sys.stderr)
    return 1 if bad or incomplete else 0


if __name__ == "__main__":
    raise SystemExit(main())
