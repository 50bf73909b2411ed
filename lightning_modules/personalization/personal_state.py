"""A site's personal state (Ditto's v_i, APFL's v_i and alpha): loaded, validated and saved in one place.

The state lives in the site's private state store under the algorithm's name, tagged with the run id, fp32, and
never leaves the site. It is transactional like every client state (docs/design.md, decision 17): what a round saves
is pending until the server's next broadcast confirms that round's result was aggregated (`settle_state`, which
the algorithm calls at round start), and dropped otherwise, so a replayed round starts from the same state.

Restart-safe: missing or unreadable state never stops the site and is never used. A file that cannot be read, a
file written by another run of the job, or entries missing, mis-shaped, of another dtype or non-finite restart
those entries from the reference (the received model) with one warning naming the site, the state and the keys.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from lightning_modules.algorithms.base import RUN_ID_KEY, ClientAlgorithm, ClientAlgorithmError, save_run_state
from lightning_modules.state_store import StateStoreError

LOG = logging.getLogger(__name__)
Tensors = dict[str, torch.Tensor]


def usable_entries(state: Mapping[str, Any], reference: Mapping[str, torch.Tensor]) -> tuple[Tensors, list[str]]:
    """The entries of ``state`` that are finite fp32 tensors of the reference's shapes, and the sorted names of the
    reference's entries that are not."""
    usable: Tensors = {}
    bad = []
    for name, ref in reference.items():
        value = state.get(name)
        if (
            isinstance(value, torch.Tensor)
            and value.dtype == torch.float32
            and tuple(value.shape) == tuple(ref.shape)
            and bool(torch.isfinite(value).all())
        ):
            usable[name] = value
        else:
            bad.append(name)
    return usable, sorted(bad)


def load_personal(algorithm: ClientAlgorithm, reference: Mapping[str, torch.Tensor], run_id: str, what: str) -> Tensors:
    """The personal state ``algorithm`` saved in this run, entry by entry where usable, else a clone of
    ``reference``'s entry (fp32 start values: the received model, an initial alpha); ``what`` names the state in
    the warnings (``"ditto personal model"``)."""
    fresh = {name: value.detach().to(torch.float32).clone() for name, value in reference.items()}
    if algorithm.state_store is None:
        raise ClientAlgorithmError(f"{algorithm.site}: {algorithm.name} has no state store bound; {what} would be lost")
    try:
        stored = algorithm.state_store.load(algorithm.name)
    except StateStoreError as exc:
        _warn_restart(algorithm, what, sorted(fresh), f"its file cannot be used ({exc})")
        return fresh
    if stored is None:
        LOG.info("%s: %s starts from the received model (first participation)", algorithm.site, what)
        return fresh
    if stored.state.get(RUN_ID_KEY) != run_id:
        writer = stored.state.get(RUN_ID_KEY)
        _warn_restart(algorithm, what, sorted(fresh), f"{stored.path} was written by another run ({writer})")
        return fresh
    personal, bad = usable_entries(stored.state, fresh)
    if bad:
        _warn_restart(algorithm, what, bad, f"{stored.path} holds them missing, mis-shaped or non-finite")
    return {name: personal.get(name, start).to(start.device) for name, start in fresh.items()}


def save_personal(algorithm: ClientAlgorithm, state: Mapping[str, torch.Tensor], run_id: str, round_num: int) -> None:
    """Save the personal state as this round's pending state (refused, keeping the last state, if non-finite)."""
    save_run_state(algorithm, state, run_id, round_num)


def _warn_restart(algorithm: ClientAlgorithm, what: str, keys: list[str], why: str) -> None:
    LOG.warning(
        "%s: %s entries %s restart from the received global model: %s",
        algorithm.site,
        what,
        keys[:10] + (["..."] if len(keys) > 10 else []),
        why,
    )
