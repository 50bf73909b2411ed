"""Federated QC before training, as an NVFlare job: the consortium's first step.

1. The server asks every site for its per-SNP genotype counts (``qc.genotype_counts``: people with 0/1/2 alt copies
   and missing, per table SNP) and the SNP IDs they refer to. A site with fewer people than the job's
   ``min_site_people`` (``--min-site-people``, default ``qc.MIN_SITE_PEOPLE``) refuses before sending anything.
2. It checks that every site harmonised against the same table and is large enough (the person count the counts
   imply; a second line of defence behind the site's own check), sums the counts (`combine_counts`) and from
   then on uses only the sum (`global_qc`): global call rates and allele frequencies, the MAF / call-rate
   thresholds applied once (``qc.qc_filter``), ``qc_report.json`` in its run folder.
3. It sends the same keep-mask to every site; each site writes the filtered SNP table (its copy of the consortium's
   table, only the kept SNPs) to ``<site workspace>/local/fedalg_qc_snp_table.csv`` (``--out`` elsewhere). Training
   jobs then use that table (``snp_table`` / ``$FEDALG_SNP_TABLE``), so the filter is identical at every site.

What leaves a site: per-SNP genotype counts are summary statistics, not anonymous aggregates. Whoever sees one
site's counts (the server, and anyone with access to its memory or logs) can test whether a given person is in that
site (a Homer-style membership test; ``benchmarks/homer.py``), and a one-person site's counts are that person's
genotypes. The QC itself needs only the sum over sites. With the default job (``secure_aggregation="none"``) the
server does see each site's counts.

With ``secure_aggregation="he"`` (``qc-job --secure-aggregation he``; a deployment provisioned with NVFlare's
``HEBuilder``) each site encrypts its counts with its TenSEAL CKKS context, the server only adds the ciphertexts
(``secure_qc.add_encrypted_counts``; its context has no secret key) and sends the encrypted sum back, and every site
decrypts it, rounds it, and runs `global_qc` itself with the thresholds from its own script arguments: the same
ciphertext, the same key and a deterministic filter give every site the same keep-mask. ``qc_report.json`` is then
written at each site, beside its filtered table; the server's names the sites and the settings only. The server can
no longer count a site's people, so the site's own ``min_site_people`` refusal is the only size check. Every site
holds the secret key and sees the sum, so the job needs `HE_MIN_SITES` sites (with two, the sum less a site's
own counts is the other site's counts).

With ``secure_aggregation="secagg"`` (SecAgg+, ``data_prep/genotypes/secagg_qc.py``) the sites mask their exact counts
and the server unmasks only their sum, which it filters as in the clear; it sees no site's counts (the same minimum
of sites and the same reliance on the site's own size check as ``he``).

The site's data comes from the same settings as training: ``$FEDALG_SITE_GENOTYPES`` (a genotype file or harmonised
``.npz``, ``{site}`` replaced by the site's name) and ``$FEDALG_SNP_TABLE``, or ``"genotypes"`` and ``"snp_table"`` in
the kit's ``local/fedalg_site_data.json`` (``data_prep.genotypes.site_files``).
``python -m data_prep.genotypes qc-job --output-dir DIR`` exports the job; ``nvflare simulator DIR/genotype_qc``
runs it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.workflows.model_controller import ModelController

from aggregators.contracts.egress import Release
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
from data_prep.genotypes.qc_noise import QcNoise, usable_counts

if TYPE_CHECKING:  # TenSEAL is the optional 'he' extra: imported only where a job uses it
    import tenseal as ts

__all__ = [
    "CLEAR_COUNTS_WARNING",
    "HE_COUNTS_NOTE",
    "HE_MIN_SITES",
    "MIN_KEPT_WITH_SITE",
    "MIN_SITE_CALL_RATE",
    "QC_TABLE",
    "SECURE_AGGREGATION",
    "GenotypeQcController",
    "check_no_site_empties_the_table",
    "check_site_calls",
    "combine_counts",
    "export_qc_job",
    "global_qc",
    "he_server_report",
    "qc_releases",
    "qc_report",
    "site_main",
]

QC_TABLE = Path("local") / "fedalg_qc_snp_table.csv"
REPORT_FILE = "qc_report.json"
COUNTS, FILTER = "qc_counts", "qc_filter"
SITE_SCRIPT = "qc_site.py"  # beside this module; the job ships it as its client script
#: The noisy job's client script (folder, file): in the site runtime's package, which holds the privacy ledger.
NOISE_SITE_SCRIPT = (Path(__file__).resolve().parents[2] / "lightning_modules" / "privacy", "qc_noise_site.py")
CLEAR_COUNTS_WARNING = (
    "federated QC: each site's per-SNP genotype counts are visible to the server unless the deployment uses secure "
    "aggregation; they reveal whether a given person is in a site (Homer-style test), and only their sum is used"
)
HE_COUNTS_NOTE = (
    "federated QC with secure_aggregation 'he': the server adds the sites' encrypted counts and sees neither a site's "
    "counts nor their sum (its TenSEAL context holds no secret key); it cannot count a site's people either, so each "
    "site's own min_site_people refusal is the only size check"
)
#: ``--secure-aggregation`` values: ``none`` (the server sums counts in the clear), ``he`` or ``secagg`` (SecAgg+'s
#: masked sum, data_prep/genotypes/secagg_qc.py; module docstring).
SECURE_AGGREGATION = ("none", "he", "secagg")
#: Fewest sites an HE QC job runs with: every site decrypts the sum, and the sum of two sites less one's own counts
#: is the other site's counts exactly.
HE_MIN_SITES = 3
ENCRYPTED_COUNTS, ENCRYPTED_SUM = "counts_he", "sum_he"
SECAGG_COUNTS_NOTE = (
    "federated QC with secure_aggregation 'secagg': the server adds the sites' masked counts and unmasks only their "
    "sum (SecAgg+); it sees no site's counts and cannot count a site's people, so each site's own min_site_people "
    "refusal is the only size check"
)


def check_secure_aggregation(value: object) -> str:
    """The job's ``secure_aggregation`` setting, refused unless it is one of `SECURE_AGGREGATION`."""
    if value not in SECURE_AGGREGATION:
        raise DataPrepError(f"QC: secure_aggregation must be one of {', '.join(SECURE_AGGREGATION)}, got {value!r}")
    return str(value)


