"""Lightning side of the bundle: models, the classifier module, client algorithms and per-site state."""

from lightning_modules.classifier import FLClassifier
from lightning_modules.fl_callback import FederatedRoundCallback

__all__ = ["FLClassifier", "FederatedRoundCallback"]
