"""Federated QC before training, as an NVFlare job: the consortium's first step.

1. The server asks every site for its per-SNP genotype counts (``qc.genotype_counts``: people with 0/1/2 alt copies
   and missing, per table SNP) and the SNP IDs they refer to. A site with fewer people than the job's
   ``min_site_people`` (``--min-site-people``, default ``qc.MIN_SITE_PEOPLE``) refuses before sending anything.
2. It checks that every site harmonised against the same table and is large enough (the person count the counts
   imply; a second line of defence behind the site's own check), sums the counts (:func:`combine_counts`) and from
   then on uses only the sum (:func:`global_qc`): global call rates and allele frequencies, the MAF / call-rate
   thresholds applied once (``qc.qc_filter``), ``qc_report.json`` in its run folder.
3. It sends the same keep-mask to every site; each site writes the filtered SNP table (its copy of the consortium's
   table, only the kept SNPs) to ``<site workspace>/local/fedalg_qc_snp_table.csv`` (``--out`` elsewhere). Training
   jobs then use that table (``snp_table`` / ``$FEDALG_SNP_TABLE``), so the filter is identical at every site.

What leaves a site: per-SNP genotype counts are summary statistics, not anonymous aggregates. Whoever sees one
site's counts (the server, and anyone with access to its memory or logs) can test whether a given person is in that
site (a Homer-style membership test; ``benchmarks/homer.py``), and a one-person site's counts are that person's
genotypes. The QC itself needs only the sum over sites. With the plain NVFlare job exported here the server does see
each site's counts; keeping them from it needs secure aggregation of the sum (e.g. homomorphic encryption), which
would replace :func:`combine_counts`, the one place per-site counts are read; everything after it takes the sum.

The site's data comes from the same settings as training: ``$FEDALG_SITE_GENOTYPES`` (a genotype file or harmonised
``.npz``, ``{site}`` replaced by the site's name) and ``$FEDALG_SNP_TABLE``.
``python -m data_prep.genotypes qc-job --output-dir DIR`` exports the job; ``nvflare simulator DIR/genotype_qc``
runs it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.model_controller import ModelController

from data_prep.errors import DataPrepError
from data_prep.genotypes.qc import (
    MIN_SITE_PEOPLE,
    QcThresholds,
    check_min_site_people,
    check_site_size,
    genotype_counts,
    implied_people,
    qc_filter,
    summary,
)

__all__ = [
    "CLEAR_COUNTS_WARNING",
    "QC_TABLE",
    "GenotypeQcController",
    "combine_counts",
    "export_qc_job",
    "global_qc",
    "qc_report",
    "site_main",
]

QC_TABLE = Path("local") / "fedalg_qc_snp_table.csv"
REPORT_FILE = "qc_report.json"
COUNTS, FILTER = "qc_counts", "qc_filter"
SITE_SCRIPT = "qc_site.py"  # beside this module; the job ships it as its client script
CLEAR_COUNTS_WARNING = (
    "federated QC: each site's per-SNP genotype counts are visible to the server unless the deployment uses secure "
    "aggregation; they reveal whether a given person is in a site (Homer-style test), and only their sum is used"
)


def combine_counts(
    sites: Mapping[str, tuple[Sequence[str], np.ndarray]], min_site_people: int = 1
) -> tuple[tuple[str, ...], np.ndarray]:
    """The table SNPs and the summed (S, 4) counts of every site. The only place the server reads one site's
    counts: it refuses, by site, SNP lists that differ, malformed counts and sites below ``min_site_people`` (the
    site refuses first; this is defence in depth against a site that skipped or changed its check)."""
    if not sites:
        raise DataPrepError("federated QC: no site sent its counts")
    names = sorted(sites)
    snps = tuple(sites[names[0]][0])
    total = np.zeros((len(snps), 4), np.int64)
    for site in names:
        site_snps, counts = tuple(sites[site][0]), np.asarray(sites[site][1])
        if site_snps != snps:
            raise DataPrepError(
                f"federated QC: {site} harmonised against other SNPs than {names[0]} ({len(site_snps)} vs "
                f"{len(snps)}); every site must use the consortium's table"
            )
        if counts.shape != total.shape or (counts < 0).any():
            raise DataPrepError(f"federated QC: {site} sent counts of shape {counts.shape}, expected {total.shape}")
        try:
            people = implied_people(counts)
        except DataPrepError as exc:
            raise DataPrepError(f"federated QC: {site} sent malformed counts: {exc}") from None
        check_site_size(site, people, min_site_people, "the server refuses its counts and writes nothing")
        total += counts.astype(np.int64)
    return snps, total


def global_qc(
    snps: Sequence[str],
    total: np.ndarray,
    thresholds: QcThresholds,
    sites: Sequence[str],
    min_site_people: int | None = None,
) -> tuple[np.ndarray, dict[str, object]]:
    """The keep-mask and the report, from the SUM of the sites' counts only: nothing here needs one site's counts,
    so a secure-aggregation sum (decrypted only as the total) can feed it unchanged."""
    keep = qc_filter(total, thresholds)
    return keep, qc_report(snps, total, keep, thresholds, sites, min_site_people)


def qc_report(
    snps: Sequence[str],
    counts: np.ndarray,
    keep: np.ndarray,
    thresholds: QcThresholds,
    sites: Sequence[str],
    min_site_people: int | None = None,
):
    """What the server writes: thresholds, sites, kept SNPs and the global summaries (before the filter), all from
    the summed ``counts``; no per-site figure."""
    settings: dict[str, object] = {"min_call_rate": thresholds.min_call_rate, "min_maf": thresholds.min_maf}
    if min_site_people is not None:
        settings["min_site_people"] = min_site_people
    return {
        "sites": sorted(sites),
        "thresholds": settings,
        "people": int(counts[0].sum()) if len(counts) else 0,
        "table_snps": len(snps),
        "kept_snps": int(keep.sum()),
        "global_qc": summary(counts),
        "kept": [snp for snp, k in zip(snps, keep, strict=True) if k],
    }


# ---- NVFlare glue ----------------------------------------------------------------------------------------------------


class GenotypeQcController(ModelController):
    """Two broadcasts: collect the sites' counts, send back the global keep-mask (module docstring)."""

    def __init__(self, min_call_rate: float = 0.95, min_maf: float = 0.01, min_site_people: int = MIN_SITE_PEOPLE):
        # Strict: a site that fails or refuses (too few people) ends the job; a QC over the other sites only would not
        # be the consortium's filter.
        super().__init__(persistor_id="", ignore_result_error=False)
        self.thresholds = QcThresholds(min_call_rate, min_maf)  # refused here, at export time, if out of range
        self.min_call_rate, self.min_maf = min_call_rate, min_maf
        self.min_site_people = check_min_site_people(min_site_people)

    def run(self) -> None:
        self.warning(CLEAR_COUNTS_WARNING)
        results = self.send_model_and_wait(COUNTS, FLModel(params={"none": np.zeros(1)}, meta={"step": COUNTS}))
        if self.abort_signal.triggered:  # a site failed or refused (its reason is logged): no sum over the others
            return
        sites = {r.meta["client_name"]: (r.meta["snps"], r.params["counts"]) for r in results}
        # Secure aggregation plugs in here: an HE sum of the sites' encrypted counts, decrypted as the total only,
        # replaces combine_counts; the size check then rests on each site's own refusal (site_main).
        snps, total = combine_counts(sites, self.min_site_people)
        keep, report = global_qc(snps, total, self.thresholds, list(sites), self.min_site_people)
        path = Path(self.get_run_dir()) / REPORT_FILE
        path.write_text(json.dumps(report, indent=2) + "\n")
        self.info(f"federated QC: kept {int(keep.sum())} of {len(snps)} SNPs over {len(sites)} sites; {path}")
        message = FLModel(params={"keep": keep.astype(np.int8)}, meta={"step": FILTER, "snps": list(snps)})
        self.send_model_and_wait(FILTER, message)


