"""``python -m data_prep.genotypes harmonise``: a site's VCF/BCF/PLINK file -> the consortium's matrix (``.npz``) and a
JSON report; ``python -m data_prep.genotypes qc-job``: export the federated QC job (``federated_qc``; its
``--min-site-people`` is the smallest site allowed to send its counts, ``--secure-aggregation he`` keeps every site's
counts and their sum from the server);
``python -m data_prep.genotypes simulate-sites``: a simulated consortium as per-site genotype files (``simulate``).

``OUT.npz`` holds ``genotypes`` (int8, people x table SNPs, copies of the table's alt allele, 3 = missing or
unusable), ``samples`` (file order), ``snps`` (table order), ``status`` (each SNP's alignment) and, with ``--labels``,
``labels`` (each person's label from a ``sample,<label column>`` CSV). It is written uncompressed, so the training
loader memory-maps the matrix instead of reading it (``data_prep.genotypes.loader``).

The report counts the SNPs per alignment status and names the dropped ones (``dropped``); counts the calls set missing
per reason and those the X and dosage rules changed (``calls``); gives each person's call rate, naming everyone below
``--min-person-call-rate`` (``person_call_rate``); lists the ID disagreements at matched positions (``ids``); the
genome build the header declares (``genome_build``); the people per sex (PLINK); the settings; and summarises call
rate, MAF and Hardy-Weinberg over the usable SNPs (``data_prep.genotypes.harmonise`` and ``formats`` say what each
rule does; docs/genomics.md has the table). Bad input stops the command with one line (file, line or record, what is
wrong) and writes nothing.

Importing this module does not import torch: harmonising is data preparation, at a site that may not train here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes.formats import BUILDS, HARD_CALL_THRESHOLD
from data_prep.genotypes.harmonise import (
    MAX_ID_DISAGREEMENT,
    MIN_PERSON_CALL_RATE,
    USABLE,
    Harmonised,
    HarmoniseSettings,
    harmonise_file,
    read_snp_table,
)
from data_prep.genotypes.qc import MIN_SITE_PEOPLE, genotype_counts, summary
from data_prep.genotypes.simulate import SITE_FORMATS
from data_prep.genotypes.site import read_labels

__all__ = ["build_parser", "main", "report", "write_npz"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep.genotypes", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    harmonise = commands.add_parser("harmonise", help="harmonise a genotype file against the consortium's SNP table")
    harmonise.add_argument("--genotypes", required=True, help=".vcf(.gz), .bcf, PLINK 1 .bed, PLINK 2 .pgen or .bgen")
    harmonise.add_argument("--snp-table", required=True, help="CSV snp,chrom,pos,ref,alt (or snp,ref,alt)")
    harmonise.add_argument("--out", required=True, type=Path, help="the .npz to write")
    harmonise.add_argument("--report", type=Path, default=None, help="the JSON report to write")
    harmonise.add_argument("--labels", default=None, help="CSV with a 'sample' column and the label column")
    harmonise.add_argument("--label-column", default="population")
    harmonise.add_argument(
        "--hard-call-threshold",
        type=float,
        default=HARD_CALL_THRESHOLD,
        help="a dosage (VCF DS, PLINK 2 dosages) within this distance of 0, 1 or 2 is that call, else missing",
    )
    harmonise.add_argument(
        "--max-id-disagreement",
        type=float,
        default=MAX_ID_DISAGREEMENT,
        help="refuse the file when a larger share of the table SNPs found by position carry another rsID (another "
        "genome build)",
    )
    harmonise.add_argument(
        "--genome-build",
        choices=BUILDS,
        default=None,
        help="the table's build: a file whose header declares another is refused",
    )
    harmonise.add_argument(
        "--min-person-call-rate",
        type=float,
        default=MIN_PERSON_CALL_RATE,
        help="the report names every person called at fewer of the usable SNPs (nobody is dropped)",
    )
    qc_job = commands.add_parser("qc-job", help="export the federated QC job (data_prep.genotypes.federated_qc)")
    qc_job.add_argument("--output-dir", required=True, type=Path)
    qc_job.add_argument("--name", default="genotype_qc")
    qc_job.add_argument("--num-sites", type=int, default=3, help="sites the server waits for")
    qc_job.add_argument("--min-call-rate", type=float, default=0.95)
    qc_job.add_argument("--min-maf", type=float, default=0.01)
    qc_job.add_argument(
        "--min-site-people",
        type=int,
        default=MIN_SITE_PEOPLE,
        help="smallest site allowed to send its counts (a site below refuses; so does the server); docs/genomics.md",
    )
    qc_job.add_argument(
        "--secure-aggregation",
        choices=("none", "he", "secagg"),
        default="none",
        help="he: the sites encrypt their counts (TenSEAL CKKS contexts from NVFlare's HEBuilder), the server only "
        "adds ciphertexts, every site decrypts the sum and filters; needs a provisioned deployment; secagg: the sites "
        "mask their counts (SecAgg+, 3 sites or more), the server unmasks only their sum; docs/genomics.md",
    )
    qc_job.add_argument(
        "--dp-target-epsilon",
        type=float,
        default=None,
        help="add discrete Gaussian noise to every site's counts before they leave it, accounted in the site's privacy "
        "ledger; this is the epsilon a site may spend on them (per person, add/remove); docs/genomics.md",
    )
    qc_job.add_argument(
        "--dp-noise-multiplier",
        type=float,
        default=None,
        help="noise sigma per count over sqrt(SNPs) (the L2 sensitivity); default: calibrated to --dp-target-epsilon",
    )
    qc_job.add_argument("--dp-delta", type=float, default=None, help="delta of the accounting (default 1e-5)")
    simulate = commands.add_parser("simulate-sites", help="an msprime cohort as per-site genotype files (simulate)")
    simulate.add_argument("--out", required=True, type=Path, help="the folder to write into")
    simulate.add_argument("--snps", type=int, default=10_000)
    simulate.add_argument("--people-per-population", type=int, default=250, help="people of each of 4 populations")
    simulate.add_argument("--sites", type=int, default=3)
    simulate.add_argument("--split", default="iid", help="data_prep.partition scheme: iid, dirichlet, population ...")
    simulate.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration (--split dirichlet)")
    simulate.add_argument(
        "--format",
        default="vcf.gz",
        help=f"the sites' file format, one of {', '.join(SITE_FORMATS)}, or a comma-separated list, one per site in "
        "order (repeated for more sites): vcf.gz,bcf,vcf,bed,pgen gives each site its own format",
    )
    simulate.add_argument("--regions", type=int, default=40, help="independent simulated regions")
    simulate.add_argument("--region-length", type=int, default=250_000, help="bases per region")
    simulate.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "qc-job":
        return _qc_job(args)
    if args.command == "simulate-sites":
        return _simulate_sites(args)
    try:
        settings = HarmoniseSettings(
            args.hard_call_threshold, args.max_id_disagreement, args.genome_build, args.min_person_call_rate
        )
        result = harmonise_file(args.genotypes, read_snp_table(args.snp_table), settings)
        labels = read_labels(args.labels, args.label_column, result.samples) if args.labels else None
        counts = report(result)
        write_npz(args.out, result, labels)
        if args.report:
            _write_atomic(args.report, json.dumps(counts, indent=2) + "\n")
    except DataPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    usable = sum(counts["alignment"][s] for s in USABLE)
    print(f"wrote {args.out}: {len(result.samples)} people x {len(result.snps)} table SNPs ({usable} usable)")
    return 0


def _qc_job(args: argparse.Namespace) -> int:
    from data_prep.genotypes.federated_qc import export_qc_job
    from data_prep.genotypes.qc import QcThresholds
    from data_prep.genotypes.qc_noise import QcNoise

    try:
        thresholds = QcThresholds(args.min_call_rate, args.min_maf)
        noise = QcNoise.from_options(args.dp_noise_multiplier, args.dp_target_epsilon, args.dp_delta)
        job = export_qc_job(
            args.output_dir, thresholds, args.num_sites, args.name, args.min_site_people, args.secure_aggregation, noise
        )
    except DataPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.secure_aggregation == "he":  # the simulator has no startup kits, hence no TenSEAL contexts
        print(f"wrote {job}: submit it to a deployment provisioned with NVFlare's HEBuilder (docs/genomics.md)")
    else:
        print(f"wrote {job}: run it with nvflare simulator {job} -w <workspace> -n {args.num_sites}")
    return 0


def _simulate_sites(args: argparse.Namespace) -> int:
    from data_prep.genotypes.simulate import simulate_sites

    try:
        written = simulate_sites(
            args.out, args.snps, args.people_per_population, args.sites, args.split, args.alpha, args.format,
            args.seed, args.regions, args.region_length,
        )  # fmt: skip
    except DataPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files into {args.out}: " + ", ".join(p.name for p in written))
    return 0


def report(result: Harmonised) -> dict[str, object]:
    """The harmonise report: SNPs per alignment status, what was done to calls, the rsID and build checks, the
    settings, and QC summaries over the usable SNPs."""
    usable = np.isin(np.array(result.status), USABLE)
    return {
        "file": result.path,
        "people": len(result.samples),
        "table_snps": len(result.snps),
        "usable_snps": int(usable.sum()),
        "alignment": result.counts(),
        **result.checks(),
        "qc": summary(genotype_counts(result.genotypes), usable),
    }


def write_npz(path: Path, result: Harmonised, labels: np.ndarray | None = None) -> Path:
    """Uncompressed ``.npz`` (memory-mappable), written to a temporary name and renamed (never half written)."""
    arrays = {
        "genotypes": np.ascontiguousarray(result.genotypes, dtype=np.int8),
        "samples": np.array(result.samples),
        "snps": np.array(result.snps),
        "status": np.array(result.status),
    }
    if labels is not None:
        arrays["labels"] = np.asarray(labels)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp.npz")
    np.savez(partial, **arrays)
    os.replace(partial, path)
    return path


def _write_atomic(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    os.replace(partial, path)
