"""Federated QC before training, as an NVFlare job: the consortium's first step.

1. The server asks every site for its per-SNP genotype counts (``qc.genotype_counts``: people with 0/1/2 alt copies
   and missing, per table SNP; aggregates only, no person-level data) and the SNP IDs they refer to.
2. It checks that every site harmonised against the same table, sums the counts into global call rates and allele
   frequencies (:func:`combine_counts`), applies the MAF / call-rate thresholds once (``qc.qc_filter``) and writes
   ``qc_report.json`` into its run folder.
3. It sends the same keep-mask to every site; each site writes the filtered SNP table (its copy of the consortium's
   table, only the kept SNPs) to ``<site workspace>/local/fedalg_qc_snp_table.csv`` (``--out`` elsewhere). Training
   jobs then use that table (``snp_table`` / ``$FEDALG_SNP_TABLE``), so the filter is identical at every site.

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
from data_prep.genotypes.qc import QcThresholds, genotype_counts, qc_filter, summary

__all__ = ["QC_TABLE", "GenotypeQcController", "combine_counts", "export_qc_job", "qc_report", "site_main"]

QC_TABLE = Path("local") / "fedalg_qc_snp_table.csv"
REPORT_FILE = "qc_report.json"
COUNTS, FILTER = "qc_counts", "qc_filter"
SITE_SCRIPT = "qc_site.py"  # beside this module; the job ships it as its client script


def combine_counts(sites: Mapping[str, tuple[Sequence[str], np.ndarray]]) -> tuple[tuple[str, ...], np.ndarray]:
    """The table SNPs and the summed (S, 4) counts of every site; refuses, by site, SNP lists that differ."""
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
        total += counts.astype(np.int64)
    return snps, total


def qc_report(
    snps: Sequence[str], counts: np.ndarray, keep: np.ndarray, thresholds: QcThresholds, sites: Sequence[str]
):
    """What the server writes: thresholds, sites, kept SNPs and the global summaries (before the filter)."""
    return {
        "sites": sorted(sites),
        "thresholds": {"min_call_rate": thresholds.min_call_rate, "min_maf": thresholds.min_maf},
        "people": int(counts[0].sum()) if len(counts) else 0,
        "table_snps": len(snps),
        "kept_snps": int(keep.sum()),
        "global_qc": summary(counts),
        "kept": [snp for snp, k in zip(snps, keep, strict=True) if k],
    }


# ---- NVFlare glue ----------------------------------------------------------------------------------------------------


class GenotypeQcController(ModelController):
    """Two broadcasts: collect the sites' counts, send back the global keep-mask (module docstring)."""

    def __init__(self, min_call_rate: float = 0.95, min_maf: float = 0.01) -> None:
        super().__init__(persistor_id="")
        self.thresholds = QcThresholds(min_call_rate, min_maf)  # refused here, at export time, if out of range
        self.min_call_rate, self.min_maf = min_call_rate, min_maf

    def run(self) -> None:
        results = self.send_model_and_wait(COUNTS, FLModel(params={"none": np.zeros(1)}, meta={"step": COUNTS}))
        sites = {r.meta["client_name"]: (r.meta["snps"], r.params["counts"]) for r in results}
        snps, counts = combine_counts(sites)
        keep = qc_filter(counts, self.thresholds)
        path = Path(self.get_run_dir()) / REPORT_FILE
        path.write_text(json.dumps(qc_report(snps, counts, keep, self.thresholds, list(sites)), indent=2) + "\n")
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
    args = parser.parse_args(argv)
    flare.init()
    site = flare.get_site_name()
    data_file = resolve(None, GENOTYPES_ENV, site, os.environ)
    table_path = resolve(None, SNP_TABLE_ENV, site, os.environ)
    if not data_file or not table_path:
        raise DataPrepError(f"{site}: federated QC needs {GENOTYPES_ENV} and {SNP_TABLE_ENV} set at the site")
    genotypes, _, snps, _ = load_harmonised(data_file, table_path)
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        if received.meta.get("step") == COUNTS:
            counts = genotype_counts(genotypes)
            flare.send(FLModel(params={"counts": counts}, meta={"snps": list(snps)}))
            print(f"{site}: sent genotype counts of {len(snps)} SNPs ({len(genotypes)} people)", flush=True)
        else:
            keep = np.asarray(received.params["keep"], dtype=bool)
            if tuple(received.meta["snps"]) != tuple(snps):
                raise DataPrepError(f"{site}: the QC filter is for other SNPs than this site's table")
            out = Path(args.out) if args.out else site_workspace() / QC_TABLE
            out.parent.mkdir(parents=True, exist_ok=True)
            read_snp_table(table_path).write(out, keep)
            flare.send(FLModel(params={"none": np.zeros(1)}, meta={"kept": int(keep.sum())}))
            print(f"{site}: kept {int(keep.sum())} of {len(snps)} SNPs; filtered table {out}", flush=True)


def export_qc_job(output_dir: Path, thresholds: QcThresholds, num_sites: int = 3, name: str = "genotype_qc") -> Path:
    """Export the QC job folder ``output_dir/name`` (NVFlare's job API; the bundle is installed at the sites)."""
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    from jobs.assembly import APP_PACKAGES, inside_directory

    output_dir = Path(output_dir).resolve()
    job = FedJob(name=name, min_clients=num_sites)
    job.set_app_packages(list(APP_PACKAGES))
    job.to_server(GenotypeQcController(thresholds.min_call_rate, thresholds.min_maf))
    # NVFlare writes the script path as given into the job config: relative, so it resolves inside custom/.
    with inside_directory(Path(__file__).parent):
        job.to_clients(ScriptRunner(script=SITE_SCRIPT, framework=FrameworkType.NUMPY))
        job.export_job(str(output_dir))
    return output_dir / name
