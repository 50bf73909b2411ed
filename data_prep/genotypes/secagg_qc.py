"""The federated QC's counts under SecAgg+ (``qc-job --secure-aggregation secagg``): exact integer sums.

The protocol is SecAgg+'s (aggregators/secagg.py, on flwr's primitives), run once for the job's one sum. The counts
are integers already, so nothing is quantised: a site's (S, 4) counts (noisy ones may be negative) are taken modulo
2^48 (`encode_counts`), masked with its self-mask and its pairwise masks with every other site (``mask_update``),
and sent as 6 bytes a value. The server adds the masked vectors, asks every site for its shares of the others'
self-mask seeds, removes the masks and reads the exact sum back (`decode_counts`, values above 2^47 negative). Four
tasks precede the keep-mask (federated_qc.py), each step's meta naming it:

1. `KEYS_STEP`: the sorted site names and the threshold go out; each site's two public keys come back.
2. `SHARES_STEP`: every public key goes out; each site's Shamir shares of its self-mask seed and mask key come back,
   sealed for each holder (only the holder can open one).
3. ``qc_counts``: the sealed shares go out; each site's masked counts come back.
4. `UNMASK_STEP`: the summed sites go out; each site returns its shares of their self-mask seeds, once.

The server then knows the sum of the counts (as the clear QC uses it: it filters and reports, and sends the keep-mask)
and no site's counts: each masked vector is uniform modulo 2^48 to anyone without that site's seed, which only a
majority of holders can rebuild (docs/privacy.md, "genotype QC under SecAgg+"). Unlike ``he``, the server does see
the sum; a site sees only the keep-mask. As under ``he`` it cannot count a site's people, so each site's own
``min_site_people`` refusal is the only size check, and the job needs `aggregators.secagg.MIN_SITES` sites.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from aggregators import secagg
from data_prep.errors import DataPrepError
from data_prep.genotypes.qc import implied_people

__all__ = [
    "KEYS_STEP",
    "MASKED_COUNTS",
    "MAX_SECAGG_COUNT",
    "SHARES_STEP",
    "UNMASK_STEP",
    "QcSecAggSite",
    "check_secagg_sites",
    "decode_counts",
    "encode_counts",
    "unmask_counts",
]

KEYS_STEP, SHARES_STEP, UNMASK_STEP = "qc_secagg_keys", "qc_secagg_shares", "qc_secagg_unmask"
#: The one entry of a site's masked counts (6 bytes a value, ``aggregators.secagg.pack``).
MASKED_COUNTS = "counts_masked"
#: Each step's answer's entries (uint8 arrays; the egress gate's declaration, federated_qc.qc_releases).
STEP_DATA = {KEYS_STEP: ("channel_pk", "mask_pk"), SHARES_STEP: ("sealed",), UNMASK_STEP: ("shares",)}
#: The protocol's round number (the masks' nonce): the QC sums once per job, with keys made for it.
QC_ROUND = 0
#: Largest count (in size) a site masks: the sum of up to 2^16 sites stays below 2^46, far inside the signed range.
MAX_SECAGG_COUNT = 10**9
_HALF = 2 ** (secagg.MODULUS_BITS - 1)
_MODULUS = 2**secagg.MODULUS_BITS


def check_secagg_sites(sites: int, what: str, threshold: int | None = None) -> int:
    """The threshold for ``sites`` sites (default: the smallest majority), refused in one line with fewer than
    ``aggregators.secagg.MIN_SITES`` sites or a threshold that is no majority or cannot be met."""
    threshold = secagg.default_threshold(sites) if threshold is None else threshold
    problem = secagg.protocol_problem(sites, threshold)
    if problem:
        raise DataPrepError(f"federated QC: secure_aggregation 'secagg' with {sites} sites ({what}): {problem}")
    return threshold


def encode_counts(site: str, counts: np.ndarray) -> np.ndarray:
    """(S, 4) integer counts as uint64 modulo 2^48 (a negative noisy count as 2^48 minus its size), refused above
    `MAX_SECAGG_COUNT` in size."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[1] != 4 or not np.issubdtype(counts.dtype, np.integer):
        raise DataPrepError(
            f"federated QC: {site}: counts of shape {counts.shape} ({counts.dtype}), expected (S, 4) ints"
        )
    if np.abs(counts.astype(np.int64)).max(initial=0) > MAX_SECAGG_COUNT:
        raise DataPrepError(
            f"federated QC: {site}: a count exceeds {MAX_SECAGG_COUNT} in size (allowed: at most {MAX_SECAGG_COUNT} "
            "people a site under secure_aggregation 'secagg'); nothing sent"
        )
    return np.mod(counts.astype(np.int64), _MODULUS).astype(np.uint64)


