"""Secure aggregation through NVFlare's homomorphic-encryption components (``--secure-aggregation he``).

What runs (docs/deployment.md, "Secure aggregation (HE)"): NVFlare's ``ScatterAndGather`` sends the global model to
every site; each site trains it with the bundle's Lightning client (any client algorithm this module admits; the
built-in models, or the user's LightningModule and data module, ``--model``/``--data``, which the job ships to the
server's persistor and to the sites as any ``--model`` job does), its result filters set the FedAvg weight
(`controllers.secure_aggregation.SampleCountWeight`) and NVFlare's ``HEModelEncryptor`` multiplies the weights
by it and encrypts them with the site's TenSEAL CKKS context; the server's
``HEInTimeAccumulateWeightedAggregator`` adds the ciphertexts and scales the sum by 1 / (total weight), its
``HEModelShareableGenerator`` keeps the encrypted global model, ``HEModelSerializeFilter`` lets the persistor save it;
each site's ``HEModelDecryptor`` decrypts the next round's model. The server's context (``server_context.tenseal``)
holds no secret key; the sites' (``client_context.tenseal``) do. Both come from provisioning with NVFlare's
``HEBuilder`` (``python -m jobs.provision.loopback --he``), so such a job does not run in the simulator. This is the
wiring of NVFlare's ``FedAvgRecipeWithHE`` (tested), with the bundle's client, weights and round records.

``--secure-aggregation plain`` builds the same workflow with NVFlare's plaintext accumulating aggregator and no
filters but the weight: the baseline HE's cost is measured against, and a way to try a job in the simulator.

Only sums can be formed this way; FedOpt's server optimizers step at the sites, on the decrypted mean
(controllers/he_fedopt.py). `secure_aggregation_problem` refuses at build time, one line each, every
setting that needs the individual updates at the server or a workflow other than a weighted sum.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aggregators.contracts.bundle import CLIENT_CONTEXT, SERVER_CONTEXT

#: The tables below are derived from what every registered rule and client algorithm declares
#: (``AggregationRule.secure_sum``, ``ClientAlgorithm.secure_sum``), on first use: the client registry loads
#: Lightning, which a job build without secure aggregation never needs.
#:
#: - ``SUM_RULES``: the rules the sum workflow computes (FedAvg, server_lr 1: the weighted mean NVFlare's aggregator
#:   forms); ``SITE_STEP_RULES``: FedOpt's server optimizers, stepped at every site on the decrypted mean
#:   (controllers/he_fedopt.py); ``RULE_REFUSALS``: why every other rule cannot run on sums of ciphertexts.
#: - ``SUM_CLIENTS``: client algorithms that need nothing from the server but the global model and keep no state
#:   between rounds; ``CLIENT_REFUSALS``: why every other one cannot.
DERIVED_TABLES = ("SUM_RULES", "SITE_STEP_RULES", "RULE_REFUSALS", "SUM_CLIENTS", "CLIENT_REFUSALS")


@functools.cache
def _derived_tables() -> dict[str, Any]:
    from aggregators.registry import RULES
    from aggregators.types import SECURE_SUM, SITE_STEP, declared_secure_sum
    from lightning_modules.algorithms.capabilities import declared_secure_sum as client_secure_sum
    from lightning_modules.algorithms.registry import CLIENT_ALGORITHMS

    rules = {name: declared_secure_sum(rule) for name, rule in RULES.items()}
    clients = {name: client_secure_sum(algorithm) for name, algorithm in CLIENT_ALGORITHMS.items()}
    return {
        "SUM_RULES": tuple(name for name, how in rules.items() if how == SECURE_SUM),
        "SITE_STEP_RULES": tuple(name for name, how in rules.items() if how == SITE_STEP),
        "RULE_REFUSALS": {name: how for name, how in rules.items() if how not in (SECURE_SUM, SITE_STEP)},
        "SUM_CLIENTS": tuple(name for name, why in clients.items() if why is None),
        "CLIENT_REFUSALS": {name: why for name, why in clients.items() if why is not None},
    }


def steps_at_sites(server: str) -> bool:
    """True for a FedOpt server optimizer that every site applies to the decrypted mean (``SITE_STEP_RULES``)."""
    return server in _derived_tables()["SITE_STEP_RULES"]


def __getattr__(name: str) -> Any:
    if name in DERIVED_TABLES:
        return _derived_tables()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: What NVFlare's HE components are called in the job's config (tests and the loopback driver look for them).
HE_COMPONENTS = (
    "nvflare.app_opt.he.model_encryptor.HEModelEncryptor",
    "nvflare.app_opt.he.model_decryptor.HEModelDecryptor",
    "nvflare.app_opt.he.intime_accumulate_model_aggregator.HEInTimeAccumulateWeightedAggregator",
    "nvflare.app_opt.he.model_shareable_generator.HEModelShareableGenerator",
    "nvflare.app_opt.he.model_serialize_filter.HEModelSerializeFilter",
)


def secure_aggregation_problem(spec: Any) -> str | None:
    """One line naming the setting that the job's ``secure_aggregation`` cannot carry and why, or ``None``."""
    mode = spec.secure_aggregation
    if mode == "none":
        return None
    who = f"secure_aggregation '{mode}'"
    tables = _derived_tables()
    if spec.server in tables["SITE_STEP_RULES"]:
        from lightning_modules.site_optimizer import site_optimizer_problem

        problem = site_optimizer_problem(spec)
        if problem:
            return f"{who} with server '{spec.server}': {problem}"
    elif spec.server not in tables["SUM_RULES"]:
        reason = tables["RULE_REFUSALS"].get(spec.server, "is not a weighted sum of the updates")
        allowed = ", ".join(tables["SUM_RULES"] + tables["SITE_STEP_RULES"])
        return f"{who} with server '{spec.server}': the rule {reason}; allowed: {allowed}"
    elif spec.server_args:
        return (
            f"{who}: server_args: NVFlare's accumulating aggregator forms the plain weighted mean (server_lr 1) and "
            f"takes no rule arguments, got {spec.server_args}"
        )
    if spec.client not in tables["SUM_CLIENTS"]:
        reason = tables["CLIENT_REFUSALS"].get(spec.client, "is not checked with the sum workflow")
        allowed = ", ".join(tables["SUM_CLIENTS"])
        return f"{who} with client '{spec.client}': the algorithm {reason}; allowed: {allowed}"
    refusals = (
        (
            spec.script is not None,
            "--script",
            "the sum workflow weighs every result by its train.num_samples, which the bundle's client sends for a "
            "--model/--data job but a user's own training loop need not; use --model and --data",
        ),
        (
            spec.devices > 1,
            "devices",
            "Lightning DDP at the sites (torchrun, NVFlare's external-process launch) has not been run with NVFlare's "
            "HE filters; one device per site",
        ),
        (bool(spec.local_keys), "local_keys", "partial sharing is not wired into the sum workflow"),
        (
            spec.attack != "none" or spec.malicious_fraction > 0 or bool(spec.malicious_sites),
            "attack settings",
            "simulated attacks test the robust rules, which need the individual updates",
        ),
        (spec.clients_per_round is not None, "clients_per_round", "ScatterAndGather trains every site every round"),
        (spec.min_accepted != 1, "min_accepted", "ScatterAndGather aggregates whatever results it accepted"),
        (spec.save_client_updates, "save_client_updates", "the individual updates never reach the server in clear"),
        (spec.resume_from is not None, "resume_from", "the bundle's controller checkpoints; ScatterAndGather does not"),
        (spec.final_site_eval, "final_site_eval", "runs in the bundle's controller"),
        (
            spec.cross_site_eval,
            "cross_site_eval",
            "sends the sites' models in clear, and runs in the bundle's controller",
        ),
        (spec.stop_patience is not None, "stop_patience", "the stopping rule runs in the bundle's controller"),
        (
            spec.max_test_samples is not None,
            "max_test_samples",
            "the server never holds the global model in clear, so it evaluates nothing (the sites can: "
            "--site-val-fraction)",
        ),
    )
    for refused, setting_name, reason in refusals:
        if refused:
            return f"{who}: {setting_name}: {reason}"
    if mode == "secagg":
        from aggregators.secagg import protocol_problem

        problem = protocol_problem(spec.num_sites, secagg_threshold(spec))
        return f"{who}: {problem}" if problem else None
    if spec.secagg_threshold is not None:
        return f"{who}: secagg_threshold: applies to --secure-aggregation secagg only"
    return None


