"""Our aggregation rules inside NVFlare's own jobs: a ``ModelAggregator`` for NVFlare's stock FedAvg controller.

    from nvflare.app_common.workflows.fedavg import FedAvg
    from controllers.nvflare_aggregator import RuleAggregator

    job.to_server(FedAvg(num_clients=3, num_rounds=5, aggregator=RuleAggregator("median")))
    # or: FedAvgRecipe(..., aggregator=RuleAggregator("trimmed_mean", {"beta": 0.2}))

NVFlare's FedAvg controller hands an aggregator the sites' results one by one and takes back the new global
weights; it never shows the aggregator the current global model, and it broadcasts nothing but the model. So only
rules that need neither can run there:

- no broadcast state (SCAFFOLD's control, FedDyn's h, FedMoS's selection, FedOpt's moments) and no required meta
  beyond the sample count;
- a result that does not depend on the global model x: the rule is *translation equivariant*,
  ``rule(x, {y_i}) = rule(0, {y_i})`` — FedAvg with ``server_lr = 1`` (x + Σ p_i (y_i − x) = Σ p_i y_i), the
  coordinate-wise median and trimmed mean, and Krum (distances between the y_i do not involve x).

Every other rule is refused when the aggregator is built, with the reason. The results are kept as they arrive
and checked together when the round aggregates, with the round engine's validation (keys, shapes, finite values,
sample count, one result per site, the round's agreed ``train.param_keys``): a bad site is left out by name and the
round goes on. The keys and shapes they are checked against are those of the model this aggregator last returned
(the global model: NVFlare's FedAvg replaces it with a FULL update); before any round aggregated, those most of the
round's results carry (`majority_signature`), so no single result, the first to arrive included, defines
them. A tie trusts no result and fails the round. A round that cannot aggregate (no valid result, a rule error, a
non-finite aggregate) leaves the global model unchanged instead of ending the job
(`RuleAggregator.aggregate_model`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator

from aggregators.registry import RULES, build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext, UndeclaredCapability, declared
from controllers.adapters import Rejection, result_site
from controllers.checkpoint import save_updates
from controllers.engine import RoundEngine, SiteResult, aggregate_problems

#: A result's parameter keys, each with its shape.
Signature = frozenset[tuple[str, tuple[int, ...]]]


def params_signature(params: Mapping[str, Any]) -> Signature:
    """The keys and shapes of a result's parameters (``np.shape`` also reads lists and tensors)."""
    return frozenset((str(key), tuple(np.shape(value))) for key, value in params.items())


def majority_signature(signatures: Sequence[Signature]) -> tuple[Signature | None, str]:
    """The keys and shapes most results carry, or ``None`` and why none is trusted.

    Every site runs the job's model, so the shapes are a property of the job: the signature most results carry is
    the model's, and a site sending another (an oversized payload, another model) is the one to reject, whenever it
    arrives. A tie trusts no signature, as the round engine's trainable-set agreement does: the server cannot tell
    which side is right. A result without parameters does not vote.
    """
    ranked = Counter(s for s in signatures if s).most_common()
    if not ranked:
        return None, "no result carries parameters"
    if len(ranked) > 1 and ranked[1][1] == ranked[0][1]:
        return None, (
            f"the round's results carry {len(ranked)} different sets of parameter keys and shapes, none more often "
            "than another; none is trusted"
        )
    return ranked[0][0], ""


def equivariant_rules(rules: Mapping[str, type]) -> dict[str, str]:
    """The rules of ``rules`` whose result does not depend on the global model, with the settings under which that
    holds: each rule's own ``translation_equivariant`` declaration, never inherited (aggregators/types.py)."""
    own = {name: declared(cls, "translation_equivariant", None) for name, cls in rules.items()}
    return {name: settings for name, settings in own.items() if settings is not None}


#: Why partial sharing (``local_keys``: FedPer, FedBN, FedRep) cannot run under NVFlare's FedAvg controller.
LOCAL_KEYS_REFUSAL = (
    "NVFlare's FedAvg controller replaces its whole global model with what the aggregator returns and never shows "
    "the aggregator that model, so the local entries the sites keep (and do not send) would vanish from it; run "
    "partial sharing with the bundle's controller (python -m jobs.build --local-keys ...)"
)


