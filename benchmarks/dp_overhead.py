"""What sample-level DP-SGD costs a site: step time with DP-SGD divided by the non-private step, and peak memory.

Each measurement is one process (so its peak resident memory, ``ru_maxrss``, is that of one site training): it
builds the model, a synthetic training set of ``--samples`` records, and fits ``--epochs`` epochs with the bundle's
client-algorithm callback (FedAvg), either plain (a shuffled loader) or with DP-SGD (Opacus's Poisson loader,
per-sample gradients, clipping to C = 1 and noise sigma = 1; the ledger in a temporary state store). The seconds per
optimizer step are taken over every epoch but the first (warm-up). Private and plain processes alternate, ``--repeats``
times, and the table shows medians; the ratio is median private / median plain.

Models: ``lenet5`` (the built-in classifier on 28x28 images), ``cnn_transformer`` (the genomics consortium's model
with ``attention="linear"``, 127 SNPs, the DP-SGD-ready variant; its non-private row uses the same variant, so the
ratio is DP-SGD's cost alone) and ``cnn_transformer_large`` (the same DP-SGD-ready model at the size a GPU is
for: ``benchmarks.snp_model.LARGE_SNP_MODEL``, d_model 256, 4 layers of 8 heads, patch 16, at ``--snps`` SNPs,
default 10,000).

``--noise`` measures the noise alone, in one process: the milliseconds per step of drawing one step's Gaussian noise
for every trainable parameter of each model, three ways, interleaved: from torch's global generator (what DP-SGD
drew from before its noise was made secret), from a generator seeded with the operating system's entropy
(lightning_modules/privacy/secret.py), and that generator with Opacus's floating-point-robust sampling (what a site
draws now); ratios against the first.

Run: ``python -m benchmarks.dp_overhead --out benchmarks/results/dp_overhead.md``; on a CUDA GPU add ``--device gpu``
(and ``--precision bf16-mixed`` for the consortium's precision): steps are then timed with the device synchronized,
and the table adds the GPU's peak allocated memory.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.snp_model import LARGE_SNP_MODEL

MODELS = ("lenet5", "cnn_transformer", "cnn_transformer_large")
#: Models timed when ``--models`` is not given (cnn_transformer_large is for a GPU).
DEFAULT_MODELS = ("lenet5", "cnn_transformer")


def snp_model_args(model: str, snps: int) -> dict[str, Any]:
    """SnpClassifier arguments of a genotype ``model`` (DP-SGD-ready attention); ``snps`` sizes the large one."""
    if model == "cnn_transformer_large":
        return {**LARGE_SNP_MODEL, "n_snps": snps, "attention": "linear", "lr": 1e-3}
    return {"arch": "cnn_transformer", "attention": "linear", "n_snps": 127, "num_classes": 5, "lr": 1e-3}


def build(model: str, samples: int, snps: int = LARGE_SNP_MODEL["n_snps"]) -> tuple[Any, Any]:
    """The module and a synthetic training set for ``model`` (``snps``: cnn_transformer_large's SNP count)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    if model == "lenet5":
        from lightning_modules.classifier import FLClassifier

        module = FLClassifier(arch="lenet5", num_classes=10, lr=0.05)
        x, y = (
            torch.rand(samples, 1, 28, 28, generator=generator),
            torch.randint(0, 10, (samples,), generator=generator),
        )
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
        from genomics.model import SnpClassifier

        args = snp_model_args(model, snps)
        module = SnpClassifier(**args)
        x, y = (
            torch.randint(0, 3, (samples, args["n_snps"]), generator=generator),
            torch.randint(0, args["num_classes"], (samples,), generator=generator),
        )
    return module, torch.utils.data.TensorDataset(x, y)


class StepClock:
    """Seconds per optimizer step after the first epoch (``synchronize``: wait for the GPU at both ends)."""

    def __init__(self, synchronize: bool = False) -> None:
        self.times: list[float] = []
        self.epoch = 0
        self.synchronize = synchronize

    def now(self) -> float:
        if self.synchronize:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def callback(self) -> Any:
        import pytorch_lightning as pl

        clock = self

        class Clock(pl.Callback):
            def on_train_epoch_start(self, trainer, pl_module):
                clock.epoch = trainer.current_epoch

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                clock.started = clock.now()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if clock.epoch > 0:
                    clock.times.append(clock.now() - clock.started)

        return Clock()


def measure_one(
    model: str,
    private: bool,
    samples: int,
    batch_size: int,
    epochs: int,
    device: str = "cpu",
    precision: str = "32-true",
    snps: int = LARGE_SNP_MODEL["n_snps"],
) -> dict[str, Any]:
    """One site's fit (this process): seconds per step (median), peak resident memory (MiB) and, on a GPU, its peak
    allocated memory (MiB)."""
    import pytorch_lightning as pl
    import torch

    from aggregators.contracts import meta_keys
    from lightning_modules.federated import FederatedAlgorithm
    from lightning_modules.privacy import PrivacyConfig
    from lightning_modules.privacy.dp_sgd import DPSGD, poisson_loader
    from lightning_modules.state_store import ClientStateStore

    torch.manual_seed(0)
    torch.set_num_threads(1)
    module, dataset = build(model, samples, snps)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)
    privacy = None
    with tempfile.TemporaryDirectory() as state:
        if private:
            store = ClientStateStore(state, "site-1")
            privacy = DPSGD(PrivacyConfig(max_grad_norm=1.0, noise_multiplier=1.0), "site-1", store, epochs)
            loader = poisson_loader(loader)
        meta = {meta_keys.ROUND: 0, meta_keys.NUM_ROUNDS: 1, meta_keys.RUN_ID: "bench"}
        callback = FederatedAlgorithm("fedavg", site="site-1", meta_source=lambda: meta, privacy=privacy)
        clock = StepClock(synchronize=device == "gpu")
        trainer = pl.Trainer(
            max_epochs=epochs,
            accelerator=device,
            devices=1,
            precision=precision,
            callbacks=[callback, clock.callback()],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=loader)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    gpu_mib = torch.cuda.max_memory_allocated() / 2**20 if device == "gpu" else None
    return {
        "seconds_per_step": statistics.median(clock.times),
        "steps": len(clock.times),
        "peak_mib": peak_mib,
        "gpu_peak_mib": gpu_mib,
    }


