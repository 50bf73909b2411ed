"""The one job builder of the bundle: a client algorithm × a server rule → an NVFlare job folder.

    python -m jobs.build --client fedavg --server fedavg --name my_job --output-dir /tmp/jobs
    python -m jobs.build --client fedavg --server fedavg   # into ./fl_jobs/fedavg_fedavg (relative to where you are)
    python -m jobs.build --presets                # re-export every committed jobs/<name>/ folder
    python -m jobs.build --presets --check        # fail if a committed folder differs from what is generated

This module is the command line only. The settings are declared once in `aggregators.contracts.job_settings` (their
options come from `jobs.settings`), validated by `jobs.spec.JobSpec`, assembled with NVFlare's job API in
`jobs.assembly`; the committed jobs are `jobs.presets`, diffed by `jobs.committed`. Any bad value, unknown name or
impossible combination exits with code 2 and one line naming the setting, the value and what is allowed, before
anything is written. A job goes to ``--output-dir`` (default ``./fl_jobs``), never into the repository's own jobs/
unless asked: only ``--presets`` writes there.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from jobs.assembly import APP_PACKAGES, CLIENT_SCRIPT, JOBS_DIR, add_tracking, build_job, export_job, inside_directory
from jobs.committed import _diff_trees, check_presets
from jobs.presets import PRESETS
from jobs.provision.resources import site_resources_arg
from jobs.settings import (
    CLIENT,
    JOB_GROUPS,
    SERVER,
    JobBuildError,
    OneLineErrorParser,
    add_arguments,
    compact_json,
    dataset_num_classes,
)
from jobs.spec import (
    JobSpec,
    _check_arch_args,
    _check_composition,
    advisories,
    client_script_args,
    companion_rules,
    job_attack_args,
    model_arch_args,
    spec_from_values,
    validate_spec,
)

__all__ = [  # the builder's public names, importable from here as before the split
    "APP_PACKAGES",
    "CLIENT_SCRIPT",
    "JOBS_DIR",
    "PRESETS",
    "JobBuildError",
    "JobSpec",
    "_check_arch_args",
    "_check_composition",
    "_diff_trees",
    "add_tracking",
    "build_job",
    "build_parser",
    "check_presets",
    "client_script_args",
    "compact_json",
    "companion_rules",
    "dataset_num_classes",
    "export_job",
    "inside_directory",
    "job_attack_args",
    "main",
    "model_arch_args",
    "model_size_from_data",
    "snp_count",
    "validate_spec",
]


#: Where a job is written without --output-dir: a folder of the current directory, never the repository's own
#: jobs/ (which holds the committed jobs that --presets regenerates and checks).
DEFAULT_OUTPUT_DIR = "fl_jobs"


def build_parser() -> argparse.ArgumentParser:
    """The builder's options: a few of its own, then one per job setting (`jobs.settings.add_arguments`)."""
    from aggregators.registry import RULES
    from lightning_modules.algorithms import CLIENT_ALGORITHMS
    from lightning_modules.models import MODELS

    parser = OneLineErrorParser(prog="python -m jobs.build", description=__doc__.splitlines()[0])
    parser.add_argument("--presets", action="store_true", help="export every preset into jobs/ (the committed jobs)")
    parser.add_argument("--check", action="store_true", help="with --presets: only report differences, exit 1 on any")
    parser.add_argument(
        "--output-dir",
        type=Path,
        help=f"where job folders are written (default: ./{DEFAULT_OUTPUT_DIR}, relative to the current directory; "
        "with --presets: the repository's jobs/, where the committed jobs live)",
    )
    parser.add_argument("--name", help="job folder name (default: <client>_<server>)")
    parser.add_argument(
        "--site-resources",
        type=site_resources_arg,
        default={},
        metavar="[SITE:]gpus=N,cpus=N,mem_gb=N;...",
        help="what each site's machine must grant the job (GPUs, CPUs, memory in GiB), written as NVFlare's "
        "resource_spec into meta.json for its Docker, Kubernetes and Slurm launchers; an entry without SITE: is "
        "every site's (docs/deployment.md). Default: none, meta.json as before",
    )
    parser.add_argument(
        "--snp-table",
        type=Path,
        metavar="TABLE",
        help="a genomics model's size from the data, never typed: the SNP table the sites harmonised against (the "
        "QC's filtered table, <site kit>/local/fedalg_qc_snp_table.csv) or a harmonised .npz sets model_args n_snps, "
        "and --data-args classes sets num_classes; a different n_snps or num_classes in --model-args is refused. "
        "Each site checks its own file against them before it trains (docs/genomics.md)",
    )
    choices_help = {
        "client": "client algorithm: " + ", ".join(sorted(CLIENT_ALGORITHMS)),
        "server": "server aggregation rule: " + ", ".join(sorted(RULES)),
        "arch": "model: " + ", ".join(sorted(MODELS)) + " (mlp for digits only)",
    }
    add_arguments(parser, JOB_GROUPS, sides=(CLIENT, SERVER), choices_help=choices_help)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.presets and args.site_resources:  # the committed jobs ask for nothing; a job's option, not theirs
            raise JobBuildError("--site-resources applies to one job (--client/--server), not to --presets")
        if args.presets:
            return _run_presets(args.check, args.output_dir or JOBS_DIR)
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(JobSpec) if f.name != "name"}
        if args.snp_table is not None:
            values["model_args"] = model_size_from_data(args.snp_table, values)
        spec = spec_from_values(args.name or f"{args.client}_{args.server}", values)
        print(f"exported {export_job(spec, args.output_dir or Path(DEFAULT_OUTPUT_DIR), args.site_resources)}")
        for note in advisories(spec):
            print(f"note: {note}", file=sys.stderr)
    except (JobBuildError, ValueError) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


