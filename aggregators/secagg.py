"""SecAgg+ secure aggregation (Bonawitz et al. 2017; Bell et al. 2020): the protocol's math as pure functions.

One round, for sites ``0..n-1`` (their positions in the round's sorted site list) and the global model ``g``:

1. *Advertise keys*: every site makes two key pairs of its own (`make_keys`): one for the channel to each neighbour,
   one whose agreement with a neighbour's public key seeds their pairwise mask. Only the public keys leave it.
2. *Share keys*: every site draws a self-mask seed ``b`` and Shamir-shares ``b`` and its mask secret key among its
   neighbourhood (`neighbours`: the site and its ``degree`` nearest sites on a ring; every site when ``degree`` is
   ``n - 1``) with threshold ``t``; each share goes to its holder encrypted for the channel (`seal_shares`), through
   the server, which cannot read it.
3. *Masked input*: a site quantises its weighted update ``w_i (x_i - g)`` (`quantise`, flwr's stochastic
   quantisation into ``[0, TARGET_RANGE]``), adds the self-mask PRG(b) and, for every neighbour j that shared keys,
   +PRG(s_ij) if i < j else -PRG(s_ij) (`mask_update`), all modulo 2^48 (`MODULUS_BITS`), sent as 6 bytes a
   coordinate (`pack`).
4. *Unmask*: the server adds the masked inputs (`masked_sum`); every responding neighbour returns, for each site of
   its neighbourhood, the share of ``b`` if that site's masked input arrived, else the share of its mask secret key
   (`unmask_shares`: never both for one site). With ``t`` shares per site the server rebuilds the seeds and removes
   the self-masks of the sites it summed and the pairwise masks they had with the dropped ones (`unmask`), which
   leaves ``sum_i w_i q_i`` and, divided by ``sum_i w_i``, FedAvg's weighted mean update (`mean_update`).

What the server learns is that sum only. A site that drops after sending its masked input is still summed (its
``b`` comes from its neighbours' shares); one that drops before has its pairwise masks removed with its rebuilt
secret key. A round needs ``t`` responding holders per site; ``t`` must be a majority of a neighbourhood (less would
let the server ask for both shares of one site from disjoint holders) and at most its size.

Threat model (docs/privacy.md): an honest-but-curious server colluding with fewer than ``t`` sites learns nothing
but the sum of the other sites' updates; the sites are trusted to follow the protocol (no signatures: the active
variant of the papers is not implemented). Each site's keys are fresh every round.

Cryptography comes from maintained libraries, none is written here: key agreement (ECDH on NIST P-384), HKDF and
authenticated encryption (Fernet) and Shamir secret sharing are flwr's ``flwr.common.secure_aggregation`` and
``flwr.supercore.primitives`` (flwr 1.41.0, the ``secagg`` extra); the masks are ChaCha20 keystreams from the
``cryptography`` package. flwr's own ``pseudo_rand_gen`` is not used: it seeds NumPy's Mersenne Twister with 32 bits.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Arrays = dict[str, np.ndarray]

#: Quantisation of a site's update (flwr's ``quantize``): each coordinate of ``x_i - g`` is clipped to
#: ``[-CLIP_RANGE, CLIP_RANGE]`` and mapped to ``[0, TARGET_RANGE]`` by stochastic rounding, so the mean update the
#: server rebuilds differs from FedAvg's by less than one step, `quantisation_step`, per coordinate (2^-20, ~1e-6).
CLIP_RANGE = 8.0
TARGET_RANGE = 2**24
#: The masked inputs live modulo 2^48 and travel as 6 bytes a coordinate (1.5x float32): the weighted sum must stay
#: below it, so `TARGET_RANGE` times the round's total weight (training samples) must be under 2^48, i.e. under 2^24
#: samples in all (`check_total_weight`).
MODULUS_BITS = 48
WIRE_BYTES = MODULUS_BITS // 8
_MASK = np.uint64(2**MODULUS_BITS - 1)
#: A site's self-mask seed and the ChaCha20 key its pairwise masks are drawn with: 32 bytes.
SEED_BYTES = 32
MIN_SITES = 3

#: On the wire (controllers/secagg.py, controllers/secagg_site.py; declared to the egress gate by jobs/egress.py):
#: the NVFlare tasks of the key and unmask stages, the DXO kind of a site's answer to one and the one data entry
#: each answer holds (the two public keys; the sealed shares by holder; the shares by source site), and the DXO kind
#: of a masked training result (a masked, weighted, quantised update, uint64).
KEYS_TASK, SHARES_TASK, UNMASK_TASK = "secagg_keys", "secagg_shares", "secagg_unmask"
#: The train task's header with the round's routing (which sites shared keys, every sealed share).
HEADER = "secagg"
STAGE_KIND = "SECAGG_STAGE"
STAGE_DATA = {KEYS_TASK: ("channel_pk", "mask_pk"), SHARES_TASK: ("sealed",), UNMASK_TASK: ("shares",)}
MASKED_KIND = "WEIGHT_DIFF"


class SecAggError(ValueError):
    """The protocol cannot go on: bad parameters, too few shares, a forged or misrouted share."""


@dataclass(frozen=True)
class SiteKeys:
    """A site's two key pairs for one round (PEM bytes): the channel pair encrypts the shares it sends and opens
    those it holds; the mask pair's agreement with each neighbour seeds their pairwise mask."""

    channel_sk: bytes
    channel_pk: bytes
    mask_sk: bytes
    mask_pk: bytes

    def public(self) -> tuple[bytes, bytes]:
        """What the site advertises: (channel public key, mask public key)."""
        return self.channel_pk, self.mask_pk


