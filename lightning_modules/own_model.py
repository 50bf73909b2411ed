"""A site that trains the user's own LightningModule on the user's own LightningDataModule, named by import path.

The job says ``--model pkg.module:Class --model-args JSON --data pkg.module:DataModule --data-args JSON``; every site
builds both, attaches the client algorithm as a callback (`lightning_modules.federated.FederatedAlgorithm`),
lets NVFlare's ``flare.patch`` load the global weights and send the result, and each round

1. evaluates the received global model on its own validation split (``trainer.validate``, when the module has a
   ``validation_step`` and the data module a ``val_dataloader``); the logged metrics travel as ``eval.<name>`` meta
   and the server logs them per site, with the sample-weighted mean, the worst site and the spread;
2. trains locally with the module's own optimizer (fresh every round, as FedAvg's clients are), seeded per
   (job seed, site, round) so that one-process and process-per-round simulations give the same bits;
3. scores its personal model on the same split, when a method provides one (``eval.personal_<name>``,
   lightning_modules/personal_scores.py): Ditto's v_i, or with ``finetune_epochs`` K > 0 a copy of the received
   model fine-tuned K epochs on the data module's ``train_dataloader`` (lightning_modules/finetune.py).

Data modules learn which site they run on: a constructor that takes ``site`` (and ``num_sites``) gets them, so one
class can shard a public dataset in simulation and read the site's own files in a real deployment; a parameter that
names the site otherwise (``site_name``) gets it with ``--data-site-arg site_name``. A constant for a parameter that
names the site is refused (`SITE_PARAMETER_NAMES`): every site would load the same site's data.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.utilities.model_helpers import is_overridden

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import ClientAlgorithmError
from lightning_modules.options import json_arg
from lightning_modules.site_choice import SELECT_SPLITS

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


def build_user_module(path: str, args: Mapping[str, Any] | None = None, seed: int | None = None) -> pl.LightningModule:
    """The user's module built with ``args``; with ``seed``, torch's, numpy's and Python's global generators are
    seeded right before the constructor (`seeded_global_generators`), so the server and every site build the same
    initial weights from the job's ``--seed`` whether or not the constructor seeds itself."""
    cls = user_class(path, pl.LightningModule, "model")
    try:
        with seeded_global_generators(seed):
            return cls(**dict(args or {}))
    except TypeError as exc:
        raise UserCodeError(f"model {path!r}: bad model_args {dict(args or {})}: {exc}") from None


@contextlib.contextmanager
def seeded_global_generators(seed: int | None) -> Iterator[None]:
    """Inside: torch's (CPU), numpy's and Python's global generators seeded with ``seed`` (``None``: as they were);
    after: all three restored, so the caller's random streams are the same whether or not it built a model. A
    published constructor may draw its initial weights from any of the three (``np.random.randn`` is common)."""
    import random

    import numpy as np
    import torch

    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            if seed is not None:
                torch.manual_seed(seed)
                np.random.seed(seed % 2**32)  # numpy takes 32-bit seeds; the job's seed may be larger
                random.seed(seed)
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def seeded_user_module(model: str, model_args: Mapping[str, Any] | None = None, seed: int = 0) -> pl.LightningModule:
    """What the job's persistor calls on the server (``config_fed_server.json``) to build the initial global model:
    `build_user_module` seeded with the job's ``--seed``, as every site builds it."""
    return build_user_module(model, model_args, seed=seed)


#: Constructor parameters of a data module that every site supplies itself (`build_user_data`).
SUPPLIED_BY_THE_SITE = ("site", "num_sites")
#: Data-module constructor parameters taken to name the site whose data the module loads (exact names; not a bare
#: ``client``, which often means something else, e.g. a database client): a constant for one in ``--data-args``
#: would give every site the same site's data, so it is refused; ``--data-site-arg NAME`` makes every site pass its
#: own name to the parameter ``NAME`` instead.
SITE_PARAMETER_NAMES = ("site", "site_name", "site_id", "client_name", "client_id")
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def data_args_problem(path: str, cls: type, args: Mapping[str, Any] | None, site_arg: str | None = None) -> str | None:
    """Why ``cls(**args)`` cannot be called at a site (which adds ``site`` and ``num_sites`` when the constructor
    takes them, and its name as ``site_arg``), or would load the same site's data at every site: a bad
    ``site_arg``, a constant for a parameter that names the site, required arguments ``args`` lacks, names the
    constructor does not take, a site-named parameter that no site passes."""
    return (
        site_arg_problem(path, cls, site_arg)
        or constant_site_problem(path, args, site_arg)
        or signature_problem(path, cls, args, site_arg)
        or unset_site_problem(path, cls, args, site_arg)
    )