def snp_count(path: Path) -> int:
    """The SNPs of a SNP table (CSV, ``data_prep.genotypes.harmonise.read_snp_table``) or of a harmonised ``.npz``
    (its ``snps``: the table it was harmonised against)."""
    import numpy as np

    from data_prep.errors import DataPrepError
    from data_prep.genotypes.harmonise import read_snp_table

    try:
        if path.suffix != ".npz":
            return len(read_snp_table(path).snps)
        with np.load(path, allow_pickle=False) as stored:
            snps = stored["snps"] if "snps" in stored.files else None
    except (OSError, ValueError, DataPrepError) as exc:
        raise JobBuildError(f"--snp-table {path}: {exc}") from None
    if snps is None:
        raise JobBuildError(f"--snp-table {path}: not a harmonised .npz (no 'snps'); give the SNP table")
    return len(snps)


def model_size_from_data(table: Path, values: dict) -> dict:
    """``model_args`` with ``n_snps`` from ``table`` (`snp_count`) and ``num_classes`` from ``data_args`` classes;
    one line when ``--model-args`` says otherwise (both numbers, and the fix)."""
    if not values.get("model"):
        raise JobBuildError(
            "--snp-table sets a genomics model's n_snps: it needs --model (genomics.model:SnpClassifier)"
        )
    model_args = dict(values.get("model_args") or {})
    classes = (values.get("data_args") or {}).get("classes")
    snps = snp_count(table)
    found = {"n_snps": (snps, f"{table} holds {snps} SNPs")}
    if isinstance(classes, list):
        found["num_classes"] = (len(classes), f"--data-args classes names {len(classes)} classes")
    for setting, (number, source) in found.items():
        given = model_args.get(setting)
        if given is not None and given != number:
            raise JobBuildError(
                f"--model-args {setting}={given}, but {source}; drop {setting} from --model-args (--snp-table sets "
                "it from the data) or give the table the sites harmonised against"
            )
        model_args[setting] = number
    return model_args


def _run_presets(check: bool, output_dir: Path) -> int:
    if check:
        differences = check_presets(output_dir)
        for line in differences:
            print(line)
        return 1 if differences else 0
    for spec in PRESETS.values():
        print(f"exported {export_job(spec, output_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
