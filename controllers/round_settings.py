"""The server controller's settings as one typed value: `ControllerSettings`.

`controllers.fedalg_controller.FedAlgController` takes this one value (``settings``), never the settings one by one:
the job's round settings (`aggregators.contracts.job_settings.RoundSettings`: ``server``, ``server_args``,
``num_rounds``, ..., inherited, so each is declared once and keeps its job name), the seed of the site sampling (the
job's ``seed``, declared in `aggregators.contracts.job_settings.DataSettings`), and what the job builder resolved from
the job for the server: ``local_keys`` (the explicit state_dict names of ``--local-keys``) and ``companions`` (the
companion rules of the client algorithm, name -> arguments).

NVFlare's job API writes a component's constructor arguments into ``config_fed_server.json`` as plain JSON, so the
controller's ``settings`` argument is the plain form, `ControllerSettings.as_dict`, and the controller turns it back
into the typed value with `ControllerSettings.from_dict`. The value checks itself once, when it is built
(``__post_init__``): every setting against its declaration, then what can be checked without the population. A bad
value is refused with the builder's one-line `aggregators.contracts.job_settings.JobBuildError` (a ``ValueError``, what
NVFlare reports when a component cannot be built) naming the setting, the value and what is allowed. The rule's name and
arguments are left to `aggregators.registry.build_rule`, which names the valid ones.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from aggregators.contracts.job_settings import DataSettings, JobBuildError, RoundSettings, check_settings
from aggregators.contracts.sampling import clients_per_round_problem

__all__ = ["ControllerSettings"]

_SEED = {spec_field.name: spec_field for spec_field in dataclasses.fields(DataSettings)}["seed"]


@dataclass(frozen=True, kw_only=True)
class ControllerSettings(RoundSettings):
    """Every setting of the server controller, by its job name (module docstring).

    Attributes (besides `RoundSettings`'):
        seed: the job's seed (`DataSettings.seed`): seeds the site sampling.
        local_keys: the entries that never leave the sites, as the job builder resolved ``--local-keys`` (FedPer,
            FedBN, FedRep's head): the rule sees the other entries only and the global model keeps its initial
            values for these (`controllers.engine.RoundEngine`; docs/personalization.md, "Partial sharing").
        companions: companion rules kept beside ``server`` for the client algorithm's server state, name -> args
            (e.g. ``{"scaffold_control": {}}`` for SCAFFOLD clients under FedYogi; see aggregators/compose.py).
    """

    #: Written into ``config_fed_server.json`` whatever their value, so that a job folder documents its rounds; the
    #: others only when they differ from their default (a job that does not use them carries nothing new).
    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = (
        "server",
        "server_args",
        "num_rounds",
        "clients_per_round",
        "min_responses",
        "min_accepted",
        "seed",
        "train_timeout",
    )

    seed: int = field(default=_SEED.default, metadata=_SEED.metadata)
    local_keys: tuple[str, ...] = ()
    companions: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_settings(self, (RoundSettings, DataSettings), registries=None)  # RoundSettings' fields and seed
        problem = clients_per_round_problem(self.clients_per_round)
        if problem:
            raise JobBuildError(problem)
        waits_for = self.clients_per_round if isinstance(self.clients_per_round, int) else None  # a fraction: later
        if self.min_responses is not None and waits_for is not None and self.min_responses > waits_for:
            raise JobBuildError(
                f"min_responses must be at most the {waits_for} site(s) sampled per round (clients_per_round), "
                f"got {self.min_responses}"
            )
        waits_for = self.min_responses if self.min_responses is not None else waits_for
        if waits_for is not None and self.min_accepted > waits_for:
            raise JobBuildError(
                f"min_accepted must be at most the {waits_for} result(s) a round waits for, got {self.min_accepted}"
            )
        keys = self.local_keys
        if not isinstance(keys, list | tuple) or not all(isinstance(k, str) and k for k in keys):
            raise JobBuildError(f"local_keys must be a list of state_dict names, got {keys!r}")
        companions = self.companions
        if not isinstance(companions, Mapping) or not all(
            isinstance(name, str) and isinstance(args, Mapping) for name, args in companions.items()
        ):
            raise JobBuildError(f"companions must be a JSON object of rule names to arguments, got {companions!r}")
        # Own copies in their typed form: nobody's later change of a list or dict reaches a built controller.
        object.__setattr__(self, "server_args", dict(self.server_args))
        object.__setattr__(self, "local_keys", tuple(keys))
        object.__setattr__(self, "companions", {name: dict(args) for name, args in companions.items()})

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every setting's name, in declaration order."""
        return tuple(spec_field.name for spec_field in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> ControllerSettings:
        """The typed value of the plain form (`as_dict`, what ``config_fed_server.json`` holds); a setting left out
        takes its declared default, a name that is not a setting is refused."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(cls.names()))
        if unknown:
            raise JobBuildError(f"unknown controller setting(s) {unknown}; the settings are {list(cls.names())}")
        return cls(**values)

    @classmethod
    def of_job(
        cls,
        job: Any,
        *,
        local_keys: tuple[str, ...] = (),
        companions: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> ControllerSettings:
        """The settings of a job: ``job`` has the job settings as attributes (e.g. a `jobs.spec.JobSpec`); the
        builder passes what it resolved for the server (``local_keys``, ``companions``)."""
        rounds = {spec_field.name: getattr(job, spec_field.name) for spec_field in dataclasses.fields(RoundSettings)}
        return cls(**rounds, seed=job.seed, local_keys=tuple(local_keys), companions=dict(companions or {}))

    def as_dict(self) -> dict[str, Any]:
        """The plain JSON form, what NVFlare writes into ``config_fed_server.json``: `ALWAYS_WRITTEN` and every other
        setting that differs from its default, in declaration order."""
        default = ControllerSettings()
        plain: dict[str, Any] = {}
        for name in self.names():
            value = getattr(self, name)
            if name in self.ALWAYS_WRITTEN or value != getattr(default, name):
                plain[name] = list(value) if isinstance(value, tuple) else copy.deepcopy(value)
        return plain

    @classmethod
    def of(cls, settings: ControllerSettings | Mapping[str, Any] | None) -> ControllerSettings:
        """``settings`` as the typed value: itself, or the plain form's (`from_dict`)."""
        return settings if isinstance(settings, ControllerSettings) else cls.from_dict(settings)
