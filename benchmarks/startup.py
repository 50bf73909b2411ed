"""Start-up of a site's client-round under ``nvflare simulator -t 1`` (a new process for every client-round).

Two measurements, each for this checkout and (``--ref REV``) for git revision ``REV`` of this repository in a
temporary ``git worktree`` (removed afterwards), in fresh processes, the two versions interleaved:

1. **The client's import + set-up path** (default). A fresh Python process imports what NVFlare's client job process
   holds before it starts the client script (the simulator worker, the Client API executor, the in-process API),
   then runs the job's own ``client.py`` with the job's own arguments in a simulated site workspace, against an
   in-process Client API that has already been told to stop: the script imports its stack, resolves its data and
   builds its round, and returns at its first ``flare.is_running()``. Reported: the script's wall time, the
   process's peak RSS, and (``--importtime``) where ``python -X importtime`` says the script's imports go, by
   top-level package. Every site workspace gets one unmeasured run first, as in a job, where a site's first
   client-round runs before its later ones.
2. **The simulator itself** (``--simulate``): ``nvflare simulator -n 3 -t 1`` on a 2-round job (by default
   Fashion-MNIST, 128 samples per site; ``--simulate-preset NAME`` takes a committed job's settings instead, with 2
   rounds, and ``--simulate-args JSON`` sets job settings on top, e.g. ``{"precision": "bf16-mixed"}``); per
   client-round, from the site logs and the simulator's log: NVFlare's part (the simulator picks the site -> the
   client script starts: a 1 s sleep, a new process, the client runner, a 0.5 s sync sleep) and the script's part
   (the script starts -> its Trainer exists, i.e. training begins; the task's arrival overlaps with it).

Run: ``python -m benchmarks.startup --ref HEAD`` (before = HEAD, after = the working tree); ``--job`` picks the
committed job (default ``fedavg``: full Fashion-MNIST, Dirichlet 0.5, 3 sites); ``--quick`` is a smoke run;
``--site-python /tmp/site/bin/python`` also measures the working tree in a site install (the bundle without its
``plots`` and ``digits`` extras: no matplotlib, scikit-learn or scipy for torchmetrics to import). On a machine with
a CUDA GPU the simulator's sites train on it (the accelerator "auto"), and the report names the GPU. ``nvflare`` is
the command beside the interpreter, else the one on ``PATH`` (a ``pip install --target`` puts it elsewhere).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "-- fedalg startup benchmark: client script starts --"


# -- the harness (runs in the measured process; imports only NVFlare, then the client script) -------------------------
def harness(script: str, script_args: Sequence[str]) -> None:
    """Print one JSON line: NVFlare's preload time, the client script's time and the peak RSS (see module doc)."""
    import logging
    import resource
    import runpy
    import time

    started = time.perf_counter()
    import nvflare.app_common.executors.client_api.in_process_backend
    import nvflare.app_common.executors.client_api_executor
    import nvflare.private.fed.app.simulator.simulator_worker  # noqa: F401  (what the client process holds)
    from nvflare.apis.fl_constant import FLMetaKey
    from nvflare.client.api_spec import CLIENT_API_KEY
    from nvflare.client.in_process.api import TOPIC_STOP, InProcessClientAPI
    from nvflare.fuel.data_event.data_bus import DataBus
    from nvflare.fuel.data_event.event_manager import EventManager

    api = InProcessClientAPI(task_metadata={FLMetaKey.SITE_NAME: "site-1", FLMetaKey.JOB_ID: "startup-benchmark"})
    api.init()
    DataBus().put_data(CLIENT_API_KEY, api)
    EventManager(DataBus()).fire_event(TOPIC_STOP, "startup benchmark: set-up only")
    logging.disable(logging.WARNING)  # the stop notice
    nvflare_s = time.perf_counter() - started
    nvflare_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(MARKER, file=sys.stderr, flush=True)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # the app's custom/, as NVFlare puts it on the path
    script_started = time.perf_counter()
    runpy.run_path(script, run_name="__main__")
    result = {
        "nvflare_s": nvflare_s,
        "nvflare_rss_mb": nvflare_rss,
        "script_s": time.perf_counter() - script_started,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(json.dumps(result), flush=True)


# -- code versions -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Version:
    """A code version: its root (on PYTHONPATH), the job's client script and arguments, a site workspace."""

    label: str
    root: Path
    script: Path
    script_args: tuple[str, ...]
    workspace: Path
    python: str = sys.executable  # the interpreter (its environment: a site install, or everything)


