"""Client-side federated algorithms, one file each, driven by :class:`lightning_modules.FLClassifier`."""

from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError, check_server_meta
from lightning_modules.algorithms.registry import CLIENT_ALGORITHMS, build_client_algorithm

__all__ = [
    "CLIENT_ALGORITHMS",
    "ClientAlgorithm",
    "ClientAlgorithmError",
    "build_client_algorithm",
    "check_server_meta",
]
