"""A site's privacy ledger: every DP-SGD step it has taken in this run of the job, kept in its state store.

The ledger is what the accountant reads, so it must outlive the process: ``nvflare simulator -t 1`` starts a new
process for every client round, and a real site may crash. It is written at the end of every round, before the
result leaves the site, and it is **not** transactional like the algorithms' state (docs/design.md, decision 17):
a result the server rejects has still left the site, so its steps stay spent.

Losing the ledger is a privacy incident: starting the count at zero again would report an epsilon smaller than
the one the site has spent. So a site that has released anything before (the server's ``server.last_released`` or
``server.last_aggregated`` names it: a result of this site reached the server, aggregated or rejected) and finds no
ledger, or a corrupt one, stops with `LedgerError` naming the site and the file; it never trains on.

A ledger can also be behind: restored from a backup older than the site's last round, it would count from an older
step and report an epsilon smaller than the one spent. The bundle's server records, per site, the DP-SGD step count
(``privacy.steps``) of the last result it received and broadcasts it every round (``server.released_steps``); a site
whose ledger holds fewer steps stops with `LedgerError` (`stale_by`). A resumed job restores that record from its
checkpoint; under ``--secure-aggregation`` the server's round recorder keeps it and a task-data filter sends it
(controllers/secure_aggregation.py, ``ReleasedStepsBroadcast``).

A server that does not track releases (its meta has no ``server.last_released``: NVFlare's ``ScatterAndGather``,
which runs ``--secure-aggregation he|plain`` and asks every site every round) cannot say who has released. Then a
site is taken to have released in every round before the one it is asked for: it may start without a ledger only in
the job's first round (``server.round`` 0), and stops in any later one. Nothing the site holds could prove that it
never released, since the ledger is that record; a site that missed the first round cannot join such a job later.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aggregators.contracts import meta_keys
from lightning_modules.algorithms.errors import ClientAlgorithmError
from lightning_modules.privacy.accountant import Segment, epsilon
from lightning_modules.state_store import ClientStateStore, StateStoreError

LOG = logging.getLogger(__name__)
#: The ledger's name in the site's state store (``<root>/<run id>/<site>/privacy.state``).
LEDGER_NAME = "privacy"


class LedgerError(ClientAlgorithmError):
    """The site's privacy ledger is missing or corrupt: the site stops rather than restart its count."""


@dataclass(frozen=True)
class Ledger:
    """The DP-SGD steps of one site in one run: segments of (q, sigma, steps), in order."""

    run_id: str
    delta: float
    segments: tuple[Segment, ...] = ()

    @property
    def steps(self) -> int:
        return sum(segment.steps for segment in self.segments)

    def epsilon(self) -> float:
        return epsilon(self.segments, self.delta)

    def spend(self, sample_rate: float, noise_multiplier: float, steps: int) -> Ledger:
        """This ledger with ``steps`` more steps at (q, sigma): a new segment unless the last one has the same."""
        last = self.segments[-1] if self.segments else None
        if last is not None and (last.sample_rate, last.noise_multiplier) == (sample_rate, noise_multiplier):
            segments = (*self.segments[:-1], Segment(sample_rate, noise_multiplier, last.steps + steps))
        else:
            segments = (*self.segments, Segment(sample_rate, noise_multiplier, steps))
        return Ledger(self.run_id, self.delta, segments)

    def to_state(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "delta": self.delta,
            "segments": [[s.sample_rate, s.noise_multiplier, s.steps] for s in self.segments],
        }


def ledger_from_state(state: Mapping[str, Any]) -> Ledger:
    """The ledger a state file holds; ``ValueError`` naming the first bad field."""
    run_id, delta, rows = state.get("run_id"), state.get("delta"), state.get("segments")
    if not isinstance(run_id, str):
        raise ValueError(f"run_id is {run_id!r}, not text")
    if not isinstance(delta, float) or not 0 < delta < 1:
        raise ValueError(f"delta is {delta!r}, not a number in (0, 1)")
    if not isinstance(rows, list):
        raise ValueError(f"segments is a {type(rows).__name__}, not a list")
    return Ledger(run_id, delta, tuple(_segment(i, row) for i, row in enumerate(rows)))


def _segment(index: int, row: Any) -> Segment:
    if not isinstance(row, list) or len(row) != 3:
        raise ValueError(f"segment {index} is {row!r}, not [sample_rate, noise_multiplier, steps]")
    q, sigma, steps = row
    valid = (
        isinstance(q, float)
        and 0 < q <= 1
        and isinstance(sigma, float)
        and math.isfinite(sigma)
        and sigma >= 0
        and isinstance(steps, int)
        and not isinstance(steps, bool)
        and steps >= 0
    )
    if not valid:
        raise ValueError(f"segment {index} is {row!r}: needs q in (0, 1], sigma >= 0 and a step count >= 0")
    return Segment(q, sigma, steps)


