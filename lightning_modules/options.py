"""Client-script options as the site code reads them.

Its own module because both the built-in site (``lightning_modules.site``) and the user-model site
(``lightning_modules.own_model``) read JSON settings, and the user-model site builds on the built-in one's round
pieces, so the built-in site must not import it.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["json_arg"]


def json_arg(value: Any) -> dict[str, Any]:
    """A JSON setting as a dict, whether the command line gave text or the caller a mapping."""
    return json.loads(value) if isinstance(value, str) else dict(value or {})