def default_threshold(num_sites: int, degree: int | None = None) -> int:
    """The smallest majority of a neighbourhood (``degree + 1`` holders, every site by default)."""
    holders = (num_sites - 1 if degree is None else degree) + 1
    return holders // 2 + 1


def protocol_problem(num_sites: int, threshold: int, degree: int | None = None) -> str | None:
    """One line naming what the sites cannot run, or ``None``: at least `MIN_SITES` sites (with two, the sum and
    one's own update give the other's), an even ring degree below the site count (or ``n - 1``), and a threshold
    that is a majority of a neighbourhood and no larger than it."""
    if num_sites < MIN_SITES:
        return (
            f"secagg needs at least {MIN_SITES} sites, got {num_sites}: with two, the sum and one site's own update "
            "give the other's; add sites or use --secure-aggregation he"
        )
    degree = num_sites - 1 if degree is None else degree
    if not (degree == num_sites - 1 or (2 <= degree < num_sites - 1 and degree % 2 == 0)):
        return f"secagg neighbourhood degree {degree}: use an even number from 2 to {num_sites - 2}, or {num_sites - 1}"
    holders = degree + 1
    if threshold > holders:
        return (
            f"secagg threshold {threshold} cannot be met: each site's seeds are shared among {holders} sites; "
            f"use {default_threshold(num_sites, degree)} to {holders}"
        )
    if threshold <= holders // 2:
        return (
            f"secagg threshold {threshold} is not a majority of the {holders} share holders (the server could "
            f"rebuild both a site's self-mask and its key); use {default_threshold(num_sites, degree)} to {holders}"
        )
    return None


def check_protocol(num_sites: int, threshold: int, degree: int | None = None) -> None:
    """`protocol_problem` as an exception."""
    problem = protocol_problem(num_sites, threshold, degree)
    if problem:
        raise SecAggError(problem)


def neighbours(index: int, num_sites: int, degree: int | None = None) -> tuple[int, ...]:
    """The sites that hold ``index``'s shares and share a pairwise mask with it: itself and its ``degree`` nearest
    on the ring of positions (``degree`` / 2 on each side; every site for ``n - 1``), sorted."""
    degree = num_sites - 1 if degree is None else degree
    if degree >= num_sites - 1:
        return tuple(range(num_sites))
    half = degree // 2
    return tuple(sorted({(index + step) % num_sites for step in range(-half, half + 1)}))


def make_keys() -> SiteKeys:
    """Two fresh key pairs, made at the site (flwr's ECDH key generation)."""
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, private_key_to_bytes, public_key_to_bytes

    channel_sk, channel_pk = generate_key_pairs()
    mask_sk, mask_pk = generate_key_pairs()
    return SiteKeys(
        private_key_to_bytes(channel_sk),
        public_key_to_bytes(channel_pk),
        private_key_to_bytes(mask_sk),
        public_key_to_bytes(mask_pk),
    )