def check_he_sites(sites: int, what: str) -> None:
    """Refuse an HE QC over fewer than `HE_MIN_SITES` sites (``what``: where the number comes from)."""
    if sites < HE_MIN_SITES:
        raise DataPrepError(
            f"federated QC: secure_aggregation 'he' with {sites} site{'s' if sites != 1 else ''} ({what}): every site "
            "decrypts the sum, and the sum less its own counts is the other sites' pooled counts, one site's counts "
            f"when there are two; allowed: {HE_MIN_SITES} sites or more"
        )


def to_wire(blob: bytes) -> np.ndarray:
    """Serialised ciphertexts as a uint8 array: the job exchanges numpy parameters (FrameworkType.NUMPY)."""
    return np.frombuffer(blob, dtype=np.uint8)


def from_wire(array: object) -> bytes:
    return np.asarray(array, dtype=np.uint8).tobytes()


def combine_counts(
    sites: Mapping[str, tuple[Sequence[str], np.ndarray]], min_site_people: int = 1, noisy: bool = False
) -> tuple[tuple[str, ...], np.ndarray]:
    """The table SNPs and the summed (S, 4) counts of every site. The only place the server reads one site's
    counts: it refuses, by site, SNP lists that differ, malformed counts and sites below ``min_site_people`` (the
    site refuses first; this is defence in depth against a site that skipped or changed its check). ``noisy``
    counts (``qc_noise``) may be negative and imply no person count, so only their shape is checked."""
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
        if counts.shape != total.shape or ((counts < 0).any() and not noisy):
            raise DataPrepError(f"federated QC: {site} sent counts of shape {counts.shape}, expected {total.shape}")
        if noisy:
            total += counts.astype(np.int64)
            continue
        try:
            people = implied_people(counts)
        except DataPrepError as exc:
            raise DataPrepError(f"federated QC: {site} sent malformed counts: {exc}") from None
        check_site_size(site, people, min_site_people, "the server refuses its counts and writes nothing")
        total += counts.astype(np.int64)
    return snps, total


#: The server refuses the QC when one site's counts leave fewer than this share of the SNPs that the other sites'
#: sum keeps: a site whose file is missing or unusable would otherwise drop every SNP for every site, unnamed.
MIN_KEPT_WITH_SITE = 0.5
#: A site whose own call rate over the table's SNPs is below this refuses to send its counts (under HE the server
#: cannot see them, so the site is the one that can name itself).
MIN_SITE_CALL_RATE = 0.5


