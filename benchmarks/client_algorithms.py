"""Per-step cost and client memory of FedMoS, MOON and Ditto relative to plain SGD on LeNet-5, and the seconds and
memory local fine-tuning adds to a round.

Reuses the machinery of `benchmarks.step_overhead` (read its docstring for the method): every variant takes one
optimizer step per cycle inside the same ``pl.Trainer.fit`` of `lightning_modules.FLClassifier`, in a freshly
shuffled order every cycle, on one fixed batch; a step is timed from ``on_train_batch_start`` to the end of
``on_train_batch_end``; ratios are medians over the ``fedavg`` (plain SGD) median of the same fits.

Variants:

- on LeNet-5: ``fedavg`` (plain SGD), ``fedmos`` (STORM: a second forward/backward at the previous iterate; target
  <= 2.2x plain) and ``fedmos authors`` (the authors' released single-pass variant);
- on LeNet-5 with MOON's projection head (84 → 84 → 256, classifier on the 256-d projection): ``fedavg`` on that model,
  and ``moon`` with 1, 2 and 4 previous local models in its history (pre-filled, as from earlier rounds). The cost per
  history model is the slope of ms/step over h = 1 → 4.

- on LeNet-5 also ``ditto`` (lam 0.1): the global step plus one personal SGD step on v_i (a second forward/backward
  at v_i on the same batch; target <= 2.1x plain);
- local fine-tuning: the seconds one round of a built-in site (LeNet-5, ``--finetune-samples`` random
  Fashion-MNIST-shaped samples, 10 % held out) takes with ``finetune_epochs`` 1 minus without, median over
  ``--finetune-rounds`` rounds (``--finetune-rounds 0`` skips it).

Client memory per site: the bytes of the tensors the algorithm keeps during a round (its state: FedMoS x, d and the
previous iterate; MOON's frozen global model and negatives; Ditto's v_i and received model), counted by walking the
algorithm object (shared storages counted once), and the size of the site's state file after the round (MOON's
history, Ditto's v_i; FedMoS writes none). Fine-tuning: the tensors of the fine-tuned copy after its epoch (its
parameters and buffers, gradients and optimizer state, walked the same way), which the site holds while it
fine-tunes on top of its own module, and (``--finetune-rss``, on by default, Linux) the peak RSS during the rounds of
one child process without and one with fine-tuning (``VmHWM`` reset through ``/proc/self/clear_refs`` once the site is
set up, so the imports' peak does not hide the rounds').

Run: ``python -m benchmarks.client_algorithms`` (``--steps`` / ``--rounds`` trade time for precision);
``--quick`` for a smoke test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from aggregators.contracts import meta_keys
from benchmarks.step_overhead import (
    BASELINE,
    SITE,
    ModelSpec,
    Ours,
    Settings,
    Variant,
    _quiet_lightning,
    machine_info,
    new_module,
    run_fit,
)
from lightning_modules.algorithms import build_client_algorithm
from lightning_modules.algorithms.base import RUN_ID_KEY
from lightning_modules.algorithms.moon import HISTORY_KEY, storable_state
from lightning_modules.state_store import ClientStateStore

RUN_ID = "client-algorithms-benchmark"
LENET = ModelSpec("lenet5", "LeNet-5", "lenet5", {}, (1, 28, 28))
LENET_HEAD = ModelSpec("lenet5-head", "LeNet-5 + projection head 256", "lenet5", {"projection_dim": 256}, (1, 28, 28))
HISTORY_SIZES = (1, 2, 4)


@dataclass(frozen=True)
class Case:
    """One row: a table label, the client algorithm and its hyperparameters, and how many history models to pre-fill."""

    row: str
    algorithm: str
    hparams: Mapping[str, Any]
    history_models: int = 0


def cases_for(spec: ModelSpec) -> list[Case]:
    if spec is LENET:
        return [
            Case(BASELINE, "fedavg", {}),
            Case("fedmos", "fedmos", {}),
            Case("fedmos authors", "fedmos", {"estimator": "authors"}),
            Case("ditto", "ditto", {"lam": 0.1}),
        ]
    moon = [Case(f"moon h={h}", "moon", {"history_size": h}, history_models=h) for h in HISTORY_SIZES]
    return [Case(BASELINE, "fedavg", {}), *moon]


def tensor_bytes(value: Any, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable from ``value`` (dicts, lists, tuples, modules); each storage counted once."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(value, nn.Module):
        return sum(tensor_bytes(t, seen) for t in value.state_dict(keep_vars=True).values())
    if isinstance(value, Mapping):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(tensor_bytes(v, seen) for v in value)
    return 0


def algorithm_state_bytes(algorithm: Any, exclude: Iterable[torch.Tensor]) -> int:
    """Tensors held by the algorithm object, not counting the live model's own (``exclude``)."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    # _params maps names to the live parameters; the captured z of the last batch is transient.
    attributes = {k: v for k, v in vars(algorithm).items() if k not in ("_params", "_z", "_batch")}
    return tensor_bytes(attributes, seen)


