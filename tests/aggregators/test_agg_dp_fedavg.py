"""DP-FedAvg (aggregators/dp_fedavg.py): clipping, noise, the adaptive clip norm, the accountant, the server
optimizers it composes with, and what it refuses (at construction and when the job is built)."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

from aggregators import dp_fedavg
from aggregators.contracts import meta_keys
from aggregators.dp_fedavg import (
    _COUNT_NOISE,
    CLIP_NORM,
    EPSILON,
    ORDERS,
    SAMPLING_RATE,
    SERVER_OPTIMIZERS,
    centred_count,
    dp_fedavg_epsilon,
    next_clip_norm,
    noisy_unclipped_share,
    rdp_epsilon,
    sampled_gaussian_rdp,
    update_noise_multiplier,
)
from aggregators.registry import RULES, build_rule
from aggregators.types import AggregationError, ClientUpdate, RoundContext

X = {"w": np.array([1.0, -2.0, 0.5], np.float32), "b": np.array([0.25], np.float32)}
KEYS = ["w", "b"]


def site_update(site: str, delta: dict[str, list[float]], samples: int = 10, base=X) -> ClientUpdate:
    params = {k: (base[k] + np.asarray(delta[k], np.float32)).astype(np.float32) for k in KEYS}
    return ClientUpdate(site=site, params=params, num_samples=samples, meta={meta_keys.PARAM_KEYS: KEYS})


def context(round_num: int = 0, sites: int = 3) -> RoundContext:
    return RoundContext(round_num=round_num, num_rounds=10, population=tuple(f"site-{i + 1}" for i in range(sites)))


#: The operating system's seed source, kept before the fixture below replaces it.
SECRET_SEED = dp_fedavg.secret_seed


@pytest.fixture(autouse=True)
def repeatable_noise(monkeypatch):
    """A fixed seed may not be set with noise (it is refused): the tests fix the secret one in-process instead."""
    monkeypatch.setattr(dp_fedavg, "secret_seed", lambda: 0)


def dp(**settings):
    return build_rule("dp_fedavg", **settings)


def run(rule, updates, round_num=0, state=None, params=X, sites=3):
    state = rule.init_state(params) if state is None else state
    return rule.aggregate(params, updates, state, context(round_num, sites))


# -- clipping and the mean ------------------------------------------------------------------------------------------
def test_each_update_is_clipped_to_s_over_all_its_entries_and_the_sum_divided_by_m():
    # ||Delta_1|| = 5 (3, 0, 0 | 4) is clipped to S = 1: (0.6, 0, 0 | 0.8); ||Delta_2|| = 0.5 stays.
    updates = [site_update("site-1", {"w": [3, 0, 0], "b": [4]}), site_update("site-2", {"w": [0, 0.5, 0], "b": [0]})]
    rule = dp(noise_multiplier=0.0, clip_norm=1.0, adaptive=False)
    result = run(rule, updates).params
    np.testing.assert_allclose(result["w"], X["w"] + np.array([0.6, 0.5, 0]) / 2, atol=1e-6, rtol=0)
    np.testing.assert_allclose(result["b"], X["b"] + np.array([0.8]) / 2, atol=1e-6, rtol=0)
    # m = expected_sites divides the sum, whoever reported.
    fixed = run(dp(noise_multiplier=0.0, clip_norm=1.0, adaptive=False, expected_sites=4), updates).params
    np.testing.assert_allclose(fixed["w"], X["w"] + np.array([0.6, 0.5, 0]) / 4, atol=1e-6, rtol=0)


def test_without_noise_and_clipping_it_is_fedavg_and_under_fedadam_the_uniform_fedadam():
    rng = np.random.default_rng(3)
    deltas = [{k: rng.normal(size=X[k].shape) for k in KEYS} for _ in range(3)]
    updates = [site_update(f"site-{i + 1}", d, samples=20) for i, d in enumerate(deltas)]
    plain = dp(noise_multiplier=0.0, clip_norm=None, adaptive=False)
    expected = build_rule("fedavg").aggregate(X, updates, {}, context()).params
    for key in KEYS:
        np.testing.assert_allclose(run(plain, updates).params[key], expected[key], atol=1e-6, rtol=0)
    adam = dp(noise_multiplier=0.0, clip_norm=None, adaptive=False, server_optimizer="fedadam")
    reference = build_rule("fedadam", weighting="uniform")
    params, state, ref_params, ref_state = X, adam.init_state(X), X, reference.init_state(X)
    for round_num in range(3):  # the optimizer's moments carry over from round to round
        moved = [site_update(u.site, {k: u.params[k] - X[k] for k in KEYS}, base=params) for u in updates]
        ref_moved = [site_update(u.site, {k: u.params[k] - X[k] for k in KEYS}, base=ref_params) for u in updates]
        result = adam.aggregate(params, moved, state, context(round_num))
        ref = reference.aggregate(ref_params, ref_moved, ref_state, context(round_num))
        params, state, ref_params, ref_state = result.params, result.state, ref.params, ref.state
    assert state["optimizer"]["step"] == 3
    for key in KEYS:
        np.testing.assert_allclose(params[key], ref_params[key], atol=1e-6, rtol=0)


def test_buffers_keep_the_global_value():
    base = {**X, "bn.running_mean": np.array([0.5, 1.5], np.float32), "bn.num_batches_tracked": np.array(3)}
    updates = []
    for i in range(2):
        params = {k: v + (1 + i) for k, v in base.items()}
        updates.append(ClientUpdate(f"site-{i + 1}", params, 10, {meta_keys.PARAM_KEYS: KEYS}))
    result = run(dp(noise_multiplier=0.0, clip_norm=None, adaptive=False), updates, params=base).params
    assert np.array_equal(result["bn.running_mean"], base["bn.running_mean"])
    assert np.array_equal(result["bn.num_batches_tracked"], base["bn.num_batches_tracked"])
    np.testing.assert_allclose(result["w"], X["w"] + 1.5, atol=1e-6, rtol=0)


# -- noise ----------------------------------------------------------------------------------------------------------
def test_the_noise_on_the_mean_has_std_z_s_over_m():
    big = {"w": np.zeros(200_000, np.float32)}
    updates = [ClientUpdate(f"site-{i}", {"w": big["w"].copy()}, 10, {meta_keys.PARAM_KEYS: ["w"]}) for i in range(4)]
    rule = dp(noise_multiplier=1.3, clip_norm=0.5, adaptive=False)
    moved = rule.aggregate(big, updates, rule.init_state(big), context(0, 8)).params["w"].astype(np.float64)
    assert abs(moved.mean()) < 4 * 1.3 * 0.5 / 4 / math.sqrt(moved.size)
    assert moved.std() == pytest.approx(1.3 * 0.5 / 4, rel=0.01)


def test_the_noise_repeats_with_the_seed_and_is_secret_without_one(monkeypatch):
    updates = [site_update(f"site-{i + 1}", {"w": [0.1 * i, 0, 0], "b": [0]}) for i in range(3)]
    first, again = run(dp(), updates).params, run(dp(), updates).params
    assert all(np.array_equal(first[k], again[k]) for k in KEYS)
    monkeypatch.setattr(dp_fedavg, "secret_seed", SECRET_SEED)
    secret, other = build_rule("dp_fedavg"), build_rule("dp_fedavg")
    state_a, state_b = secret.init_state(X), other.init_state(X)
    assert state_a == state_b and "seed" not in state_a  # the seed is never in the (checkpointed) state
    again = [secret.aggregate(X, updates, state_a, context()).params for _ in range(2)]
    assert all(np.array_equal(again[0][k], again[1][k]) for k in KEYS)  # one run: the same noise
    runs = [
        rule.aggregate(X, updates, state, context()).params for rule, state in ((secret, state_a), (other, state_b))
    ]
    assert not np.array_equal(runs[0]["w"], runs[1]["w"])  # two runs: seeds drawn from the OS, different noise
    secret.init_state(X)  # a run starting again (a resumed job) draws a fresh seed: fresh noise for its rounds
    assert not np.array_equal(secret.aggregate(X, updates, state_a, context()).params["w"], again[0]["w"])


def test_a_pickled_rule_leaves_its_secret_seed_behind(monkeypatch):
    """A copy of the rule (pickle, deepcopy) carries no seed: it draws its own, so its noise differs."""
    updates = [site_update(f"site-{i + 1}", {"w": [0.1 * i, 0, 0], "b": [0]}) for i in range(3)]
    rule = dp()
    state = rule.init_state(X)
    reference = rule.aggregate(X, updates, state, context()).params["w"]
    assert rule._secret == 0  # the fixture's seed
    for copied in (pickle.loads(pickle.dumps(rule)), copy.deepcopy(rule)):
        assert copied._secret is None and copied == rule
    monkeypatch.setattr(dp_fedavg, "secret_seed", SECRET_SEED)
    copied = pickle.loads(pickle.dumps(rule))
    assert not np.array_equal(copied.aggregate(X, updates, state, context()).params["w"], reference)


# -- adaptive clipping ----------------------------------------------------------------------------------------------
def test_the_adaptive_clip_norm_moves_geometrically_towards_the_target_quantile():
    # Norms 0.5, 2, 3 against S = 1: one of three unclipped, b = 1/3; S' = exp(-0.2 (1/3 - 0.5)).
    updates = [
        site_update("site-1", {"w": [0.5, 0, 0], "b": [0]}),
        site_update("site-2", {"w": [0, 2, 0], "b": [0]}),
        site_update("site-3", {"w": [0, 0, 3], "b": [0]}),
    ]
    rule = dp(noise_multiplier=0.0, clip_norm=1.0, clip_count_stddev=0.0, clip_lr=0.2, target_quantile=0.5)
    result = run(rule, updates)
    assert result.state["clip_norm"] == pytest.approx(math.exp(-0.2 * (1 / 3 - 0.5)), abs=1e-12)
    assert rule.diagnostics(result.state)[CLIP_NORM] == pytest.approx(math.exp(0.2 / 6), abs=1e-12)
    # The round itself used the old S = 1: (0.5, 1, 1) / 3 on the three axes.
    np.testing.assert_allclose(result.params["w"], X["w"] + np.array([0.5, 1, 1]) / 3, atol=1e-6, rtol=0)


def test_the_count_is_centred_so_one_site_moves_it_by_exactly_one_half():
    """Andrew et al. 2021: the released count is sum_i (b_i - 1/2) + noise, so that the sensitivity is 1/2 (the
    split of z assumes it); the plain sum_i b_i would move by 1 when a site with b = 1 is added."""
    rng = np.random.default_rng(7)
    for size in (0, 1, 3, 10):
        below = rng.random(size) < 0.5
        for new in (False, True):
            grown = np.append(below, new)
            assert abs(centred_count(grown) - centred_count(below)) == 0.5  # exactly, add or remove, b = 0 or 1
            assert abs(int(grown.sum()) - int(below.sum())) == int(new)  # the uncentred count: 1 or 0
    # By hand: norms 0.5, 2, 3 against S = 1 give b = (1, 0, 0), so sum_i (b_i - 1/2) = 1 - 3/2 = -1/2; with m = 4
    # and a noise draw of 0.7: b = (-0.5 + 0.7) / 4 + 1/2 = 0.55, S' = exp(-0.2 (0.55 - 0.5)) = exp(-0.01).
    assert centred_count(np.array([0.5, 2.0, 3.0]) <= 1.0) == -0.5
    assert noisy_unclipped_share(-0.5, 0.7, 4.0) == pytest.approx(0.55, abs=1e-15)
    assert next_clip_norm(1.0, 0.55, 0.5, 0.2) == pytest.approx(math.exp(-0.01), abs=1e-15)


def test_the_round_moves_s_by_the_centred_noisy_count():
    """3 of m = 4 sites report, norms 0.5, 2, 3 against S = 1. Without noise the centred share is
    (1 - 3/2) / 4 + 1/2 = 3/8 (the uncentred one would be 1/4); with sigma_b = 2 the count noise is the rule's
    count stream of (seed, round) drawn here again, and S' = exp(-0.2 ((-1/2 + noise) / 4 + 1/2 - 1/2))."""
    updates = [
        site_update("site-1", {"w": [0.5, 0, 0], "b": [0]}),
        site_update("site-2", {"w": [0, 2, 0], "b": [0]}),
        site_update("site-3", {"w": [0, 0, 3], "b": [0]}),
    ]
    quiet = dp(noise_multiplier=0.0, clip_norm=1.0, clip_count_stddev=0.0, expected_sites=4, clip_lr=0.2)
    assert run(quiet, updates, sites=4).state["clip_norm"] == pytest.approx(math.exp(-0.2 * (3 / 8 - 0.5)), abs=1e-15)
    noisy = dp(noise_multiplier=1.0, clip_norm=1.0, clip_count_stddev=2.0, expected_sites=4, clip_lr=0.2)
    for round_num in (0, 5):
        noise = np.random.default_rng([0, round_num, _COUNT_NOISE]).normal(0.0, 2.0)  # the fixture's seed is 0
        expected = math.exp(-0.2 * (min(1.0, max(0.0, (-0.5 + noise) / 4 + 0.5)) - 0.5))
        assert run(noisy, updates, round_num, sites=4).state["clip_norm"] == pytest.approx(expected, abs=1e-14)