def _call_rate(counts: np.ndarray) -> float:
    """The share of called genotypes in (S, 4) counts (0/1/2 copies, missing)."""
    counts = np.asarray(counts, np.int64)
    return float(counts[:, :3].sum() / counts.sum()) if counts.sum() else 0.0


def check_site_calls(site: str, counts: np.ndarray) -> None:
    """At a site, before anything is sent: refuse when most of its genotype calls are missing (`MIN_SITE_CALL_RATE`),
    naming the site and the fix, rather than let its counts drop most SNPs of the consortium's table."""
    rate = _call_rate(counts)
    if rate < MIN_SITE_CALL_RATE:
        raise DataPrepError(
            f"federated QC: {site}: its call rate over the {len(counts)} table SNPs is {rate:.3f} (below "
            f"{MIN_SITE_CALL_RATE}): its genotype file's calls are missing or unusable, and its counts would drop "
            f"most SNPs for every site; harmonise its file again (the harmoniser names the cause) before the QC; "
            "nothing sent"
        )


def check_no_site_empties_the_table(
    sites: Mapping[str, tuple[Sequence[str], np.ndarray]], total: np.ndarray, thresholds: QcThresholds
) -> None:
    """At the server, with the sites' counts in the clear: refuse, naming the site, when one site's counts leave fewer
    than `MIN_KEPT_WITH_SITE` of the SNPs that the sum of the others keeps."""
    if len(sites) < 2:
        return
    kept = int(qc_filter(total, thresholds).sum())
    for site in sorted(sites):
        counts = np.asarray(sites[site][1], np.int64)
        without = int(qc_filter(total - counts, thresholds).sum())
        if without and kept < MIN_KEPT_WITH_SITE * without:
            others = _call_rate(total - counts)
            raise DataPrepError(
                f"federated QC: {site}'s counts would leave {kept} of the {len(total)} SNPs ({without} without "
                f"{site}); its call rate is {_call_rate(counts):.3f} (the other sites' {others:.3f}): its genotype "
                f"file's calls are missing or unusable; fix {site}'s genotype file (harmonising it names the cause) "
                "or run the QC without it; nothing written"
            )


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
    """What the server writes (under HE: each site): thresholds, sites, kept SNPs and the global summaries (before
    the filter), all from the summed ``counts``; no per-site figure."""
    return {
        "sites": sorted(sites),
        "thresholds": _settings(thresholds, min_site_people),
        "people": int(counts[0].sum()) if len(counts) else 0,
        "table_snps": len(snps),
        "kept_snps": int(keep.sum()),
        "global_qc": summary(counts),
        "kept": [snp for snp, k in zip(snps, keep, strict=True) if k],
    }


def he_server_report(
    snps: Sequence[str], thresholds: QcThresholds, sites: Sequence[str], min_site_people: int | None = None
) -> dict[str, object]:
    """What the server can report under HE: which sites took part and the job's settings; no figure of the data."""
    return {
        "secure_aggregation": "he",
        "sites": sorted(sites),
        "thresholds": _settings(thresholds, min_site_people),
        "table_snps": len(snps),
    }


def noise_report(noise: QcNoise | None) -> dict[str, object]:
    """The job's noise settings for a report (nothing without noise); never a site's draws."""
    if noise is None:
        return {}
    return {"noise": {"target_epsilon": noise.target_epsilon, "noise_multiplier": noise.noise_multiplier,
                      "delta": noise.delta, "mechanism": "discrete Gaussian per cell, added at each site"}}  # fmt: skip


def _settings(thresholds: QcThresholds, min_site_people: int | None) -> dict[str, object]:
    settings: dict[str, object] = {"min_call_rate": thresholds.min_call_rate, "min_maf": thresholds.min_maf}
    if min_site_people is not None:
        settings["min_site_people"] = min_site_people
    return settings


def encrypted_counts(result: FLModel) -> bytes:
    """A site's serialised ciphertext from its result; a site that sent clear counts to an HE job is named."""
    site = result.meta.get("client_name", "?")
    if ENCRYPTED_COUNTS not in (result.params or {}):
        raise DataPrepError(
            f"federated QC: {site} sent no encrypted counts, but the job uses secure_aggregation 'he' (its script "
            "must run with --secure-aggregation he)"
        )
    return from_wire(result.params[ENCRYPTED_COUNTS])


# ---- NVFlare glue ----------------------------------------------------------------------------------------------------


