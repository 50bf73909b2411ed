r"""What secure aggregation costs per round: the same job with ``--secure-aggregation plain``, ``he`` and ``secagg``
(``--modes``), on one loopback deployment (provisioned with NVFlare's HEBuilder when ``he`` runs; docs/deployment.md,
"Secure aggregation").

    python -m benchmarks.secure_aggregation --rounds 3 --repeats 2 --out benchmarks/results/secure_aggregation.md

A user's own LightningModule and data module run the same way (``--model``, ``--model-args``, ``--data``,
``--data-args``, ``--ship``, as ``python -m jobs.build`` takes them), e.g. the genomics consortium's
``cnn_transformer`` with the model and data settings of the committed ``jobs/snp_fedavg``:

    python -m benchmarks.secure_aggregation --rounds 3 --repeats 3 --model genomics.model:SnpClassifier \
        --model-args '{"arch":"cnn_transformer","n_snps":127,"num_classes":5,"lr":0.001}' \
        --data genomics.data:SnpSites --data-args '{"source":"1kg","split":"dirichlet","alpha":0.1,"batch_size":128}' \
        --ship examples/genomics --out benchmarks/results/secure_aggregation.md

A provisioned genomics site trains on its own genotype file, never the public panel: ``--genotypes`` (``{site}`` for
each site's name) and ``--snp-table`` name them, e.g. the genomics MLP on a simulated cohort harmonised per site
(``python -m data_prep.genotypes simulate-sites`` and ``harmonise --labels``; docs/tutorials/consortium.md):

    python -m benchmarks.secure_aggregation --rounds 3 --repeats 2 --model genomics.model:SnpClassifier \
        --model-args '{"arch":"mlp","n_snps":127,"num_classes":4,"lr":0.001}' --data genomics.data:SnpSites \
        --data-args '{"classes":["AFR","EUR","ASIA","ADMIX"],"batch_size":32}' --ship examples/genomics \
        --genotypes "$C/{site}.npz" --snp-table $C/snp_table.csv   # $C: the cohort's folder

``--out`` replaces the table of the same model in the results file (a ``## <model>`` section) and keeps the others.

Every job is NVFlare's ScatterAndGather with the bundle's Lightning client and the same settings; ``he`` adds
NVFlare's HE encryptor/decryptor filters, accumulating aggregator and shareable generator; ``secagg`` SecAgg+'s key and
unmask stages, masking filter and aggregator (controllers/secagg.py), whose seconds and message bytes the round record
carries apart (``secagg``). The runs alternate (plain, he, secagg, plain, ...) on the same started server and sites.
From each run's ``metrics/round_metrics.jsonl`` (`controllers.secure_aggregation.RoundRecorder`): seconds per round
(the server's ROUND_STARTED -> ROUND_DONE, less the seconds the recorder spent measuring sizes), bytes of each site's
result and of the global model sent down, as NVFlare serialises them. Round 1 (index 0) is reported apart: it
includes every site's client start-up, and its global model goes down unencrypted in every job. Afterwards site-1
decrypts every HE run's final global model with its own context; they and the SecAgg+ runs' are compared with the
plain runs' (same seeds, same data), beside the spread between plain runs (NVFlare adds the results in the order they
arrive, so floating-point rounding differs from run to run, and later rounds train from slightly different models).
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

MODES = ("plain", "he", "secagg")


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
        # SecAgg+'s key and unmask stages (controllers/secagg.py's cost, in the later rounds' records)
        stages = [r["secagg"] for records in mode_runs for r in records[1:] if r.get("secagg")]
        for key in ("setup_s", "unmask_s", "up_bytes", "down_bytes"):
            summary[mode][f"stage_{key}"] = statistics.median(s[key] for s in stages) if stages else 0.0
    return summary


def saved_model(model_file: Path, shapes: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    """A plaintext run's saved global model (``app_server/FL_global_model.pt``) as float32 arrays of ``shapes``."""
    import torch

    saved = torch.load(model_file, map_location="cpu", weights_only=False)
    weights = saved.get("model", saved) if isinstance(saved, dict) else saved
    return {name: np.asarray(weights[name], dtype=np.float32).reshape(shape) for name, shape in shapes.items()}