def decode_counts(values: np.ndarray, n_snps: int, noisy: bool) -> np.ndarray:
    """The unmasked sum modulo 2^48 as (S, 4) int64 counts (values at or above 2^47 negative). A sum of exact counts
    must be genotype counts (non-negative, the same people on every SNP); a ``noisy`` sum is only shaped."""
    values = np.asarray(values, dtype=np.uint64).reshape(-1)
    if values.size != 4 * n_snps:
        raise DataPrepError(f"federated QC: the unmasked sum has {values.size} values, expected {4 * n_snps}")
    signed = values.astype(np.int64)
    signed[values >= _HALF] -= _MODULUS
    counts = signed.reshape(n_snps, 4)
    if noisy:
        return counts
    try:
        if (counts < 0).any():
            raise DataPrepError("negative counts")
        implied_people(counts)
    except DataPrepError as exc:
        raise DataPrepError(
            f"federated QC: the unmasked sum is not genotype counts ({exc}): a site's masked counts or shares were "
            "not what the protocol expects; nothing written"
        ) from None
    return counts


def unmask_counts(
    sites: Sequence[str],
    masked: Mapping[str, np.ndarray],
    returned: Mapping[str, Mapping[str, bytes]],
    mask_pks: Mapping[str, bytes],
    threshold: int,
    n_snps: int,
    noisy: bool = False,
) -> np.ndarray:
    """The server's computation: the sum of every site's masked counts (``masked``: site -> packed bytes), unmasked
    with the holders' shares of the summed sites' self-mask seeds (``returned``: holder -> source -> share), decoded.
    Every site that shared keys must have sent its counts (the QC job ends if one fails)."""
    sites = tuple(sorted(sites))
    missing = [site for site in sites if site not in masked]
    if missing:
        raise DataPrepError(f"federated QC: no masked counts from {', '.join(missing)}")
    shape = {MASKED_COUNTS: (4 * n_snps,)}
    try:
        inputs = [secagg.unpack({MASKED_COUNTS: masked[site]}, shape) for site in sites]
        index = {site: i for i, site in enumerate(sites)}
        shares = {index[h]: {index[s]: v for s, v in got.items() if s in index} for h, got in returned.items()}
        total = secagg.unmask(
            secagg.masked_sum(inputs),
            list(range(len(sites))),
            [],
            shares,
            {index[s]: mask_pks[s] for s in sites},
            len(sites),
            threshold,
            QC_ROUND,
        )
    except secagg.SecAggError as exc:
        raise DataPrepError(f"federated QC: the secure sum failed: {exc}") from None
    return decode_counts(total[MASKED_COUNTS], n_snps, noisy)


def to_wire(blob: bytes) -> np.ndarray:
    """Bytes as a uint8 array: the job exchanges numpy parameters."""
    return np.frombuffer(bytes(blob), dtype=np.uint8)


def from_wire(array: object) -> bytes:
    return np.asarray(array, dtype=np.uint8).tobytes()


def to_text(blob: bytes) -> str:
    """Bytes for the server's messages' meta (base64)."""
    return base64.b64encode(bytes(blob)).decode("ascii")