class GenotypeQcController(ModelController):
    """Two broadcasts: collect the sites' counts, send back the global keep-mask (module docstring)."""

    def __init__(
        self,
        min_call_rate: float = 0.95,
        min_maf: float = 0.01,
        min_site_people: int = MIN_SITE_PEOPLE,
        secure_aggregation: str = "none",
        dp_target_epsilon: float | None = None,
        dp_noise_multiplier: float | None = None,
        dp_delta: float | None = None,
    ):
        # Strict: a site that fails or refuses (too few people) ends the job; a QC over the other sites only would not
        # be the consortium's filter.
        super().__init__(persistor_id="", ignore_result_error=False)
        self.thresholds = QcThresholds(min_call_rate, min_maf)  # refused here, at export time, if out of range
        self.min_call_rate, self.min_maf = min_call_rate, min_maf
        self.min_site_people = check_min_site_people(min_site_people)
        self.secure_aggregation = check_secure_aggregation(secure_aggregation)
        self.noise = QcNoise.from_options(dp_noise_multiplier, dp_target_epsilon, dp_delta)  # refused here too
        # NVFlare's job API writes a component's constructor arguments from its attributes of the same names.
        self.dp_target_epsilon, self.dp_noise_multiplier = dp_target_epsilon, dp_noise_multiplier
        self.dp_delta = dp_delta

    def run(self) -> None:
        if self.secure_aggregation == "he":
            self._run_encrypted()
            return
        if self.secure_aggregation == "secagg":
            self._run_masked()
            return
        self.warning(CLEAR_COUNTS_WARNING)
        results = self.send_model_and_wait(COUNTS, FLModel(params={"none": np.zeros(1)}, meta={"step": COUNTS}))
        if self.abort_signal.triggered:  # a site failed or refused (its reason is logged): no sum over the others
            return
        sites = {r.meta["client_name"]: (r.meta["snps"], r.params["counts"]) for r in results}
        # The one place the server reads a site's counts; under HE (_run_encrypted) it adds ciphertexts instead.
        snps, total = combine_counts(sites, self.min_site_people, noisy=self.noise is not None)
        if self.noise is None:  # with noise each site checked its own call rate (check_site_calls) before sending
            check_no_site_empties_the_table(sites, total, self.thresholds)
        else:
            total = usable_counts(total)
        keep, report = global_qc(snps, total, self.thresholds, list(sites), self.min_site_people)
        report.update(noise_report(self.noise))
        path = Path(self.get_run_dir()) / REPORT_FILE
        path.write_text(json.dumps(report, indent=2) + "\n")
        self.info(f"federated QC: kept {int(keep.sum())} of {len(snps)} SNPs over {len(sites)} sites; {path}")
        message = FLModel(params={"keep": keep.astype(np.int8)}, meta={"step": FILTER, "snps": list(snps)})
        self.send_model_and_wait(FILTER, message)

    def _step(self, step: str, meta: dict[str, object]) -> dict[str, FLModel]:
        """One broadcast of the secure sum (``step`` names the task and the step); every site's answer, by site."""
        request = FLModel(params={"none": np.zeros(1)}, meta={"step": step, "secure_aggregation": "secagg", **meta})
        results = self.send_model_and_wait(step, request)
        return {} if self.abort_signal.triggered else {r.meta["client_name"]: r for r in results}

    def _run_masked(self) -> None:
        """The SecAgg+ variant (secagg_qc): the key steps, the masked counts, the unmask step; the server then holds
        the exact sum, never a site's counts, and filters it as in the clear."""
        from data_prep.genotypes import secagg_qc as sq

        self.info(SECAGG_COUNTS_NOTE)
        sites = tuple(sorted(c.name for c in self.engine.get_clients()))
        threshold = sq.check_secagg_sites(len(sites), "sites connected")
        keys = self._step(sq.KEYS_STEP, {"sites": list(sites), "threshold": threshold})
        if not keys:
            return
        public = {s: sq.read_public(r.params) for s, r in keys.items()}
        shares = self._step(sq.SHARES_STEP, {"public": sq.public_text(public)})
        if not shares:
            return
        sealed = {s: sq.read_answer(r.params["sealed"]) for s, r in shares.items()}
        masked = self._step(COUNTS, {"sealed": sealed})
        if not masked:
            return
        snp_lists = {tuple(r.meta["snps"]) for r in masked.values()}
        if len(snp_lists) != 1:
            raise DataPrepError("federated QC: the sites harmonised against different SNPs; every site must use "
                                "the consortium's table")  # fmt: skip
        (snps,) = snp_lists
        packed = {s: r.params[sq.MASKED_COUNTS] for s, r in masked.items()}
        returned = self._step(sq.UNMASK_STEP, {"summed": sorted(packed)})
        if not returned:
            return
        held = {
            h: {s: sq.from_text(v) for s, v in sq.read_answer(r.params["shares"]).items()} for h, r in returned.items()
        }
        mask_pks = {s: pk for s, (_, pk) in public.items()}
        noisy = self.noise is not None
        total = sq.unmask_counts(sites, packed, held, mask_pks, threshold, len(snps), noisy=noisy)
        keep, report = global_qc(snps, usable_counts(total) if noisy else total, self.thresholds, sites,
                                 self.min_site_people)  # fmt: skip
        report = {"secure_aggregation": "secagg", **report, **noise_report(self.noise)}
        path = Path(self.get_run_dir()) / REPORT_FILE
        path.write_text(json.dumps(report, indent=2) + "\n")
        self.info(f"federated QC: unmasked the sum of {len(sites)} sites; kept {int(keep.sum())} of {len(snps)} SNPs")
        message = FLModel(params={"keep": keep.astype(np.int8)}, meta={"step": FILTER, "snps": list(snps)})
        self.send_model_and_wait(FILTER, message)

    def _run_encrypted(self) -> None:
        """The HE variant: add the sites' ciphertexts, send the encrypted sum back; the sites filter."""
        from data_prep.genotypes.secure_qc import add_encrypted_counts, load_server_context

        self.info(HE_COUNTS_NOTE)
        context = load_server_context(self.fl_ctx)  # before asking the sites: a misprovisioned server stops first
        request = FLModel(params={"none": np.zeros(1)}, meta={"step": COUNTS, "secure_aggregation": "he"})
        results = self.send_model_and_wait(COUNTS, request)
        if self.abort_signal.triggered:  # a site failed or refused (its reason is logged)
            return
        sites = {r.meta["client_name"]: (r.meta["snps"], encrypted_counts(r)) for r in results}
        check_he_sites(len(sites), "sites that answered")  # defence in depth behind the export's check
        snps, summed = add_encrypted_counts(context, sites)
        report = he_server_report(snps, self.thresholds, list(sites), self.min_site_people)
        report.update(noise_report(self.noise))
        path = Path(self.get_run_dir()) / REPORT_FILE
        path.write_text(json.dumps(report, indent=2) + "\n")
        self.info(f"federated QC: added the encrypted counts of {len(sites)} sites ({len(snps)} SNPs); {path}")
        meta = {"step": FILTER, "snps": list(snps), "sites": sorted(sites), "secure_aggregation": "he"}
        self.send_model_and_wait(FILTER, FLModel(params={ENCRYPTED_SUM: to_wire(summed)}, meta=meta))


