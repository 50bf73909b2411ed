"""Where a site's round learns the server meta: NVFlare's received model, or a function given in process.

`lightning_modules.federated.FederatedAlgorithm` reads the meta once per round, after NVFlare's FLCallback
has loaded the global weights; the in-process runner and the tests hand it a plain function instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

MetaSource = Callable[[], Mapping[str, Any]]


def nvflare_meta_source() -> Mapping[str, Any]:
    """The server meta of the model received this round (NVFlare caches it for the whole fit)."""
    import nvflare.client as flare

    received = flare.receive()
    return dict(received.meta or {}) if received is not None else {}
