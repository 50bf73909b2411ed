"""Lightning side of the bundle: models, the built-in classifier, the client-algorithm callback and per-site state.

The two names below load on first use (PEP 562): the server imports this package's plain-torch parts (the state
store) and must not pay for importing Lightning, about 3 s of CPU in every server process."""

from typing import Any

__all__ = ["FLClassifier", "FederatedAlgorithm"]


def __getattr__(name: str) -> Any:
    if name == "FLClassifier":
        from lightning_modules.classifier import FLClassifier

        return FLClassifier
    if name == "FederatedAlgorithm":
        from lightning_modules.federated import FederatedAlgorithm

        return FederatedAlgorithm
    raise AttributeError(f"module 'lightning_modules' has no attribute {name!r}")