def from_text(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


@dataclass
class QcSecAggSite:
    """One site's side of the QC's secure sum: its keys, self-mask seed and the shares it opened live here, in its
    job process, and never leave it except as the protocol's answers."""

    site: str
    sites: tuple[str, ...] = ()
    threshold: int = 0
    keys: secagg.SiteKeys | None = None
    b_seed: bytes = b""
    public: dict[str, tuple[bytes, bytes]] = field(default_factory=dict)
    opened: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    answered_unmask: bool = False

    def _refuse(self, what: str) -> DataPrepError:
        return DataPrepError(f"federated QC: {self.site}: secagg: {what}; nothing sent")

    def advertise(self, meta: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Step 1: the site list and threshold checked, fresh keys made, the public keys answered."""
        if self.keys is not None:
            raise self._refuse("asked for keys a second time in this job")
        sites, threshold = tuple(meta.get("sites") or ()), meta.get("threshold")
        if sites != tuple(sorted(set(sites))) or self.site not in sites or not isinstance(threshold, int):
            raise self._refuse(f"the server's site list {list(sites)} or threshold {threshold!r} is malformed")
        problem = secagg.protocol_problem(len(sites), threshold)
        if problem:
            raise self._refuse(problem)
        self.sites, self.threshold, self.keys = sites, threshold, secagg.make_keys()
        return {"channel_pk": to_wire(self.keys.channel_pk), "mask_pk": to_wire(self.keys.mask_pk)}

    def share(self, meta: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Step 2: every site's public keys received; the seed and mask key Shamir-shared, sealed per holder."""
        if self.keys is None or self.b_seed:
            raise self._refuse("asked to share keys out of order")
        public = {s: (from_text(c), from_text(m)) for s, (c, m) in dict(meta.get("public") or {}).items()}
        if tuple(sorted(public)) != self.sites or public[self.site] != self.keys.public():
            raise self._refuse("the public keys do not match the sites, or this site's own keys were replaced")
        self.public, self.b_seed = public, secagg.new_seed()
        holders = list(range(len(self.sites)))
        shares = secagg.share_secrets(self.b_seed, self.keys.mask_sk, self.threshold, len(holders))
        channel = {i: public[s][0] for i, s in enumerate(self.sites)}
        sealed = secagg.seal_shares(self.sites.index(self.site), self.keys, shares, holders, channel)
        text = {self.sites[i]: token.decode("ascii") for i, token in sealed.items()}
        return {"sealed": to_wire(json.dumps(text, sort_keys=True).encode())}

    def mask(self, counts: np.ndarray, meta: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Step 3: the shares sealed for this site opened (every site's), the counts masked."""
        if not self.b_seed or self.opened:
            raise self._refuse("asked for masked counts out of order")
        sealed = dict(meta.get("sealed") or {})
        if tuple(sorted(sealed)) != self.sites:
            raise self._refuse(f"shares from {sorted(sealed)}, expected every site's ({list(self.sites)})")
        me = self.sites.index(self.site)
        try:
            for src, site in enumerate(self.sites):
                token = str(dict(sealed[site])[self.site]).encode("ascii")
                self.opened[src] = secagg.open_share(me, src, self.keys, self.public[site][0], token)
        except (KeyError, secagg.SecAggError) as exc:
            raise self._refuse(f"a share for this site is missing or does not open ({exc})") from None
        mask_pks = {i: self.public[s][1] for i, s in enumerate(self.sites)}
        values = {MASKED_COUNTS: encode_counts(self.site, counts).reshape(-1)}
        masked = secagg.mask_update(me, values, self.b_seed, self.keys.mask_sk, mask_pks, QC_ROUND)
        return {MASKED_COUNTS: secagg.pack(masked)[MASKED_COUNTS]}

    def unmask(self, meta: Mapping[str, object]) -> dict[str, np.ndarray]:
        """Step 4, once: this site's shares of the summed sites' self-mask seeds (never a mask key: no site dropped
        in a QC job, which ends if one fails)."""
        if not self.opened or self.answered_unmask:
            raise self._refuse("asked to unmask out of order or a second time")
        summed = list(meta.get("summed") or ())
        if sorted(summed) != list(self.sites):
            raise self._refuse(f"asked to unmask {summed}: a QC sum is over every site ({list(self.sites)})")
        self.answered_unmask = True
        index = {s: i for i, s in enumerate(self.sites)}
        try:
            shares = secagg.unmask_shares(index[self.site], self.opened, [index[s] for s in summed], [], self.threshold)
        except secagg.SecAggError as exc:
            raise self._refuse(str(exc)) from None
        text = {self.sites[src]: to_text(share) for src, share in shares.items()}
        return {"shares": to_wire(json.dumps(text, sort_keys=True).encode())}


def read_answer(blob: object) -> dict[str, str]:
    """A site's sealed shares or unmask shares as sent (JSON in a uint8 array)."""
    return dict(json.loads(from_wire(blob).decode()))


def read_shares(blob: object) -> dict[str, bytes]:
    """A holder's unmask answer: source site -> its share."""
    return {site: from_text(share) for site, share in read_answer(blob).items()}


def read_public(params: Mapping[str, object]) -> tuple[bytes, bytes]:
    """A site's answer to `KEYS_STEP`: (channel public key, mask public key)."""
    return from_wire(params["channel_pk"]), from_wire(params["mask_pk"])


def public_text(public: Mapping[str, tuple[bytes, bytes]]) -> dict[str, list[str]]:
    """Every site's public keys for `SHARES_STEP`'s meta (``QcSecAggSite.share`` reads them back)."""
    return {site: [to_text(channel), to_text(mask)] for site, (channel, mask) in public.items()}
