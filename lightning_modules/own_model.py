"""A site that trains the user's own LightningModule on the user's own LightningDataModule, named by import path.

The job says ``--model pkg.module:Class --model-args JSON --data pkg.module:DataModule --data-args JSON``; every site
builds both, attaches the client algorithm as a callback (:class:`lightning_modules.federated.FederatedAlgorithm`),
lets NVFlare's ``flare.patch`` load the global weights and send the result, and each round

1. evaluates the received global model on its own validation split (``trainer.validate``, when the module has a
   ``validation_step`` and the data module a ``val_dataloader``); the logged metrics travel as ``eval.<name>`` meta
   and the server logs them per site, with the sample-weighted mean, the worst site and the spread;
2. trains locally with the module's own optimizer (fresh every round, as FedAvg's clients are), seeded per
   (job seed, site, round) so that one-process and process-per-round simulations give the same bits.

Data modules learn which site they run on: a constructor that takes ``site`` (and ``num_sites``) gets them, so one
class can shard a public dataset in simulation and read the site's own files in a real deployment.
"""

from __future__ import annotations

import importlib
import inspect
import json
from collections.abc import Mapping
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities.model_helpers import is_overridden

from lightning_modules.algorithms.base import ClientAlgorithmError

IMPORT_PATH_FORMAT = "'package.module:ClassName'"


class UserCodeError(ClientAlgorithmError):
    """The user's model or data class cannot be imported or used (the message names the path and the site)."""


def load_object(path: str, what: str = "class") -> Any:
    """The object at ``package.module:Name``; errors name the path and what went wrong."""
    module_name, _, attribute = str(path).partition(":")
    if not module_name or not attribute:
        raise UserCodeError(f"{what} import path must look like {IMPORT_PATH_FORMAT}, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserCodeError(
            f"{what} {path!r}: cannot import module {module_name!r} ({exc}); is the package installed on this "
            "machine or shipped with the job (--ship)?"
        ) from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise UserCodeError(f"{what} {path!r}: module {module_name!r} has no attribute {attribute!r}") from None


def user_class(path: str, base: type, what: str) -> type:
    """The class at ``path``, checked to be a subclass of ``base``."""
    cls = load_object(path, what)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserCodeError(f"{what} {path!r} is {cls!r}, not a subclass of {base.__module__}.{base.__name__}")
    return cls


def build_user_module(path: str, args: Mapping[str, Any] | None = None) -> pl.LightningModule:
    cls = user_class(path, pl.LightningModule, "model")
    try:
        return cls(**dict(args or {}))
    except TypeError as exc:
        raise UserCodeError(f"model {path!r}: bad model_args {dict(args or {})}: {exc}") from None


def build_user_data(
    path: str, args: Mapping[str, Any] | None = None, site: str = "local", num_sites: int | None = None
) -> pl.LightningDataModule:
    """The data module, told its site (and the number of sites) when its constructor takes them."""
    cls = user_class(path, pl.LightningDataModule, "data")
    kwargs = dict(args or {})
    parameters = inspect.signature(cls).parameters
    if "site" in parameters:
        kwargs.setdefault("site", site)
    if "num_sites" in parameters and num_sites is not None:
        kwargs.setdefault("num_sites", num_sites)
    try:
        data = cls(**kwargs)
    except TypeError as exc:
        raise UserCodeError(f"{site}: data {path!r}: bad data_args {dict(args or {})}: {exc}") from None
    if not is_overridden("train_dataloader", data, pl.LightningDataModule):
        raise UserCodeError(f"{site}: data {path!r} defines no train_dataloader(); a site needs training data")
    return data


def evaluates_at_the_site(module: pl.LightningModule, data: pl.LightningDataModule) -> bool:
    """True when the module can score the global model on the site's validation split."""
    return is_overridden("validation_step", module, pl.LightningModule) and is_overridden(
        "val_dataloader", data, pl.LightningDataModule
    )


def run_site(args: Any) -> None:
    """The client loop for a user model (called by ``jobs/client.py`` when the job names ``--model``)."""
    import nvflare.client.lightning as flare
    import torch

    from data_prep.site_config import seed_index
    from lightning_modules.federated import FederatedAlgorithm
    from lightning_modules.site import local_epochs, make_trainer, round_seed
    from lightning_modules.state_store import ClientStateStore, default_state_root

    flare.init()
    site = flare.get_site_name()
    module = build_user_module(args.model, _json(args.model_args))
    data = build_user_data(args.data, _json(args.data_args), site, args.num_sites)
    callback = FederatedAlgorithm(
        args.client,
        algorithm_args=_json(args.client_args),
        site=site,
        state_store=ClientStateStore(default_state_root() / flare.get_job_id(), site),
    )
    evaluate = evaluates_at_the_site(module, data)
    if not evaluate:
        print(f"{site}: no validation_step/val_dataloader: the global model is not evaluated at this site")
    index = seed_index(site, args.num_sites)
    while flare.is_running():
        received = flare.receive()
        if received is None:
            break
        round_num = received.current_round or 0
        torch.manual_seed(round_seed(args.seed, index, round_num))
        trainer = make_trainer(args, callback, local_epochs(args, index, round_num))
        flare.patch(trainer, restore_state=False)  # a fresh optimizer every round, as FedAvg's clients have
        if evaluate:
            trainer.validate(module, datamodule=data, verbose=False)
        trainer.fit(module, datamodule=data)
        print(f"{site} round {round_num}: {json.dumps(_scalars(callback.last_meta), sort_keys=True)}", flush=True)


def _json(value: Any) -> dict[str, Any]:
    return json.loads(value) if isinstance(value, str) else dict(value or {})


def _scalars(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in meta.items() if isinstance(v, int | float)}
