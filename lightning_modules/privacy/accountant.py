"""The privacy accountant: epsilon of a site's DP-SGD steps over every round, from its ledger (pure functions).

DP-SGD with Poisson sampling at rate q and noise multiplier sigma is the sampled Gaussian mechanism, once per step.
Its Renyi-DP at order alpha (Mironov, Talwar, Zhang 2019) adds up over steps, and over segments of steps run with
different (q, sigma); the total converts to (epsilon, delta)-DP by the conversion of Balle et al. 2020, minimised over
the orders. The per-order RDP and the conversion are Opacus's own functions (``opacus.accountants.analysis.rdp``);
what is ours is the ledger they read (every step of every round, across process restarts) and the calibration of
sigma to a budget. The orders are Opacus's default grid, so a ledger of one segment gives the epsilon of Opacus's
``RDPAccountant`` for the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_modules.privacy.config import PRIVACY_EXTRA

#: Opacus's default RDP orders (``RDPAccountant.DEFAULT_ALPHAS``).
DEFAULT_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
#: The largest sigma `noise_for_budget` searches; a budget that needs more is refused as unreachable.
MAX_NOISE_MULTIPLIER = 1000.0


class AccountantUnavailable(ImportError):
    """Opacus (the ``privacy`` extra) is not installed."""


@dataclass(frozen=True)
class Segment:
    """``steps`` DP-SGD steps at sample rate ``sample_rate`` (q) with noise multiplier ``noise_multiplier``."""

    sample_rate: float
    noise_multiplier: float
    steps: int


def _rdp_analysis():
    try:
        from opacus.accountants.analysis import rdp
    except ImportError:
        raise AccountantUnavailable(
            f"DP-SGD needs Opacus, which is not installed: pip install '{PRIVACY_EXTRA}'"
        ) from None
    return rdp


def rdp_curve(segments: Sequence[Segment], orders: Sequence[float] = DEFAULT_ORDERS) -> list[float]:
    """Total RDP at every order: the per-step RDP of each segment times its steps, summed over the segments."""
    rdp = _rdp_analysis()
    total = [0.0] * len(orders)
    for segment in segments:
        if segment.steps == 0:
            continue
        if segment.noise_multiplier == 0:  # no noise: no privacy at any order
            return [math.inf] * len(orders)
        per_order = rdp.compute_rdp(
            q=segment.sample_rate, noise_multiplier=segment.noise_multiplier, steps=segment.steps, orders=list(orders)
        )
        total = [a + float(b) for a, b in zip(total, per_order, strict=True)]
    return total


def epsilon(segments: Sequence[Segment], delta: float, orders: Sequence[float] = DEFAULT_ORDERS) -> float:
    """(epsilon, delta)-DP of all the ``segments`` together (0 for no steps, inf without noise)."""
    curve = rdp_curve(segments, orders)
    if all(value == 0 for value in curve):
        return 0.0
    if any(math.isinf(value) for value in curve):
        return math.inf
    eps, _ = _rdp_analysis().get_privacy_spent(orders=list(orders), rdp=curve, delta=delta)
    return float(eps)


def noise_for_budget(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    spent: Sequence[Segment] = (),
    tolerance: float = 1e-3,
) -> float:
    """The smallest sigma (within ``tolerance`` relative) at which ``spent`` plus ``steps`` more steps at
    ``sample_rate`` stay within ``target_epsilon``. Raises ``ValueError`` when even `MAX_NOISE_MULTIPLIER`
    does not fit (a budget the steps already spent, or one step, exceed)."""

    def total(sigma: float) -> float:
        return epsilon([*spent, Segment(sample_rate, sigma, steps)], delta)

    high = 1.0
    while total(high) > target_epsilon:
        high *= 2
        if high > MAX_NOISE_MULTIPLIER:
            raise ValueError(
                f"no noise multiplier up to {MAX_NOISE_MULTIPLIER:g} keeps epsilon within {target_epsilon:g} at "
                f"delta {delta:g} for {steps} steps at sample rate {sample_rate:.4g} (after {spent_steps(spent)} "
                "steps already spent)"
            )
    low = 0.0
    while high - low > tolerance * high:
        middle = (low + high) / 2
        low, high = (low, middle) if total(middle) <= target_epsilon else (middle, high)
    return high


def spent_steps(segments: Sequence[Segment]) -> int:
    return sum(segment.steps for segment in segments)