#: A noisy release (``lightning_modules.privacy.qc_release``): (site, exact counts, settings) -> (noisy counts, what
#: it cost). data_prep cannot account (the ledger is the site runtime's), so the noisy job's script passes it in.
NoisyRelease = Callable[[str, np.ndarray, QcNoise], tuple[np.ndarray, Mapping[str, object]]]


def site_main(argv: Sequence[str] | None = None, release: NoisyRelease | None = None) -> None:
    """The site's side (run by the job's client script): counts (noisy with ``--dp-*``, encrypted under HE), then the
    filtered table."""
    import nvflare.client as flare

    from data_prep.genotypes.harmonise import read_snp_table
    from data_prep.genotypes.site import GENOTYPES_ENV, SNP_TABLE_ENV, load_harmonised
    from data_prep.genotypes.site_files import read_line, site_genotype_files
    from data_prep.site_config import LOCAL_CONFIG, site_workspace

    args = _site_parser().parse_args(argv)
    flare.init()
    site = flare.get_site_name()
    try:
        noise = QcNoise.from_options(args.dp_noise_multiplier, args.dp_target_epsilon, args.dp_delta)
    except DataPrepError as exc:
        raise DataPrepError(f"{site}: {exc}") from None
    if noise is not None and release is None:
        raise DataPrepError(
            f"{site}: the job adds noise to the QC counts, but its client script has no privacy ledger to account "
            "it in (export the job with python -m data_prep.genotypes qc-job --dp-target-epsilon, whose script is "
            "lightning_modules/privacy/qc_noise_site.py); nothing sent"
        )
    files = site_genotype_files(site, site_workspace(), os.environ)  # the environment, then the kit's local/
    data_file, table_path = files.path("genotypes"), files.path("snp_table")
    if not data_file or not table_path:
        raise DataPrepError(
            f'{site}: federated QC needs {GENOTYPES_ENV} and {SNP_TABLE_ENV} set at the site, or "genotypes" and '
            f'"snp_table" in {site_workspace() / LOCAL_CONFIG}; nothing sent'
        )
    genotypes, samples, snps, _ = load_harmonised(data_file, table_path)
    print(read_line(site, files, len(genotypes), len(snps)), flush=True)
    genotypes = _counted_once(site, genotypes, samples)
    # Before the first message: a site too small for the consortium's minimum answers nothing at all. Under HE this is
    # the only size check: the server cannot count people in ciphertexts.
    check_site_size(site, len(genotypes), args.min_site_people, "refused at the site, nothing sent or written")
    thresholds = QcThresholds(args.min_call_rate, args.min_maf)  # applied here under HE only
    counts = genotype_counts(genotypes)
    check_site_calls(site, counts)  # before the first message: under HE nobody else can see it
    context = _site_context(site, len(genotypes)) if args.secure_aggregation == "he" else None
    masking = _site_masking(site) if args.secure_aggregation == "secagg" else None
    out = Path(args.out) if args.out else site_workspace() / QC_TABLE
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        step = received.meta.get("step")
        if masking is not None and step in masking.steps:  # SecAgg+'s key and unmask steps (secagg_qc)
            flare.send(FLModel(params=masking.steps[step](received.meta), meta={}))
            continue
        if step == COUNTS:
            sent, spent = (counts, None) if noise is None else release(site, counts, noise)  # ledger first
            if masking is not None:
                message = FLModel(params=masking.site.mask(sent, received.meta), meta={"snps": list(snps)})
            else:
                message = _counts_message(sent, snps, context)
            flare.send(message)
            how = "which sees them unless the deployment uses secure aggregation"
            if context is not None:
                how = "encrypted with its CKKS context; the server adds ciphertexts it cannot decrypt"
            if masking is not None:
                how = "masked (SecAgg+); the server unmasks only the sum over the sites"
            if spent is not None:
                how += (
                    f"; with discrete Gaussian noise sigma {spent['sigma']:.4g} per count (noise multiplier "
                    f"{spent['noise_multiplier']:.4g}), epsilon {spent['epsilon']:.4g} at delta {noise.delta:g} "
                    f"in its ledger {spent['ledger']}"
                )
            print(f"{site}: sent genotype counts of {len(snps)} SNPs ({len(genotypes)} people) to the server, {how}")
            continue
        if tuple(received.meta["snps"]) != tuple(snps):
            raise DataPrepError(f"{site}: the QC filter is for other SNPs than this site's table")
        if context is None:
            keep, report = np.asarray(received.params["keep"], dtype=bool), None
        else:
            keep, report = site_qc(site, context, received, counts, thresholds, args.min_site_people, noise)
        out.parent.mkdir(parents=True, exist_ok=True)
        read_snp_table(table_path).write(out, keep)
        if report is not None:
            (out.parent / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        # Under HE even the kept count stays at the site: it is a figure of the sum the server must not learn.
        flare.send(FLModel(params={"none": np.zeros(1)}, meta={} if report else {"kept": int(keep.sum())}))
        where = f"; report {out.parent / REPORT_FILE}" if report is not None else ""
        print(f"{site}: kept {int(keep.sum())} of {len(snps)} SNPs; filtered table {out}{where}", flush=True)


def _counted_once(site: str, genotypes: np.ndarray, samples: Sequence[str]) -> np.ndarray:
    """Without the people the PSI jobs found at an earlier-named site, which counts them (``data_prep.genotypes.psi``);
    all of them when no PSI job has run here."""
    from data_prep.genotypes.psi import counted_once, shared_people_path
    from data_prep.site_config import site_workspace

    return counted_once(site, genotypes, samples, shared_people_path(site, site_workspace(), os.environ))


def _site_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="federated QC, site side")
    parser.add_argument("--out", default=None, help=f"filtered table to write (default <site workspace>/{QC_TABLE})")
    parser.add_argument(
        "--min-site-people", type=int, default=MIN_SITE_PEOPLE, help="refuse to send counts of fewer people"
    )
    parser.add_argument(
        "--secure-aggregation",
        choices=SECURE_AGGREGATION,
        default="none",
        help="he: encrypt the counts with startup/client_context.tenseal and filter the decrypted sum here; "
        "secagg: mask the counts (SecAgg+), the server unmasks only their sum",
    )
    # Under HE the site applies the thresholds itself; they come from the signed job config, not from the server.
    parser.add_argument("--min-call-rate", type=float, default=QcThresholds.min_call_rate)
    parser.add_argument("--min-maf", type=float, default=QcThresholds.min_maf)
    # Noise (data_prep.genotypes.qc_noise): the site's budget for this run, the multiplier, the accounting's delta.
    parser.add_argument("--dp-target-epsilon", type=float, default=None)
    parser.add_argument("--dp-noise-multiplier", type=float, default=None)
    parser.add_argument("--dp-delta", type=float, default=None)
    return parser


