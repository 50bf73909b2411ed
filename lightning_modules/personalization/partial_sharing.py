"""The site's half of partial sharing (FedPer, FedBN, FedRep's head): keep the local entries L between rounds and
never send them. `lightning_modules.federated.FederatedAlgorithm` drives it; the math is in
`lightning_modules.personalization.local_keys`.

Per round, at the points of the fit where the callback runs:

1. round start (NVFlare's FLCallback has loaded the whole global model): the L of the site's previous round is
   committed or rolled back with the store's pending/commit mechanism (the same as SCAFFOLD's c_i: committed only
   when the server confirms it aggregated that round's result, so a rejected or replayed round leaves L as it
   was), then loaded over the received values. Before the site first trains, L keeps the received values, which
   are the initial model's (the server never changes them). A missing file where the server says the site was
   aggregated before, a corrupt file, a file of another run or of another model: a warning naming the site, the
   keys and why, and the round goes on from the received values; never a silently wrong L;
2. round end: L is saved as pending state, and a state_dict post-hook on the module drops L from every state_dict
   until the fit ends, so what NVFlare's FLCallback (or the in-process `lightning_modules.site.LocalExchange`)
   takes at its ``on_train_end``, which runs after ours, carries S only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.base import (
    LOCAL_KEYS_ATTRIBUTE,
    RUN_ID_KEY,
    ClientAlgorithm,
    ClientAlgorithmError,
    save_run_state,
    settle_state,
)
from lightning_modules.personalization.local_keys import (
    HEAD_METHOD,
    declared_head_keys,
    local_keys_problem,
    parse_local_keys,
)
from lightning_modules.state_store import ClientStateStore, StateStoreError

LOG = logging.getLogger(__name__)
#: The entry of the site's state store that holds L.
STORE_NAME = "local_entries"


class LocalEntries:
    """One site's local entries ``keys`` (explicit state_dict names) and where they persist between rounds."""

    def __init__(self, site: str, keys: Sequence[str], state_store: ClientStateStore | None) -> None:
        self.site = site
        self.keys = tuple(sorted(keys))
        self.state_store = state_store
        self.name = STORE_NAME  # settle_state / save_run_state name the state by it
        self._hook: Any = None

    def __bool__(self) -> bool:
        return bool(self.keys)

    def restore(self, module: nn.Module, meta: Mapping[str, Any]) -> str:
        """Settle last round's L and load the committed one into ``module``; returns where L came from
        (``stored``, ``received``), warning when the received values stand in for a state that should be there."""
        if self.state_store is None:
            self._warn("no state store is bound, so L cannot persist", "")
            return "received"
        settle_state(self, meta)  # type: ignore[arg-type]  # needs .site, .name, .state_store only
        stored, problem = self._stored(module, str(meta.get(meta_keys.RUN_ID) or ""))
        if stored is None:
            confirmed = meta.get(meta_keys.LAST_AGGREGATED) or {}
            if problem is None and self.site in confirmed:
                problem = "no stored state although the server aggregated this site's result before"
            if problem is not None:
                self._warn(problem, str(self.state_store.path(STORE_NAME)))
            return "received"
        current = module.state_dict(keep_vars=True)
        with torch.no_grad():
            for key in self.keys:
                current[key].data.copy_(stored[key].to(current[key].device))
        return "stored"

    def _stored(self, module: nn.Module, run_id: str) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """The committed L of this run and model, or ``None`` and why not (``None`` reason: there is none yet)."""
        current = module.state_dict()
        expected = {key: (tuple(current[key].shape), current[key].dtype) for key in self.keys}
        try:
            found = self.state_store.load(STORE_NAME)
            if found is None:
                return None, None
            if found.state.get(RUN_ID_KEY) != run_id:
                return None, f"the stored state was written by another run ({found.state.get(RUN_ID_KEY)})"
            found = self.state_store.load(STORE_NAME, expected=expected)
        except StateStoreError as exc:
            return None, f"unusable stored state ({exc})"
        return {key: found.state[key] for key in self.keys}, None

    def _warn(self, problem: str, path: str) -> None:
        LOG.warning(
            "%s: local entries %s restart from the received global model's values: %s%s",
            self.site,
            list(self.keys),
            problem,
            f" [{path}]" if path else "",
        )

    def save(self, module: nn.Module, meta: Mapping[str, Any]) -> None:
        """Keep this round's L as pending state (committed when the server confirms the round, see module doc)."""
        if self.state_store is None:
            return
        state = module.state_dict()
        tensors = {key: state[key] for key in self.keys}
        run_id, round_num = str(meta.get(meta_keys.RUN_ID) or ""), int(meta.get(meta_keys.ROUND, 0))
        save_run_state(self, tensors, run_id, round_num)  # type: ignore[arg-type]  # .site, .name, .state_store

    def hide(self, module: nn.Module) -> None:
        """From now until `show`, every ``module.state_dict()`` leaves L out (what the site sends)."""
        self.show()
        keys = self.keys

        def drop_local(_module: nn.Module, state_dict: dict[str, Any], prefix: str, _metadata: Any) -> None:
            for key in keys:
                state_dict.pop(prefix + key, None)

        self._hook = module.register_state_dict_post_hook(drop_local)

    def show(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def local_entries_for(
    algorithm: ClientAlgorithm, module: nn.Module, local_keys: str | Sequence[str] | None
) -> LocalEntries:
    """The site's `LocalEntries` for ``module``, marked on the module so that every client algorithm leaves
    them alone (`lightning_modules.algorithms.base.trainable_parameters`).

    ``local_keys`` are explicit names (the builder resolved the job's patterns). An algorithm that needs a head
    (FedRep) and gets none takes the head the module declares (``fl_head_keys()``), else it is refused. Names the
    module lacks, or names covering the whole model, are refused with the site's name: the job was built for
    another model.
    """
    keys = parse_local_keys(local_keys)
    if not keys and algorithm.needs_head:
        keys = declared_head_keys(module)
        if not keys:
            raise ClientAlgorithmError(
                f"{algorithm.site}: client algorithm '{algorithm.name}' needs a head: give --local-keys (e.g. "
                f"'net.classifier.*') or define {HEAD_METHOD}() on the model"
            )
    problem = local_keys_problem(keys, module.state_dict()) if keys else None
    if problem:
        raise ClientAlgorithmError(f"{algorithm.site}: {problem}")
    setattr(module, LOCAL_KEYS_ATTRIBUTE, frozenset(keys))
    return LocalEntries(algorithm.site, keys, algorithm.state_store)
