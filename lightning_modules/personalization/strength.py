"""A personal method at several strengths, and the one a site's validation prefers (Ditto's ``lam_grid``;
docs/personalization.md, "Candidates").

A method that offers several personal models of one kind (`ClientAlgorithm.personal_options`: Ditto trains one v_i
per lam) has each scored on the site's validation split after the round, with the same scorer as the single
personal model; the site keeps the one with the best validation score (`preferred`) as its personal model of the
round. Keep best (lightning_modules/keep_best.py) takes the best of its challengers on the same validation score, so
choosing among the strengths first and offering the winner is the same as offering each one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def preferred(scores: Mapping[float, Mapping[str, float]], metric: str, lower_is_better: bool) -> float:
    """The option (a strength) whose validation ``metric`` is best; ties, and options whose score is missing or not
    finite, go to the earlier option; with no finite score at all, the first option."""
    if not scores:
        raise ValueError("preferred: no personal model to choose from")
    sign = 1.0 if lower_is_better else -1.0
    finite = [
        (sign * float(value), index, option)
        for index, (option, named) in enumerate(scores.items())
        if (value := named.get(metric)) is not None and math.isfinite(float(value))
    ]
    return min(finite)[2] if finite else next(iter(scores))


__all__ = ["preferred"]