def export_job(root: Path, job: str, out_dir: Path) -> Path:
    """Export committed job ``job`` with the builder of the code at ``root``."""
    code = (
        "import sys; from pathlib import Path; from jobs.presets import PRESETS; from jobs.build import export_job; "
        "export_job(PRESETS[sys.argv[1]], Path(sys.argv[2]))"
    )
    subprocess.run([sys.executable, "-c", code, job, str(out_dir)], check=True, cwd=root, env=code_env(root))
    return out_dir / job


def prepare(label: str, root: Path, job: str, scratch: Path, python: str = sys.executable) -> Version:
    scratch = scratch / re.sub(r"\W+", "-", label)  # NVFlare splits its worker's command line on spaces
    job_dir = export_job(root, job, scratch / "jobs")
    client = json.loads((job_dir / "app" / "config" / "config_fed_client.json").read_text())
    args = client["executors"][0]["executor"]["args"]["task_script_args"].split()
    workspace = scratch / "site-1"
    (workspace / "startup").mkdir(parents=True)  # what the simulator creates: a simulated site (no fed_client.json)
    return Version(label, root, job_dir / "app" / "custom" / "client.py", tuple(args), workspace, python)


def code_env(root: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))


@contextmanager
def worktree(ref: str | None) -> Iterator[Path | None]:
    """A detached ``git worktree`` of ``ref`` (round_overhead's), removed on exit; ``None`` without a ref."""
    if ref is None:
        yield None
        return
    from benchmarks.round_overhead import worktree as ref_worktree

    with ref_worktree(ref) as folder:
        yield folder


# -- measurement 1: the client's import + set-up path ----------------------------------------------------------------
def run_harness(version: Version, importtime: bool = False) -> tuple[dict[str, float], str]:
    """One fresh process; its JSON result and (with ``importtime``) its ``-X importtime`` output after the marker."""
    command = [version.python, *(["-X", "importtime"] if importtime else []), __file__, "--harness"]
    command += [str(version.script), "--", *version.script_args]
    done = subprocess.run(
        command, capture_output=True, text=True, cwd=version.workspace, env=code_env(version.root), check=False
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{version.label}: harness failed\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1]), done.stderr.partition(MARKER)[2]


def measure_client(versions: Sequence[Version], repeats: int) -> dict[str, list[dict[str, float]]]:
    """One unmeasured run per version (a site's first client-round), then ``repeats`` interleaved measured runs."""
    for version in versions:
        run_harness(version)
    results: dict[str, list[dict[str, float]]] = {v.label: [] for v in versions}
    for _ in range(repeats):
        for version in versions:
            results[version.label].append(run_harness(version)[0])
    return results