def _site_context(site: str, people: int) -> ts.Context:
    """The site's CKKS context from its startup kit; refused in one line (missing TenSEAL, file, key, range)."""
    try:
        from data_prep.genotypes.secure_qc import check_he_people, load_client_context
    except ImportError as missing:
        raise DataPrepError(
            f"federated QC: {site}: secure_aggregation 'he' needs TenSEAL at the site (pip install "
            f"'nvflare-noniid[he]'): {missing}"
        ) from None
    from nvflare.fuel.sec.security_content_service import SecurityContentService

    from data_prep.site_config import site_workspace

    check_he_people(site, people)
    # NVFlare points its content service at the kit's startup/ in a provisioned job process; else find the kit.
    startup = Path(SecurityContentService.content_folder or site_workspace() / "startup")
    return load_client_context(site, startup)


class _SiteMasking:
    """A site's SecAgg+ state (secagg_qc.QcSecAggSite) and its answer to each key or unmask step, by step."""

    def __init__(self, site: str) -> None:
        from data_prep.genotypes import secagg_qc as sq

        self.site = sq.QcSecAggSite(site)
        self.steps = {
            sq.KEYS_STEP: self.site.advertise,
            sq.SHARES_STEP: self.site.share,
            sq.UNMASK_STEP: self.site.unmask,
        }