#: What NVFlare's HE encryptor adds to a result's meta: which entries it encrypted and with which scheme (public).
HE_RESULT_META = ("PROCESSED_KEYS", "PROCESSED_ALGORITHM")


def sum_result_meta(spec: Any) -> tuple[str, ...]:
    """The meta keys the sum workflow's site filters add to a training result (declared to the egress gate,
    `jobs.egress`): NVFlare's weight (``NUM_STEPS_CURRENT_ROUND``, set to ``train.num_samples``), the names of the
    DXO filters that ran (``filter_history``), the HE encryptor's bookkeeping, and the digest of the site's FedOpt
    step; nothing without secure aggregation."""
    if spec.secure_aggregation == "none":
        return ()
    meta: tuple[str, ...] = ("NUM_STEPS_CURRENT_ROUND", "filter_history")  # NVFlare's DXO filters name themselves
    if spec.secure_aggregation == "he":
        meta += HE_RESULT_META
    if spec.secure_aggregation == "secagg":
        from aggregators.contracts.meta_keys import SECAGG_ROUND

        meta += (SECAGG_ROUND,)
    if steps_at_sites(spec.server):
        from lightning_modules.site_optimizer import DIGEST, DIGEST_ROUND

        meta += (DIGEST, DIGEST_ROUND)
    return meta


