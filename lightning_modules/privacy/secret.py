"""The randomness of the privacy mechanisms: secret, never a function of the job.

Differential privacy holds against an adversary who knows everything except the mechanism's random draws: the job's
configuration (its ``--seed`` included), the model the site received, the server's meta and every record but one.
If DP-SGD's Poisson sample or its Gaussian noise were drawn from a generator seeded by the job's seed (as the rest
of a round is, so that simulations repeat bit for bit), that adversary could replay the round with and without one
record and see which replay matches the released model, or draw the same noise with a dummy site and subtract it:
the guarantee would be void whatever the ledger says (``tests/lightning_modules/test_dp_attacks.py`` plays both).

So every privacy draw comes from a ``torch.Generator`` seeded here with 63 bits of the operating system's entropy
(`secrets`), a fresh seed for every round of every site, kept in memory only and never written or sent. A site
needs no continuity of these draws across restarts: each round's draws only need to be unknown to everyone else.

What this is and is not (docs/privacy.md, "Secret randomness"): the seed is unpredictable, but the generator it
seeds (torch's Mersenne Twister on the CPU, Philox on a GPU) is not a cryptographically secure generator, and a
double-precision Gaussian sampler leaks through its floating-point representation in principle (the attacks that
Opacus's ``secure_mode`` guards against). Opacus's full secure mode needs ``torchcsprng``, which has no release for
torch 2.x; the floating-point hardening part of it (several Gaussian draws summed) is what `SECURE_NOISE`
turns on in the DP step.
"""

from __future__ import annotations

import secrets

import torch

#: Opacus's floating-point-robust Gaussian sampling (sum of four draws over 2): on in the DP step. Its cost, measured
#: by ``python -m benchmarks.dp_overhead``, is in docs/privacy.md.
SECURE_NOISE = True


class _SecretGenerator(torch.Generator):
    """A generator that `is_secret` recognises by its type. A type, not a registry of instances: torch 2.11's
    generators cannot be weakly referenced (measured on a GPU machine), and a strong registry would keep every
    round's generator alive."""


def entropy_seed() -> int:
    """63 bits of the operating system's entropy: the only source of every privacy draw's seed."""
    return secrets.randbits(63)


def secret_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator on ``device`` seeded from `entropy_seed`, registered as secret (`is_secret`)."""
    generator = _SecretGenerator(device=device)
    generator.manual_seed(entropy_seed())
    return generator


def is_secret(generator: torch.Generator | None) -> bool:
    """Whether ``generator`` came from `secret_generator` (``None``, torch's global generator, is seeded from
    the job's seed at every round, so it is not)."""
    return isinstance(generator, _SecretGenerator)
