"""Per-round overhead of a tiny FedAvg job in ``nvflare simulator -t N``: round wall time minus the sites' compute.

A tiny job (3 sites, 128 training samples each: 2 optimizer steps per site per round, LeNet-5, 200 test samples) is
exported once with the bundle's builder and run with ``nvflare simulator -n 3 -t 3`` under several settings of the
knobs that decide how long a round waits (one simulator run per variant and repeat, variants interleaved so that they
share the machine's load):

- the server's ``task_request_interval`` (``"server"`` section of ``config_fed_server.json``): how long a site waits
  after each task before asking for the next, and between asks (NVFlare's default: 2 s);
- the controller's ``task_check_period``: how often the server checks whether a round's results are in (NVFlare 2.9
  polls every 0.2 s whatever this says; the bundle's controller makes it apply);
- the sites' in-process Client API polls (``$FEDALG_CLIENT_POLL_S``): task pick-up and result hand-back (NVFlare 2.9
  hard-codes 0.5 s).

Per round, from the server's ``metrics/round_metrics.jsonl`` (round 0 is left out: it includes the sites' start-up):

- ``wall``: the round's ``elapsed_s`` (broadcast to recorded metrics; rounds run back to back);
- ``fit``: the slowest site's ``train.fit_seconds`` (its ``trainer.fit``);
- ``overhead = wall - fit``: everything that is not the slowest site's training: waiting, the sites' Trainer set-up
  and (de)serialisation, and the server's validation, aggregation, evaluation and saving;
- ``waiting = train_wait_s - fit``: the part of the overhead spent inside the server's broadcast-and-wait (polling,
  task pick-up, transfer; also the site's Trainer set-up), and ``server = wall - train_wait_s`` the server's own
  work (needs the bundle's ``train_wait_s`` field; ``-`` for ``--ref`` code without it).

``--ref REF`` also runs the job exported by git revision ``REF`` of this repository (a temporary ``git worktree``,
removed afterwards), so "before" is the code as it was, not a re-creation. ``--quick`` is a smoke run (2 rounds, the
NVFlare defaults and the tuned settings once).

Run: ``python -m benchmarks.round_overhead`` (about 3 minutes on 2 busy cores); ``--rounds``, ``--repeats``,
``--variants``, ``--intervals 0.1 0.5`` (extra tuned variants with other ``task_request_interval`` values).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NVFLARE = Path(sys.executable).with_name("nvflare")
SITES = 3
#: The tiny job: 384 IID training samples over 3 sites = 128 per site = 2 steps of batch 64 per round.
JOB_SETTINGS = {"max_train_samples": 384, "scheme": "iid", "max_test_samples": 200, "num_sites": SITES}
CLIENT_POLL_ENV = "FEDALG_CLIENT_POLL_S"  # jobs/client.py reads it (kept literal: --ref code may predate it)


@dataclass(frozen=True)
class Knobs:
    """What a variant sets; ``None`` keeps what the exported job says."""

    task_request_interval: float | None = None
    task_check_period: float | None = None
    client_poll: float | None = None


#: NVFlare 2.9's behaviour: 2 s task_request_interval, the monitor's 0.2 s, 0.5 s in-process polls.
NVFLARE_DEFAULTS = Knobs(task_request_interval=2.0, task_check_period=0.2, client_poll=0.5)
VARIANTS: dict[str, Knobs] = {
    "nvflare defaults": NVFLARE_DEFAULTS,
    "tuned (exported job)": Knobs(),
    "tuned, task_request_interval 2 s": Knobs(task_request_interval=2.0),
    "tuned, task_check_period 0.2 s": Knobs(task_check_period=0.2),
    "tuned, client polls 0.5 s": Knobs(client_poll=0.5),
}
DEFAULT_VARIANTS = ("nvflare defaults", "tuned (exported job)")


@dataclass(frozen=True)
class Round:
    """One round's timings (seconds); ``train_wait`` is None for code that does not record it."""

    wall: float
    fit: float
    train_wait: float | None
    digest: str = ""  # the round's global model (SHA-256): the knobs must not change it

    @property
    def overhead(self) -> float:
        return self.wall - self.fit

    @property
    def waiting(self) -> float | None:
        return None if self.train_wait is None else self.train_wait - self.fit

    @property
    def server(self) -> float | None:
        return None if self.train_wait is None else self.wall - self.train_wait


