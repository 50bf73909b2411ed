"""What a client algorithm may do, declared on its own class (`lightning_modules.algorithms.base.ClientAlgorithm`).

Every table that used to name algorithms in another package is now derived from these declarations over the
registry (`lightning_modules.algorithms.registry.CLIENT_ALGORITHMS`):

- `DPSGD` (``dp_sgd``): whether its outputs can be accounted under sample-level DP-SGD, and why
  (`lightning_modules.privacy.dp_sgd.COMPOSES` / ``REFUSED``);
- `Released` (``released``): the meta items it sends and their privacy status
  (`lightning_modules.privacy.release.RELEASED`);
- `PersonalModel` (``personal_model``): the site's personal model it keeps, if any
  (`lightning_modules.personalization.methods`, and the build-time exclusions between personal methods).

and ``local_update`` (how its local update relates to the local gradients, read by FedNova's composition) and
``secure_sum`` (`declared_secure_sum`). Each is read from the class's own body, never inherited
(`aggregators.types.declared`, the one admission rule for algorithms and rules alike): a subclass that does not
declare one is refused where the job asks it, in one line naming it, the capability and what to declare.

Pure data, no torch: the job builder and the privacy tables read it without building anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aggregators.types import declared

#: The capabilities every client algorithm of `lightning_modules.algorithms.registry.CLIENT_ALGORITHMS` declares on
#: its own class (the server rules' are `aggregators.types.RULE_CAPABILITIES`).
CLIENT_CAPABILITIES = ("dp_sgd", "released", "local_update", "secure_sum")

#: ``dp``: DP-SGD's output; ``post-processing``: computed from DP outputs and public values only; ``public``: a
#: function of the job's settings and the site's sample count; ``withheld``: data-dependent, unprotected, dropped
#: from a DP site's result (docs/privacy.md).
Status = Literal["dp", "post-processing", "public", "withheld"]


@dataclass(frozen=True)
class Released:
    """One item that leaves a site: a meta key or an fnmatch pattern over meta keys (``<weights>`` for the model)."""

    pattern: str
    what: str
    status: Status


@dataclass(frozen=True)
class DPSGD:
    """Whether an algorithm's outputs can be accounted under sample-level DP-SGD (``composes``) and why: its extra
    terms are post-processing of the noisy gradient, or part of each sample's clipped loss; or what escapes."""

    composes: bool
    why: str


#: What a class that declares no ``dp_sgd`` of its own gets (a subclass may add computations on the data that its
#: parent's declaration does not cover): refused.
UNDECLARED_DP_SGD = DPSGD(
    False,
    "its extra computations on the data are not accounted (its class declares no dp_sgd: declare "
    "dp_sgd = DPSGD(composes, why) on it)",
)


def declared_dp_sgd(algorithm_cls: type) -> DPSGD:
    """The ``dp_sgd`` declared on ``algorithm_cls`` itself, never inherited (`UNDECLARED_DP_SGD` otherwise)."""
    return declared(algorithm_cls, "dp_sgd", UNDECLARED_DP_SGD)


#: Why an algorithm that keeps state at the site between rounds cannot run in the secure-aggregation (sum) workflow:
#: the bundle's controller confirms that state every round, NVFlare's ``ScatterAndGather`` does not.
PER_SITE_STATE = (
    "keeps per-site state that the bundle's controller confirms every round (server.run_id, "
    "server.last_aggregated), which NVFlare's ScatterAndGather does not send"
)
#: What a class that declares no ``secure_sum`` of its own and keeps no personal model gets: refused (a subclass may
#: need from the server what its parent did not).
UNDECLARED_SECURE_SUM = "declares no secure_sum of its own: what it needs from the server is not known"


def declared_secure_sum(algorithm_cls: type) -> str | None:
    """Why the algorithm cannot run in the sum workflow of secure aggregation, or ``None``: it needs nothing from the
    server but the global model and keeps no state between rounds. Read from the class itself, never inherited; a
    class with a personal model and no declaration keeps per-site state (`PER_SITE_STATE`)."""
    undeclared = PER_SITE_STATE if getattr(algorithm_cls, "personal_model", None) is not None else UNDECLARED_SECURE_SUM
    return declared(algorithm_cls, "secure_sum", undeclared)


#: What a personal model is: ``weights`` of the algorithm's own that `ClientAlgorithm.personal_weights` returns and
#: the site loads into a copy of its module (Ditto's v_i, APFL's mixed model); ``module`` the trained module itself
#: with the site's local entries (FedRep's head, FedPer/FedBN); ``copy`` a model the site round builds beside the
#: round and scores itself (local fine-tuning).
PERSONAL_KINDS = ("weights", "module", "copy")


@dataclass(frozen=True)
class PersonalModel:
    """The site's personal model an algorithm keeps (``ClientAlgorithm.personal_model``): its kind (one of
    `PERSONAL_KINDS`), what it is, in words for the refusals (``"Ditto's v_i"``), and the meta key of the optimizer
    steps its personal training took in the round, if any: the local-only baseline's matched compute counts them
    (lightning_modules/local_baseline.py)."""

    kind: str
    what: str
    steps_key: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in PERSONAL_KINDS:
            raise ValueError(f"personal model kind {self.kind!r}: use one of {list(PERSONAL_KINDS)}")
