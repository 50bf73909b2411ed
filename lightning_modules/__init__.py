"""Lightning side of the bundle: models, the built-in classifier, the client-algorithm callback and per-site state."""

from lightning_modules.classifier import FLClassifier
from lightning_modules.federated import FederatedAlgorithm

__all__ = ["FLClassifier", "FederatedAlgorithm"]