def agreed_key(secret_key: bytes, public_key: bytes) -> bytes:
    """The key two sites agree on (ECDH, then HKDF-SHA256; flwr's ``generate_shared_key``), urlsafe base64."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

    return generate_shared_key(bytes_to_private_key(secret_key), bytes_to_public_key(public_key))


def prg(seed: bytes, round_num: int, shapes: Mapping[str, tuple[int, ...]]) -> Arrays:
    """Uniform arrays modulo 2^`MODULUS_BITS` (uint64) of ``shapes`` (in sorted name order) from the ChaCha20
    keystream of the 32-byte ``seed``, the round number as the nonce."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    if len(seed) != SEED_BYTES:
        raise SecAggError(f"a mask seed must be {SEED_BYTES} bytes, got {len(seed)}")
    names = sorted(shapes)
    sizes = [math.prod(shapes[name]) for name in names]
    nonce = int(round_num).to_bytes(16, "little")
    stream = Cipher(algorithms.ChaCha20(seed, nonce), mode=None).encryptor().update(bytes(8 * sum(sizes)))
    flat = np.frombuffer(stream, dtype="<u8").astype(np.uint64) & _MASK
    out, start = {}, 0
    for name, size in zip(names, sizes, strict=True):
        out[name] = flat[start : start + size].reshape(shapes[name])
        start += size
    return out


def pairwise_seed(mask_sk: bytes, peer_mask_pk: bytes) -> bytes:
    """The 32-byte seed of the pairwise mask between the key's owner and the peer (the same from both sides)."""
    return base64.urlsafe_b64decode(agreed_key(mask_sk, peer_mask_pk))


def new_seed() -> bytes:
    """A fresh self-mask seed ``b`` from the operating system's random source."""
    return os.urandom(SEED_BYTES)


def share_secrets(b_seed: bytes, mask_sk: bytes, threshold: int, holders: int) -> list[tuple[bytes, bytes]]:
    """Shamir shares (flwr's ``create_shares``) of the self-mask seed and of the mask secret key: one
    ``(b share, key share)`` per holder, in the order of the site's `neighbours`."""
    from flwr.common.secure_aggregation.crypto.shamir import create_shares

    return list(zip(create_shares(b_seed, threshold, holders), create_shares(mask_sk, threshold, holders), strict=True))


def seal_shares(
    src: int,
    keys: SiteKeys,
    shares: Sequence[tuple[bytes, bytes]],
    holders: Sequence[int],
    channel_pks: Mapping[int, bytes],
) -> dict[int, bytes]:
    """Each holder's pair of shares, encrypted for it (flwr's Fernet under the agreed channel key) with the source
    and destination inside, so that a share the server misroutes or swaps is refused when opened."""
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_concat

    sealed = {}
    for dst, (b_share, sk_share) in zip(holders, shares, strict=True):
        plaintext = share_keys_plaintext_concat(src, dst, b_share, sk_share)
        sealed[dst] = encrypt(agreed_key(keys.channel_sk, channel_pks[dst]), plaintext)
    return sealed


def open_share(dst: int, src: int, keys: SiteKeys, sender_channel_pk: bytes, sealed: bytes) -> tuple[bytes, bytes]:
    """The ``(b share, key share)`` that ``src`` sealed for ``dst`` (this site), checked to be addressed so."""
    from cryptography.fernet import InvalidToken
    from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt
    from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate

    try:
        plaintext = decrypt(agreed_key(keys.channel_sk, sender_channel_pk), sealed)
    except InvalidToken:
        raise SecAggError(f"site {dst}: the share from site {src} does not open with their channel key") from None
    got_src, got_dst, b_share, sk_share = share_keys_plaintext_separate(plaintext)
    if (got_src, got_dst) != (src, dst):
        raise SecAggError(f"site {dst}: a share labelled {src}->{dst} says {got_src}->{got_dst}")
    return b_share, sk_share


def quantisation_step(clip_range: float = CLIP_RANGE, target_range: int = TARGET_RANGE) -> float:
    """One quantisation step: the bound on the rebuilt mean update's error per coordinate."""
    return 2 * clip_range / target_range