def importtime_by_package(text: str, top: int = 8) -> list[tuple[str, float]]:
    """Self time (s) of the imports in ``-X importtime`` output, summed by top-level package, largest first."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
        if match:
            totals[match[2].split(".")[0]] += int(match[1]) / 1e6
    return sorted(totals.items(), key=lambda item: -item[1])[:top]


def client_report(results: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    lines = [
        "| code | runs | NVFlare preload (s) | client script (s) | peak RSS (MB) | script ÷ first |",
        "|---|---|---|---|---|---|",
    ]
    first = None
    for label, runs in results.items():
        script = statistics.median(r["script_s"] for r in runs)
        first = first or script
        nvflare = statistics.median(r["nvflare_s"] for r in runs)
        rss = statistics.median(r["peak_rss_mb"] for r in runs)
        lines.append(f"| {label} | {len(runs)} | {nvflare:.2f} | {script:.2f} | {rss:.0f} | {script / first:.2f} |")
    return "\n".join(lines)


# -- measurement 2: the simulator, -t 1 -------------------------------------------------------------------------------
#: The -t 1 job's settings when no preset is named: 2 rounds, 384 Fashion-MNIST samples in all (IID, 128 a site).
TINY_T1_JOB = {"num_rounds": 2, "max_train_samples": 384, "scheme": "iid", "max_test_samples": 200}
#: Exports the -t 1 job with the builder at the version's root: argv = out dir, preset ('' = none), JSON settings.
#: A preset's own settings come from that root's presets, with 2 rounds; the JSON settings go on top.
T1_EXPORT = (
    "import json, sys; from pathlib import Path; from jobs.build import JobSpec, export_job; "
    "from jobs.presets import PRESET_SETTINGS; "
    "base = {**PRESET_SETTINGS[sys.argv[2]], 'num_rounds': 2} if sys.argv[2] else {}; "
    "export_job(JobSpec(name='startup_t1', **{**base, **json.loads(sys.argv[3])}), Path(sys.argv[1]))"
)


def t1_job(preset: str | None, overrides: Mapping[str, object]) -> tuple[str, dict[str, object]]:
    """The -t 1 job's (preset, settings) for `T1_EXPORT`: the tiny job's settings unless a preset is named."""
    return (preset or "", dict(overrides) if preset else {**TINY_T1_JOB, **overrides})


def nvflare_command(python: str) -> str:
    """The ``nvflare`` command beside ``python`` (the version's environment), else the one on PATH (a package
    installed with ``pip --target``, whose scripts are not beside the interpreter)."""
    beside = Path(python).with_name("nvflare")
    found = beside if beside.exists() else shutil.which("nvflare")
    if found is None:
        raise RuntimeError(f"no nvflare command beside {python} or on PATH: install nvflare 2.9")
    return str(found)


def simulate_t1(
    version: Version, preset: str | None = None, overrides: Mapping[str, object] | None = None
) -> list[dict[str, float]]:
    """``nvflare simulator -n 3 -t 1`` of a 2-round job (`t1_job`); per client-round NVFlare's and the
    script's seconds."""
    name, settings = t1_job(preset, overrides or {})
    scratch = version.workspace.parent
    jobs = scratch / "t1-jobs"
    export = [sys.executable, "-c", T1_EXPORT, str(jobs), name, json.dumps(settings)]
    subprocess.run(export, check=True, cwd=version.root, env=code_env(version.root))
    workspace = scratch / "t1-ws"
    command = [nvflare_command(version.python), "simulator", str(jobs / "startup_t1"), "-w", str(workspace)]
    command += ["-n", "3", "-t", "1"]
    completed = subprocess.run(
        command, capture_output=True, text=True, cwd=scratch, env=code_env(version.root), check=False
    )
    from aggregators.contracts.run_records import finished_records  # here: this module's own imports stay light

    finished_records(workspace, completed.stdout[-2000:] + completed.stderr[-2000:])  # an aborted job is an error
    return client_rounds(workspace)


def _stamp(line: str) -> float:
    return dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _events(path: Path, needle: str) -> list[float]:
    return [_stamp(line) for line in path.read_text().splitlines() if needle in line and line[:2] == "20"]


def client_rounds(workspace: Path) -> list[dict[str, float]]:
    """Match every 'Simulate Run client: X' of the simulator to X's next script start and next Trainer."""
    server_log = (workspace / "server" / "log.txt").read_text().splitlines()
    picks = [(_stamp(ln), ln.split("client: ")[1].split()[0]) for ln in server_log if "Simulate Run client:" in ln]
    rounds = []
    for picked, site in picks:
        log = workspace / site / "log.txt"
        starts = [t for t in _events(log, "start task run()") if t > picked]
        trainers = [t for t in _events(log, "GPU available") if t > picked]
        if starts and trainers and trainers[0] > starts[0]:
            rounds.append({"nvflare_s": starts[0] - picked, "script_s": trainers[0] - starts[0]})
    return rounds