def _max_difference(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


#: The table's rows: summary key, label, scale.
ROWS = (
    ("first_round_s", "round 1 (site start-up included), s", 1.0),
    ("later_round_s", "later rounds, s per round", 1.0),
    ("stage_setup_s", "of which SecAgg+ key set-up (advertise, share keys), s per round", 1.0),
    ("stage_unmask_s", "of which SecAgg+ unmask stage, s per round", 1.0),
    ("result_bytes_per_round", "results up (all sites), MB per round", 1e-6),
    ("stage_up_bytes", "SecAgg+ stage answers up (all sites), MB per round", 1e-6),
    ("global_bytes_per_round", "global model down (per site), MB per round", 1e-6),
    ("stage_down_bytes", "SecAgg+ stage messages and routing down (all sites), MB per round", 1e-6),
)


def markdown(
    summary: Mapping[str, Mapping[str, float]],
    settings: Mapping[str, Any],
    differences: Mapping[str, float],
    heading: str | None = None,
    model_size: tuple[int, int] | None = None,
) -> str:
    modes = [m for m in MODES if m in summary]
    others = [m for m in modes if m != "plain"]
    rows = [
        "| | " + " | ".join(modes) + " | " + " | ".join(f"{m} / plain" for m in others) + " |",
        "|---|" + "---|" * (len(modes) + len(others)),
    ]
    plain = summary["plain"]
    secagg_rows = "secagg" in summary
    for key, label, scale in ROWS:
        if key.startswith("stage_") and not secagg_rows:
            continue
        values = " | ".join(f"{summary[m].get(key, 0.0) * scale:.3g}" for m in modes)
        ratios = " | ".join(f"{summary[m][key] / plain[key]:.1f}x" if plain.get(key) else "-" for m in others)
        rows.append(f"| {label} | {values} | {ratios} |")
    size = f"; model: {model_size[0]} state_dict entries, {model_size[1]:,} values" if model_size else ""
    notes = []
    if "he" in summary:
        notes.append(f"an HE job's (decrypted by site-1) and a plain job's {differences['he_vs_plain']:.2e}")
    if "secagg" in summary:
        notes.append(f"a SecAgg+ job's and a plain job's {differences['secagg_vs_plain']:.2e}")
    notes.append(f"two plain jobs' (the results are summed in arrival order) {differences['plain_vs_plain']:.2e}")
    lines = [
        *([f"## {heading}", ""] if heading else []),
        f"Settings: {json.dumps(dict(settings), sort_keys=True)}; runs per mode: {plain['runs']}, alternating{size}.",
        "",
        *rows,
        "",
        "Largest difference per parameter between final global models: "
        + "; ".join(notes)
        + "."
        + (
            f" Received ciphertexts whose context held a secret key: {summary['he']['private_ciphertexts']}."
            if "he" in summary
            else ""
        ),
    ]
    return "\n".join(lines) + "\n"


def replace_section(text: str, section: str) -> str:
    """``text`` (a results file of ``## <model>`` sections) with ``section`` in place of the one of the same heading,
    or appended; text before the first heading is kept, and a file without headings is replaced."""
    heading = section.splitlines()[0]
    parts = text.split("\n## ")
    head, sections = parts[0], [f"## {part}" for part in parts[1:]]
    if head.startswith("## "):
        head, sections = "", [head, *sections]
    elif not head.startswith("#"):
        head = ""  # an older file: one table, no heading
    sections = [part.rstrip("\n") + "\n" for part in sections]
    headings = [part.splitlines()[0] for part in sections]
    if heading in headings:
        sections[headings.index(heading)] = section
    else:
        sections.append(section)
    return "\n".join(([head.rstrip("\n") + "\n"] if head else []) + sections)


def bench_spec_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The job settings both modes share: the built-in LeNet-5 on Fashion-MNIST shards, or the user's model."""
    settings: dict[str, Any] = {"num_rounds": args.rounds, "num_sites": args.sites}
    if args.model is None:
        return {**settings, "max_train_samples": args.max_train_samples}
    user = {"model": args.model, "model_args": json.loads(args.model_args), "data": args.data}
    return {**settings, **user, "data_args": json.loads(args.data_args), "ship": args.ship}


def main(argv: Sequence[str] | None = None) -> int:
    from jobs.build import JobSpec, export_job
    from jobs.provision import loopback
    from jobs.secure_aggregation import CLIENT_CONTEXT, decrypt_global_model, job_model_shapes
    from jobs.shipping import importable
    from jobs.spec import shipped_folders

    parser = argparse.ArgumentParser(prog="python -m benchmarks.secure_aggregation", description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per job (default: 3)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each job, alternating (default: 2)")
    parser.add_argument("--sites", type=int, default=3, help="sites (default: 3)")
    parser.add_argument("--max-train-samples", type=int, default=900, help="samples split across the sites")
    parser.add_argument("--model", help="a user LightningModule, pkg.module:Class (default: LeNet-5)")
    parser.add_argument("--model-args", default="{}", help="JSON arguments of --model")
    parser.add_argument("--data", help="the user's LightningDataModule, package.module:Class (with --model)")
    parser.add_argument("--data-args", default="{}", help="JSON arguments of --data")
    parser.add_argument("--ship", help="package folder(s) shipped with the job, comma-separated (with --model)")
    parser.add_argument(
        "--genotypes", help="each site's genotype file for --data genomics.data:SnpSites, {site} for its name"
    )
    parser.add_argument("--snp-table", help="the consortium's SNP table (with --genotypes)")
    parser.add_argument("--workspace", type=Path, help="deployment folder (default: a temporary one, removed)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"secure-aggregation modes to run, plain first (default: {','.join(MODES)})",
    )
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if modes[0] != "plain" or not set(modes) <= set(MODES):
        parser.error(f"--modes: plain first, then any of {', '.join(MODES[1:])}; got {args.modes}")

    if (args.model is None) != (args.data is None):
        parser.error("--model and --data go together")
    settings = bench_spec_settings(args)
    heading = args.model or "built-in lenet5 on Fashion-MNIST"
    with tempfile.TemporaryDirectory(prefix="fedalg-he-bench-") as scratch:
        root = args.workspace.resolve() if args.workspace else Path(scratch)
        specs = {m: JobSpec(name=f"bench_{m}", secure_aggregation=m, **settings) for m in modes}
        jobs = {m: export_job(spec, root / "jobs") for m, spec in specs.items()}
        with importable(shipped_folders(specs["plain"])):  # the user's model gives the shapes to decrypt into
            shapes = job_model_shapes(jobs["plain"])
        env = loopback.participant_env()
        deployment = loopback.provision(root / "fl", args.sites, env, he="he" in modes)
        for participant in [deployment.server, *deployment.sites.values()]:
            loopback.allow_bundle_classes(participant)
        loopback.keep_server_storage_inside(deployment.server)
        data = {"dataset": "fashion_mnist", "scheme": "dirichlet", "num_sites": args.sites}
        for site, site_dir in deployment.sites.items():  # a user's data module derives or reads its own data
            if args.model is None:
                loopback.configure_site_data(site_dir, site, {**data, "max_train_samples": args.max_train_samples})
            elif args.genotypes:  # a provisioned genomics site trains on its own file, never the public panel
                loopback.configure_site_genotypes(site_dir, site, args.genotypes, args.snp_table, None)
        runs: dict[str, list[list[dict[str, Any]]]] = {m: [] for m in modes}
        results: dict[str, list[Path]] = {m: [] for m in modes}
        try:
            loopback.start(deployment, env)
            with loopback.admin_session(deployment) as session:
                loopback.wait_for_sites(session, deployment)
                for repeat in range(args.repeats):
                    for mode in modes:
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
        context = deployment.sites["site-1"] / "startup" / CLIENT_CONTEXT  # only an HE run's model is encrypted
        models = {
            mode: [
                decrypt_global_model(r / "app_server" / "FL_global_model.pt", context, shapes)
                if mode == "he"
                else saved_model(r / "app_server" / "FL_global_model.pt", shapes)
                for r in found
            ]
            for mode, found in results.items()
        }
        differences = {
            f"{mode}_vs_plain": max(_max_difference(a, b) for a in models[mode] for b in models["plain"])
            for mode in modes[1:]
        }
        differences |= {
            "plain_vs_plain": max(
                (_max_difference(a, b) for i, a in enumerate(models["plain"]) for b in models["plain"][i + 1 :]),
                default=float("nan"),
            ),
        }
    size = (len(shapes), sum(int(np.prod(shape)) for shape in shapes.values()))
    text = markdown(summarise(runs), settings, differences, heading=heading, model_size=size)
    print(text)
    if args.out:
        args.out.write_text(replace_section(args.out.read_text() if args.out.is_file() else "", text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
