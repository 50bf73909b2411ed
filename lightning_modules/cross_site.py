"""A site's side of cross-site evaluation (``cross_site_eval``; aggregators/contracts/cross_site.py has the names and
the arithmetic, controllers/cross_site.py the server's side).

- `submission`: the model the site keeps (`lightning_modules.kept_model.KEPT_STORE`: one state, or for a mixture
  its own and federated states and the weight) and its early-stopped local-only model
  (`lightning_modules.kept_model.OWN_STORE`), both of the run the task names, as ``<part>/<entry>`` weights;
- `score_owners`: the other sites' models the task carries, scored on this site's validation split in one plain
  forward pass per model (lightning_modules/split_scores.py; a mixture mixes the probabilities, as the owner chose
  it), answered as counts per owner (`aggregators.contracts.cross_site.COUNTS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch

from aggregators.contracts import cross_site, meta_keys
from lightning_modules.kept_model import KEPT_STORE, OWN_STORE, RUN_KEY
from lightning_modules.site_choice import mixture_scores
from lightning_modules.split_scores import SplitBatches, log_probs
from lightning_modules.state_store import ClientStateStore

__all__ = ["CrossSiteError", "answer", "is_cross_site_task", "owner_models", "respond", "score_owners", "submission"]


class CrossSiteError(RuntimeError):
    """The site cannot take part (no kept or local-only model of this run, a malformed task): one line."""


def _state(store: ClientStateStore, name: str, run_id: str, site: str) -> dict[str, Any]:
    stored = store.load(name)
    if stored is None or stored.state.get(RUN_KEY) != run_id:
        raise CrossSiteError(
            f"{site}: cross-site evaluation: no {name} of run {run_id!r} in the site's state store "
            "(the job needs --keep best --local-baseline and a validation split, and at least one round)"
        )
    return dict(stored.state)


def _cpu(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {key: torch.as_tensor(value).detach().cpu() for key, value in state.items()}


def submission(store: ClientStateStore, run_id: str, site: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The site's kept and local-only models of run ``run_id`` as ``<part>/<entry>`` weights, and the meta (the
    mixture's weight of the federated model, for a mixture only)."""
    store.use_run(run_id)
    kept, own = _state(store, KEPT_STORE, run_id, site), _state(store, OWN_STORE, run_id, site)
    if "kind" not in kept or "state" not in kept:
        raise CrossSiteError(
            f"{site}: cross-site evaluation: the kept model was chosen on the Lightning path (a module whose forward "
            "is not a classifier's, lightning_modules/keep_best.py), which keeps no local-only model to send"
        )
    params: dict[str, torch.Tensor] = {}
    meta: dict[str, Any] = {}
    if kept.get("kind") == "mixture":
        mixture = kept["state"]
        for part, state in ((cross_site.KEPT_OWN, mixture["own"]), (cross_site.KEPT_FEDERATED, mixture["federated"])):
            params.update({cross_site.model_key(part, k): v for k, v in _cpu(state).items()})
        meta[cross_site.KEPT_WEIGHT] = float(mixture["weight"])
    else:
        params.update({cross_site.model_key(cross_site.KEPT, k): v for k, v in _cpu(kept["state"]).items()})
    params.update({cross_site.model_key(cross_site.LOCAL, k): v for k, v in _cpu(own["state"]).items()})
    return params, meta