def quantise(
    update: Mapping[str, np.ndarray], clip_range: float = CLIP_RANGE, target_range: int = TARGET_RANGE
) -> Arrays:
    """flwr's stochastic quantisation of each array into ``[0, target_range]``, as uint64. A coordinate outside
    ``[-clip_range, clip_range]`` is refused (clipping it would change the model silently)."""
    from flwr.common.secure_aggregation.quantization import quantize

    names = sorted(update)
    values = [np.asarray(update[name], dtype=np.float64) for name in names]
    for name, value in zip(names, values, strict=True):
        peak = float(np.max(np.abs(value))) if value.size else 0.0
        if not np.isfinite(peak) or peak > clip_range:
            raise SecAggError(
                f"update entry {name!r} reaches {peak:.4g}, outside the quantisation range +-{clip_range}: "
                "lower the learning rate or the local epochs"
            )
    quantised = quantize(values, clip_range, target_range)
    return {name: q.astype(np.uint64) for name, q in zip(names, quantised, strict=True)}


def mask_update(
    index: int,
    weighted: Mapping[str, np.ndarray],
    b_seed: bytes,
    mask_sk: bytes,
    peer_mask_pks: Mapping[int, bytes],
    round_num: int,
) -> Arrays:
    """The site's masked input: its weighted quantised update (uint64) plus PRG(b) plus, for each neighbour j in
    ``peer_mask_pks`` (those that shared keys), +PRG(s_ij) for i < j and -PRG(s_ij) for i > j, modulo 2^48."""
    shapes = {name: np.shape(value) for name, value in weighted.items()}
    masked = {name: np.asarray(value, dtype=np.uint64).copy() for name, value in weighted.items()}
    _add(masked, prg(b_seed, round_num, shapes))
    for peer, peer_pk in sorted(peer_mask_pks.items()):
        if peer == index:
            continue
        mask = prg(pairwise_seed(mask_sk, peer_pk), round_num, shapes)
        _add(masked, mask) if index < peer else _subtract(masked, mask)
    return masked


def check_total_weight(total_weight: int, target_range: int = TARGET_RANGE) -> None:
    """Refuse a total weight whose weighted sum could pass the modulus (the sum would wrap and be wrong)."""
    if isinstance(total_weight, bool) or not isinstance(total_weight, int) or total_weight < 1:
        raise SecAggError(f"a weight must be a positive integer, got {total_weight!r}")
    if total_weight * target_range >= 2**MODULUS_BITS:
        raise SecAggError(
            f"total weight {total_weight} times the quantisation range {target_range} reaches 2^{MODULUS_BITS}: "
            f"at most {(2**MODULUS_BITS - 1) // target_range} training samples in a round"
        )


def weigh(quantised: Mapping[str, np.ndarray], weight: int) -> Arrays:
    """``weight * q`` (exact: `check_total_weight`)."""
    check_total_weight(weight)
    return {name: np.asarray(value, dtype=np.uint64) * np.uint64(weight) for name, value in quantised.items()}


