"""The federated QC's counts under homomorphic encryption (``qc-job --secure-aggregation he``).

Each site encrypts its (S, 4) genotype counts with its TenSEAL CKKS context (``startup/client_context.tenseal``,
written by NVFlare's ``HEBuilder`` and holding the secret key, the same at every site); the server loads its own
context (``startup/server_context.tenseal``, no secret key) only to read the ciphertexts back and add them, and sends
the encrypted sum to every site; each site decrypts it, rounds it to integers and applies the thresholds itself. The
server therefore never sees a site's counts nor their sum. All encryption, addition and decryption is TenSEAL's; this
module only moves bytes, checks and rounds.

CKKS is approximate: a decrypted count is the integer plus a small error. With HEBuilder's defaults (degree 8192,
moduli [60, 40, 40], scale 2^40) the error measured on three sites' sums was about 1.5e-9 for counts up to 10^5
people per site and 2.4e-7 at 10^9, but it grows with the values (0.05 at 10^14, 0.5 at 10^15, where float64 decoding
runs out of digits), and an error of a whole unit would round to a wrong count without any sign. So a site refuses to
encrypt counts above `MAX_HE_PEOPLE`, and every decrypted value must lie within `ROUNDING_TOLERANCE` of
an integer (far below 0.5), or the site stops naming the error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tenseal as ts

# The file names NVFlare's HEBuilder writes into the startup kits, as the training jobs' HE filters read them.
from aggregators.contracts.bundle import CLIENT_CONTEXT, SERVER_CONTEXT
from data_prep.errors import DataPrepError
from data_prep.genotypes.qc import implied_people

__all__ = [
    "CLIENT_CONTEXT",
    "MAX_HE_PEOPLE",
    "ROUNDING_TOLERANCE",
    "SERVER_CONTEXT",
    "add_encrypted_counts",
    "check_he_people",
    "check_sum_covers_site",
    "decrypt_counts",
    "encrypt_counts",
    "load_client_context",
    "load_server_context",
    "round_counts",
]

#: Largest count a site encrypts, and largest decrypted sum accepted: at 10^9 the measured CKKS error (2.4e-7) is
#: four orders of magnitude below ROUNDING_TOLERANCE; far larger values would lose whole units (module docstring).
MAX_HE_PEOPLE = 10**9
#: How far a decrypted count may lie from an integer. The measured error is ~1e-9 for realistic cohorts; anything
#: near this bound means the context or the values are not what this job expects, and rounding could be wrong.
ROUNDING_TOLERANCE = 1e-3
_PROVISIONING = (
    "provision the deployment with nvflare.lighter.impl.he.HEBuilder among the project's builders (on one machine: "
    "python -m jobs.provision.loopback --he)"
)


def load_client_context(site: str, startup: Path) -> ts.Context:
    """The site's CKKS context from its startup kit, through NVFlare's signature check (HEBuilder runs before the
    kit is signed): missing, unsigned, tampered or key-less files are refused in one line naming the file."""
    from nvflare.fuel.sec.security_content_service import LoadResult, SecurityContentManager

    path = Path(startup) / CLIENT_CONTEXT
    data, result = SecurityContentManager(str(startup)).load_content(CLIENT_CONTEXT)
    who = f"federated QC: {site}: secure_aggregation 'he'"
    if result == LoadResult.NO_SUCH_CONTENT:
        raise DataPrepError(
            f"{who} needs the site's TenSEAL context {path}, which does not exist: {_PROVISIONING}; the simulator has "
            "no startup kits, so an HE QC job does not run there; nothing sent"
        )
    if result != LoadResult.OK:
        raise DataPrepError(
            f"{who}: {path} failed NVFlare's signature check ({result.value}; allowed: a file signed at provisioning, "
            "listed in the kit's signature.json); nothing sent"
        )
    context = ts.context_from(data)
    if not context.is_private():
        raise DataPrepError(
            f"{who}: {path} holds no secret key (is it the server's context?); a site needs the client context "
            "HEBuilder wrote into its own kit; nothing sent"
        )
    return context


def load_server_context(fl_ctx: Any) -> ts.Context:
    """The server's context through NVFlare's own loader (signature checked in secure mode), refused if it holds a
    secret key: a server that could decrypt would see every site's counts."""
    from nvflare.app_opt.he.homomorphic_encrypt import load_tenseal_context_from_workspace
    from nvflare.fuel.sec.security_content_service import SecurityContentService

    path = Path(SecurityContentService.content_folder or "startup") / SERVER_CONTEXT
    try:
        context = load_tenseal_context_from_workspace(SERVER_CONTEXT, fl_ctx)
    except ValueError as exc:
        raise DataPrepError(f"federated QC: the server cannot load {path} ({exc}); {_PROVISIONING}") from None
    return check_public_context(context, str(path))


def check_public_context(context: ts.Context, where: str) -> ts.Context:
    """Refuse a server-side context that can decrypt."""
    if context.is_private():
        raise DataPrepError(
            f"federated QC: the server's TenSEAL context {where} holds a secret key, so the server could decrypt the "
            "sites' counts; allowed: a context without one (HEBuilder's server_context.tenseal)"
        )
    return context


def check_he_people(site: str, people: int) -> None:
    """Refuse counts too large for exact rounding after CKKS (`MAX_HE_PEOPLE`)."""
    if people > MAX_HE_PEOPLE:
        raise DataPrepError(
            f"federated QC: {site} has {people} people; secure_aggregation 'he' rounds CKKS sums exactly only up to "
            f"{MAX_HE_PEOPLE} people (allowed: at most {MAX_HE_PEOPLE}); nothing sent"
        )