def named_by_the_server(site: str, meta: Mapping[str, Any]) -> bool:
    """Whether the server's meta names this site as one whose result reached it in this run, aggregated or not."""
    return any(
        isinstance(named, Mapping) and site in named
        for named in (meta.get(meta_keys.LAST_AGGREGATED), meta.get(meta_keys.LAST_RELEASED))
    )


def trained_before(site: str, meta: Mapping[str, Any]) -> bool:
    """Whether the site must be taken to have released something in this run (so it must have a ledger): the server
    names it, or the server does not track releases (no ``server.last_released``) and this is not the job's first
    round (module docstring)."""
    untracked = meta.get(meta_keys.LAST_RELEASED) is None and meta.get(meta_keys.ROUND) != 0
    return named_by_the_server(site, meta) or untracked


def read_ledger(store: ClientStateStore | None, site: str, meta: Mapping[str, Any], delta: float) -> Ledger:
    """The site's ledger for the run the meta names, or an empty one for a site that never trained in it.

    Stops (`LedgerError`) on a corrupt ledger, on a missing one when the server says the site has trained,
    and on a ledger of another delta (its epsilon would change meaning halfway)."""
    if store is None:
        raise LedgerError(f"{site}: DP-SGD needs the site's state store: its privacy ledger would be lost")
    run_id = str(meta.get(meta_keys.RUN_ID) or "")
    where = store.path(LEDGER_NAME)
    try:
        stored = store.load(LEDGER_NAME)
        ledger = None if stored is None else ledger_from_state(stored.state)
    except (StateStoreError, ValueError) as exc:
        raise LedgerError(
            f"{site}: privacy ledger {where} is corrupt ({exc}); this site stops: restarting the count at zero would "
            "under-report the privacy it has spent. Restore the ledger from a backup"
        ) from None
    if ledger is None or ledger.run_id != run_id:
        if trained_before(site, meta):
            said = (
                "the server received this site's results"
                if named_by_the_server(site, meta)
                else f"this is round {meta.get(meta_keys.ROUND)} of a server that does not track releases, so this "
                "site may have released in an earlier round"
            )
            raise LedgerError(
                f"{site}: privacy ledger {where} is missing although {said} (run {run_id}); this site stops: "
                "restarting the count at zero would under-report the privacy it has spent. Restore the ledger from a "
                "backup"
            )
        return Ledger(run_id, delta)
    if ledger.delta != delta:
        raise LedgerError(f"{site}: privacy ledger {where} was kept at delta {ledger.delta:g}, the job says {delta:g}")
    behind = stale_by(site, ledger, meta)
    if behind:
        raise LedgerError(
            f"{site}: privacy ledger {where} is stale: it holds {ledger.steps} DP-SGD steps (epsilon "
            f"{ledger.epsilon():.4g}), but the server received results of this site after {behind} steps (run "
            f"{run_id}); this site stops: training on would under-report the privacy it has spent. Restore the newest "
            "backup of the ledger (one written after its last round)"
        )
    return ledger


def stale_by(site: str, ledger: Ledger, meta: Mapping[str, Any]) -> int | None:
    """The step count the server recorded for this site (``server.released_steps``, the ``privacy.steps`` of its last
    result that reached the server) when the ledger holds fewer steps: the ledger is behind what the site released
    (an old backup restored). ``None`` when it is not, or when the server sends no record (a server that does not
    track releases, or a site that has released nothing)."""
    recorded = meta.get(meta_keys.RELEASED_STEPS)
    steps = recorded.get(site) if isinstance(recorded, Mapping) else None
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > ledger.steps:
        return steps
    return None


def write_ledger(store: ClientStateStore, ledger: Ledger, round_num: int) -> None:
    """Persist the ledger at once (atomic, committed, never pending): the steps are spent whatever the server does."""
    store.save(LEDGER_NAME, ledger.to_state(), round_num=max(int(round_num), 0))


def privacy_meta(ledger: Ledger, max_grad_norm: float) -> dict[str, float | int]:
    """The ``privacy.*`` meta of a round: the site's epsilon so far and what it was computed from."""
    last: Segment | None = ledger.segments[-1] if ledger.segments else None
    return {
        meta_keys.PRIVACY_EPSILON: ledger.epsilon(),
        meta_keys.PRIVACY_DELTA: ledger.delta,
        meta_keys.PRIVACY_NOISE_MULTIPLIER: last.noise_multiplier if last else math.nan,
        meta_keys.PRIVACY_SAMPLE_RATE: last.sample_rate if last else math.nan,
        meta_keys.PRIVACY_STEPS: ledger.steps,
        meta_keys.PRIVACY_MAX_GRAD_NORM: max_grad_norm,
    }


def segments_text(segments: Sequence[Segment]) -> str:
    return ", ".join(f"{s.steps} steps at q={s.sample_rate:.4g}, sigma={s.noise_multiplier:.4g}" for s in segments)
