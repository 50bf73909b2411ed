"""FedOpt under secure aggregation: the server optimizer's step, taken by every site on the decrypted mean.

``--secure-aggregation he --server fedadam|fedyogi|fedadagrad|fedavgm`` (docs/deployment.md, section 10). Under HE
the server holds no secret key: NVFlare's aggregator forms the encrypted weighted mean ybar = sum_i p_i y_i of the
site models and sends it back, and only the sites can read it. FedOpt (aggregators/fedopt.py, Reddi et al. 2021)
needs Delta = ybar - x and moments m, v that are non-linear in Delta, so the server cannot take its step. Every site
takes it instead, with the bundle's own rule, on the same numbers:

- round 0: the received model is the initial one (NVFlare's ScatterAndGather sends it in clear). It is x_0; the
  moments are empty and the step counter 0. Stored, and trained from.
- round r >= 1: the received model is ybar_{r-1}, decrypted by NVFlare's ``HEModelDecryptor`` just before
  `SiteOptimizerStep` runs. With the stored x_{r-1} and state, x_r = FedOpt(x_{r-1}, ybar_{r-1}, state):
  `aggregators.fedopt.FedOpt.aggregate` with ybar as the single update of weight 1, which is the rule's
  pseudo-gradient sum_i p_i (y_i - x) since sum_i p_i = 1. x_r and the new state are stored, and x_r replaces
  ybar as the model the site trains from.
- the same round again (a site restarted after storing x_r): the stored x_r, provided the received model is the
  one it was computed from; anything else is refused.

The state lives in the site's private store (lightning_modules/state_store.py: checksummed, written atomically),
``<state root>/<NVFlare job id>/<site>/he_fedopt.state``, beside the client algorithm's own state. A site whose
stored state is not of the previous round (it missed a round's model, lost its store, or the server restarted the
job from round 0) is refused in one line naming the site: it cannot rebuild x from later means.

Every site must hold the same x and moments. The step is deterministic: CKKS decryption of the same ciphertext with
the same secret key gives the same numbers (checked, tests/controllers/test_ctl_he_fedopt.py), every site receives
the same ciphertext, and the rule's numpy arithmetic is elementwise IEEE float32. Should two sites still disagree
(another TenSEAL or numpy build, a site that trained from a stale store), `SiteOptimizerDigest` sends a
16-hex digest of (x_r, m, v, step) with every result, and the server's `SiteOptimizerConsensus` stops the job
before it aggregates a round whose sites trained from different models, naming the sites that differ from the
majority. The digest is a SHA-256 of values that every site holds; it tells the server whether the sites agree, not
what x is (only someone who can already guess x bit for bit could confirm it).

The server's saved global model is the last mean ybar_{T-1}; the FedOpt model x_T is one more step at a site:
`SiteOptimizer.final_model` (``python -m jobs.fedopt_final``). The step, the digest and the settings check are in
`lightning_modules.site_optimizer`, the site's layer, which the builder and the site's tool read too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.dxo_filter import DXOFilter
from nvflare.apis.fl_component import FLComponent
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReservedHeaderKey, Shareable
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType

from aggregators.contracts import meta_keys

# The step itself runs at the site (lightning_modules/site_optimizer.py); its names are re-exported here.
from lightning_modules.site_optimizer import (  # noqa: F401
    ALGORITHM,
    DIGEST,
    DIGEST_CHARS,
    DIGEST_ROUND,
    SiteOptimizer,
    SiteOptimizerError,
    SiteState,
    as_model,
    digest,
    divergence_problem,
    site_optimizer_problem,
)
from lightning_modules.state_store import ClientStateStore, default_state_root


def _site_optimizer(rule: str, rule_args: Mapping[str, Any], fl_ctx: FLContext) -> SiteOptimizer:
    """The site's optimizer, its state in the site's store (``$FLALGO_STATE_DIR`` or ``./client_state``, as the
    client's algorithm state) under NVFlare's job id."""
    store = ClientStateStore(default_state_root(), fl_ctx.get_identity_name(), per_run=True)
    store.use_run(fl_ctx.get_job_id())
    return SiteOptimizer(rule, rule_args, store)


class SiteOptimizerStep(DXOFilter):
    """Site, task data, after NVFlare's ``HEModelDecryptor``: the received mean becomes x_r (``train`` tasks
    only: the filter is registered with the decryptor's task set, and a ``validate`` task passes unchanged)."""

    def __init__(self, server: str, server_args: dict | None = None) -> None:
        """``server``, ``server_args``: the job's rule and its arguments (the job settings of those names)."""
        super().__init__(supported_data_kinds=[DataKind.WEIGHTS], data_kinds_to_filter=[DataKind.WEIGHTS])
        self.server, self.server_args = server, dict(server_args or {})

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO | None:
        task = shareable.get_header(ReservedHeaderKey.TASK_NAME)
        if task not in (None, AppConstants.TASK_TRAIN):  # another task (validate) gets the model as it came
            return None
        round_num = int(shareable.get_header(AppConstants.CURRENT_ROUND))
        state = _site_optimizer(self.server, self.server_args, fl_ctx).start_round(round_num, dxo.data)
        dxo.data = {key: np.array(value, copy=True) for key, value in state.x.items()}
        self.log_info(fl_ctx, f"FedOpt at the site: round {round_num}, step {state.step}, x {state.digest}")
        return dxo


class SiteOptimizerDigest(DXOFilter):
    """Site, ``train`` task result, before the weight and the encryptor: the digest of the state trained from."""

    def __init__(self, server: str, server_args: dict | None = None) -> None:
        """``server``, ``server_args``: the job's rule and its arguments (the job settings of those names)."""
        super().__init__(supported_data_kinds=[DataKind.WEIGHTS], data_kinds_to_filter=[DataKind.WEIGHTS])
        self.server, self.server_args = server, dict(server_args or {})

    def process_dxo(self, dxo: DXO, shareable: Shareable, fl_ctx: FLContext) -> DXO:
        round_num = int(shareable.get_header(AppConstants.CURRENT_ROUND))
        optimizer = _site_optimizer(self.server, self.server_args, fl_ctx)
        state = optimizer.record_result(round_num, dxo.get_meta_prop(meta_keys.PARAM_KEYS))
        dxo.set_meta_prop(DIGEST, state.digest)
        dxo.set_meta_prop(DIGEST_ROUND, round_num)
        return dxo


class SiteOptimizerConsensus(FLComponent):
    """Server: before each aggregation, every accepted result must carry the same state digest
    (`divergence_problem`); otherwise the job stops (NVFlare's system panic) with that one line."""

    def __init__(self) -> None:
        super().__init__()
        self._reports: dict[str, dict[str, Any]] = {}

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == AppEventType.ROUND_STARTED:
            self._reports = {}
        elif event_type == AppEventType.AFTER_CONTRIBUTION_ACCEPT:
            result = fl_ctx.get_prop(AppConstants.TRAINING_RESULT)
            if result is None or not fl_ctx.get_prop(AppConstants.AGGREGATION_ACCEPTED):
                return
            meta = from_shareable(result).meta or {}
            site = result.get_peer_prop(ReservedKey.IDENTITY_NAME, "?")
            self._reports[site] = {key: meta.get(key) for key in (DIGEST, DIGEST_ROUND)}
        elif event_type == AppEventType.BEFORE_AGGREGATION:
            round_num = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
            problem = divergence_problem(round_num, self._reports)
            if problem:
                self.log_error(fl_ctx, problem)
                self.system_panic(problem, fl_ctx)
            elif self._reports:
                agreed = next(iter(self._reports.values()))[DIGEST]
                self.log_info(fl_ctx, f"FedOpt at the sites, round {round_num}: every site holds x {agreed}")