def tf_privacy_clip_step(clip_norm: float, below: float, noise: float, expected: float, quantile: float, lr: float):
    """TF-Privacy's QuantileEstimatorQuery, geometric update, written out here as the reference: the noised sum of
    (b_i - 1/2) over the expected count, plus 1/2, clipped to [0, 1], then S exp(-lr (estimate - quantile))."""
    estimate = float(np.clip((below + noise) / expected + 0.5, 0.0, 1.0))
    return clip_norm * math.exp(-lr * (estimate - quantile))


def test_the_noisy_share_is_clamped_to_0_1_before_the_clip_step_by_hand():
    """Norms 0.5, 2, 3 against S = 1, m = 3: sum_i (b_i - 1/2) = -1/2. A count noise of +3 gives
    (-0.5 + 3) / 3 + 1/2 = 4/3, clamped to 1, so S' = exp(-0.2 (1 - 0.5)) = exp(-0.1) (unclamped: exp(-1/6));
    a noise of -2 gives -1/3, clamped to 0, so S' = exp(0.1) (unclamped: exp(1/6))."""
    assert noisy_unclipped_share(-0.5, 3.0, 3.0) == 1.0 and noisy_unclipped_share(-0.5, -2.0, 3.0) == 0.0
    assert noisy_unclipped_share(-0.5, 0.7, 3.0) == pytest.approx(0.2 / 3 + 0.5, abs=1e-15)  # inside: unchanged
    assert next_clip_norm(1.0, noisy_unclipped_share(-0.5, 3.0, 3.0), 0.5, 0.2) == pytest.approx(math.exp(-0.1))
    assert next_clip_norm(1.0, noisy_unclipped_share(-0.5, -2.0, 3.0), 0.5, 0.2) == pytest.approx(math.exp(0.1))


