"""The one exception type of ``data_prep``.

Every user-facing failure (bad name, missing file, impossible partition) raises `DataPrepError` with a
single-line message that says what is wrong and how to fix it, so the CLI and the NVFlare client can show it
without a traceback.
"""

from __future__ import annotations

__all__ = ["DataPrepError"]


class DataPrepError(ValueError):
    """Invalid data-preparation input, or data that cannot be found or parsed.

    Subclasses ``ValueError`` so callers that already guard against bad values keep working.
    """