def sum_result_kind(spec: Any) -> str:
    """The DXO kind of a site's training result as it leaves: weights (ciphertexts under ``he``), or under
    ``secagg`` the masked update."""
    from aggregators.secagg import MASKED_KIND

    return MASKED_KIND if spec.secure_aggregation == "secagg" else "WEIGHTS"


def secagg_releases(spec: Any) -> tuple[Any, ...]:
    """Under ``secagg``, what a site's answer to each key and unmask stage carries: one DXO of its own kind with
    the stage's entries (the public keys; the shares sealed for their holders; the shares the unmask stage asks)."""
    if spec.secure_aggregation != "secagg":
        return ()
    from aggregators.contracts.egress import Release
    from aggregators.secagg import STAGE_DATA, STAGE_KIND

    return tuple(Release(task, (STAGE_KIND,), entries, ()) for task, entries in STAGE_DATA.items())


def add_sum_workflow(job: Any, spec: Any, model_config: Mapping[str, Any]) -> None:
    """The server side: persistor, shareable generator, aggregator, round records and ``ScatterAndGather``; HE
    components for ``he``, NVFlare's plaintext ones for ``plain``."""
    from nvflare.apis.dxo import DataKind
    from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather
    from nvflare.app_opt.pt.file_model_persistor import PTFileModelPersistor
    from nvflare.app_opt.pt.job_config.model import PTModel

    from controllers.secure_aggregation import RoundRecorder
    from lightning_modules.privacy.job_checks import is_private

    encrypted = spec.secure_aggregation == "he"
    masked = spec.secure_aggregation == "secagg"
    if encrypted:
        from nvflare.app_opt.he.intime_accumulate_model_aggregator import HEInTimeAccumulateWeightedAggregator
        from nvflare.app_opt.he.model_serialize_filter import HEModelSerializeFilter
        from nvflare.app_opt.he.model_shareable_generator import HEModelShareableGenerator

        persistor = PTFileModelPersistor(model=dict(model_config), filter_id="model_serialize_filter")
        job.to_server(PTModel(dict(model_config), persistor=persistor))
        job.to_server(HEModelSerializeFilter(tenseal_context_file=SERVER_CONTEXT), id="model_serialize_filter")
        job.to_server(HEModelShareableGenerator(tenseal_context_file=SERVER_CONTEXT), id="shareable_generator")
        # The sites multiply by their weight before encrypting (weigh_by_local_iter there); the server only adds.
        aggregator = HEInTimeAccumulateWeightedAggregator(
            expected_data_kind=DataKind.WEIGHTS, weigh_by_local_iter=False
        )
    else:
        from nvflare.app_common.aggregators.intime_accumulate_model_aggregator import (
            InTimeAccumulateWeightedAggregator,
        )
        from nvflare.app_common.shareablegenerators.full_model_shareable_generator import (
            FullModelShareableGenerator,
        )

        job.to_server(PTModel(dict(model_config)))
        job.to_server(FullModelShareableGenerator(), id="shareable_generator")  # adds secagg's mean update too
        if masked:
            from controllers.secagg import SecAggAggregator

            aggregator = SecAggAggregator()
        else:
            aggregator = InTimeAccumulateWeightedAggregator(expected_data_kind=DataKind.WEIGHTS)
    job.to_server(aggregator, id="aggregator")
    # A DP-SGD job's workflow ends after the round in which a site's budget runs out (controllers/secure_aggregation.py)
    budgeted = is_private(spec)  # SecAggScatterAndGather is a BudgetScatterAndGather too
    recorder = RoundRecorder(spec.num_rounds, spec.secure_aggregation, end_on_spent_budget=budgeted)
    job.to_server(recorder, id="rounds")
    if is_private(spec):  # what each DP site released, with every task: a site on a stale ledger stops
        from nvflare.job_config.defs import FilterType

        from controllers.secure_aggregation import ReleasedStepsBroadcast

        job.to_server(ReleasedStepsBroadcast(), tasks=["train"], filter_type=FilterType.TASK_DATA)
    if steps_at_sites(spec.server):  # the sites step; the server stops the job if they disagree
        from controllers.he_fedopt import SiteOptimizerConsensus

        job.to_server(SiteOptimizerConsensus(), id="fedopt_consensus")
    rounds = {
        "min_clients": spec.min_responses or spec.num_sites,
        "num_rounds": spec.num_rounds,
        "wait_time_after_min_received": 0,
        "aggregator_id": "aggregator",
        "persistor_id": "persistor",
        "shareable_generator_id": "shareable_generator",
        "train_timeout": spec.train_timeout,
    }
    if masked:  # SecAgg+'s key and unmask stages around ScatterAndGather's round (controllers/secagg.py)
        from controllers.secagg import SecAggScatterAndGather

        controller = SecAggScatterAndGather(threshold=secagg_threshold(spec), **rounds)
    elif budgeted:
        from controllers.secure_aggregation import BudgetScatterAndGather

        controller = BudgetScatterAndGather(**rounds)
    else:
        controller = ScatterAndGather(**rounds)
    job.to_server(controller)


