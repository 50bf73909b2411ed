"""Differential privacy for the federated QC counts: integer Gaussian noise a site adds before its counts leave it.

Opt-in (``qc-job --dp-target-epsilon``; docs/genomics.md, "Noisy counts"). A site's release is its (S, 4) genotype
counts (``qc.genotype_counts``) plus independent discrete Gaussian noise on every cell.

Sensitivity of one person's counts. Each person adds exactly 1 to exactly one of the 4 cells of every SNP (0, 1 or 2
alt copies, or missing). So, over S SNPs:

- add/remove one person: every SNP's row changes by one unit in one cell, L1 = S and L2 = sqrt(S);
- substitute one person for another: each SNP where the two differ loses 1 in one cell and gains 1 in another, so at
  worst (they differ everywhere) L1 = 2S and L2 = sqrt(2S).

Both are attained. The bundle accounts under add/remove, the relation its DP-SGD ledger uses (Poisson sampling), so
that the QC release and training steps read on one scale; under substitution the same noise gives the epsilon of a
noise multiplier sqrt(2) smaller.

The mechanism. The noise on each cell is the discrete Gaussian N_Z(0, sigma^2), P(x) proportional to
exp(-x^2 / (2 sigma^2)) on the integers, with sigma = z * sqrt(S) for the job's noise multiplier z. Canonne, Kamath
and Steinke (NeurIPS 2020, "The Discrete Gaussian for Differential Privacy", multivariate case) show that the product of
discrete Gaussians with L2 sensitivity Delta satisfies the concentrated DP Delta^2 / (2 sigma^2) of the continuous
Gaussian: its Renyi DP at every order alpha is at most alpha / (2 z^2), the continuous Gaussian's. So one QC release
is accounted as one step of the Gaussian mechanism at sample rate 1 and noise multiplier z, by the same maintained
accountant (Opacus's RDP analysis) and ledger as DP-SGD (``lightning_modules/privacy/qc_release.py``). Integer
noise keeps the counts integers, so the HE sum still rounds exactly.

Each site's noise alone meets the job's epsilon ("local" calibration): every view of a site's counts (the server's
in the clear, another site's decrypted sum under HE, any collusion of the other sites) contains that site's own noise
and everything else in it is independent of the site's people, so the guarantee holds by post-processing whoever
else adds noise. The price: the sum over k sites carries k shares of noise (variance k sigma^2). Splitting the noise
into shares that only add up to sigma (distributed discrete Gaussian or Skellam) would need an accountant for a sum
of discrete Gaussians that no maintained library offers, and a server in the clear would see one small share.

This module is the mechanism only (pure numpy): settings, sensitivity, the sampler and what the QC reads from noisy
counts. The draws' generator is the caller's: at a site it is secret (``qc_release``), never a function of the job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_prep.errors import DataPrepError

__all__ = [
    "DEFAULT_DELTA",
    "RELATIONS",
    "QcNoise",
    "discrete_gaussian",
    "discrete_gaussian_pmf",
    "l1_sensitivity",
    "l2_sensitivity",
    "noisy_counts",
    "usable_counts",
]

#: The delta a QC release is accounted at unless the job says otherwise (DP-SGD's default, ``--dp-delta``).
DEFAULT_DELTA = 1e-5
#: Neighbouring datasets: one person added or removed (the accounted one), or one person replaced by another.
RELATIONS = ("add_remove", "substitution")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class QcNoise:
    """A QC job's noise settings, checked once (at export and again at the site). ``target_epsilon`` is the site's
    budget for the QC run: without ``noise_multiplier`` (z) the site calibrates z so that its release spends exactly
    the budget left in its ledger; with z the budget is a cap the release must fit. Noise without a budget is
    refused: nothing would bound what the site spends."""

    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = DEFAULT_DELTA

    def __post_init__(self) -> None:
        if self.target_epsilon is None:
            raise DataPrepError(
                f"QC: noise multiplier {self.noise_multiplier!r} without a privacy budget: a noisy QC release is "
                "accounted against the site's budget; add --dp-target-epsilon (the epsilon a site may spend on its "
                "counts); nothing sent"
            )
        if not _finite(self.target_epsilon) or self.target_epsilon <= 0:
            raise DataPrepError(f"QC: dp_target_epsilon must be a finite number > 0, got {self.target_epsilon!r}")
        if self.noise_multiplier is not None and (not _finite(self.noise_multiplier) or self.noise_multiplier <= 0):
            raise DataPrepError(
                f"QC: dp_noise_multiplier must be a finite number > 0 (or left out to calibrate it to the budget), "
                f"got {self.noise_multiplier!r}"
            )
        if not _finite(self.delta) or not 0 < self.delta < 1:
            raise DataPrepError(f"QC: dp_delta must be a finite number in (0, 1), got {self.delta!r}")

    @classmethod
    def from_options(
        cls, noise_multiplier: float | None, target_epsilon: float | None, delta: float | None
    ) -> QcNoise | None:
        """The settings from the ``--dp-*`` options, or ``None`` when the job adds no noise (none of the three)."""
        if noise_multiplier is None and target_epsilon is None:
            if delta is not None:
                raise DataPrepError("QC: --dp-delta without --dp-target-epsilon: the QC adds no noise; drop it")
            return None
        return cls(noise_multiplier, target_epsilon, DEFAULT_DELTA if delta is None else delta)

    def script_args(self) -> str:
        """The site script's options that carry these settings (the signed job config is the sites' source)."""
        args = f"--dp-target-epsilon {self.target_epsilon!r} --dp-delta {self.delta!r}"
        if self.noise_multiplier is not None:
            args += f" --dp-noise-multiplier {self.noise_multiplier!r}"
        return args


def l2_sensitivity(n_snps: int, relation: str = "add_remove") -> float:
    """L2 norm of the largest change one person makes to (S, 4) counts (module docstring): sqrt(S) for add/remove,
    sqrt(2 S) for substitution."""
    return math.sqrt(_per_snp(relation) * _snps(n_snps))


def l1_sensitivity(n_snps: int, relation: str = "add_remove") -> int:
    """L1 norm of the same change: S for add/remove, 2 S for substitution."""
    return _per_snp(relation) * _snps(n_snps)


def _per_snp(relation: str) -> int:
    if relation not in RELATIONS:
        raise DataPrepError(f"QC: relation must be one of {', '.join(RELATIONS)}, got {relation!r}")
    return 1 if relation == "add_remove" else 2


def _snps(n_snps: int) -> int:
    if isinstance(n_snps, bool) or not isinstance(n_snps, int | np.integer) or n_snps < 1:
        raise DataPrepError(f"QC: the number of SNPs must be a whole number >= 1, got {n_snps!r}")
    return int(n_snps)


def discrete_gaussian_pmf(values: np.ndarray, sigma: float) -> np.ndarray:
    """P(X = x) of the discrete Gaussian N_Z(0, sigma^2), normalised over the integers within 40 sigma of 0 (the
    mass beyond is below 1e-300)."""
    support = np.arange(-math.ceil(40 * sigma) - 1, math.ceil(40 * sigma) + 2)
    norm = np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma**2)).sum()
    return np.exp(-(np.asarray(values, np.float64) ** 2) / (2 * sigma**2)) / norm


def discrete_gaussian(shape: tuple[int, ...], sigma: float, rng: np.random.Generator) -> np.ndarray:
    """int64 draws of N_Z(0, sigma^2): Canonne, Kamath and Steinke's rejection sampler (2020), with a
    discrete Laplace of scale t = floor(sigma) + 1 as the proposal (a difference of two geometric draws) accepted with
    probability exp(-(|y| - sigma^2 / t)^2 / (2 sigma^2)). In double precision, as their reference sampler's float
    variant; the accounting (module docstring) is that of the exact distribution."""
    if not _finite(sigma) or sigma <= 0:
        raise DataPrepError(f"QC: the noise's sigma must be a finite number > 0, got {sigma!r}")
    size = int(np.prod(shape, dtype=np.int64))
    t = math.floor(sigma) + 1
    success = -math.expm1(-1.0 / t)  # geometric success probability: P(G = k) = (1 - e^{-1/t}) e^{-k/t}, k >= 0
    out = np.empty(size, np.int64)
    filled = 0
    while filled < size:
        want = max(2 * (size - filled), 64)  # acceptance is at least about 0.5 for every sigma
        y = rng.geometric(success, want) - rng.geometric(success, want)
        keep = rng.random(want) < np.exp(-((np.abs(y) - sigma**2 / t) ** 2) / (2 * sigma**2))
        accepted = y[keep][: size - filled]
        out[filled : filled + len(accepted)] = accepted
        filled += len(accepted)
    return out.reshape(shape)


def noisy_counts(counts: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """(S, 4) int64: ``counts`` plus independent N_Z(0, sigma^2) on every cell (may be negative; rows no longer add
    up to one number of people: that is the point)."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[1] != 4:
        raise DataPrepError(f"QC: genotype counts must be SNPs x 4, got shape {counts.shape}")
    return counts.astype(np.int64) + discrete_gaussian(counts.shape, sigma, rng)


def usable_counts(noisy: np.ndarray) -> np.ndarray:
    """What the QC filter reads from a noisy sum: negative cells set to 0 (post-processing: no privacy cost)."""
    return np.maximum(np.asarray(noisy, np.int64), 0)