def owner_models(params: Mapping[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """A validate task's weights, per owner and part: ``{owner: {part: state_dict}}``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in params.items():
        owner, part, name = cross_site.split_key(key, with_owner=True)
        out.setdefault(str(owner), {}).setdefault(part, {})[name] = value
    return out


def _table(template: pl.LightningModule, state: Mapping[str, Any], split: SplitBatches) -> np.ndarray:
    template.load_state_dict({k: torch.as_tensor(np.array(v, copy=True)) for k, v in state.items()}, strict=True)
    table = log_probs(template, split)
    if table is None:
        raise CrossSiteError("cross-site evaluation: the job's model is not a classifier")
    return table


def score_owners(
    params: Mapping[str, Any],
    weights: Mapping[str, float | None],
    split: SplitBatches,
    make_module: Callable[[], pl.LightningModule],
) -> dict[str, int]:
    """Every owner's kept and local-only model on ``split`` (this site's validation split), as counts."""
    module = make_module()
    out: dict[str, int] = {}
    for owner, parts in sorted(owner_models(params).items()):
        if cross_site.KEPT in parts:
            kept = _table(module, parts[cross_site.KEPT], split)
        else:
            weight = weights.get(owner)
            if weight is None or not {cross_site.KEPT_OWN, cross_site.KEPT_FEDERATED} <= set(parts):
                raise CrossSiteError(f"cross-site evaluation: {owner}'s kept model is incomplete")
            own = _table(module, parts[cross_site.KEPT_OWN], split)
            federated = _table(module, parts[cross_site.KEPT_FEDERATED], split)
            kept = mixture_scores({"v": own}, {"v": federated}, float(weight))["v"]
        local = _table(module, parts[cross_site.LOCAL], split)
        kept_right, local_right = kept.argmax(axis=1) == split.labels, local.argmax(axis=1) == split.labels
        counts = {
            "num_samples": len(split),
            "kept_correct": int(kept_right.sum()),
            "local_correct": int(local_right.sum()),
            "kept_only": int((kept_right & ~local_right).sum()),
            "local_only": int((local_right & ~kept_right).sum()),
        }
        out.update({cross_site.count_name(owner, name): value for name, value in counts.items()})
    return out


def answer(
    task: str,
    params: Mapping[str, Any] | None,
    meta: Mapping[str, Any],
    site: str,
    store: ClientStateStore | None,
    split: SplitBatches | None,
    make_module: Callable[[], pl.LightningModule],
) -> dict[str, Any]:
    """The site's reply to a cross-site task, as ``FLModel`` fields: ``params`` and ``meta`` (submit) or
    ``metrics`` (validate)."""
    run_id = str(meta.get(meta_keys.RUN_ID) or "")
    if task == cross_site.SUBMIT_TASK:
        if store is None:
            raise CrossSiteError(f"{site}: cross-site evaluation: the site keeps no state store")
        params_out, meta_out = submission(store, run_id, site)
        return {"params": params_out, "meta": meta_out}
    if split is None:
        raise CrossSiteError(f"{site}: cross-site evaluation: the site holds no validation split")
    weights = dict(meta.get(cross_site.WEIGHTS) or {})
    return {"metrics": score_owners(params or {}, weights, split, make_module)}


def is_cross_site_task(task: str) -> bool:
    """Whether ``task`` is one of cross-site evaluation's."""
    return task in (cross_site.SUBMIT_TASK, cross_site.VALIDATE_TASK)


def respond(
    task: str,
    received: Any,
    site: str,
    store: ClientStateStore | None,
    split: SplitBatches | None,
    make_module: Callable[[], pl.LightningModule],
    send: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Answer a cross-site task over NVFlare (``send``: ``nvflare.client.send``) and return the reply. A site that
    cannot take part says why in its log (one line) and answers empty (no weights, no counts): the server names it
    and goes on without it, after the training it did."""
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    try:
        reply = answer(task, received.params, received.meta or {}, site, store, split, make_module)
        print(f"{site}: answered {task}", flush=True)
    except CrossSiteError as exc:
        print(f"error: {exc}; answering {task} with nothing", flush=True)
        reply = {}
    if send is None:
        import nvflare.client as flare_api

        send = flare_api.send
    if task == cross_site.SUBMIT_TASK:
        send(FLModel(params_type=ParamsType.FULL, params=reply.get("params", {}), meta=reply.get("meta", {})))
    else:
        send(FLModel(metrics=reply.get("metrics", {})))
    return reply