def site_arg_problem(path: str, cls: type, site_arg: str | None) -> str | None:
    """``--data-site-arg`` must name a parameter of the constructor that is not ``num_sites``."""
    named = [name for name, p in inspect.signature(cls).parameters.items() if p.kind in _NAMED]
    if site_arg is None or (site_arg in named and site_arg != "num_sites"):
        return None
    return (
        f"--data-site-arg {site_arg!r} is not a parameter of {cls.__name__}({', '.join(named)}) ({path!r}): name "
        "the constructor parameter that takes the site's name"
    )


def constant_site_problem(path: str, args: Mapping[str, Any] | None, site_arg: str | None) -> str | None:
    """A ``--data-args`` value for the parameter ``site_arg`` names, or for one named like the site: one value for
    every site, so every site would load that site's data."""
    for name, value in (args or {}).items():
        if name == site_arg:
            why, hint = f"--data-site-arg gives {name} each site's own name", ""
        elif name == "site":
            why, hint = "each site passes its own name to site", ""
        elif name in SITE_PARAMETER_NAMES:
            why = "a parameter named like the site picks the site's data"
            hint = f" and give --data-site-arg {name}" if site_arg is None else ""
        else:
            continue
        return (
            f"data {path!r}: --data-args gives {name!r} one value ({value!r}) for every site, but {why}: leave it "
            f"out of --data-args{hint}"
        )
    return None


def signature_problem(path: str, cls: type, args: Mapping[str, Any] | None, site_arg: str | None) -> str | None:
    """Required constructor arguments that neither ``args`` nor the site gives, or names it does not take."""
    parameters = inspect.signature(cls).parameters
    given = set(args or {}) | {name for name in (*SUPPLIED_BY_THE_SITE, site_arg) if name in parameters}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    missing = [n for n, p in parameters.items() if p.default is p.empty and p.kind in _NAMED and n not in given]
    unknown = [] if takes_any else sorted(set(args or {}) - set(parameters))
    if missing:
        site_like = next((name for name in missing if name in SITE_PARAMETER_NAMES), "NAME")
        return (
            f"data {path!r}: data_args {dict(args or {})} lack the required constructor argument(s) {missing} of "
            f"{cls.__name__}; give them in --data-args, except one that names the site: --data-site-arg {site_like} "
            f"passes each site's name to it (every site supplies {list(SUPPLIED_BY_THE_SITE)} itself)"
        )
    if unknown:
        return f"data {path!r}: data_args {unknown} are not constructor arguments of {cls.__name__}: {list(parameters)}"
    return None


def unset_site_problem(path: str, cls: type, args: Mapping[str, Any] | None, site_arg: str | None) -> str | None:
    """A data module that learns no site (no ``site`` parameter, no ``site_arg``) but has a parameter named like
    the site, left at its default: every site would load the default site's data."""
    parameters = inspect.signature(cls).parameters
    if "site" in parameters or site_arg is not None:
        return None
    for name in SITE_PARAMETER_NAMES:
        parameter = parameters.get(name)
        if parameter is not None and parameter.kind in _NAMED and name not in (args or {}):
            return (
                f"data {path!r}: {cls.__name__}'s parameter {name!r} (default {parameter.default!r}) names the site "
                f"whose data it loads, but no site passes it, so every site would load the same data: give "
                f"--data-site-arg {name}"
            )
    return None


@contextlib.contextmanager
def naming_the_site(site: str) -> Iterator[None]:
    """Errors of the user's code raised inside name ``site`` first (a site's log line must say which site)."""
    try:
        yield
    except UserCodeError as exc:
        if str(exc).startswith(f"{site}: "):
            raise
        raise UserCodeError(f"{site}: {exc}") from None


