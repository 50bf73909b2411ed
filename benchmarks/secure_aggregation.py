"""What homomorphic encryption costs per round: the same job with ``--secure-aggregation he`` and ``plain``, on one
loopback deployment provisioned with NVFlare's HEBuilder (docs/deployment.md, "Secure aggregation (HE)").

    python -m benchmarks.secure_aggregation --rounds 3 --repeats 2 --out benchmarks/results/secure_aggregation.md

Both jobs are NVFlare's ScatterAndGather with the bundle's Lightning client and the same settings; ``he`` adds
NVFlare's HE encryptor/decryptor filters, accumulating aggregator and shareable generator. The runs alternate
(plain, he, plain, he, ...) on the same started server and sites. From each run's ``metrics/round_metrics.jsonl``
(:class:`controllers.secure_aggregation.RoundRecorder`): seconds per round (the server's ROUND_STARTED -> ROUND_DONE,
less the seconds the recorder spent measuring sizes), bytes of each site's result and of the global model sent down,
as NVFlare serialises them. Round 1 (index 0) is reported apart: it includes every site's client start-up, and its
global model goes down unencrypted in both jobs. Afterwards site-1 decrypts every HE run's final global model with its
own context; they are compared with the plain runs' (same seeds, same data), beside the spread between plain runs
(NVFlare adds the results in the order they arrive, so floating-point rounding differs from run to run, and later
rounds train from slightly different models).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

MODES = ("plain", "he")


def round_records(result: Path) -> list[dict[str, Any]]:
    """The round records of a downloaded run folder."""
    lines = (result / "metrics" / "round_metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("stage") == "round"]


def round_seconds(record: Mapping[str, Any]) -> float:
    return float(record["elapsed_s"]) - float(record.get("measure_s") or 0.0)


def summarise(runs: Mapping[str, Sequence[Sequence[Mapping[str, Any]]]]) -> dict[str, dict[str, float]]:
    """Per mode: median seconds of round 1 and of the later rounds, and bytes per round (every site's result summed;
    the global model sent down, later rounds) over all runs of that mode."""
    summary = {}
    for mode, mode_runs in runs.items():
        first = [round_seconds(records[0]) for records in mode_runs]
        later = [round_seconds(r) for records in mode_runs for r in records[1:]]
        results = [sum(r["result_bytes"].values()) for records in mode_runs for r in records]
        down = [r["global_bytes"] for records in mode_runs for r in records[1:] if r.get("global_bytes")]
        summary[mode] = {
            "runs": len(mode_runs),
            "first_round_s": statistics.median(first),
            "later_round_s": statistics.median(later) if later else float("nan"),
            "result_bytes_per_round": statistics.median(results),
            "global_bytes_per_round": statistics.median(down) if down else float("nan"),
            "private_ciphertexts": sum(r.get("private_ciphertexts", 0) for records in mode_runs for r in records),
        }
    return summary


def _max_difference(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def markdown(
    summary: Mapping[str, Mapping[str, float]], settings: Mapping[str, Any], differences: Mapping[str, float]
) -> str:
    rows = [
        "| | plain | he | he / plain |",
        "|---|---|---|---|",
    ]
    plain, he = summary["plain"], summary["he"]
    for key, label, scale, unit in (
        ("first_round_s", "round 1 (site start-up included), s", 1.0, ""),
        ("later_round_s", "later rounds, s per round", 1.0, ""),
        ("result_bytes_per_round", "results up (all sites), MB per round", 1e-6, ""),
        ("global_bytes_per_round", "global model down (per site), MB per round", 1e-6, ""),
    ):
        ratio = he[key] / plain[key] if plain[key] else float("nan")
        rows.append(f"| {label} | {plain[key] * scale:.3g}{unit} | {he[key] * scale:.3g}{unit} | {ratio:.1f}x |")
    lines = [
        f"Settings: {json.dumps(dict(settings), sort_keys=True)}; runs per mode: {plain['runs']}, alternating.",
        "",
        *rows,
        "",
        "Largest difference per parameter between final global models: an HE job's (decrypted by site-1) and a "
        f"plain job's {differences['he_vs_plain']:.2e}; two plain jobs' (the results are summed in arrival order) "
        f"{differences['plain_vs_plain']:.2e}. Received ciphertexts whose context held a secret key: "
        f"{he['private_ciphertexts']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from jobs.build import JobSpec, export_job
    from jobs.provision import loopback
    from jobs.secure_aggregation import CLIENT_CONTEXT, decrypt_global_model, job_model_shapes

    parser = argparse.ArgumentParser(prog="python -m benchmarks.secure_aggregation", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per job (default: 3)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each job, alternating (default: 2)")
    parser.add_argument("--sites", type=int, default=3, help="sites (default: 3)")
    parser.add_argument("--max-train-samples", type=int, default=900, help="samples split across the sites")
    parser.add_argument("--workspace", type=Path, help="deployment folder (default: a temporary one, removed)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)

    settings = {"num_rounds": args.rounds, "num_sites": args.sites, "max_train_samples": args.max_train_samples}
    with tempfile.TemporaryDirectory(prefix="fedalg-he-bench-") as scratch:
        root = args.workspace.resolve() if args.workspace else Path(scratch)
        specs = {m: JobSpec(name=f"bench_{m}", secure_aggregation=m, **settings) for m in MODES}
        jobs = {m: export_job(spec, root / "jobs") for m, spec in specs.items()}
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", args.sites, env, he=True)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        loopback.keep_server_storage_inside(deployment.server)
        data = {"dataset": "fashion_mnist", "scheme": "dirichlet", "num_sites": args.sites}
        for site, site_dir in deployment.sites.items():
            loopback.configure_site_data(site_dir, site, {**data, "max_train_samples": args.max_train_samples})
        runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in MODES}
        results: dict[str, list[Path]] = {m: [] for m in MODES}
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                for repeat in range(args.repeats):
                    for mode in MODES:
                        started = time.monotonic()
                        job_id, meta = loopback.run_job(session, deployment, jobs[mode], timeout=900.0)
                        result = loopback.download_result(session, job_id)
                        problems = loopback.job_problems(meta, result)
                        if problems:
                            print(f"error: {mode} run {repeat + 1}: {'; '.join(problems)}", file=sys.stderr)
                            return 1
                        runs[mode].append(round_records(result))
                        results[mode].append(result)
                        took = time.monotonic() - started
                        print(f"{mode} run {repeat + 1}: {took:.1f} s from submission", flush=True)
        finally:
            loopback.stop(deployment)
        shapes = job_model_shapes(jobs["he"])
        context = deployment.sites["site-1"] / "startup" / CLIENT_CONTEXT
        models = {
            mode: [decrypt_global_model(r / "app_server" / "FL_global_model.pt", context, shapes) for r in found]
            for mode, found in results.items()
        }
        differences = {
            "he_vs_plain": max(_max_difference(he, plain) for he in models["he"] for plain in models["plain"]),
            "plain_vs_plain": max(
                (_max_difference(a, b) for i, a in enumerate(models["plain"]) for b in models["plain"][i + 1 :]),
                default=float("nan"),
            ),
        }
    text = markdown(summarise(runs), settings, differences)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