def pack(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each array's values (below 2^48) as its low `WIRE_BYTES` little-endian bytes, flat uint8."""
    out = {}
    for name, value in arrays.items():
        raw = np.ascontiguousarray(np.asarray(value, dtype="<u8")).reshape(-1).view(np.uint8).reshape(-1, 8)
        out[name] = np.ascontiguousarray(raw[:, :WIRE_BYTES]).reshape(-1)
    return out


def unpack(packed: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> Arrays:
    """`pack`'s inverse, given each array's shape; a wrong length or set of names is refused."""
    if set(packed) != set(shapes):
        raise SecAggError(f"masked input with other entries than the model's: {sorted(set(packed) ^ set(shapes))}")
    out = {}
    for name, shape in shapes.items():
        raw = np.asarray(packed[name], dtype=np.uint8).reshape(-1)
        size = math.prod(shape)
        if raw.size != size * WIRE_BYTES:
            raise SecAggError(f"masked entry {name!r}: {raw.size} bytes, expected {size * WIRE_BYTES}")
        wide = np.zeros((size, 8), dtype=np.uint8)
        wide[:, :WIRE_BYTES] = raw.reshape(size, WIRE_BYTES)
        out[name] = wide.reshape(-1).view("<u8").astype(np.uint64).reshape(shape)
    return out


def masked_sum(inputs: Sequence[Mapping[str, np.ndarray]]) -> Arrays:
    """The sum of the masked inputs, modulo 2^48."""
    if not inputs:
        raise SecAggError("no masked input to sum")
    total = {name: np.asarray(value, dtype=np.uint64).copy() for name, value in inputs[0].items()}
    for masked in inputs[1:]:
        if set(masked) != set(total):
            raise SecAggError(f"masked inputs with different entries: {sorted(set(masked) ^ set(total))}")
        _add(total, masked)
    return total


def unmask_shares(
    holder: int,
    opened: Mapping[int, tuple[bytes, bytes]],
    summed: Sequence[int],
    dropped: Sequence[int],
    threshold: int,
) -> dict[int, bytes]:
    """What holder ``holder`` returns in the unmask stage: for each site in ``summed`` the share of its self-mask
    seed, for each in ``dropped`` the share of its mask secret key, from the shares it opened (``opened``: source ->
    (b share, key share)). Refused if the lists overlap (both shares of one site would let the server unmask its
    input) or if fewer than ``threshold`` sites are summed (too few for the sum to hide one)."""
    overlap = set(summed) & set(dropped)
    if overlap:
        raise SecAggError(f"site {holder}: sites {sorted(overlap)} asked as both summed and dropped; nothing returned")
    if len(set(summed)) < threshold:
        raise SecAggError(f"site {holder}: only {len(set(summed))} sites summed, fewer than the threshold {threshold}")
    out = {src: opened[src][0] for src in summed if src in opened}
    out.update({src: opened[src][1] for src in dropped if src in opened})
    return out


def rebuild(shares: Sequence[bytes], threshold: int, what: str) -> bytes:
    """A secret from at least ``threshold`` Shamir shares (flwr's ``combine_shares``)."""
    from flwr.common.secure_aggregation.crypto.shamir import combine_shares

    if len(shares) < threshold:
        raise SecAggError(f"{what}: {len(shares)} shares returned, the threshold is {threshold}")
    return combine_shares(list(shares)[:threshold])


def unmask(
    total: Mapping[str, np.ndarray],
    summed: Sequence[int],
    dropped: Sequence[int],
    returned: Mapping[int, Mapping[int, bytes]],
    mask_pks: Mapping[int, bytes],
    num_sites: int,
    threshold: int,
    round_num: int,
    degree: int | None = None,
) -> Arrays:
    """``sum_i w_i q_i`` over ``summed`` from their masked sum: ``returned`` is each responding holder's
    `unmask_shares`; self-mask seeds of the summed sites and mask keys of the dropped ones (sites that shared keys
    but sent no masked input) are rebuilt from their holders' shares and their masks removed."""
    shapes = {name: np.shape(value) for name, value in total.items()}
    out = {name: np.asarray(value, dtype=np.uint64).copy() for name, value in total.items()}
    for site in summed:
        b_seed = rebuild([r[site] for r in returned.values() if site in r], threshold, f"site {site}'s self-mask")
        _subtract(out, prg(b_seed, round_num, shapes))
    summed_set = set(summed)
    for site in dropped:
        sk = rebuild([r[site] for r in returned.values() if site in r], threshold, f"site {site}'s mask key")
        for peer in neighbours(site, num_sites, degree):
            if peer not in summed_set:
                continue
            mask = prg(pairwise_seed(sk, mask_pks[peer]), round_num, shapes)
            # The peer added +mask if peer < site, else -mask: take that term back out.
            _subtract(out, mask) if peer < site else _add(out, mask)
    return out


def mean_update(
    weighted_sum: Mapping[str, np.ndarray],
    total_weight: int,
    clip_range: float = CLIP_RANGE,
    target_range: int = TARGET_RANGE,
) -> Arrays:
    """FedAvg's weighted mean update from ``sum_i w_i q_i`` (flwr's ``dequantize`` of the mean level)."""
    from flwr.common.secure_aggregation.quantization import dequantize

    check_total_weight(total_weight, target_range)
    names = sorted(weighted_sum)
    levels = [np.asarray(weighted_sum[name], dtype=np.uint64).astype(np.float64) / total_weight for name in names]
    return dict(zip(names, dequantize(levels, clip_range, target_range), strict=True))


def _add(target: Arrays, other: Mapping[str, np.ndarray]) -> None:
    for name in target:
        target[name] = (target[name] + other[name]) & _MASK  # uint64 wraps modulo 2^64, a multiple of 2^48


def _subtract(target: Arrays, other: Mapping[str, np.ndarray]) -> None:
    for name in target:
        target[name] = (target[name] - other[name]) & _MASK