def test_the_rounds_clip_norm_follows_tf_privacys_quantile_estimator_also_when_the_noise_leaves_0_1():
    """The rule against the reference rule above over 40 rounds of 3 sites at sigma_b = 2 (the rule's count stream
    of (seed, round) drawn again): at m = 3 about half of the rounds put the unclamped share outside [0, 1]; the
    test asserts some do on both sides, so it fails on a rule that does not clamp."""
    updates = [
        site_update("site-1", {"w": [0.5, 0, 0], "b": [0]}),
        site_update("site-2", {"w": [0, 2, 0], "b": [0]}),
        site_update("site-3", {"w": [0, 0, 3], "b": [0]}),
    ]
    rule = dp(noise_multiplier=1.0, clip_norm=1.0, clip_count_stddev=2.0, clip_lr=0.2, target_quantile=0.5)
    outside = set()
    for round_num in range(40):
        noise = np.random.default_rng([0, round_num, _COUNT_NOISE]).normal(0.0, 2.0)  # the fixture's seed is 0
        unclamped = (-0.5 + noise) / 3 + 0.5
        outside |= {"below 0"} if unclamped < 0 else {"above 1"} if unclamped > 1 else set()
        expected = tf_privacy_clip_step(1.0, -0.5, noise, 3.0, 0.5, 0.2)
        assert run(rule, updates, round_num).state["clip_norm"] == pytest.approx(expected, abs=1e-6, rel=0)
        assert math.exp(-0.1) - 1e-12 <= expected <= math.exp(0.1) + 1e-12  # one step moves S by e^0.1 at most
    assert outside == {"below 0", "above 1"}