# -- jobs --------------------------------------------------------------------------------------------------------
def export_tiny_job(code_root: Path, out_dir: Path, rounds: int) -> Path:
    """Export the tiny job with the builder of the code at ``code_root`` (this checkout or a ``--ref`` worktree)."""
    settings = {**JOB_SETTINGS, "num_rounds": rounds, "name": "round_overhead"}
    script = (
        "import sys; from pathlib import Path; from jobs.build import JobSpec, export_job; "
        f"export_job(JobSpec(**{settings!r}), Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", script, str(out_dir)], check=True, cwd=code_root, env=_env(code_root))
    return out_dir / "round_overhead"


def apply_knobs(job_dir: Path, knobs: Knobs, target: Path) -> Path:
    """A copy of ``job_dir`` at ``target`` with the server-side knobs written into its server config."""
    shutil.copytree(job_dir, target)
    config_path = target / "app" / "config" / "config_fed_server.json"
    config = json.loads(config_path.read_text())
    if knobs.task_request_interval is not None:
        config.setdefault("server", {})["task_request_interval"] = knobs.task_request_interval
    if knobs.task_check_period is not None:
        config["workflows"][0]["args"]["task_check_period"] = knobs.task_check_period
    config_path.write_text(json.dumps(config, indent=4))
    return target


def _env(code_root: Path, knobs: Knobs = Knobs()) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(code_root), os.environ.get("PYTHONPATH")])))
    env.pop(CLIENT_POLL_ENV, None)
    if knobs.client_poll is not None:
        env[CLIENT_POLL_ENV] = str(knobs.client_poll)
    return env


# -- runs ----------------------------------------------------------------------------------------------------------
def simulate(job_dir: Path, workspace: Path, env: Mapping[str, str]) -> list[Round]:
    """Run the job with ``-t 3``; the rounds after round 0 (which includes the sites' start-up)."""
    records = simulator_records(job_dir, workspace, env, SITES, SITES)
    rounds = [parse_round(record) for record in records]
    return [r for r in rounds if r is not None][1:]


def simulator_records(
    job_dir: Path, workspace: Path, env: Mapping[str, str], sites: int, threads: int
) -> list[dict[str, Any]]:
    """``nvflare simulator job_dir -n sites -t threads``; the server's metrics records of the finished run (an error
    with the log's tail when it did not finish)."""
    command = [str(NVFLARE), "simulator", str(job_dir), "-w", str(workspace), "-n", str(sites), "-t", str(threads)]
    completed = subprocess.run(command, capture_output=True, text=True, env=dict(env), cwd=workspace.parent)
    from aggregators.contracts.run_records import finished_records  # here: this module's own imports stay light

    return finished_records(workspace, completed.stdout[-2000:] + completed.stderr[-2000:])


