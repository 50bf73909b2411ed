"""One admission rule: a capability is read from the class's own declaration, never inherited, and an algorithm or
rule that does not declare it is refused with one line naming it, the capability and what to declare.

The hostile cases: a contributor subclasses a registered algorithm or rule, changes what it does, registers it, and
forgets a declaration. Inheriting the parent's answer would admit it (fail open); it must be refused instead.
"""

from __future__ import annotations

import pytest

from aggregators.dp_fedavg import DPFedAvg
from aggregators.fedavg import FedAvg
from aggregators.median import Median
from aggregators.registry import RULES
from jobs.build import JobBuildError, JobSpec
from lightning_modules.algorithms import CLIENT_ALGORITHMS, ClientAlgorithm
from lightning_modules.privacy import release


class DriftingFedAvg(ClientAlgorithm):
    """Adds a correction that is no local gradient (as SCAFFOLD does) but forgets ``local_update``."""

    name = "drifting"
    dp_sgd = ClientAlgorithm.dp_sgd
    secure_sum = None
    released = ()


class ForgetsReleased(ClientAlgorithm):
    """Sends meta of its own but forgets ``released``."""

    name = "forgets_released"
    local_update = "gradient"
    dp_sgd = ClientAlgorithm.dp_sgd
    secure_sum = None


class ReweightingFedAvg(FedAvg):
    """Aggregates otherwise than FedAvg but forgets ``partial_sharing_refused``."""

    name = "reweighting"
    secure_sum = "weights each site by its own update"
    translation_equivariant = None
    client_level_dp = None


class NoisierDPFedAvg(DPFedAvg):
    """DP-FedAvg with a change of its own that forgets ``client_level_dp``."""

    name = "noisier_dp_fedavg"
    secure_sum = "clips every individual update"
    translation_equivariant = None
    partial_sharing_refused = None


class ShiftedMedian(Median):
    """A median that depends on the global model but forgets ``translation_equivariant``."""

    name = "shifted_median"
    secure_sum = "takes the median of the individual updates"
    partial_sharing_refused = None
    client_level_dp = None


def _refusal(capability: str, who: str) -> str:
    return rf"^{who} declares no {capability} of its own \(a class never inherits one\): declare {capability} = "


def test_a_client_that_forgets_its_local_update_is_refused_by_fednova(monkeypatch):
    monkeypatch.setitem(CLIENT_ALGORITHMS, DriftingFedAvg.name, DriftingFedAvg)
    with pytest.raises(JobBuildError, match=_refusal("local_update", "client algorithm 'drifting'")) as refused:
        JobSpec(name="hostile", client=DriftingFedAvg.name, server="fednova")
    assert "\n" not in str(refused.value)


def test_a_client_that_forgets_what_it_releases_is_refused(monkeypatch):
    monkeypatch.setitem(CLIENT_ALGORITHMS, ForgetsReleased.name, ForgetsReleased)
    with pytest.raises(JobBuildError, match=_refusal("released", "client algorithm 'forgets_released'")):
        JobSpec(name="hostile", client=ForgetsReleased.name)
    with pytest.raises(ValueError, match=_refusal("released", "client algorithm 'forgets_released'")):
        release.declared_meta(ForgetsReleased.name, private=True)


def test_a_rule_that_forgets_partial_sharing_is_refused_with_local_keys(monkeypatch):
    monkeypatch.setitem(RULES, ReweightingFedAvg.name, ReweightingFedAvg)
    with pytest.raises(JobBuildError, match=_refusal("partial_sharing_refused", "server rule 'reweighting'")):
        JobSpec(
            name="hostile",
            dataset="digits",
            arch="mlp",
            server="reweighting",
            local_keys="net.classifier.*",
            site_val_fraction=0.1,
        )


def test_a_dp_rule_that_forgets_client_level_dp_is_refused(monkeypatch):
    """DP-FedAvg's exclusions (a companion's state escapes its noise) were asked by the rule's name."""
    monkeypatch.setitem(RULES, NoisierDPFedAvg.name, NoisierDPFedAvg)
    with pytest.raises(JobBuildError, match=_refusal("client_level_dp", "server rule 'noisier_dp_fedavg'")):
        JobSpec(name="hostile", client="scaffold", server=NoisierDPFedAvg.name)


def test_a_rule_that_forgets_translation_equivariance_cannot_run_as_an_nvflare_aggregator(monkeypatch):
    from controllers.nvflare_aggregator import RuleAggregator, equivariant_rules

    assert equivariant_rules({**RULES, ShiftedMedian.name: ShiftedMedian}) == RuleAggregator.EQUIVARIANT
    monkeypatch.setitem(RULES, ShiftedMedian.name, ShiftedMedian)
    with pytest.raises(ValueError, match=_refusal("translation_equivariant", "server rule 'shifted_median'")):
        RuleAggregator(rule=ShiftedMedian.name)


@pytest.mark.parametrize("name", sorted(CLIENT_ALGORITHMS))
def test_every_registered_client_algorithm_declares_every_capability(name):
    from lightning_modules.algorithms.capabilities import CLIENT_CAPABILITIES

    cls = CLIENT_ALGORITHMS[name]
    assert [c for c in CLIENT_CAPABILITIES if c not in vars(cls)] == [], f"declare them on {cls.__qualname__}"


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_registered_rule_declares_every_capability(name):
    from aggregators.types import RULE_CAPABILITIES

    cls = RULES[name]
    assert [c for c in RULE_CAPABILITIES if c not in vars(cls)] == [], f"declare them on {cls.__qualname__}"