def test_the_update_noise_multiplier_leaves_the_pair_at_z():
    assert update_noise_multiplier(1.0, 1.0) == pytest.approx((1 - 1 / 4) ** -0.5, abs=1e-12)
    assert update_noise_multiplier(2.0, 0.0) == 2.0 and update_noise_multiplier(0.0, 5.0) == 0.0
    z, sigma_b = 0.8, 3.0  # the pair's multiplier: (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2) = z
    assert (update_noise_multiplier(z, sigma_b) ** -2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z, abs=1e-12)


def test_the_clip_count_noise_has_std_sigma_b():
    """All four updates are zero (b_i = 1) and m = 40: log(S'/S) = -eta_C ((2 + noise) / 40 + 1/2 - gamma), so the
    noise is read back from S' in each of 3000 independent rounds (b = 0.55 + noise / 40 stays inside [0, 1], where
    the clamp does nothing, unless the noise exceeds 9 sigma_b)."""
    zero = [site_update(f"site-{i}", {"w": [0, 0, 0], "b": [0]}) for i in range(4)]
    rule = dp(
        noise_multiplier=1.0, clip_norm=1.0, clip_count_stddev=2.0, clip_lr=0.2, target_quantile=0.5, expected_sites=40
    )
    state = rule.init_state(X)
    noise = [
        -math.log(rule.aggregate(X, zero, state, context(r, 4)).state["clip_norm"]) / 0.2 * 40 - 2 for r in range(3000)
    ]
    assert np.std(noise) == pytest.approx(2.0, rel=0.05) and abs(np.mean(noise)) < 0.15
    assert rule.count_stddev(40.0) == 2.0 and dp(noise_multiplier=1.0).count_stddev(40.0) == 2.0  # max(m/20, z)
    assert dp(noise_multiplier=1.0).count_stddev(4.0) == 1.0 and dp(noise_multiplier=0.0).count_stddev(4.0) == 0.0