def build_user_data(
    path: str,
    args: Mapping[str, Any] | None = None,
    site: str = "local",
    num_sites: int | None = None,
    site_arg: str | None = None,
) -> pl.LightningDataModule:
    """The data module, told its site (and the number of sites) when its constructor takes them; ``site_arg``
    (``--data-site-arg``) names one more parameter that gets the site's name."""
    with naming_the_site(site):
        cls = user_class(path, pl.LightningDataModule, "data")
        problem = data_args_problem(path, cls, args, site_arg)
        if problem:
            raise UserCodeError(problem)
        kwargs = dict(args or {})
        parameters = inspect.signature(cls).parameters
        for name in ("site", site_arg):
            if name in parameters:
                kwargs[name] = site
        if "num_sites" in parameters and num_sites is not None:
            kwargs.setdefault("num_sites", num_sites)
        try:
            data = cls(**kwargs)
        except TypeError as exc:
            raise UserCodeError(f"data {path!r}: bad data_args {dict(args or {})}: {exc}") from None
        problem = training_data_problem(path, data)
        if problem:
            raise UserCodeError(problem)
    return data


def training_data_problem(path: str, data: pl.LightningDataModule | type) -> str | None:
    """Why ``data`` (the class, at build time, or the site's instance) gives a site nothing to train on."""
    if is_overridden("train_dataloader", data, pl.LightningDataModule):
        return None
    return (
        f"data {path!r} defines no train_dataloader(); a site needs training data: add train_dataloader() "
        "returning the site's training DataLoader"
    )


def tests_at_the_site(module: pl.LightningModule, data: pl.LightningDataModule) -> bool:
    """True when the module can score a model on the site's test split (``test_step`` and ``test_dataloader``)."""
    return is_overridden("test_step", module, pl.LightningModule) and is_overridden(
        "test_dataloader", data, pl.LightningDataModule
    )


def evaluates_at_the_site(module: pl.LightningModule, data: pl.LightningDataModule) -> bool:
    """True when the module can score the global model on the site's validation split."""
    return is_overridden("validation_step", module, pl.LightningModule) and is_overridden(
        "val_dataloader", data, pl.LightningDataModule
    )


