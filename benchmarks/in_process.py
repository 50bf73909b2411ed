"""A job's federation run in this process: the round engine with the client script's site rounds, no NVFlare.

Given the `jobs.build.JobSpec` a job folder is built from, `run_in_process` uses what the NVFlare job
uses, piece by piece:

- the server: the same rule and companions (``compose(build_rule(...), companion_rules(spec))``), the same
  `controllers.engine.RoundEngine` (sampling, broadcast meta, validation, aggregation, failure handling),
  the same initial model (``FLClassifier(..., init_seed=seed)``, what the job's persistor builds) and the same
  `controllers.evaluator.TestSetEvaluator`;
- every site: the client script's own options (``client_script_args(spec)`` parsed by ``jobs.client``'s parser),
  its simulation shard (``site_split``), and `lightning_modules.site.SiteRound`, the round the client script
  runs, with `lightning_modules.site.LocalExchange` in place of NVFlare's FLCallback. Client algorithm
  state goes to a per-site `ClientStateStore` under ``state_root``.

So the global model of every round is bit-identical to the simulator's (``tests/e2e/test_e2e_engine_equivalence.py``
checks FedAvg, SCAFFOLD with partial participation and the median), at a fraction of the time: no processes, no
polling. The robustness benchmark runs its grid through here.

It reads a job's build-time settings (`jobs`) and drives the server's round engine (`controllers`), which are
independent of each other, so it lives on the layer above both (docs/design.md, "Layers").
"""

from __future__ import annotations

import contextlib
import logging
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aggregators.compose import compose
from aggregators.registry import build_rule
from controllers.engine import Host, InProcessTransport, Params, RoundEngine, RoundObserver, Transport
from controllers.evaluator import TestSetEvaluator
from data_prep import SiteDataConfig, site_split
from data_prep.site_config import seed_index
from lightning_modules.classifier import FLClassifier
from lightning_modules.site import build_site_round
from lightning_modules.state_store import ClientStateStore


class RecordingHost(Host):
    """Keeps every metrics line in memory (`records`) and scores the global model with ``evaluator``."""

    def __init__(self, evaluator: Any | None = None) -> None:
        self.evaluator = evaluator
        self.records: list[dict[str, Any]] = []

    def evaluate(self, params: Params) -> dict[str, float]:
        return self.evaluator.evaluate(params) if self.evaluator is not None else {}

    def record(self, record: dict[str, Any]) -> None:
        self.records.append(record)


@dataclass
class InProcessRun:
    """The final global model and rule state, and the metrics lines the NVFlare job would have written."""

    params: Params
    state: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    #: site -> the final global model's validation metrics on that site's split (user models only)
    final_site_scores: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def rounds(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r["stage"] == "round"]


def site_args(spec: Any) -> Any:
    """The options every site's client script gets for ``spec``, parsed by the client script's own parser."""
    from jobs.build import client_script_args
    from jobs.client import build_parser

    return build_parser().parse_args(client_script_args(spec).split())


def site_rounds(spec: Any, state_root: Path) -> dict[str, Any]:
    """``site-1`` .. ``site-N`` of ``spec`` as the client script sets them up in the simulator."""
    from jobs.build import dataset_num_classes

    args = site_args(spec)
    if spec.model is not None:  # the user's own module and data module (lightning_modules/own_model.py)
        from lightning_modules.own_model import UserSite

        names = [f"site-{i + 1}" for i in range(spec.num_sites)]
        return {site: UserSite(args, site, ClientStateStore(Path(state_root), site)) for site in names}
    config = SiteDataConfig.from_namespace(args)
    num_classes = dataset_num_classes(spec.dataset)
    sites = {}
    for i in range(spec.num_sites):
        site = f"site-{i + 1}"
        x, y = site_split(config, site)
        store = ClientStateStore(Path(state_root), site)
        sites[site] = build_site_round(args, site, seed_index(site, args.num_sites), x, y, num_classes, store)
    return sites


def initial_params(spec: Any) -> Params:
    """The job's initial global model: what its persistor builds (``FLClassifier`` seeded with the job seed, or
    the user's module from its import path)."""
    from jobs.build import dataset_num_classes, model_arch_args

    if spec.model is not None:
        from lightning_modules.own_model import build_user_module

        module = build_user_module(spec.model, spec.model_args, seed=spec.seed)
        return {key: value.detach().cpu().numpy().copy() for key, value in module.state_dict().items()}
    model = FLClassifier(
        arch=spec.arch,
        num_classes=dataset_num_classes(spec.dataset),
        arch_args=model_arch_args(spec) or None,
        init_seed=spec.seed,
    )
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def run_in_process(
    spec: Any,
    state_root: Path,
    *,
    evaluate: bool = True,
    observers: Sequence[RoundObserver] = (),
    host: RecordingHost | None = None,
    run_id: str | None = None,
    wrap_transport: Callable[[Transport], Transport] | None = None,
) -> InProcessRun:
    """Run ``spec``'s federation here (module docstring); ``state_root`` holds the sites' client state files.

    ``wrap_transport`` wraps the sites' transport, e.g. to count the bytes each round sends (benchmarks/compare.py).
    """
    from jobs.build import companion_rules, dataset_num_classes, model_arch_args

    rule = compose(build_rule(spec.server, **dict(spec.server_args)), companion_rules(spec))
    engine = RoundEngine(
        rule,
        num_rounds=spec.num_rounds,
        clients_per_round=spec.clients_per_round,
        min_accepted=getattr(spec, "min_accepted", 1),
        min_responses=getattr(spec, "min_responses", None),
        seed=spec.seed,
        rule_label=spec.server,
        observers=observers,
        local_keys=[key for key in getattr(spec, "local_keys", "").split(",") if key],
        stop_patience=getattr(spec, "stop_patience", None),
    )
    if host is None:
        evaluator = None
        if evaluate and spec.model is None:  # a user model's job has no server-side test set: sites evaluate
            evaluator = TestSetEvaluator(
                arch=spec.arch,
                num_classes=dataset_num_classes(spec.dataset),
                arch_args=model_arch_args(spec) or None,
                dataset=spec.dataset,
                max_test_samples=spec.max_test_samples,
            )
        host = RecordingHost(evaluator)
    sites = site_rounds(spec, state_root)
    params = initial_params(spec)
    transport: Transport = InProcessTransport({name: site.train for name, site in sites.items()})
    if wrap_transport is not None:
        transport = wrap_transport(transport)
    final, state = engine.run(
        tuple(sites), params, engine.init_state(params), transport, host, run_id=run_id or uuid.uuid4().hex
    )
    for name in sites:  # the job's end confirms its last round: the sites settle their pending state
        ClientStateStore(Path(state_root), name).settle_all(spec.num_rounds, engine.last_aggregated)
    scores = {name: site.score(final) for name, site in sites.items() if getattr(site, "evaluate", False)}
    return InProcessRun(params=final, state=state, records=host.records, final_site_scores=scores)


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's per-fit banner and its small-dataset warnings (hundreds of fits in a benchmark)."""
    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="pytorch_lightning")
            warnings.filterwarnings("ignore", module="lightning")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


__all__ = [
    "InProcessRun",
    "RecordingHost",
    "initial_params",
    "quiet_lightning",
    "run_in_process",
    "site_args",
    "site_rounds",
]