def _site_masking(site: str) -> _SiteMasking:
    """The site's side of the secure sum; refused in one line without flwr (the 'secagg' extra)."""
    try:
        import flwr.common.secure_aggregation  # noqa: F401
    except ImportError as missing:
        raise DataPrepError(
            f"federated QC: {site}: secure_aggregation 'secagg' needs flwr at the site (pip install "
            f"'nvflare-noniid[secagg]'): {missing}; nothing sent"
        ) from None
    return _SiteMasking(site)


def _counts_message(counts: np.ndarray, snps: Sequence[str], context: ts.Context | None) -> FLModel:
    if context is None:
        return FLModel(params={"counts": counts}, meta={"snps": list(snps)})
    from data_prep.genotypes.secure_qc import encrypt_counts

    return FLModel(params={ENCRYPTED_COUNTS: to_wire(encrypt_counts(context, counts))}, meta={"snps": list(snps)})


def site_qc(
    site: str,
    context: ts.Context,
    received: FLModel,
    own: np.ndarray,
    thresholds: QcThresholds,
    min_site_people: int,
    noise: QcNoise | None = None,
) -> tuple[np.ndarray, dict[str, object]]:
    """Under HE, at a site: decrypt the server's sum, check it, and filter it exactly as the server would in the
    clear (`global_qc`); the report records the sites, the mode and the largest CKKS rounding error. A noisy sum
    (``noise``) is neither a count of people nor above this site's own counts: only its integrality is checked, and
    the filter reads it with negative cells at 0."""
    from data_prep.genotypes.secure_qc import check_sum_covers_site, decrypt_counts

    snps = tuple(received.meta["snps"])
    blob = from_wire(received.params[ENCRYPTED_SUM])
    total, rounding = decrypt_counts(site, context, blob, len(snps), noisy=noise is not None)
    if noise is None:
        check_sum_covers_site(site, total, own)
    else:
        total = usable_counts(total)
    keep, report = global_qc(snps, total, thresholds, list(received.meta.get("sites", [])), min_site_people)
    return keep, {"secure_aggregation": "he", "he_rounding_error": rounding, **report, **noise_report(noise)}