class UserSite:
    """One site with the user's module and data: the same round in the NVFlare client and in process.

    `fit` runs a round with the exchange ``connect`` attaches (``flare.patch``, or the in-process
    `lightning_modules.site.LocalExchange`): seed torch from (job seed, site, round), a fresh Trainer with
    the algorithm callback, site evaluation of the received model (``trainer.validate``), then ``trainer.fit``.
    """

    def __init__(self, args: Any, site: str, state_store: Any, meta_source: Any = None) -> None:
        from data_prep.site_config import seed_index
        from lightning_modules.federated import FederatedAlgorithm
        from lightning_modules.site import site_privacy

        self.args, self.site = args, site
        self.state_store = state_store  # the site's private store: the kept and local-only models live there
        with naming_the_site(site):  # the job's --seed, as the server's persistor builds it
            self.module = build_user_module(args.model, json_arg(args.model_args), seed=args.seed)
        site_arg = getattr(args, "data_site_arg", None)
        self.data = build_user_data(args.data, json_arg(args.data_args), site, args.num_sites, site_arg)
        extra = {"meta_source": meta_source} if meta_source is not None else {}
        self.callback = FederatedAlgorithm(
            args.client,
            algorithm_args=json_arg(args.client_args),
            site=site,
            state_store=state_store,
            local_keys=getattr(args, "local_keys", None),
            privacy=site_privacy(args, site, state_store),
            **extra,
        )
        self.evaluate = evaluates_at_the_site(self.module, self.data)
        if not self.evaluate:
            print(f"{site}: no validation_step/val_dataloader: the global model is not evaluated at this site")
        self.finetune_epochs = int(getattr(args, "finetune_epochs", 0) or 0)
        self._finetune_val: Any = None  # fine-tuning's validation batches on the classifier path (False: none)
        if self.finetune_epochs and not self.evaluate:
            raise UserCodeError(
                f"{site}: finetune_epochs {self.finetune_epochs} needs a validation split to score the fine-tuned "
                f"copy on: {args.model!r} needs a validation_step and {args.data!r} a val_dataloader()"
            )
        if self.evaluate:  # the personal model an algorithm provides (Ditto's v_i) is scored on the same split
            from lightning_modules.personal_scores import validation_scorer

            self.callback.personal_scorer = validation_scorer(args.precision, args.accelerator, datamodule=self.data)
        self.index = seed_index(site, args.num_sites)
        self.callback.candidates = self.candidates(state_store)

    def candidates(self, store: Any) -> Any:
        """The site's `lightning_modules.keep_best.SiteCandidates` with ``--local-baseline`` or ``--keep
        best`` (else ``None``: nothing changes): the module's ``validation_step`` on ``val_dataloader`` selects, its
        ``test_step`` on ``test_dataloader`` reports. Test scoring is opt-in for a user's module (a data module's
        ``test_dataloader`` may be a pooled benchmark set, or absent at a real site)."""
        args = self.args
        keep, local = getattr(args, "keep", "last"), getattr(args, "local_baseline", False)
        if not local and keep == "last":
            return None
        from lightning_modules.keep_best import SiteCandidates, module_scorer, sample_correct
        from lightning_modules.local_baseline import LocalBaseline, batch_transform, datamodule_batches

        data, precision, accelerator = self.data, args.precision, args.accelerator
        found = SiteCandidates(self.site, self.index, args.seed, keep, getattr(args, "keep_metric", "val_loss"))
        found.store = store
        if self.evaluate:
            found.score_val = module_scorer(precision, accelerator, "validate", datamodule=data)
        if tests_at_the_site(self.module, data):
            found.score_test = module_scorer(precision, accelerator, "test", datamodule=data)
            transform = batch_transform(data, self.module)
            found.correct = lambda module: sample_correct(module, data.test_dataloader(), transform)
        if local:

            def make_module() -> pl.LightningModule:  # the federation's initial model, as the persistor builds it
                return build_user_module(args.model, json_arg(args.model_args), seed=args.seed)

            fit = lambda trainer, module: trainer.fit(module, datamodule=data)  # noqa: E731
            # Without a Trainer per round where the module declares it needs none (local_baseline.plain_fit).
            batches = datamodule_batches(data, type(self.module))
            found.local = LocalBaseline(self.site, store, make_module, fit, precision, accelerator, batches)
        found.margin = float(getattr(args, "keep_margin", found.margin))
        found.select = SELECT_SPLITS[getattr(args, "keep_view", "own")]
        if found.select != "val" and not callable(getattr(data, "pooled_val_dataloader", None)):
            raise UserCodeError(self.no_pooled_val())
        if self.evaluate:
            found.split_source = lambda: self.classifier_splits(found.score_test is not None, found.select != "val")
        return found

    def no_pooled_val(self) -> str:
        """keep_view pooled at a site whose data module offers no pooled validation split."""
        return (
            f"{self.site}: keep_view 'pooled' chooses on a pooled validation split, but data {self.args.data!r} has "
            "no pooled_val_dataloader() or it returned None: add the hook returning a reference set of the population "
            "the site serves, disjoint from its test splits (docs/personalization.md), or set keep_view own"
        )

    def classifier_splits(self, with_test: bool, pooled_val: bool = False) -> dict[str, Any]:
        """The data module's validation (and test, and pooled test, and with ``pooled_val`` the hook
        ``pooled_val_dataloader()``'s) batches, read once, for the classifier path (lightning_modules/split_scores.py;
        ``None`` where the batches are not (x, integer y))."""
        from lightning_modules.local_baseline import batch_transform
        from lightning_modules.split_scores import classifier_batches

        data = self.data
        transfer = batch_transform(data, self.module)  # what the Trainer's loops do to a batch, scored alike
        splits = {"val": classifier_batches(data.val_dataloader(), transfer)}
        if with_test:
            data.setup("test")  # trainer.test would have; a data module that splits per stage needs it
            splits["test"] = classifier_batches(data.test_dataloader(), transfer)
            if splits["test"] is None:  # the test_step's own metrics then, through Lightning
                return {"val": None}
            # The "next patient" view: a data module that has a pooled test set offers it through this optional
            # hook (docs/own_model.md); every candidate is scored on it beside the site's own test split.
            pooled = getattr(data, "pooled_test_dataloader", lambda: None)()
            if pooled is not None:
                splits["pooled"] = classifier_batches(pooled, transfer)
        if pooled_val:  # keep_view pooled: the split the site chooses on (a reference set the site holds)
            loader = data.pooled_val_dataloader()
            if loader is None:
                raise UserCodeError(self.no_pooled_val())
            splits["pooled_val"] = classifier_batches(loader, transfer)
        return splits

    def fit(self, round_num: int, connect: Any) -> dict[str, Any]:
        import torch

        from lightning_modules.site import local_epochs, make_trainer, round_seed

        seed = round_seed(self.args.seed, self.index, round_num)
        torch.manual_seed(seed)
        # Under DDP, Lightning's DistributedSampler shuffles with this seed (and the epoch): a new order every round.
        os.environ["PL_GLOBAL_SEED"] = str(seed)
        trainer = make_trainer(self.args, self.callback, local_epochs(self.args, self.index, round_num))
        connect(trainer)
        if self.evaluate:
            trainer.validate(self.module, datamodule=self.data, verbose=False)
            if self.finetune_epochs:
                self.finetune(round_num)
        trainer.fit(self.module, datamodule=self.training_data())
        return self.callback.last_meta

    def training_data(self) -> pl.LightningDataModule:
        """The data module the round trains on: under DP-SGD its training loader samples by Poisson sampling from
        a secret generator (`lightning_modules.privacy.dp_sgd.poisson_loader`), the rest unchanged."""
        if self.callback.privacy is None:
            return self.data
        from lightning_modules.privacy.dp_sgd import poisson_data_module

        return poisson_data_module(self.data)

    def finetune(self, round_num: int) -> pl.LightningModule:
        """Local fine-tuning (lightning_modules/finetune.py): a copy of the received model (loaded for the
        validation) trained ``finetune_epochs`` on the data module, scored on its validation split and sent as
        ``eval.personal_*``; the module and the round's random draws are untouched."""
        from lightning_modules.finetune import BEST_EPOCH, epoch_scorer, finetune_seed, finetuned_copy
        from lightning_modules.personal_scores import single_process_trainer, validation_scores

        seed = finetune_seed(self.args.seed, self.index, round_num)
        precision, accelerator = self.args.precision, self.args.accelerator

        def validate(copy: pl.LightningModule) -> dict[str, float]:
            return validation_scores(copy, single_process_trainer(precision, accelerator), datamodule=self.data)

        if self._finetune_val is None and self.finetune_epochs >= 2:  # read once: the per-epoch scores' batches
            self._finetune_val = self.classifier_splits(False)["val"] or False
        tuned = finetuned_copy(
            self.module,
            self.finetune_epochs,
            seed,
            lambda trainer, copy: trainer.fit(copy, datamodule=self.data),
            precision,
            accelerator,
            epoch_scorer(self._finetune_val or None, validate),
        )
        self.callback.add_personal_scores(validate(tuned))
        self.callback.add_site_scores({BEST_EPOCH: tuned.__fl_best_epoch__})
        if self.callback.candidates is not None:
            self.callback.candidates.hand_over(tuned)
        return tuned

    def train(self, round_num: int, global_params: Mapping[str, Any], server_meta: Mapping[str, Any]):
        """One round in process: the global model and server meta in, the site's model (numpy) and meta out."""
        from lightning_modules.site import LocalExchange

        exchange = LocalExchange(global_params)

        def connect(trainer: pl.Trainer) -> None:
            exchange.on_train_start(trainer, self.module)  # the received weights, for the validation too
            trainer.callbacks.append(exchange)

        self.callback.meta_source = lambda: dict(server_meta)
        meta = self.fit(round_num, connect)
        assert exchange.result is not None, "the fit ended without reaching on_train_end"
        return exchange.result, dict(meta)

    def score_received(self, connect: Any) -> dict[str, float] | None:
        """Score the model NVFlare sends with a ``validate`` task (``connect`` attaches ``flare.patch``, whose
        callback loads it and sends the metrics back); ``None`` when this site has no validation split."""
        from lightning_modules.site import make_trainer

        if not self.evaluate:
            return None
        trainer = make_trainer(self.args, self.callback)
        connect(trainer)
        results = trainer.validate(self.module, datamodule=self.data, verbose=False)
        self.callback.forget_site_eval()  # not a round's evaluation
        return {k: float(v) for k, v in (results[0] if results else {}).items()}

    @property
    def withholds_scores(self) -> bool:
        """Under DP-SGD the site's validation scores are computed on its data outside DP-SGD: they stay at the site
        unless the job releases them, unaccounted (``--dp-release-site-scores``)."""
        privacy = self.callback.privacy
        return privacy is not None and not privacy.config.release_site_scores

    def answer_cross_site(self, task: str, received: Any) -> dict[str, Any]:
        """This site's answer to a cross-site task (lightning_modules/cross_site.py): its kept and local-only models,
        or the other sites' models scored on its data module's validation split."""
        from lightning_modules.cross_site import respond
        from lightning_modules.personal_scores import site_copy

        split = self.classifier_splits(with_test=False)["val"] if self.evaluate else None
        return respond(task, received, self.site, self.state_store, split, lambda: site_copy(self.module))

    def score(self, params: Mapping[str, Any]) -> dict[str, float]:
        """The validation metrics of ``params`` on this site's validation split (a site x model table)."""
        from lightning_modules.site import LocalExchange

        LocalExchange(params).on_train_start(None, self.module)
        return self.score_received(lambda trainer: None) or {}