NOISE_WAYS = ("global generator", "secret generator", "secret + robust sampling")


def noise_seconds(
    model: str, repeats: int, device: str = "cpu", snps: int = LARGE_SNP_MODEL["n_snps"]
) -> dict[str, float]:
    """Median seconds to draw one step's noise for ``model``'s trainable parameters, per way of `NOISE_WAYS`
    (interleaved, after one warm-up round)."""
    import torch
    from opacus.optimizers.optimizer import _generate_noise

    from lightning_modules.privacy.secret import secret_generator

    torch.set_num_threads(1)
    target = "cuda" if device == "gpu" else "cpu"
    params = [p.to(target) for p in build(model, 1, snps)[0].parameters() if p.requires_grad]
    secret = secret_generator(params[0].device)
    ways = {
        NOISE_WAYS[0]: lambda: [_generate_noise(1.0, p, None, False) for p in params],
        NOISE_WAYS[1]: lambda: [_generate_noise(1.0, p, secret, False) for p in params],
        NOISE_WAYS[2]: lambda: [_generate_noise(1.0, p, secret, True) for p in params],
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    for round_index in range(repeats + 1):
        for way, draw in ways.items():
            start = time.perf_counter()
            draw()
            if target == "cuda":
                torch.cuda.synchronize()
            if round_index:  # the first round warms up
                times[way].append(time.perf_counter() - start)
    return {way: statistics.median(values) for way, values in times.items()}


def noise_table(
    models: list[str], repeats: int, device: str, snps: int = LARGE_SNP_MODEL["n_snps"], record: dict | None = None
) -> str:
    """The ``--noise`` table; ``record`` (if given) receives each model's seconds per way."""
    lines = ["| model | " + " | ".join(f"ms/step, {way}" for way in NOISE_WAYS) + " | ratios to the first |"]
    lines.append("|---|" + "---|" * (len(NOISE_WAYS) + 1))
    for model in models:
        seconds = noise_seconds(model, repeats, device, snps)
        if record is not None:
            record[model] = seconds
        base = seconds[NOISE_WAYS[0]]
        cells = " | ".join(f"{1000 * seconds[way]:.3f}" for way in NOISE_WAYS)
        ratios = " / ".join(f"{seconds[way] / base:.2f}" for way in NOISE_WAYS[1:])
        lines.append(f"| {model} | {cells} | {ratios} |")
    return "\n".join(lines) + f"\n\n{repeats} interleaved draws per cell, one torch thread; {device_label(device)}\n"


def run_child(model: str, private: bool, args: argparse.Namespace) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.dp_overhead", "--child", model, "1" if private else "0"]
    command += ["--samples", str(args.samples), "--batch-size", str(args.batch_size), "--epochs", str(args.epochs)]
    command += ["--device", args.device, "--precision", args.precision, "--snps", str(args.snps)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:  # say why (an out-of-memory GPU, a missing package), not only that it failed
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        kind = "DP-SGD" if private else "plain"
        raise SystemExit(f"error: dp_overhead {model} {kind}: exit {done.returncode}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[tuple[str, bool], list[dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = [
        "| model | ms/step plain | ms/step DP-SGD | DP ÷ plain | peak MiB plain | peak MiB DP-SGD |"
        + (" GPU peak MiB plain | GPU peak MiB DP-SGD |" if args.device == "gpu" else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if args.device == "gpu" else ""),
    ]
    for model in args.models:
        plain = [r["seconds_per_step"] for r in results[(model, False)]]
        private = [r["seconds_per_step"] for r in results[(model, True)]]
        mem = {p: statistics.median(r["peak_mib"] for r in results[(model, p)]) for p in (False, True)}
        ratio = statistics.median(private) / statistics.median(plain)
        lines.append(
            f"| {model} | {1000 * statistics.median(plain):.2f} | {1000 * statistics.median(private):.2f} | "
            f"{ratio:.2f} | {mem[False]:.0f} | {mem[True]:.0f} |" + _gpu_cells(results, model, args.device)
        )
    setup = (
        f"{args.samples} synthetic records, batch {args.batch_size} (DP: expected batch), {args.epochs} epochs (the "
        f"first dropped), {args.repeats} alternating processes per row, one torch thread, {args.precision}; "
        f"{device_label(args.device)}, Python {platform.python_version()}"
    )
    return "\n".join(lines) + f"\n\n{setup}\n"


def _gpu_cells(results: dict[tuple[str, bool], list[dict[str, Any]]], model: str, device: str) -> str:
    if device != "gpu":
        return ""
    peaks = [statistics.median(r["gpu_peak_mib"] for r in results[(model, p)]) for p in (False, True)]
    return "".join(f" {peak:.0f} |" for peak in peaks)


def device_label(device: str) -> str:
    if device == "gpu":
        import torch

        return torch.cuda.get_device_name(0)
    return platform.processor() or platform.machine()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(DEFAULT_MODELS))
    parser.add_argument(
        "--snps",
        type=int,
        default=LARGE_SNP_MODEL["n_snps"],
        help=f"SNPs of cnn_transformer_large (default {LARGE_SNP_MODEL['n_snps']:,})",
    )
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu: a CUDA GPU (default: cpu)")
    parser.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    parser.add_argument("--out", type=Path, help="also write the markdown report here")
    parser.add_argument("--json", type=Path, help="also write the measurements as JSON here")
    parser.add_argument("--noise", action="store_true", help="measure the noise draws alone (module docstring)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "PRIVATE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("snps", "samples", "batch_size", "epochs", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.device == "gpu":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device gpu: no CUDA GPU is available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        from benchmarks.in_process import quiet_lightning

        with quiet_lightning():
            result = measure_one(
                args.child[0],
                args.child[1] == "1",
                args.samples,
                args.batch_size,
                args.epochs,
                args.device,
                args.precision,
                args.snps,
            )
        print(json.dumps(result))
        return 0
    command = f"python -m benchmarks.dp_overhead {' '.join(argv if argv is not None else sys.argv[1:])}"
    if args.noise:
        noise: dict[str, dict[str, float]] = {}
        text = noise_table(args.models, max(args.repeats, 50), args.device, args.snps, noise)
        title = f"# The noise of one DP-SGD step ({device_label(args.device)})"
        return report(args, title, command, text, {"noise_seconds": noise})
    results: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        for model in args.models:
            for private in (False, True):
                results.setdefault((model, private), []).append(run_child(model, private, args))
    runs = [{"model": model, "private": private, **r} for (model, private), rs in results.items() for r in rs]
    title = f"# DP-SGD step cost and peak memory per site ({device_label(args.device)})"
    return report(args, title, command, table(results, args), {"runs": runs})


def report(args: argparse.Namespace, title: str, command: str, text: str, measured: dict[str, Any]) -> int:
    """Print ``text``; write it under ``title`` to ``--out`` and ``measured`` to ``--json``."""
    print(text)
    if args.out:
        args.out.write_text(f"{title}\n\n`{command}`\n\n{text}")
    if args.json:
        record = {"command": command, "device": device_label(args.device), "precision": args.precision, **measured}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