def parse_round(record: Mapping[str, Any]) -> Round | None:
    """A round record's timings; ``None`` for the initial record."""
    if record.get("stage") != "round":
        return None
    fits = [meta.get("train.fit_seconds", 0.0) for meta in record.get("site_meta", {}).values()]
    wait, digest = record.get("train_wait_s"), record.get("global_sha256", "")
    return Round(wall=record["elapsed_s"], fit=max(fits, default=0.0), train_wait=wait, digest=digest)


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A detached ``git worktree`` of ``ref`` in a temporary folder, removed on exit (nothing else is touched)."""
    folder = Path(tempfile.mkdtemp(prefix="round-overhead-ref-"))
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), ref], cwd=ROOT, check=True, capture_output=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@dataclass(frozen=True)
class Plan:
    """One variant: the code it runs, its job folder and its knobs."""

    name: str
    code_root: Path
    job_dir: Path
    knobs: Knobs


def run_plans(plans: Sequence[Plan], repeats: int, scratch: Path) -> dict[str, list[list[Round]]]:
    """Every plan ``repeats`` times, interleaved (A B C A B C), so that all share the machine's load; per plan, the
    measured rounds of each run."""
    results: dict[str, list[list[Round]]] = {plan.name: [] for plan in plans}
    for repeat in range(repeats):
        for index, plan in enumerate(plans):
            run_dir = scratch / f"run-{repeat}-{index}"
            run_dir.mkdir()
            job = apply_knobs(plan.job_dir, plan.knobs, run_dir / "job")
            started = time.monotonic()
            rounds = simulate(job, run_dir / "ws", _env(plan.code_root, plan.knobs))
            print(f"  {plan.name} (repeat {repeat + 1}): {time.monotonic() - started:.0f} s", flush=True)
            results[plan.name].append(rounds)
            shutil.rmtree(run_dir, ignore_errors=True)
    return results


# -- report --------------------------------------------------------------------------------------------------------
def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def summarize(name: str, rounds: Sequence[Round], baseline: float | None) -> list[str]:
    """One table row: medians over every measured round, and the overhead relative to the baseline variant."""
    overhead = _median([r.overhead for r in rounds])
    ratio = "-" if not baseline or overhead is None else f"{overhead / baseline:.2f}"
    spread = f"{min(r.overhead for r in rounds):.2f}–{max(r.overhead for r in rounds):.2f}" if rounds else "-"
    columns = [r.wall for r in rounds], [r.fit for r in rounds], [r.waiting for r in rounds], [r.server for r in rounds]
    return [name, str(len(rounds)), *(_fmt(_median(c)) for c in columns), _fmt(overhead), spread, ratio]


def report(results: Mapping[str, Sequence[Sequence[Round]]], baseline_name: str) -> str:
    header = ["variant", "rounds", "wall", "fit", "waiting", "server", "overhead", "overhead range", "÷ baseline"]
    flat = {name: [r for run in runs for r in run] for name, runs in results.items()}
    baseline = _median([r.overhead for r in flat.get(baseline_name, [])])
    rows = [summarize(name, rounds, baseline) for name, rounds in flat.items()]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    notes = (
        f"Seconds per round, medians over the measured rounds (round 0 left out); overhead = wall - fit; "
        f"÷ baseline = overhead ÷ that of '{baseline_name}'. {digest_line(results)} {machine_line()}"
    )
    return "\n".join([*lines, "", notes])


def digest_line(results: Mapping[str, Sequence[Sequence[Round]]]) -> str:
    """Whether every run of every variant produced the same global model in every round (it must)."""
    runs = {tuple(r.digest for r in run) for runs in results.values() for run in runs}
    return "Global models: identical in every run." if len(runs) == 1 else f"Global models DIFFER: {len(runs)} kinds."


def machine_line() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"Machine: {os.cpu_count()} CPUs, load average {load} (1/5/15 min) at the end."


# -- command line --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.round_overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (round 0 is not measured)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per variant, interleaved")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS))
    parser.add_argument("--ablation", action="store_true", help="also the tuned job with one knob reverted each")
    parser.add_argument("--intervals", type=float, nargs="*", default=[], help="extra task_request_interval values")
    parser.add_argument("--ref", help="also run the job and code of this git revision (e.g. HEAD)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, defaults vs tuned, once")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats, args.variants = 2, 1, list(DEFAULT_VARIANTS)
        args.ablation, args.intervals = False, []
    if args.rounds < 2 or args.repeats < 1:
        parser.error("--rounds must be at least 2 and --repeats at least 1")
    return args


def variant_knobs(args: argparse.Namespace) -> dict[str, Knobs]:
    names = list(dict.fromkeys([*args.variants, *(VARIANTS if args.ablation else [])]))
    chosen = {name: VARIANTS[name] for name in names}
    for interval in args.intervals:
        chosen[f"tuned, task_request_interval {interval:g} s"] = Knobs(task_request_interval=interval)
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="round-overhead-") as scratch_name:
        scratch = Path(scratch_name)
        job_dir = export_tiny_job(ROOT, scratch / "jobs", args.rounds)
        plans = [Plan(name, ROOT, job_dir, knobs) for name, knobs in variant_knobs(args).items()]
        with worktree(args.ref) if args.ref else _no_worktree() as ref_root:
            if ref_root is not None:
                ref_job = export_tiny_job(ref_root, scratch / "ref-jobs", args.rounds)
                plans.insert(0, Plan(f"code at {args.ref}", ref_root, ref_job, Knobs()))
            print(f"{len(plans)} variants x {args.repeats} runs of {args.rounds} rounds, -n {SITES} -t {SITES}")
            results = run_plans(plans, args.repeats, scratch)
    table = report(results, baseline_name=plans[0].name)
    print(table)
    if args.out:
        args.out.write_text(table + "\n", encoding="utf-8")
    return 0


@contextmanager
def _no_worktree() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    sys.exit(main())