class Configured(Ours):
    """A client algorithm with given hyperparameters; MOON's history is pre-filled with ``history_models`` models."""

    def __init__(self, case: Case, settings: Settings) -> None:
        Variant.__init__(self, case.row, settings)
        self.case = case
        self.state_bytes = 0
        self.file_bytes = 0

    def start(self, trainer: pl.Trainer, module: Any, state_root: Path) -> None:
        self.store = ClientStateStore(state_root / self.row.replace(" ", "_").replace("=", ""), SITE)
        algorithm = build_client_algorithm(self.case.algorithm, **self.case.hparams)
        algorithm.bind(SITE, self.store)
        if self.case.history_models:
            history = [storable_state(module.net) for _ in range(self.case.history_models)]
            self.store.save("moon", {RUN_ID_KEY: RUN_ID, HISTORY_KEY: history}, round_num=0)
        self.start_callback(trainer, module, algorithm, {meta_keys.ROUND: 1, meta_keys.RUN_ID: RUN_ID})
        # The harness times steps on one fixed batch and its callback does not call on_batch, which the callback of
        # a real fit does: FedMoS's and Ditto's extra pass take the batch from there.
        self.batch = [tensor.to(module.device) for tensor in next(iter(trainer.train_dataloader))]

    def activate(self, module: Any, batch: Any) -> None:
        super().activate(module, self.batch)  # the harness's fixed batch is the one every step trains on

    def finish(self, module: Any) -> None:
        self.state_bytes = algorithm_state_bytes(self.algorithm, module.state_dict(keep_vars=True).values())
        self.algorithm.on_round_end(module)
        path = self.store.pending_path(self.case.algorithm)  # a round's state is pending until the server confirms
        path = path if path.exists() else self.store.path(self.case.algorithm)
        self.file_bytes = path.stat().st_size if path.exists() else 0
        counted = getattr(self.algorithm, "steps", None)
        if isinstance(counted, int) and counted != self.steps:
            raise RuntimeError(f"{self.key}: the algorithm counted {counted} steps, the benchmark ran {self.steps}")


@dataclass
class Row:
    model: str
    model_bytes: int
    row: str
    ms: float
    ratio: float
    spread: tuple[float, float]
    state_bytes: int
    file_bytes: int


