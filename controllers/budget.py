"""Privacy budgets at the server: which sites have spent theirs, and whether the job can go on without them.

A DP site with a budget (``dp_target_epsilon``) sends, with every result, its epsilon so far, its budget and the
epsilon its next round would reach (``privacy.*``: functions of the settings, its size and its step count, so
public). Once the next round would exceed the budget, the round engine sends that site no more rounds: it would
refuse them before training anyway, and a round it is sent but cannot train would hold up the others. When fewer
sites remain than a round needs, the job ends at that round, before anyone trains on a result that could not be
used (docs/privacy.md, "Budget").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aggregators.contracts import meta_keys

#: The site's own check (lightning_modules/privacy/dp_sgd.py) allows the same relative slack.
TOLERANCE = 1e-9


def spent_budget(meta: Mapping[str, Any]) -> str | None:
    """What a result's meta says when its site cannot afford another round (one phrase), else ``None``."""
    target, after = meta.get(meta_keys.PRIVACY_TARGET_EPSILON), meta.get(meta_keys.PRIVACY_NEXT_EPSILON)
    spent = meta.get(meta_keys.PRIVACY_EPSILON)
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (target, after, spent))
    if not numbers or after <= target * (1 + TOLERANCE):
        return None
    return f"epsilon {spent:.4g} of dp_target_epsilon {target:g} spent (its next round would reach {after:.4g})"


def required_sites(min_accepted: int, min_responses: int | None) -> int:
    """How many sites a round needs: the results it waits for (``min_responses``; all sampled when unset) and at
    least ``min_accepted`` valid ones."""
    return max(min_accepted, min_responses or 1)


def end_of_budget_message(round_num: int, out_of_budget: Mapping[str, str], remaining: int, needed: int) -> str:
    """The one line that ends a job whose remaining sites are too few for a round."""
    sites = "; ".join(f"{site}: {why}" for site, why in sorted(out_of_budget.items()))
    return (
        f"ending the job before round {round_num + 1}: {len(out_of_budget)} site(s) have spent their privacy "
        f"budget ({sites}); {remaining} site(s) remain, a round needs {needed}"
    )
