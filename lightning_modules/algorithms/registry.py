"""Client algorithms by name (the name used by the job builder and ``jobs/client.py --client``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aggregators.registry import unknown_setting_problem
from lightning_modules.algorithms.apfl import APFL
from lightning_modules.algorithms.base import ClientAlgorithm, ClientAlgorithmError
from lightning_modules.algorithms.ditto import Ditto
from lightning_modules.algorithms.feddyn import FedDyn
from lightning_modules.algorithms.fedmos import FedMoS
from lightning_modules.algorithms.fedprox import FedProx
from lightning_modules.algorithms.fedrep import FedRep
from lightning_modules.algorithms.hparams import HParams
from lightning_modules.algorithms.moon import Moon
from lightning_modules.algorithms.scaffold import Scaffold

CLIENT_ALGORITHMS: dict[str, type[ClientAlgorithm]] = {ClientAlgorithm.name: ClientAlgorithm, Scaffold.name: Scaffold}
CLIENT_ALGORITHMS[FedProx.name] = FedProx
CLIENT_ALGORITHMS[FedDyn.name] = FedDyn
CLIENT_ALGORITHMS[FedMoS.name] = FedMoS
CLIENT_ALGORITHMS[Moon.name] = Moon
CLIENT_ALGORITHMS[FedRep.name] = FedRep
CLIENT_ALGORITHMS[Ditto.name] = Ditto
CLIENT_ALGORITHMS[APFL.name] = APFL


def declared_hparams(algorithm_cls: type[ClientAlgorithm]) -> type[HParams] | None:
    """The hyperparameter dataclass whose fields are the algorithm's constructor arguments, or ``None`` for a class
    with a constructor of its own and no declaration (a user's algorithm: its constructor checks its arguments)."""
    for klass in algorithm_cls.__mro__:
        if "hparams_class" in vars(klass):
            return vars(klass)["hparams_class"]
        if "__init__" in vars(klass):  # a constructor below the nearest declaration takes arguments of its own
            return None
    return None


def client_args_problem(name: str, hparams: Iterable[str]) -> str | None:
    """Why ``hparams`` cannot be the settings of the client algorithm ``name`` (keys it does not declare), or
    ``None``; the job builder words its refusal with it before anything is built."""
    declared = declared_hparams(_algorithm_class(name))
    return None if declared is None else unknown_setting_problem(name, hparams, declared.names())


def _algorithm_class(name: str) -> type[ClientAlgorithm]:
    try:
        return CLIENT_ALGORITHMS[name]
    except KeyError:
        raise ClientAlgorithmError(
            f"unknown client algorithm '{name}'; choose one of {sorted(CLIENT_ALGORITHMS)}"
        ) from None


def build_client_algorithm(name: str, **hparams: Any) -> ClientAlgorithm:
    """Instantiate the client algorithm ``name``; unknown names list the valid ones, unknown hyperparameters the
    declared ones, and the algorithm's dataclass refuses bad values."""
    algorithm_cls = _algorithm_class(name)
    problem = client_args_problem(name, hparams)
    if problem:
        raise ClientAlgorithmError(f"bad hyperparameters for client algorithm '{name}': {problem}")
    try:
        return algorithm_cls(**hparams)
    except TypeError as exc:
        raise ClientAlgorithmError(f"bad hyperparameters for client algorithm '{name}': {exc}") from None
