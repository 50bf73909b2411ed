"""Build-time checks of a job with DP-SGD at its sites: every refusal is one line naming the setting and what is
allowed (``jobs/spec.py`` raises it as a ``JobBuildError`` before anything is written)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning_modules.privacy.config import PRIVACY_EXTRA, privacy_config_problem

DP_FIELDS = ("dp_noise_multiplier", "dp_max_grad_norm", "dp_target_epsilon", "dp_release_site_scores")


def is_private(spec: Any) -> bool:
    return spec.dp_noise_multiplier is not None or spec.dp_target_epsilon is not None


def privacy_problem(spec: Any, algorithm: Any, build_model: Callable[[], Any]) -> str | None:
    """Why the job's DP settings cannot run (``None`` when DP is off and no DP setting is given, or all is well).
    ``algorithm`` is the job's client algorithm; ``build_model()`` builds the job's model (called last)."""
    if not is_private(spec):
        given = [name for name in DP_FIELDS if getattr(spec, name, None) not in (None, False)]
        return f"{given[0]} is set but DP-SGD is off: give dp_noise_multiplier or dp_target_epsilon" if given else None
    problem = privacy_config_problem(
        spec.dp_max_grad_norm, spec.dp_noise_multiplier, spec.dp_delta, spec.dp_target_epsilon
    )
    if problem is None:
        problem = _job_problem(spec)
    if problem is None:
        try:
            import opacus  # noqa: F401  (the builder checks the model with it, as the sites will)
        except ImportError:
            return f"DP-SGD needs Opacus, which is not installed here: pip install '{PRIVACY_EXTRA}'"
        from lightning_modules.privacy.dp_sgd import dp_problem

        problem = dp_problem(algorithm, build_model(), spec.precision, spec.devices)
    return problem or _first_round_problem(spec)


def _job_problem(spec: Any) -> str | None:
    if spec.script is not None:
        return (
            "DP-SGD with --script: your own training script builds its own loader and optimizer, which the bundle "
            "cannot make private; use --model and --data"
        )
    if spec.finetune_epochs:
        return (
            f"finetune_epochs {spec.finetune_epochs} under DP-SGD: the fine-tuned copy trains on the data outside "
            "DP-SGD and its scores would be withheld; use finetune_epochs 0"
        )
    if spec.dp_noise_multiplier == 0 and spec.dp_target_epsilon is not None:
        return "dp_noise_multiplier 0 with dp_target_epsilon: without noise one step already has epsilon infinite"
    return None


def _first_round_problem(spec: Any) -> str | None:
    """With both sigma and a budget, and the bundle's own datasets (whose site sizes the builder can work out): a
    budget that some site's first round already exceeds. With your own data the site refuses it at its first round."""
    if spec.dp_noise_multiplier is None or spec.dp_target_epsilon is None or spec.model is not None:
        return None
    from lightning_modules.privacy.accountant import Segment, epsilon
    from lightning_modules.privacy.dp_sgd import planned_epochs

    for site, n in builtin_site_sizes(spec).items():
        batches = math.ceil(n / spec.batch_size)
        one_round = Segment(1 / batches, spec.dp_noise_multiplier, planned_epochs(spec) * batches)
        eps = epsilon([one_round], spec.dp_delta)
        if eps > spec.dp_target_epsilon:
            return (
                f"dp_target_epsilon {spec.dp_target_epsilon:g}: {site}'s first round alone ({one_round.steps} steps "
                f"at q={one_round.sample_rate:.4g}, sigma {spec.dp_noise_multiplier:g}) spends epsilon {eps:.4g}; "
                "raise the budget or sigma, or leave sigma out to calibrate it"
            )
    return None


def builtin_site_sizes(spec: Any) -> dict[str, int]:
    """Training samples of every simulated site of a built-in dataset (after its validation and test hold-outs)."""
    from lightning_modules.site import builtin_split_sizes

    return {site: sizes[0] for site, sizes in builtin_split_sizes(spec).items()}