def site_main(argv: Sequence[str] | None = None) -> None:
    """The site's side (run by the job's client script): counts, then the filtered table."""
    import nvflare.client as flare

    from data_prep.genotypes.harmonise import read_snp_table
    from data_prep.genotypes.site import GENOTYPES_ENV, SNP_TABLE_ENV, load_harmonised, resolve
    from data_prep.site_config import site_workspace

    parser = argparse.ArgumentParser(description="federated QC, site side")
    parser.add_argument("--out", default=None, help=f"filtered table to write (default <site workspace>/{QC_TABLE})")
    parser.add_argument(
        "--min-site-people", type=int, default=MIN_SITE_PEOPLE, help="refuse to send counts of fewer people"
    )
    args = parser.parse_args(argv)
    flare.init()
    site = flare.get_site_name()
    data_file = resolve(None, GENOTYPES_ENV, site, os.environ)
    table_path = resolve(None, SNP_TABLE_ENV, site, os.environ)
    if not data_file or not table_path:
        raise DataPrepError(f"{site}: federated QC needs {GENOTYPES_ENV} and {SNP_TABLE_ENV} set at the site")
    genotypes, _, snps, _ = load_harmonised(data_file, table_path)
    # Before the first message: a site too small for the consortium's minimum answers nothing at all.
    check_site_size(site, len(genotypes), args.min_site_people, "refused at the site, nothing sent or written")
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        if received.meta.get("step") == COUNTS:
            counts = genotype_counts(genotypes)
            flare.send(FLModel(params={"counts": counts}, meta={"snps": list(snps)}))
            print(
                f"{site}: sent genotype counts of {len(snps)} SNPs ({len(genotypes)} people) to the server, which sees "
                "them unless the deployment uses secure aggregation",
                flush=True,
            )
        else:
            keep = np.asarray(received.params["keep"], dtype=bool)
            if tuple(received.meta["snps"]) != tuple(snps):
                raise DataPrepError(f"{site}: the QC filter is for other SNPs than this site's table")
            out = Path(args.out) if args.out else site_workspace() / QC_TABLE
            out.parent.mkdir(parents=True, exist_ok=True)
            read_snp_table(table_path).write(out, keep)
            flare.send(FLModel(params={"none": np.zeros(1)}, meta={"kept": int(keep.sum())}))
            print(f"{site}: kept {int(keep.sum())} of {len(snps)} SNPs; filtered table {out}", flush=True)


def export_qc_job(
    output_dir: Path,
    thresholds: QcThresholds,
    num_sites: int = 3,
    name: str = "genotype_qc",
    min_site_people: int = MIN_SITE_PEOPLE,
) -> Path:
    """Export the QC job folder ``output_dir/name`` (NVFlare's job API; the bundle is installed at the sites).
    ``min_site_people`` goes to both sides: the server's workflow and every site's script arguments, so a site's
    admin sees the minimum in the job it is asked to run."""
    min_site_people = check_min_site_people(min_site_people)
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    from jobs.assembly import APP_PACKAGES, inside_directory

    output_dir = Path(output_dir).resolve()
    job = FedJob(name=name, min_clients=num_sites)
    job.set_app_packages(list(APP_PACKAGES))
    job.to_server(GenotypeQcController(thresholds.min_call_rate, thresholds.min_maf, min_site_people))
    # NVFlare writes the script path as given into the job config: relative, so it resolves inside custom/.
    with inside_directory(Path(__file__).parent):
        script_args = f"--min-site-people {min_site_people}"
        job.to_clients(ScriptRunner(script=SITE_SCRIPT, script_args=script_args, framework=FrameworkType.NUMPY))
        job.export_job(str(output_dir))
    return output_dir / name