# -- accounting -----------------------------------------------------------------------------------------------------
def test_the_gaussian_mechanism_rdp_and_its_epsilon():
    np.testing.assert_allclose(sampled_gaussian_rdp(1.0, 2.0, (2, 3, 10)), [2 / 8, 3 / 8, 10 / 8], atol=1e-12)
    assert np.all(sampled_gaussian_rdp(0.0, 1.0) == 0) and np.all(np.isinf(sampled_gaussian_rdp(0.5, 0.0)))
    # Balle et al. 2020 at one order by hand: a = 2, rdp = 1: eps = 1 + log(1/2) - (log(1e-5) + log 2).
    assert rdp_epsilon([1.0], 1e-5, (2,)) == pytest.approx(1 + math.log(0.5) - math.log(1e-5) - math.log(2), abs=1e-12)
    # A larger q, more rounds or less noise never lowers epsilon.
    assert dp_fedavg_epsilon(0.1, 1.0, 10, 1e-5) < dp_fedavg_epsilon(0.2, 1.0, 10, 1e-5)
    assert dp_fedavg_epsilon(0.1, 1.0, 10, 1e-5) < dp_fedavg_epsilon(0.1, 1.0, 20, 1e-5)


def test_the_accountant_matches_opacus_at_the_same_orders_and_the_published_reference():
    rdp_module = pytest.importorskip("opacus.accountants.analysis.rdp")
    orders = list(ORDERS)
    for q, z in ((0.01, 1.1), (0.3, 0.7), (0.05, 3.0)):
        theirs = rdp_module.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=orders)
        np.testing.assert_allclose(sampled_gaussian_rdp(q, z), theirs, rtol=1e-9)
        eps, _ = rdp_module.get_privacy_spent(orders=orders, rdp=theirs * 50, delta=1e-5)
        assert dp_fedavg_epsilon(q, z, 50, 1e-5) == pytest.approx(eps, rel=1e-9)
    # q = 0.01, z = 1.1, 1000 steps, delta = 1e-5: Opacus's fractional orders give 1.71; integers only, 1.725.
    assert 1.71 < dp_fedavg_epsilon(0.01, 1.1, 1000, 1e-5) < 1.73


def test_epsilon_in_the_round_diagnostics_counts_the_rounds_at_the_sampling_rate():
    rule = dp(noise_multiplier=1.2, clip_norm=1.0)
    population = tuple(f"site-{i}" for i in range(10))
    state = rule.init_state(X)
    for round_num in range(4):
        sites, state = rule.select_sites(population, 5, state, seed=123, round_num=round_num)
        updates = [site_update(site, {"w": [0.1, 0, 0], "b": [0]}) for site in sites]
        state = rule.aggregate(X, updates, state, RoundContext(round_num, 10, population)).state
    values = rule.diagnostics(state)
    assert values[SAMPLING_RATE] == 0.5 and state["rounds"] == 4
    assert values[EPSILON] == pytest.approx(dp_fedavg_epsilon(0.5, 1.2, 4, 1e-5), rel=1e-12)
    assert EPSILON not in dp(noise_multiplier=0.0).diagnostics(dp(noise_multiplier=0.0).init_state(X))


