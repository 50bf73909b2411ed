"""Client-side federated algorithms, one file each, driven by `lightning_modules.FLClassifier`."""

from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError, check_server_meta
from lightning_modules.algorithms.hparams import HParams, hparam
from lightning_modules.algorithms.registry import CLIENT_ALGORITHMS, build_client_algorithm, client_args_problem

__all__ = [
    "CLIENT_ALGORITHMS",
    "ClientAlgorithm",
    "ClientAlgorithmError",
    "HParams",
    "build_client_algorithm",
    "check_server_meta",
    "client_args_problem",
    "hparam",
]