def secagg_entries_problem(model: Any) -> str | None:
    """SecAgg+ quantises each entry's floating-point update: an integer entry of the job's ``model`` (BatchNorm's
    ``num_batches_tracked``, which grows by the round's steps) would be refused at every site in round 1."""
    integers = [name for name, value in model.state_dict().items() if not value.is_floating_point()]
    if integers:
        return (
            f"secure_aggregation 'secagg': the model's entries {integers} are integers (e.g. BatchNorm's "
            "num_batches_tracked): SecAgg+ sums quantised floating-point updates; use a model without them or "
            "--secure-aggregation he"
        )
    return None


def secagg_threshold(spec: Any) -> int:
    """The job's SecAgg+ threshold: ``secagg_threshold``, or the smallest majority of the sites."""
    from aggregators.secagg import default_threshold

    return spec.secagg_threshold or default_threshold(spec.num_sites)


def add_sum_site_filters(job: Any, spec: Any) -> None:
    """The sites' filters, in the order they run: decrypt the received model (``he``), take FedOpt's step on it (the
    site-step rules) and, under DP-SGD, give it the round meta the privacy ledger keys on; set the result's weight,
    then weigh and encrypt it (``he``)."""
    from nvflare.job_config.defs import FilterType

    from controllers.secure_aggregation import SampleCountWeight, SumWorkflowRound
    from lightning_modules.privacy.job_checks import is_private

    encrypted = spec.secure_aggregation == "he"
    if spec.secure_aggregation == "secagg":  # first: it keeps the model as the server sent it, before any step
        add_secagg_site(job)
    if encrypted:
        from nvflare.app_opt.he.model_decryptor import HEModelDecryptor

        decryptor = HEModelDecryptor(tenseal_context_file=CLIENT_CONTEXT)
        job.to_clients(decryptor, tasks=["train", "validate"], filter_type=FilterType.TASK_DATA)
    if steps_at_sites(spec.server):  # x_r from the mean after decryption; x_r's digest with the result
        from controllers.he_fedopt import SiteOptimizerDigest, SiteOptimizerStep

        rule = {"server": spec.server, "server_args": dict(spec.server_args)}
        job.to_clients(SiteOptimizerStep(**rule), tasks=["train", "validate"], filter_type=FilterType.TASK_DATA)
        job.to_clients(SiteOptimizerDigest(**rule), tasks=["train"], filter_type=FilterType.TASK_RESULT)
    if is_private(spec):
        # The same task set as the filters above: NVFlare keeps one filter chain per set of tasks.
        job.to_clients(SumWorkflowRound(), tasks=["train", "validate"], filter_type=FilterType.TASK_DATA)
    job.to_clients(SampleCountWeight(), tasks=["train"], filter_type=FilterType.TASK_RESULT)
    if spec.secure_aggregation == "secagg":
        from controllers.secagg_site import SecAggMask

        job.to_clients(SecAggMask(), tasks=["train"], filter_type=FilterType.TASK_RESULT)
    if encrypted:
        from nvflare.app_opt.he.model_encryptor import HEModelEncryptor

        encryptor = HEModelEncryptor(tenseal_context_file=CLIENT_CONTEXT, weigh_by_local_iter=True)
        job.to_clients(encryptor, tasks=["train"], filter_type=FilterType.TASK_RESULT)