def test_the_rule_samples_the_sites_from_its_own_secret_generator():
    rule, population = dp(), tuple(f"site-{i}" for i in range(20))
    state = rule.init_state(X)
    picks = [rule.select_sites(population, 4, state, seed=s, round_num=0)[0] for s in (0, 1)]
    assert picks[0] == picks[1] and len(picks[0]) == 4 and picks[0] == sorted(picks[0])  # the job seed is ignored
    later, new_state = rule.select_sites(population, 4, state, seed=0, round_num=1)
    assert later != picks[0] and new_state["sampled"] == 4
    assert rule.select_sites(population, 20, state, 0, 0)[0] == sorted(population)


# -- refusals -------------------------------------------------------------------------------------------------------
NOT_SUMS = ("median", "trimmed_mean", "krum", "fedatt", "fedadp", "attack_adaptive", "scaffold", "fednova")


@pytest.mark.parametrize("inner", NOT_SUMS)
def test_rules_that_do_not_aggregate_a_sum_are_refused_with_the_reason(inner):
    with pytest.raises(AggregationError, match=r"server_optimizer' must be one of .*need the individual updates"):
        build_rule("dp_fedavg", server_optimizer=inner)


def test_the_server_optimizers_are_registered_rules_and_every_other_rule_is_refused():
    assert set(SERVER_OPTIMIZERS) <= set(RULES)
    assert set(RULES) - set(SERVER_OPTIMIZERS) - {"dp_fedavg"} >= set(NOT_SUMS)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"clip_norm": None}, r"'clip_norm' must be a number > 0 \(the noise is calibrated to it"),
        ({"clip_norm": None, "noise_multiplier": 0.0}, r"'clip_norm' must be a number > 0 .*adaptive clipping"),
        ({"noise_multiplier": 1.0, "clip_count_stddev": 0.5}, r"'clip_count_stddev' must be a number > .* = 0.5"),
        ({"optimizer_args": {"weighting": "samples"}}, r"'optimizer_args' must be settings other than 'weighting'"),
        ({"seed": 0}, r"^dp_fedavg: hyperparameter 'seed' must be unset when noise_multiplier > 0 \(the noise must"),
        ({"optimizer_args": {"beta9": 1}}, r"'optimizer_args' must be settings of fedavg"),
        ({"server_optimizer": "fedadam", "optimizer_args": {"tau": 0.0}}, r"^fedadam: hyperparameter 'tau'"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(AggregationError, match=message):
        build_rule("dp_fedavg", **settings)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"client": "scaffold"}, r"dp_fedavg with client 'scaffold': its server state \(scaffold_control\)"),
        ({"arch": "bn_cnn"}, r"float buffers \['net.bn1.running_mean'.*--local-keys batchnorm"),
        ({"server_args": {"server_optimizer": "median"}}, r"--server-args: dp_fedavg: .*'server_optimizer'"),
        ({"server_args": {"seed": 3}}, r"^--server-args: dp_fedavg: hyperparameter 'seed' must be unset when noise"),
    ],
)
def test_the_job_builder_refuses_what_dp_fedavg_cannot_protect(values, message):
    pytest.importorskip("torch")
    from jobs.settings import JobBuildError
    from jobs.spec import spec_from_values

    with pytest.raises(JobBuildError, match=message) as refused:
        spec_from_values("dp", {"server": "dp_fedavg", **values})
    assert "\n" not in str(refused.value)  # one line
    fedbn = {"server": "dp_fedavg", "arch": "bn_cnn", "local_keys": "batchnorm", "site_val_fraction": 0.1}
    assert spec_from_values("dp", fedbn).local_keys


def test_a_fixed_seed_is_kept_only_without_noise():
    """Without noise there is nothing to subtract: the seed then repeats the site sample of a comparison run."""
    rule = build_rule("dp_fedavg", noise_multiplier=0.0, seed=5)
    rule.init_state(X)
    assert rule.noise_seed() == 5 and rule._secret is None
    with pytest.raises(AggregationError, match=r"'seed' must be unset when noise_multiplier > 0 .*, got 5$"):
        build_rule("dp_fedavg", noise_multiplier=1e-3, seed=5)