def benchmark(spec: ModelSpec, settings: Settings, progress: Any) -> list[Row]:
    cases = cases_for(spec)
    times: dict[str, list[list[float]]] = {}
    memory: dict[str, tuple[int, int]] = {}
    for fit_index in range(settings.rounds):
        variants = [Configured(case, settings) for case in cases]
        progress(f"[{spec.key}] fit {fit_index + 1}/{settings.rounds}: {len(variants)} variants interleaved")
        for key, kept in run_fit(variants, spec, settings, fit_index).items():
            times.setdefault(key, []).append(kept)
        memory = {v.key: (v.state_bytes, v.file_bytes) for v in variants}
    model_bytes = tensor_bytes(new_module(spec, settings).net)
    base = [t for fit in times[f"ours:{BASELINE}"] for t in fit]
    rows = []
    for case in cases:
        key = f"ours:{case.row}"
        per_fit = [
            statistics.median(v) / statistics.median(b)
            for v, b in zip(times[key], times[f"ours:{BASELINE}"], strict=True)
        ]
        median = statistics.median(t for fit in times[key] for t in fit)
        ratio = median / statistics.median(base)
        rows.append(Row(spec.label, model_bytes, case.row, median, ratio, (min(per_fit), max(per_fit)), *memory[key]))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    lines = [
        "| model | algorithm | ms/step | ÷ plain SGD [per-fit range] | state in memory (MB) | ÷ model size "
        "| state file (MB) |",
        "|" + "---|" * 7,
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.row} | {r.ms:.2f} | {r.ratio:.2f} [{r.spread[0]:.2f}–{r.spread[1]:.2f}] | "
            f"{r.state_bytes / 1e6:.3f} | {r.state_bytes / r.model_bytes:.1f} | {r.file_bytes / 1e6:.3f} |"
        )
    return "\n".join(lines)


def history_slope(rows: Sequence[Row]) -> str:
    """ms per extra history model (MOON), from the h = 1 and h = 4 rows."""
    moon = {r.row: r for r in rows if r.row.startswith("moon h=")}
    first, last = moon.get(f"moon h={HISTORY_SIZES[0]}"), moon.get(f"moon h={HISTORY_SIZES[-1]}")
    if first is None or last is None:
        return ""
    span = HISTORY_SIZES[-1] - HISTORY_SIZES[0]
    per_model = (last.ms - first.ms) / span
    base = next(r.ms for r in rows if r.row == BASELINE and r.model == first.model)
    return (
        f"MOON cost per history model: {per_model:+.2f} ms/step ({per_model / base:+.2f}× plain SGD), "
        f"from h = {HISTORY_SIZES[0]} to h = {HISTORY_SIZES[-1]}."
    )


@dataclass
class FinetuneCost:
    """Fine-tuning's cost per round: seconds (medians), the tensors a site holds while it fine-tunes, peak RSS."""

    base_s: float
    added_s: float
    model_bytes: int  # the site's own module: parameters and buffers
    copy_bytes: int  # the fine-tuned copy's parameters and buffers
    grad_bytes: int  # the copy's gradients
    optimizer_bytes: int  # the copy's optimizer state
    peak_rss: dict[int, tuple[int, int]]  # finetune_epochs -> (RSS before, peak RSS during) the rounds, bytes

    @property
    def held_bytes(self) -> int:
        return self.copy_bytes + self.grad_bytes + self.optimizer_bytes


def finetune_site(epochs: int, samples: int, state_root: Path) -> Any:
    """A built-in site (LeNet-5, ``samples`` random Fashion-MNIST-shaped samples, 10 % held out) with
    ``finetune_epochs`` = ``epochs``."""
    import numpy as np

    from benchmarks.in_process import site_args
    from jobs.spec import JobSpec
    from lightning_modules.site import build_site_round

    rng = np.random.default_rng(0)
    x, y = rng.random((samples, 1, 28, 28), dtype=np.float32), rng.integers(0, 10, samples).astype(np.int64)
    args = site_args(JobSpec(name="ft", site_val_fraction=0.1, finetune_epochs=epochs))
    return build_site_round(args, SITE, 0, x, y, 10, ClientStateStore(state_root, SITE))


def run_site_round(site: Any, round_num: int, params: Mapping[str, Any]) -> None:
    site.train(round_num, params, {meta_keys.ROUND: round_num, meta_keys.RUN_ID: RUN_ID})