def simulate_report(results: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    lines = [
        "| code | client-rounds | NVFlare: site picked -> script starts (s) | script: starts -> training (s) |"
        " start-up total (s) |",
        "|---|---|---|---|---|",
    ]
    for label, rounds in results.items():
        nvflare = statistics.median(r["nvflare_s"] for r in rounds) if rounds else float("nan")
        script = statistics.median(r["script_s"] for r in rounds) if rounds else float("nan")
        lines.append(f"| {label} | {len(rounds)} | {nvflare:.2f} | {script:.2f} | {nvflare + script:.2f} |")
    return "\n".join(lines)


# -- command line --------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.splitlines()[0])
    parser.add_argument("--ref", help="also measure this git revision (before), e.g. HEAD")
    parser.add_argument("--job", default="fedavg", help="committed job whose client script and arguments to run")
    parser.add_argument("--repeats", type=int, default=3, help="measured runs per version, interleaved")
    parser.add_argument("--importtime", action="store_true", help="where the script's imports go, by package")
    parser.add_argument("--simulate", action="store_true", help="also run nvflare simulator -t 1 (about 1 min each)")
    parser.add_argument(
        "--simulate-preset",
        help="the -t 1 job: this committed job's settings with 2 rounds (default: 2 rounds of Fashion-MNIST, 128 "
        "samples per site)",
    )
    parser.add_argument(
        "--simulate-args",
        type=json.loads,
        default={},
        help='JSON settings on top of the -t 1 job\'s, e.g. \'{"precision": "bf16-mixed"}\'',
    )
    parser.add_argument(
        "--site-python",
        help="also measure the working tree under this interpreter, e.g. a site install's "
        "(python -m venv /tmp/site && /tmp/site/bin/pip install torch==2.13.0 . : no plots/digits extras)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: one measured run, no simulator")
    parser.add_argument("--out", type=Path, help="also write the report to this file")
    parser.add_argument("--json", type=Path, help="also write the measurements as JSON to this file")
    args = parser.parse_args(argv)
    if not isinstance(args.simulate_args, dict):
        parser.error(f"--simulate-args must be a JSON object of job settings, got {args.simulate_args!r}")
    if args.quick:
        args.repeats, args.simulate = 1, False
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sections: list[str] = []
    measured: dict[str, object] = {"job": args.job}
    with tempfile.TemporaryDirectory(prefix="startup-") as name, worktree(args.ref) as ref_root:
        scratch = Path(name)
        versions = [prepare("working tree", ROOT, args.job, scratch)]
        if ref_root is not None:
            versions.insert(0, prepare(f"code at {args.ref}", ref_root, args.job, scratch))
        if args.site_python:
            versions.append(prepare("working tree, site install", ROOT, args.job, scratch, python=args.site_python))
        measured["client"] = client = measure_client(versions, args.repeats)
        sections.append(f"Client import + set-up path (job {args.job}, site-1):\n\n{client_report(client)}")
        write_report(args, sections, measured)  # kept if the simulator below runs past a caller's time limit
        if args.importtime:
            sections += [importtime_section(v) for v in versions]
        if args.simulate:
            sections.append(simulate_section(args, versions, measured))
    print(write_report(args, sections, measured, final=True))
    return 0


def simulate_section(args: argparse.Namespace, versions: Sequence[Version], measured: dict[str, object]) -> str:
    """Measurement 2 for every version; the client-rounds go into ``measured["simulate"]``."""
    rounds = {v.label: simulate_t1(v, args.simulate_preset, args.simulate_args) for v in versions}
    measured["simulate"] = {"preset": args.simulate_preset, "args": args.simulate_args, "client_rounds": rounds}
    job = f"job {args.simulate_preset}" if args.simulate_preset else "Fashion-MNIST, 128 samples per site"
    settings = f", settings {json.dumps(args.simulate_args)}" if args.simulate_args else ""
    return f"nvflare simulator -n 3 -t 1, 2 rounds, {job}{settings} (medians):\n\n{simulate_report(rounds)}"


def write_report(
    args: argparse.Namespace, sections: Sequence[str], measured: Mapping[str, object], final: bool = False
) -> str:
    """The report so far (the machine line at the end), written to ``--out`` and ``--json`` when given."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    machine = f"Machine: {os.cpu_count()} CPUs, {gpu_name()}, load average {load} (1/5/15 min)"
    text = "\n\n".join(sections) + f"\n\n{machine}{' at the end' if final else ' (run not finished)'}."
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps({**measured, "machine": machine, "finished": final}, indent=1))
    return text


def gpu_name() -> str:
    """The CUDA device the simulator's sites train on (Lightning's accelerator "auto"), or "no GPU"."""
    import torch  # here: the measured processes are separate; this one's imports do not count

    return f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"


def importtime_section(version: Version) -> str:
    _, text = run_harness(version, importtime=True)
    rows = importtime_by_package(text)
    total = sum(seconds for _, seconds in importtime_by_package(text, top=10_000))
    body = ", ".join(f"{package} {seconds:.2f}" for package, seconds in rows)
    return f"Imports of the client script ({version.label}), self time by package (s), {total:.2f} in all: {body}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--harness":
        sys.path.pop(0)  # benchmarks/ itself: its module names must not shadow anything the client imports
        separator = sys.argv.index("--")
        harness(sys.argv[2], sys.argv[separator + 1 :])
    else:
        sys.exit(main())
