"""Client algorithms by name (the name used by the job builder and ``jobs/client.py --client``)."""

from __future__ import annotations

from typing import Any

from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError
from lightning_modules.algorithms.feddyn import FedDyn
from lightning_modules.algorithms.fedmos import FedMoS
from lightning_modules.algorithms.fedprox import FedProx
from lightning_modules.algorithms.moon import Moon
from lightning_modules.algorithms.scaffold import Scaffold

CLIENT_ALGORITHMS: dict[str, type[ClientAlgorithm]] = {ClientAlgorithm.name: ClientAlgorithm, Scaffold.name: Scaffold}
CLIENT_ALGORITHMS[FedProx.name] = FedProx
CLIENT_ALGORITHMS[FedDyn.name] = FedDyn
CLIENT_ALGORITHMS[FedMoS.name] = FedMoS
CLIENT_ALGORITHMS[Moon.name] = Moon


def build_client_algorithm(name: str, **hparams: Any) -> ClientAlgorithm:
    """Instantiate the client algorithm ``name``; unknown names list the valid ones."""
    try:
        algorithm_cls = CLIENT_ALGORITHMS[name]
    except KeyError:
        raise ClientAlgorithmError(
            f"unknown client algorithm '{name}'; choose one of {sorted(CLIENT_ALGORITHMS)}"
        ) from None
    try:
        return algorithm_cls(**hparams)
    except TypeError as exc:
        raise ClientAlgorithmError(f"bad hyperparameters for client algorithm '{name}': {exc}") from None
