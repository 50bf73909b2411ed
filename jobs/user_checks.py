"""Build-time checks of a job with the user's own model and data (``--model``, ``--data``): what the job's client
algorithm and server rule need from them, refused before anything is written wherever it is knowable.

Knowable here: whether the data class defines ``train_dataloader``; whether the model (built with ``--model-args``)
has what the client algorithm declares it needs (:mod:`lightning_modules.protocols`); and which optimizer its
``configure_optimizers()`` returns, when it returns one without a trainer. A ``configure_optimizers`` that needs the
trainer is skipped here: the site refuses the same problem when the round starts, with the site's name.
"""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl

from jobs.settings import JobBuildError


def check_user_job(spec: Any, module: pl.LightningModule) -> None:
    """Raise :class:`JobBuildError` (one line naming the path) for the first problem of ``spec``'s user code;
    ``module`` is the model the builder already built from ``spec.model`` and ``spec.model_args``."""
    problem = data_problem(spec) or algorithm_problem(spec, module)
    if problem:
        raise JobBuildError(problem)


def data_problem(spec: Any) -> str | None:
    from lightning_modules.own_model import training_data_problem, user_class

    if spec.data is None:  # --script without --data: the user's script brings its own data
        return None
    return training_data_problem(spec.data, user_class(spec.data, pl.LightningDataModule, "data"))


def algorithm_problem(spec: Any, module: pl.LightningModule) -> str | None:
    """What the job's client algorithm or server rule cannot run with in ``module`` or its optimizer."""
    from aggregators import RULES
    from lightning_modules.algorithms import ClientAlgorithmError, build_client_algorithm
    from lightning_modules.protocols import configured_optimizer, module_problem, optimizer_problem

    try:
        algorithm = build_client_algorithm(spec.client, **spec.client_args)
    except (ClientAlgorithmError, TypeError, ValueError):
        return None  # bad client_args: the builder's client_args check refuses them with their own message
    problem = module_problem(algorithm, module)
    if problem is None:
        optimizer = configured_optimizer(module)
        problem = optimizer_problem(algorithm, RULES.get(spec.server), optimizer) if optimizer else None
    return f"model {spec.model!r}: {problem}" if problem else None