class RuleAggregator(ModelAggregator):
    """A rule of `aggregators.registry.RULES` as an NVFlare ``ModelAggregator`` (module docstring)."""

    #: Rules whose result does not depend on the global model, with the settings under which that holds: derived
    #: from each rule's own ``translation_equivariant`` declaration (`equivariant_rules`).
    EQUIVARIANT: ClassVar[dict[str, str]] = equivariant_rules(RULES)

    def __init__(
        self,
        rule: str = "fedavg",
        rule_args: Mapping[str, Any] | None = None,
        save_updates_dir: str = "",
        local_keys: Sequence[str] = (),
    ) -> None:
        """``save_updates_dir``: also save every round's accepted site models and the result there (audits).
        ``local_keys`` (partial sharing) is refused: see `LOCAL_KEYS_REFUSAL`."""
        if local_keys:
            raise ValueError(f"RuleAggregator: local_keys {list(local_keys)[:5]}: {LOCAL_KEYS_REFUSAL}")
        super().__init__()
        self.local_keys: list[str] = []
        # NVFlare's job export reads the constructor's arguments back from attributes of the same names.
        self.rule = rule
        self.rule_args = dict(rule_args or {})
        self.save_updates_dir = save_updates_dir
        self.aggregation_rule = build_rule(rule, **self.rule_args)
        _check_usable(self.aggregation_rule, rule)
        self.state = self.aggregation_rule.init_state({})
        # The round engine's validation, so a result is accepted here exactly when our controller would accept it.
        self.validator = RoundEngine(self.aggregation_rule, num_rounds=0, rule_label=rule)
        #: keys and shapes of the model this aggregator last returned, i.e. NVFlare's global model (None: none yet).
        self.model_signature: Signature | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.results: list[SiteResult] = []
        self.updates: list[ClientUpdate] = []
        self.rejections: list[Rejection] = []
        self.reference: dict[str, np.ndarray] | None = None
        self.round_num = 0

    def accept_model(self, model: FLModel) -> None:
        """Keep the result; it is checked with the round's others in `aggregate_model`, so that the order in
        which results arrive decides nothing (module docstring)."""
        self.round_num = model.current_round or self.round_num
        self.results.append(SiteResult(result_site(model), model.params or {}, model.meta or {}))

    def aggregate_model(self) -> FLModel:
        """The new global model; on any failure a no-op update (below), never an exception.

        NVFlare's FedAvg controller ends the whole job when its aggregator raises, and it would persist and
        broadcast whatever comes back. So a round without a valid result, a rule that raises, or an aggregate with
        NaN/Inf or other keys or shapes is logged with the rule's name and answered with an empty ``DIFF`` update:
        NVFlare adds nothing to the global model, which stays as it was, and the next round runs.
        """
        try:
            params = self._aggregate()
        except Exception as exc:  # no rule error may end the job or reach the global model
            failure = f"{type(exc).__name__}: {exc}" if not isinstance(exc, AggregationError) else str(exc)
            self.error(f"round {self.round_num}: {failure}; the global model is left unchanged this round")
            meta = {"nr_aggregated": 0, "aggregation_rule": self.rule, "round_failed": failure}
            return FLModel(params_type=ParamsType.DIFF, params={}, meta=meta)
        meta = {"nr_aggregated": len(self.updates), "aggregation_rule": self.rule}
        return FLModel(params_type=ParamsType.FULL, params=params, meta=meta)

    def _aggregate(self) -> dict[str, np.ndarray]:
        """The rule's aggregate of the accepted results, checked; the rule state advances only when it is usable."""
        self._validate()
        if not self.updates or self.reference is None:
            raise AggregationError(f"{self.rule}: no valid result this round ({len(self.rejections)} rejected)")
        updates = self.updates
        sites = tuple(u.site for u in updates)
        context = RoundContext(round_num=self.round_num, num_rounds=self.round_num + 1, population=sites)
        # Translation equivariance (module docstring): aggregating around x = 0 gives the rule's result for any x.
        result = self.aggregation_rule.aggregate(self.reference, updates, self.state, context)
        problems = aggregate_problems(self.reference, result.params)
        if problems:
            raise AggregationError(f"rule '{self.rule}' produced an unusable model: " + "; ".join(problems))
        self.state = result.state
        self.model_signature = params_signature(result.params)
        if self.save_updates_dir:
            save_updates(Path(self.save_updates_dir) / f"round_{self.round_num:05d}.npz", updates, result.params)
        return dict(result.params)

    def _validate(self) -> None:
        """Sets `updates` (sorted by site), `rejections` (each logged by site name) and
        `reference`: zeros with the global model's keys and shapes when known, else the majority's."""
        signatures = [params_signature(r.params) for r in self.results]
        chosen, reason = (self.model_signature, "") if self.model_signature else majority_signature(signatures)
        if chosen is None:
            self.updates, self.rejections = [], [Rejection(r.site, (reason,)) for r in self.results]
        else:
            self.reference = reference_of(self.results, chosen)
            self.updates, self.rejections = self.validator.validate(self.results, self.reference, self.state)
        for rejection in self.rejections:
            self.error(str(rejection))


def reference_of(results: Sequence[SiteResult], signature: Signature) -> dict[str, np.ndarray]:
    """Zeros with ``signature``'s keys and shapes, in the key order and dtypes of the result that carries it from
    the first site by name (arrival order decides nothing); float32 when no result carries it."""
    matching = sorted((r for r in results if params_signature(r.params) == signature), key=lambda r: r.site)
    if matching:
        return {key: np.zeros_like(np.asarray(value)) for key, value in matching[0].params.items()}
    return {key: np.zeros(shape, np.float32) for key, shape in sorted(signature)}


def _check_usable(rule: Any, name: str) -> None:
    try:
        equivariant = declared(RULES[name], "translation_equivariant")  # undeclared: refused, never inherited
    except UndeclaredCapability as exc:
        raise AggregationError(str(exc)) from None
    if equivariant is None:
        raise AggregationError(
            f"rule '{name}' cannot run as an NVFlare ModelAggregator: NVFlare's FedAvg controller neither shows an "
            "aggregator the global model nor broadcasts a rule's meta; usable there: "
            f"{sorted(RuleAggregator.EQUIVARIANT)}. Use our controller (python -m jobs.build --server {name})."
        )
    if getattr(rule, "broadcast_keys", ()) or set(rule.required_meta) - {"train.num_samples"}:
        raise AggregationError(f"rule '{name}' needs broadcast or extra meta, which NVFlare's FedAvg does not carry")
    if getattr(rule, "server_lr", 1.0) != 1.0:  # the setting its declaration names (FedAvg's "server_lr = 1")
        raise AggregationError(
            f"rule '{name}' with server_lr={rule.server_lr} needs the global model; as an NVFlare ModelAggregator "
            "only server_lr = 1 is exact"
        )
