"""FLModel <-> ClientUpdate: the only place server-side code touches NVFlare's result type.

Every result is validated before a rule sees it (docs/design.md, decision 8): a site whose result has wrong keys,
wrong shapes, NaN/Inf, a bad sample count or missing required meta is rejected *by name*, and the round goes on
with the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from aggregators.types import ClientUpdate
from controllers.engine import SiteResult, validate_result  # the engine's one validation path
from controllers.rejection import Rejection  # also imported from here by the NVFlare aggregator and tests


def result_site(result: Any) -> str:
    """The sending site's name as NVFlare records it in the result meta."""
    return str((getattr(result, "meta", None) or {}).get("client_name", "<unknown site>"))


UpdateCheck = Callable[[ClientUpdate], list[str]]


def to_client_update(
    result: Any,
    global_params: Mapping[str, np.ndarray],
    required_meta: Iterable[str] = (),
    rule_check: UpdateCheck | None = None,
) -> ClientUpdate | Rejection:
    """Validate one NVFlare ``FLModel`` result and convert it, or say why it cannot be used.

    ``rule_check`` adds the aggregation rule's own checks (e.g. the SCAFFOLD control's keys and shapes).
    """
    site_result = SiteResult(
        site=result_site(result),
        params=getattr(result, "params", None) or {},
        meta=getattr(result, "meta", None) or {},
    )
    return validate_result(site_result, global_params, required_meta, rule_check)


def split_results(
    results: Sequence[Any],
    global_params: Mapping[str, np.ndarray],
    required_meta: Iterable[str] = (),
    rule_check: UpdateCheck | None = None,
) -> tuple[list[ClientUpdate], list[Rejection]]:
    """Accepted updates (sorted by site so aggregation never depends on arrival order) and rejections."""
    required = tuple(required_meta)
    converted = [to_client_update(r, global_params, required, rule_check) for r in results]
    updates = sorted((c for c in converted if isinstance(c, ClientUpdate)), key=lambda u: u.site)
    rejections = [c for c in converted if isinstance(c, Rejection)]
    return updates, rejections