def record_finetuned(site: Any) -> list[tuple[int, int, int]]:
    """Wraps ``site.finetune`` so that every round appends what the site holds beyond its own module while it
    fine-tunes: (the copy's parameters and buffers, its gradients, its optimizer's state), in bytes, tensors walked
    with each storage counted once. Gradients and optimizer state are walked right after every optimizer step of
    the fine-tuning (a global step post-hook, removed afterwards) and their largest total is kept: the training's
    peak, since Lightning drops the gradients when the fit ends."""
    held: list[tuple[int, int, int]] = []
    finetune = site.finetune

    def recording(*args: Any, **kwargs: Any) -> Any:
        during: list[tuple[int, int]] = [(0, 0)]

        def after_step(optimizer: torch.optim.Optimizer, *_: Any) -> None:
            seen: set[int] = set()
            grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
            during.append((tensor_bytes(grads, seen), tensor_bytes(dict(optimizer.state), seen)))

        hook = register_optimizer_step_post_hook(after_step)
        try:
            tuned = finetune(*args, **kwargs)
        finally:
            hook.remove()
        held.append((tensor_bytes(tuned), *max(during, key=sum)))
        return tuned

    site.finetune = recording
    return held


def finetune_cost(samples: int, rounds: int, epochs: int = 1, rss: bool = True) -> FinetuneCost:
    """Median seconds of a built-in site's round without fine-tuning and the seconds ``epochs`` add (interleaved in
    one process), the tensors the fine-tuning copy holds, and (``rss``) the peak RSS of one process per setting."""
    import tempfile

    seconds: dict[int, list[float]] = {0: [], epochs: []}
    with tempfile.TemporaryDirectory() as tmp:
        sites = {k: finetune_site(k, samples, Path(tmp) / str(k)) for k in seconds}
        held = record_finetuned(sites[epochs])
        params = {key: v.numpy().copy() for key, v in sites[0].module.state_dict().items()}
        for round_num in range(rounds):
            for k, site in sites.items():  # interleaved: the shared machine's load hits both alike
                started = time.perf_counter()
                run_site_round(site, round_num, params)
                seconds[k].append(time.perf_counter() - started)
        model_bytes = tensor_bytes(sites[0].module)
    base = statistics.median(seconds[0])
    peak = {k: child_round_rss(k, samples, rounds) for k in seconds} if rss else {}
    return FinetuneCost(base, statistics.median(seconds[epochs]) - base, model_bytes, *held[-1], peak_rss=peak)


RSS_LINE = "finetune-rss"  # the child's last line: RSS_LINE, resident bytes before the rounds, peak during them