def encrypt_counts(context: ts.Context, counts: np.ndarray) -> bytes:
    """One CKKS vector of the (S, 4) counts, row by row, serialised without any key (TenSEAL serialises a vector's
    ciphertexts only; the reader supplies the context)."""
    values = np.asarray(counts, dtype=np.float64).ravel()
    return ts.ckks_vector(context, values.tolist()).serialize()


def add_encrypted_counts(
    context: ts.Context, sites: Mapping[str, tuple[Sequence[str], bytes]]
) -> tuple[tuple[str, ...], bytes]:
    """The server's whole computation under HE: the table SNPs and the serialised sum of every site's ciphertext.
    ``context`` must hold no secret key; sites on another SNP table or with a vector of the wrong length are refused
    by name (the only checks possible without decrypting)."""
    check_public_context(context, "given to add_encrypted_counts")
    if not sites:
        raise DataPrepError("federated QC: no site sent its encrypted counts")
    names = sorted(sites)
    snps = tuple(sites[names[0]][0])
    total = None
    for site in names:
        site_snps, blob = tuple(sites[site][0]), sites[site][1]
        if site_snps != snps:
            raise DataPrepError(
                f"federated QC: {site} harmonised against other SNPs than {names[0]} ({len(site_snps)} vs "
                f"{len(snps)}); every site must use the consortium's table"
            )
        try:
            vector = ts.ckks_vector_from(context, bytes(blob))
        except Exception as exc:  # TenSEAL raises its own C++ errors on bytes that are not its ciphertexts
            raise DataPrepError(f"federated QC: {site} sent bytes that are not a CKKS vector here: {exc}") from None
        if vector.size() != 4 * len(snps):
            raise DataPrepError(
                f"federated QC: {site} sent {vector.size()} encrypted counts, expected {4 * len(snps)} (4 per SNP)"
            )
        total = vector if total is None else total + vector
    return snps, total.serialize()


def decrypt_counts(
    site: str, context: ts.Context, blob: bytes, n_snps: int, noisy: bool = False
) -> tuple[np.ndarray, float]:
    """The site's view of the sum: decrypted with its secret key, rounded and checked (`round_counts`)."""
    try:
        values = ts.ckks_vector_from(context, bytes(blob)).decrypt()
    except Exception as exc:  # as above: bytes that are not a ciphertext of this context
        raise DataPrepError(f"federated QC: {site} cannot decrypt the server's sum: {exc}") from None
    return round_counts(site, np.asarray(values, dtype=np.float64), n_snps, noisy)


def round_counts(site: str, values: np.ndarray, n_snps: int, noisy: bool = False) -> tuple[np.ndarray, float]:
    """(S, 4) int64 counts from decrypted values, and the largest distance of a value from its integer (what CKKS
    added; recorded in the site's report): refused unless every value is within `ROUNDING_TOLERANCE` of
    a non-negative integer, there are 4 per SNP, every SNP counts the same people and they are at most
    `MAX_HE_PEOPLE`. Deterministic, so every site that decrypts the same ciphertext gets the same counts. A ``noisy``
    sum (integer noise from every site, ``qc_noise``) is checked for integrality and range only: it may be negative
    and its rows count no one number of people."""
    values = np.asarray(values, dtype=np.float64)
    if values.shape != (4 * n_snps,):
        raise DataPrepError(f"federated QC: {site} decrypted {values.size} counts, expected {4 * n_snps} (4 per SNP)")
    rounded = np.rint(values)
    error = np.abs(values - rounded)
    worst = int(np.argmax(error)) if len(error) else 0
    largest = float(error[worst]) if len(error) else 0.0
    if not largest <= ROUNDING_TOLERANCE:  # also refuses NaN
        raise DataPrepError(
            f"federated QC: {site}: the decrypted sum lies {largest:.3g} from an integer at SNP {worst // 4} "
            f"(allowed: at most {ROUNDING_TOLERANCE}); CKKS lost precision (counts beyond {MAX_HE_PEOPLE} people, "
            "or a context other than HEBuilder's), so the counts cannot be rounded safely"
        )
    counts = rounded.astype(np.int64).reshape(n_snps, 4)
    if noisy:
        if np.abs(counts).max(initial=0) > MAX_HE_PEOPLE:
            raise DataPrepError(f"federated QC: {site}: the decrypted noisy sum exceeds {MAX_HE_PEOPLE} in size")
        return counts, largest
    if (counts < 0).any():
        raise DataPrepError(f"federated QC: {site}: the decrypted sum has negative counts; it is not a sum of counts")
    try:
        people = implied_people(counts)
    except DataPrepError as exc:
        raise DataPrepError(f"federated QC: {site}: the decrypted sum is not genotype counts: {exc}") from None
    if people > MAX_HE_PEOPLE:
        raise DataPrepError(
            f"federated QC: {site}: the decrypted sum counts {people} people, above {MAX_HE_PEOPLE}, where CKKS "
            "rounding is no longer exact"
        )
    return counts, largest


def check_sum_covers_site(site: str, total: np.ndarray, own: np.ndarray) -> None:
    """The sum must contain this site's own counts. Catches a server that sent back something other than a sum over
    the sites (a bug, or a wrong message); it cannot catch a server that forwards another site's ciphertext added to
    this one's, which only a site colluding with it could then read (docs/genomics.md)."""
    if np.asarray(total).shape != np.asarray(own).shape or (np.asarray(total) < np.asarray(own)).any():
        raise DataPrepError(
            f"federated QC: {site}: the decrypted sum is smaller than this site's own counts, so it is not a sum over "
            "the sites; the filtered table is not written"
        )