def export_qc_job(
    output_dir: Path,
    thresholds: QcThresholds,
    num_sites: int = 3,
    name: str = "genotype_qc",
    min_site_people: int = MIN_SITE_PEOPLE,
    secure_aggregation: str = "none",
    noise: QcNoise | None = None,
) -> Path:
    """Export the QC job folder ``output_dir/name`` (NVFlare's job API; the bundle is installed at the sites).
    ``min_site_people`` goes to both sides: the server's workflow and every site's script arguments, so a site's
    admin sees the minimum in the job it is asked to run. Under ``secure_aggregation="he"`` the thresholds go to the
    sites' arguments too, since there the sites filter. With ``noise`` every site adds noise to its counts before they
    leave it, accounted in its ledger: the sites run ``lightning_modules/privacy/qc_noise_site.py`` (qc_noise,
    qc_release), which the bundle installs beside this module's package."""
    min_site_people = check_min_site_people(min_site_people)
    secure_aggregation = check_secure_aggregation(secure_aggregation)
    if secure_aggregation == "he":
        check_he_sites(num_sites, "--num-sites")
    if secure_aggregation == "secagg":
        from data_prep.genotypes.secagg_qc import check_secagg_sites

        check_secagg_sites(num_sites, "--num-sites")
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.script_runner import FrameworkType, ScriptRunner

    from aggregators.contracts.bundle import APP_PACKAGES, inside_directory

    output_dir = Path(output_dir).resolve()
    job = FedJob(name=name, min_clients=num_sites)
    job.set_app_packages(list(APP_PACKAGES))
    dp = {} if noise is None else {"dp_target_epsilon": noise.target_epsilon, "dp_delta": noise.delta}
    if noise is not None and noise.noise_multiplier is not None:
        dp["dp_noise_multiplier"] = noise.noise_multiplier
    controller = GenotypeQcController(
        thresholds.min_call_rate, thresholds.min_maf, min_site_people, secure_aggregation, **dp
    )
    job.to_server(controller)
    # NVFlare writes the script path as given into the job config: relative, so it resolves inside custom/. A noisy
    # job's script is the site runtime's (it accounts in the ledger), a file of the installed bundle, not an import.
    script_dir, script = (Path(__file__).parent, SITE_SCRIPT) if noise is None else NOISE_SITE_SCRIPT
    with inside_directory(script_dir):
        script_args = f"--min-site-people {min_site_people}"
        if secure_aggregation == "he":
            script_args += (
                f" --secure-aggregation he --min-call-rate {thresholds.min_call_rate} --min-maf {thresholds.min_maf}"
            )
        if secure_aggregation == "secagg":
            script_args += " --secure-aggregation secagg"
        if noise is not None:
            script_args += f" {noise.script_args()}"
        job.to_clients(ScriptRunner(script=script, script_args=script_args, framework=FrameworkType.NUMPY))
        add_egress_gates(job, secure_aggregation)
        job.export_job(str(output_dir))
    return output_dir / name


def qc_releases(secure_aggregation: str) -> tuple[Release, ...]:
    """What a QC site declares it sends (docs/privacy.md, the genotype QC rows), per task, for the egress gate: its
    counts (clear, the ciphertext under HE, the masked vector under SecAgg+) and the SNP IDs they refer to; then the
    kept count (clear and SecAgg+, where the server knows the keep-mask: under HE even that stays at the site); under
    SecAgg+ also each key and unmask step's answer (secagg_qc.STEP_DATA: public keys, sealed shares, the shares of
    the summed sites' self-mask seeds)."""
    mode = check_secure_aggregation(secure_aggregation)
    counts = {"he": ENCRYPTED_COUNTS, "secagg": "counts_masked"}.get(mode, "counts")
    releases = (
        Release(COUNTS, ("WEIGHTS",), (counts,), ("snps",)),
        Release(FILTER, ("WEIGHTS",), ("none",), () if mode == "he" else ("kept",)),
    )
    if mode != "secagg":
        return releases
    from data_prep.genotypes.secagg_qc import STEP_DATA

    return (*releases, *(Release(step, ("WEIGHTS",), entries, ()) for step, entries in STEP_DATA.items()))


def add_egress_gates(job: object, secure_aggregation: str) -> None:
    """The egress gate last on each of the QC tasks' results (aggregators/contracts/egress_gate.py)."""
    from nvflare.job_config.defs import FilterType

    from aggregators.contracts.egress_gate import EgressGate

    for release in qc_releases(secure_aggregation):
        job.to_clients(EgressGate(**release.to_config()), tasks=[release.task], filter_type=FilterType.TASK_RESULT)