def run_finetune_child(epochs: int, samples: int, rounds: int) -> str:
    """The rounds of one fine-tuning setting alone, in this process: the site is built (imports, data), the peak
    RSS is reset (Linux: ``/proc/self/clear_refs``), the rounds run, and the returned line holds the resident bytes
    before the rounds and the peak during them (``VmHWM``), for `child_round_rss`."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        site = finetune_site(epochs, samples, Path(tmp))
        params = {key: v.numpy().copy() for key, v in site.module.state_dict().items()}
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = proc_status_bytes("VmRSS")
        for round_num in range(rounds):
            run_site_round(site, round_num, params)
        return f"{RSS_LINE} {before} {proc_status_bytes('VmHWM')}"


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def child_round_rss(epochs: int, samples: int, rounds: int) -> tuple[int, int]:
    """(resident bytes before the rounds, peak resident bytes during them) of `run_finetune_child` run in a
    child process from the repository root; raises if the child fails."""
    import subprocess

    command = [sys.executable, "-m", "benchmarks.client_algorithms", "--finetune-child", str(epochs)]
    command += ["--finetune-samples", str(samples), "--finetune-rounds", str(rounds)]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RSS_LINE)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    _, before, peak = lines[-1].split()
    return int(before), int(peak)


def finetune_report(cost: FinetuneCost, samples: int, rounds: int) -> str:
    mb = 1e6
    lines = [
        f"Local fine-tuning (1 epoch, LeNet-5, {samples} samples, 10 % held out): a round takes {cost.base_s:.2f} s "
        f"without and {cost.added_s:+.2f} s more with it (median over {rounds} rounds). While it fine-tunes, a site "
        f"holds {cost.held_bytes / mb:.3f} MB of tensors beyond its own module ({cost.model_bytes / mb:.3f} MB): the "
        f"copy's parameters and buffers {cost.copy_bytes / mb:.3f} MB, its gradients {cost.grad_bytes / mb:.3f} MB, "
        f"its optimizer's state {cost.optimizer_bytes / mb:.3f} MB ({cost.held_bytes / cost.model_bytes:.1f}x the "
        "model; freed before the round's training)."
    ]
    if cost.peak_rss:
        (before_0, peak_0), (before_k, peak_k) = cost.peak_rss[0], cost.peak_rss[max(cost.peak_rss)]
        lines.append(
            f"Peak RSS during those {rounds} rounds, one child process per setting with the peak reset after the "
            f"site's set-up: {peak_0 / mb:.1f} MB without fine-tuning ({(peak_0 - before_0) / mb:+.1f} MB over the "
            f"set-up's {before_0 / mb:.1f} MB), {peak_k / mb:.1f} MB with it ({(peak_k - before_k) / mb:+.1f} MB over "
            f"{before_k / mb:.1f} MB)."
        )
    return " ".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.client_algorithms",
        description="Per-step time (÷ plain SGD) and client memory of FedMoS, MOON and Ditto on LeNet-5, and the "
        "time and memory of local fine-tuning; prints a report.",
    )
    parser.add_argument("--steps", type=int, default=200, help="kept steps per variant and model (default 200)")
    parser.add_argument("--rounds", type=int, default=4, help="fits per model, variants interleaved (default 4)")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped per variant and fit (default 5)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: usable CPUs)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this file")
    parser.add_argument("--finetune-rounds", type=int, default=3, help="rounds timed for fine-tuning (0: skip)")
    parser.add_argument("--finetune-samples", type=int, default=2000, help="a fine-tuning site's samples")
    parser.add_argument(
        "--finetune-rss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the peak RSS of the fine-tuning rounds in one child process per setting (default on; "
        "--quick turns it off)",
    )
    parser.add_argument("--finetune-child", type=int, default=None, help=argparse.SUPPRESS)  # child_round_rss's child
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes: 2 fits x 3 kept steps, 1 warm-up")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.rounds, args.warmup = 6, 2, 1
        args.finetune_rounds, args.finetune_samples, args.finetune_rss = min(args.finetune_rounds, 1), 200, False
    if min(args.steps, args.rounds, args.batch_size) < 1 or args.warmup < 0:
        parser.error("--steps, --rounds and --batch-size must be >= 1, --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.finetune_child is not None:
        with _quiet_lightning():
            print(run_finetune_child(args.finetune_child, args.finetune_samples, args.finetune_rounds))
        return 0
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(args.threads or usable)
    settings = Settings(steps=args.steps, rounds=args.rounds, warmup=args.warmup, batch_size=args.batch_size)
    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    rows: list[Row] = []
    with _quiet_lightning():
        for spec in (LENET, LENET_HEAD):
            rows += benchmark(spec, settings, progress)
    command = "python -m benchmarks.client_algorithms " + " ".join(sys.argv[1:] if argv is None else argv)
    report = "\n".join(
        [
            "## FedMoS, MOON and Ditto: step time and client memory vs plain SGD",
            "",
            f"Command: `{command.strip()}` ({time.perf_counter() - started:.0f} s)",
            "",
            *machine_info(settings)[:-1],  # its last line describes step_overhead's settings
            f"- settings: batch {settings.batch_size}, SGD lr {settings.lr} (no momentum), precision 32-true, "
            f"FedMoS defaults (a 0.1, mu 0.001), MOON defaults (mu 5, temperature 0.5); {settings.rounds} fits x "
            f"{settings.measured_per_fit} kept steps per variant (+{settings.warmup} warm-up steps dropped per "
            "variant and fit), interleaved step by step in shuffled cycles, the same batch every step",
            "",
            format_table(rows),
            "",
            history_slope(rows),
            "",
        ]
    )
    if args.finetune_rounds > 0:
        progress(f"fine-tuning: {args.finetune_rounds} rounds with and without, {args.finetune_samples} samples")
        with _quiet_lightning():
            cost = finetune_cost(args.finetune_samples, args.finetune_rounds, rss=args.finetune_rss)
        report += finetune_report(cost, args.finetune_samples, args.finetune_rounds)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