def add_secagg_site(job: Any) -> None:
    """The sites' SecAgg+ state and key stages (controllers/secagg_site.py): the round's state, the executor of the
    key and unmask stages, and the task-data filter that opens the shares addressed to the site and keeps the model
    as the server sent it (the masked update is taken against it, so that the server's sum is the trained models'
    mean under FedOpt's site step too). The masking result filter comes after the weight (`add_sum_site_filters`)."""
    from nvflare.job_config.defs import FilterType

    from aggregators.secagg import KEYS_TASK, SHARES_TASK, UNMASK_TASK
    from controllers.secagg_site import STATE_ID, SecAggExecutor, SecAggSite, SecAggTaskData

    job.to_clients(SecAggSite(), id=STATE_ID)
    job.to_clients(SecAggExecutor(), tasks=[KEYS_TASK, SHARES_TASK, UNMASK_TASK])
    # The same task set as the other task-data filters: NVFlare keeps one filter chain per set of tasks.
    job.to_clients(SecAggTaskData(), tasks=["train", "validate"], filter_type=FilterType.TASK_DATA)


def is_he_job(job_dir: Path) -> bool:
    """Whether an exported job folder uses NVFlare's HE components (it then needs kits provisioned with HEBuilder)."""
    configs = Path(job_dir).glob("app*/config/config_fed_*.json")
    return any(name in path.read_text() for path in configs for name in HE_COMPONENTS)


def decrypt_global_model(model_file: Path, context_file: Path, shapes: Mapping[str, Sequence[int]]) -> dict[str, Any]:
    """The server's saved global model (``app_server/FL_global_model.pt`` of an HE job), decrypted with a site's
    TenSEAL context (``<site kit>/startup/client_context.tenseal``, which holds the secret key), as float32 arrays of
    ``shapes``. Entries that were never encrypted (the initial model of a job that stopped before its first round)
    are returned as they are."""
    import numpy as np
    import tenseal as ts
    import torch

    context = ts.context_from(Path(context_file).read_bytes())
    if not context.is_private():
        raise ValueError(f"{context_file} holds no secret key: decrypt with a site's client context, not the server's")
    saved = torch.load(model_file, map_location="cpu", weights_only=False)
    weights = saved.get("model", saved) if isinstance(saved, dict) else saved
    model = {}
    for name, shape in shapes.items():
        value = weights[name]
        if isinstance(value, bytes):
            value = ts.ckks_vector_from(context, value).decrypt()
        elif hasattr(value, "numpy"):
            value = value.numpy()
        model[name] = np.asarray(value, dtype=np.float32).reshape(shape)
    return model


def job_model_shapes(job_dir: Path) -> dict[str, tuple[int, ...]]:
    """The state_dict shapes of an exported job's model, built from its persistor's entry (no weights loaded)."""
    import json

    from nvflare.fuel.utils.class_utils import instantiate_class

    config = json.loads((Path(job_dir) / "app" / "config" / "config_fed_server.json").read_text())
    persistor = next(c for c in config["components"] if c["id"] == "persistor")
    entry = persistor["args"]["model"]
    model = instantiate_class(entry["path"], entry.get("args", {}))
    return {name: tuple(value.shape) for name, value in model.state_dict().items()}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m jobs.secure_aggregation decrypt``: a site decrypts an HE job's final global model."""
    import torch

    parser = argparse.ArgumentParser(prog="python -m jobs.secure_aggregation", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    decrypt = commands.add_parser("decrypt", help="decrypt the server's saved global model at a site")
    decrypt.add_argument("model", type=Path, help="the downloaded app_server/FL_global_model.pt")
    decrypt.add_argument("--context", type=Path, required=True, help="<site kit>/startup/client_context.tenseal")
    decrypt.add_argument("--job", type=Path, required=True, help="the job folder (its model gives the shapes)")
    decrypt.add_argument("--out", type=Path, required=True, help="where to write the plaintext state_dict (.pt)")
    args = parser.parse_args(argv)
    try:
        model = decrypt_global_model(args.model, args.context, job_model_shapes(args.job))
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.save({name: torch.from_numpy(value) for name, value in model.items()}, args.out)
    print(f"decrypted {len(model)} entries into {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