def run_site(args: Any) -> None:
    """The client loop for a user model (called by ``jobs/client.py`` when the job names ``--model``)."""
    import nvflare.client as flare_api
    import nvflare.client.lightning as flare

    from lightning_modules.distributed import close_site_processes, init_site_processes, next_task, share_from_rank_zero
    from lightning_modules.state_store import ClientStateStore, default_state_root

    devices = getattr(args, "devices", 1)
    rank = init_site_processes(devices, args.accelerator)  # DDP: rank 0 talks to NVFlare, the others follow
    flare.init()
    site_name = share_from_rank_zero(flare.get_site_name() if rank == 0 else None)
    site = UserSite(args, site_name, ClientStateStore(default_state_root(), site_name, per_run=True))

    def connect(trainer: pl.Trainer) -> None:  # a fresh optimizer every round, as FedAvg's clients have
        flare.patch(trainer, restore_state=False)

    while True:
        kind, round_num = share_from_rank_zero(next_task(flare) if rank == 0 else None)
        if kind == "stop":
            break
        if kind == "evaluate" and site.withholds_scores:  # DP-SGD: the scores stay here, in the site's log
            scores = site.score(flare.receive().params) if site.evaluate else {}
            flare_api.send(flare.FLModel(metrics={}, meta={meta_keys.PRIVACY_WITHHELD: sorted(scores)}))
            outcome = f"final model (withheld from the server under DP-SGD): {json.dumps(_scalars(scores))}"
        elif kind == "cross_site":  # after the last round (cross_site_eval, lightning_modules/cross_site.py)
            site.answer_cross_site(flare_api.get_task_name(), flare.receive())
            continue
        elif kind == "evaluate":  # the final model, scored on this site's validation split (final_site_eval)
            scores = site.score_received(connect)
            if scores is None and rank == 0:
                flare_api.send(flare.FLModel(metrics={}))
            outcome = f"final model: {json.dumps(_scalars(scores or {}), sort_keys=True)}"
        else:
            outcome = f"round {round_num}: {json.dumps(_scalars(site.fit(round_num, connect)), sort_keys=True)}"
        if rank == 0:
            print(f"{site_name} {outcome}", flush=True)
    close_site_processes()


def run_user_script(args: Any, client_script: str) -> None:
    """Run the user's own training script (shipped next to the client script) as ``__main__``; the job's client
    algorithm reaches it through the environment (`lightning_modules.federated.job_algorithm`)."""
    import runpy
    import sys
    from pathlib import Path

    from lightning_modules.federated import CLIENT_ARGS_ENV, CLIENT_ENV

    script = Path(client_script).resolve().parent / Path(args.script).name
    os.environ[CLIENT_ENV] = args.client
    os.environ[CLIENT_ARGS_ENV] = json.dumps(json_arg(args.client_args))
    argv, sys.argv = sys.argv, [str(script)]
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv


def _scalars(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The numbers of a site's round for its log line, to 4 significant digits (not decimals: delta 1e-5 is not 0)."""
    return {k: float(f"{v:.4g}") if isinstance(v, float) else v for k, v in meta.items() if isinstance(v, int | float)}
