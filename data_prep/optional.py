"""Optional dependencies: what a site does not need, imported only where used, with the extra that installs it.

A site installs the bundle without its ``plots`` and ``digits`` extras (``pip install .``): torchmetrics, which
Lightning imports, imports scipy (scikit-learn's dependency) and matplotlib whenever they are installed, and that
costs every client process about a second of start-up under ``nvflare simulator -t 1`` and on real sites.
"""

from __future__ import annotations

import importlib
from types import ModuleType

PACKAGE = "nvflare-noniid"


def require(module: str, extra: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or a ModuleNotFoundError that names the extra which installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is None or exc.name.split(".")[0] != top:
            raise  # something inside the package is missing: not ours to explain
        raise ModuleNotFoundError(
            f"{purpose} needs {top}, which a site install leaves out: pip install '{PACKAGE}[{extra}]' "
            "(make setup installs it)",
            name=top,
        ) from exc
