"""The DP-SGD settings of a site (``--dp-*`` options), checked once: pure Python, no Opacus."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: The extra that brings Opacus (pyproject.toml); named in every "not installed" message.
PRIVACY_EXTRA = "nvflare-noniid[privacy]"


@dataclass(frozen=True)
class PrivacyConfig:
    """DP-SGD at a site: per-sample clipping to ``max_grad_norm`` (C), Gaussian noise ``noise_multiplier`` (sigma)
    times C, Poisson sampling, accounted at ``delta``. ``target_epsilon`` is the site's budget: without sigma, sigma
    is calibrated so that the planned rounds spend exactly the budget; with sigma, the budget is a cap. Either way a
    site whose next round would exceed the budget stops (docs/privacy.md)."""

    max_grad_norm: float
    noise_multiplier: float | None = None
    delta: float = 1e-5
    target_epsilon: float | None = None
    release_site_scores: bool = False  # eval.* and the final scores leave the site, unaccounted (the job says so)

    def __post_init__(self) -> None:
        problem = privacy_config_problem(self.max_grad_norm, self.noise_multiplier, self.delta, self.target_epsilon)
        if problem:
            raise ValueError(problem)

    @classmethod
    def from_namespace(cls, args: Any) -> PrivacyConfig | None:
        """The site's DP settings from the client options, or ``None`` when DP is off (neither ``dp_noise_multiplier``
        nor ``dp_target_epsilon`` set)."""
        sigma, target = getattr(args, "dp_noise_multiplier", None), getattr(args, "dp_target_epsilon", None)
        if sigma is None and target is None:
            return None
        return cls(
            max_grad_norm=getattr(args, "dp_max_grad_norm", None),  # None is refused by the check
            noise_multiplier=sigma,
            delta=getattr(args, "dp_delta", 1e-5),
            target_epsilon=target,
            release_site_scores=bool(getattr(args, "dp_release_site_scores", False)),
        )


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def privacy_config_problem(max_grad_norm: Any, noise_multiplier: Any, delta: Any, target_epsilon: Any) -> str | None:
    """One line naming the DP setting that cannot be used and what is allowed, or ``None``."""
    if noise_multiplier is None and target_epsilon is None:
        return "DP-SGD needs dp_noise_multiplier (sigma) or dp_target_epsilon (the budget sigma is calibrated to)"
    if not _finite(max_grad_norm) or max_grad_norm <= 0:
        return f"dp_max_grad_norm (C) must be a finite number > 0 when DP-SGD is on, got {max_grad_norm!r}"
    if noise_multiplier is not None and (not _finite(noise_multiplier) or noise_multiplier < 0):
        return f"dp_noise_multiplier (sigma) must be a finite number >= 0, got {noise_multiplier!r}"
    if not _finite(delta) or not 0 < delta < 1:
        return f"dp_delta must be a finite number in (0, 1), got {delta!r}"
    if target_epsilon is not None and (not _finite(target_epsilon) or target_epsilon <= 0):
        return f"dp_target_epsilon must be a finite number > 0, got {target_epsilon!r}"
    return None
