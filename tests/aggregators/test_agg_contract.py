"""The contract every aggregation rule keeps, checked for every rule in the registry (no hand-kept list):

- inputs (global model, updates, their meta, the state) are never mutated;
- the result does not depend on the order of the updates;
- for mean-type rules (``mean_type``), identical client models give that model (to float32 round-off);
- a round in which no client moved leaves the model exactly where it was (bit for bit), for every rule, over many
  rounds, with server momentum too (FedAtt's noise switched off: it moves the model on purpose);
- the rule state survives the server checkpoint: aggregating after a save/load round trip gives the same model;
- the result has the global model's keys, shapes and dtypes, and is finite.

A new rule is under these tests once it is registered. Its required meta comes from `META_FOR_KEY`; a rule
that requires a key missing there fails loudly, so the fixture has to learn the key.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest

from aggregators import dp_fedavg
from aggregators.compose import compose
from aggregators.contracts import meta_keys
from aggregators.registry import RULES, build_rule
from aggregators.types import ClientUpdate, RoundContext
from controllers.checkpoint import load_rule_state, save_rule_state

RNG = np.random.default_rng(7)
GLOBAL = {
    "net.w": RNG.normal(size=(4, 3)).astype(np.float32),
    "net.b": RNG.normal(size=3).astype(np.float32),
    "net.bn.num_batches_tracked": np.array(5, dtype=np.int64),
}
TRAINABLE = ["net.w", "net.b"]
SITES = ("site-1", "site-2", "site-3", "site-4", "site-5")
SAMPLES = dict(zip(SITES, (10, 20, 30, 40, 50), strict=True))

#: Valid meta per required key, given the site's model: how a well-behaved client would report it.
META_FOR_KEY: dict[str, Callable[[dict[str, np.ndarray]], object]] = {
    meta_keys.SCAFFOLD_CTRL_DIFF: lambda y: {k: (GLOBAL[k] - y[k]).astype(np.float32) for k in TRAINABLE},
    meta_keys.FEDNOVA_TAU: lambda y: 4,
    meta_keys.FEDNOVA_A_NORM: lambda y: 4.0,
    meta_keys.FEDDYN_ALPHA_K: lambda y: 0.01,
    meta_keys.FEDDYN_PARAM_KEYS: lambda y: list(TRAINABLE),
}
#: Arguments a rule cannot be built without.
ARGS = {
    "attack_adaptive": {"allow_random_attention": True},  # the shipped network fits LeNet-5 only
}
#: Settings other than the defaults under which a round that no client moved must leave the model where it is.
UNMOVED_VARIANTS = {"fednova": {"server_momentum": 0.9}, "fedavg": {"server_lr": 0.7}, "scaffold": {"server_lr": 0.7}}
#: FedAtt and DP-FedAvg add Gaussian noise on purpose; without it, it too must leave an unmoved model where it is.
QUIET = {"fedatt": {"noise": 0.0}, "dp_fedavg": {"noise_multiplier": 0.0}}


@pytest.fixture(autouse=True)
def repeatable_dp_noise(monkeypatch):
    """DP-FedAvg draws a secret seed per run (a fixed one is refused with noise), so two runs could not be
    compared: the secret seed is fixed in-process instead."""
    monkeypatch.setattr(dp_fedavg, "secret_seed", lambda: 0)


def rule_names() -> list[str]:
    return sorted(RULES)


def make_rule(name: str, **settings):
    if name == "attack_adaptive":
        pytest.importorskip("torch")
    return build_rule(name, **{**ARGS.get(name, {}), **settings})


def update(site: str, params: dict[str, np.ndarray], rule) -> ClientUpdate:
    missing = [key for key in rule.required_meta if key not in META_FOR_KEY]
    assert not missing, f"rule '{rule.name}' requires {missing}: teach META_FOR_KEY how a client reports it"
    meta = {key: META_FOR_KEY[key](params) for key in rule.required_meta}
    meta[meta_keys.PARAM_KEYS] = list(TRAINABLE)
    return ClientUpdate(site=site, params=params, num_samples=SAMPLES[site], meta=meta)


def site_models() -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(11)
    return {
        site: {
            k: (v + rng.normal(scale=0.1, size=v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v.copy()
            for k, v in GLOBAL.items()
        }
        for site in SITES
    }


def context(round_num: int = 0) -> RoundContext:
    return RoundContext(round_num=round_num, num_rounds=5, population=SITES)


def aggregate(rule, updates, state, round_num: int = 0):
    return rule.aggregate(GLOBAL, updates, state, context(round_num))


@pytest.mark.parametrize("name", rule_names())
def test_inputs_are_never_mutated_and_the_result_is_well_formed(name):
    rule = make_rule(name)
    updates = [update(site, params, rule) for site, params in site_models().items()]
    state = rule.init_state(GLOBAL)
    before = copy.deepcopy((GLOBAL, [(u.params, u.meta) for u in updates], state))
    result = aggregate(rule, updates, state)
    after = (GLOBAL, [(u.params, u.meta) for u in updates], state)
    np.testing.assert_equal(after, before)
    assert list(result.params) == list(GLOBAL)
    for key, value in result.params.items():
        assert value.shape == GLOBAL[key].shape and value.dtype == GLOBAL[key].dtype, key
        assert np.isfinite(value).all(), key


@pytest.mark.parametrize("name", rule_names())
def test_the_result_does_not_depend_on_the_order_of_the_updates(name):
    rule = make_rule(name)
    updates = [update(site, params, rule) for site, params in site_models().items()]
    forward = aggregate(rule, updates, rule.init_state(GLOBAL)).params
    backward = aggregate(rule, updates[::-1], rule.init_state(GLOBAL)).params
    for key in GLOBAL:
        np.testing.assert_allclose(forward[key], backward[key], atol=1e-6, rtol=0, err_msg=key)


@pytest.mark.parametrize("name", [n for n in rule_names() if RULES[n].mean_type])
def test_identical_client_models_give_that_model_for_mean_type_rules(name):
    rule = make_rule(name)
    same = {k: (v + np.float32(0.25)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in GLOBAL.items()}
    updates = [update(site, {k: v.copy() for k, v in same.items()}, rule) for site in SITES]
    result = aggregate(rule, updates, rule.init_state(GLOBAL)).params
    for key in TRAINABLE:
        np.testing.assert_allclose(result[key], same[key], atol=1e-6, rtol=0, err_msg=key)


def unmoved_cases() -> list[tuple[str, dict]]:
    """Every registered rule with its defaults, then the variants with server momentum or a server learning rate."""
    cases = [(name, QUIET.get(name, {})) for name in rule_names()]
    return cases + [(name, settings) for name, settings in sorted(UNMOVED_VARIANTS.items())]


def test_the_variants_and_quiet_settings_name_registered_rules():
    assert set(UNMOVED_VARIANTS) | set(QUIET) <= set(RULES)


@pytest.mark.parametrize(("name", "settings"), unmoved_cases(), ids=lambda v: v if isinstance(v, str) else str(v))
def test_a_round_in_which_no_client_moved_leaves_the_model_bit_for_bit(name, settings):
    """Every client returns exactly the global model (random float32 x, unequal sample weights) for 30 rounds.

    The rearranged sum (1 - sum_i c_i) x + sum_i c_i y_i used to round x by an ulp in about a third of its
    coordinates (FedNova, FedAdp, FedAtt), and FedNova's server momentum carried that on round after round.
    """
    rule = make_rule(name, **settings)
    params, state = dict(GLOBAL), rule.init_state(GLOBAL)
    for round_num in range(30):
        unmoved = [update(site, {k: v.copy() for k, v in params.items()}, rule) for site in SITES]
        result = rule.aggregate(params, unmoved, state, context(round_num))
        params, state = result.params, result.state
    for key, value in GLOBAL.items():
        assert params[key].dtype == value.dtype and np.array_equal(params[key], value), key


def test_the_rules_listed_for_nvflares_fedavg_are_registered_and_ignore_the_global_model():
    """controllers/nvflare_aggregator.py keeps by hand the rules that may run where the global model is never shown
    (RuleAggregator.EQUIVARIANT): each must be registered, and its result must not depend on the global model."""
    from controllers.nvflare_aggregator import RuleAggregator

    shifted = {k: (v + np.float32(3.0)).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in GLOBAL.items()}
    for name in RuleAggregator.EQUIVARIANT:
        assert name in RULES, name
        rule = make_rule(name)
        updates = [update(site, params, rule) for site, params in site_models().items()]
        here = aggregate(rule, updates, rule.init_state(GLOBAL)).params
        there = rule.aggregate(shifted, updates, rule.init_state(shifted), context()).params
        for key in GLOBAL:
            assert np.array_equal(here[key], there[key]), (name, key)


@pytest.mark.parametrize("name", [*rule_names(), "fedyogi+scaffold_control"])
def test_the_state_survives_the_server_checkpoint(tmp_path, name):
    if "+" in name:
        rule = compose(build_rule("fedyogi"), {"scaffold_control": {}})
        probe = compose(build_rule("fedyogi"), {"scaffold_control": {}})
    else:
        rule, probe = make_rule(name), make_rule(name)
    updates = [update(site, params, probe) for site, params in site_models().items()]
    state = aggregate(rule, updates, rule.init_state(GLOBAL)).state
    save_rule_state(tmp_path / "server_state.pt", rule.name, 0, state)
    _, restored = load_rule_state(tmp_path / "server_state.pt", rule.name)
    direct = aggregate(rule, updates, state, round_num=1).params
    reloaded = aggregate(rule, updates, restored, round_num=1).params
    for key in GLOBAL:
        np.testing.assert_allclose(reloaded[key], direct[key], atol=1e-12, rtol=0, err_msg=key)


def test_every_registered_rule_is_an_aggregation_rule_with_its_hooks():
    from aggregators.types import AggregationRule

    for name in rule_names():
        rule_cls = RULES[name]
        assert issubclass(rule_cls, AggregationRule) and rule_cls.name == name
        assert all(meta_keys.is_namespaced(k) for k in (*rule_cls.required_meta, *rule_cls.broadcast_keys))
