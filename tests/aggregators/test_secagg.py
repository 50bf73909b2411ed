"""SecAgg+ (aggregators/secagg.py), one round played in-process by every party, as an attacker would test it.

`play_round` runs the four stages with real keys and real shares and keeps what the server saw (``Transcript``). The
sum is checked against plain weighted FedAvg computed here with NumPy alone; dropouts at each stage; bad parameters
refused in one line; and the collusion test: the server together with one site (its keys, its seed, the shares it
opened and everything the server saw) cannot rebuild another site's update under SecAgg+, while under the shared-key
HE model (NVFlare's HEBuilder gives every site the same TenSEAL secret key) the same coalition decrypts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

pytest.importorskip("flwr")

from aggregators import secagg

SHAPES = {"conv.weight": (4, 3), "fc.bias": (5,)}
GLOBAL = {name: np.random.default_rng(1).normal(0, 0.5, shape) for name, shape in SHAPES.items()}


def site_models(num_sites: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {n: (g + rng.normal(0, 0.3, g.shape)).astype(np.float32) for n, g in GLOBAL.items()} for _ in range(num_sites)
    ]


def weights_of(num_sites: int) -> list[int]:
    return [37 + 101 * i for i in range(num_sites)]


def fedavg(models: list[dict[str, np.ndarray]], weights: list[int], sites: list[int]) -> dict[str, np.ndarray]:
    """Plain weighted FedAvg of ``sites``' models, in float64 with NumPy only."""
    total = sum(weights[i] for i in sites)
    return {n: sum(weights[i] * models[i][n].astype(np.float64) for i in sites) / total for n in GLOBAL}


@dataclass
class Site:
    index: int
    keys: secagg.SiteKeys
    b_seed: bytes = b""
    opened: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    weighted: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class Transcript:
    """Everything the server saw in one round."""

    public: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    sealed: dict[int, dict[int, bytes]] = field(default_factory=dict)  # src -> dst -> ciphertext
    masked: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    returned: dict[int, dict[int, bytes]] = field(default_factory=dict)
    weights: dict[int, int] = field(default_factory=dict)
    mean: dict[str, np.ndarray] | None = None


def play_round(
    models: list[dict[str, np.ndarray]],
    weights: list[int],
    threshold: int,
    degree: int | None = None,
    drop_before_shares: tuple[int, ...] = (),
    drop_before_input: tuple[int, ...] = (),
    drop_before_unmask: tuple[int, ...] = (),
    round_num: int = 3,
) -> tuple[Transcript, list[Site]]:
    n = len(models)
    secagg.check_protocol(n, threshold, degree)
    sites = [Site(i, secagg.make_keys()) for i in range(n)]
    seen = Transcript()
    # 1. advertise keys
    seen.public = {s.index: s.keys.public() for s in sites}
    # 2. share keys (a site dropping here sends nothing further)
    for s in sites:
        if s.index in drop_before_shares:
            continue
        holders = secagg.neighbours(s.index, n, degree)
        s.b_seed = secagg.new_seed()
        shares = secagg.share_secrets(s.b_seed, s.keys.mask_sk, threshold, len(holders))
        seen.sealed[s.index] = secagg.seal_shares(
            s.index, s.keys, shares, holders, {j: seen.public[j][0] for j in holders}
        )
    shared = sorted(seen.sealed)
    for s in sites:  # the server forwards each sealed share to its holder
        for src in shared:
            if s.index in seen.sealed[src]:
                s.opened[src] = secagg.open_share(s.index, src, s.keys, seen.public[src][0], seen.sealed[src][s.index])
    # 3. masked input
    for i in shared:
        if i in drop_before_input:
            continue
        s = sites[i]
        update = {name: models[i][name].astype(np.float64) - GLOBAL[name] for name in GLOBAL}
        s.weighted = secagg.weigh(secagg.quantise(update), weights[i])
        peers = {j: seen.public[j][1] for j in secagg.neighbours(i, n, degree) if j in seen.sealed}
        masked = secagg.mask_update(i, s.weighted, s.b_seed, s.keys.mask_sk, peers, round_num)
        seen.masked[i] = secagg.unpack(secagg.pack(masked), SHAPES)  # as it travels
        seen.weights[i] = weights[i]
    # 4. unmask
    summed = sorted(seen.masked)
    dropped = [i for i in shared if i not in seen.masked]
    for i in shared:
        if i in drop_before_unmask or i in drop_before_input:
            continue
        seen.returned[i] = secagg.unmask_shares(i, sites[i].opened, summed, dropped, threshold)
    total = secagg.masked_sum([seen.masked[i] for i in summed])
    mask_pks = {i: pk for i, (_, pk) in seen.public.items()}
    weighted_sum = secagg.unmask(total, summed, dropped, seen.returned, mask_pks, n, threshold, round_num, degree)
    mean_update = secagg.mean_update(weighted_sum, sum(seen.weights.values()))
    seen.mean = {name: GLOBAL[name] + mean_update[name] for name in GLOBAL}
    return seen, sites


STEP = secagg.quantisation_step()


def assert_fedavg(seen: Transcript, models: list, weights: list, sites: list[int]) -> None:
    expected = fedavg(models, weights, sites)
    for name in GLOBAL:
        assert seen.mean[name].shape == expected[name].shape
        assert np.max(np.abs(seen.mean[name] - expected[name])) < STEP


@pytest.mark.parametrize(("num_sites", "threshold", "degree"), [(3, 2, None), (5, 3, None), (5, 3, 2), (7, 2, 2)])
def test_sum_equals_plain_fedavg_within_one_quantisation_step(num_sites, threshold, degree) -> None:
    models, weights = site_models(num_sites), weights_of(num_sites)
    seen, _ = play_round(models, weights, threshold, degree)
    assert_fedavg(seen, models, weights, list(range(num_sites)))
    assert pytest.approx(2 * 8.0 / 2**24) == STEP and STEP < 1e-6


def test_quantisation_error_is_what_the_step_says() -> None:
    """The step is a real bound, not a loose one: one site's rebuilt mean misses by a visible fraction of it."""
    models, weights = site_models(3, seed=5), [1, 1, 1]
    seen, _ = play_round(models, weights, 2)
    expected = fedavg(models, weights, [0, 1, 2])
    worst = max(float(np.max(np.abs(seen.mean[n] - expected[n]))) for n in GLOBAL)
    assert 1e-3 * STEP < worst < STEP


def test_masked_inputs_alone_look_nothing_like_the_updates() -> None:
    models, weights = site_models(3), weights_of(3)
    seen, sites = play_round(models, weights, 2)
    for i, s in enumerate(sites):
        for name in GLOBAL:
            assert not np.array_equal(seen.masked[i][name], s.weighted[name])
            # a quantised weighted update stays below 2^40 here; a masked one is uniform below 2^48
            assert np.all(s.weighted[name] < np.uint64(2**40))
            assert np.all(seen.masked[i][name] < np.uint64(2**48)) and np.any(seen.masked[i][name] >= 2**40)


@pytest.mark.parametrize("dropped", [(0,), (2,), (4,)])
def test_site_dropping_after_its_masked_input_is_still_summed(dropped) -> None:
    models, weights = site_models(5), weights_of(5)
    seen, _ = play_round(models, weights, 3, drop_before_unmask=dropped)
    assert set(seen.returned) == set(range(5)) - set(dropped)
    assert_fedavg(seen, models, weights, list(range(5)))


def test_site_dropping_before_its_masked_input_is_left_out_of_the_mean() -> None:
    models, weights = site_models(5), weights_of(5)
    seen, _ = play_round(models, weights, 3, drop_before_input=(1,))
    assert_fedavg(seen, models, weights, [0, 2, 3, 4])


def test_site_dropping_before_sharing_keys_is_left_out() -> None:
    models, weights = site_models(5), weights_of(5)
    seen, _ = play_round(models, weights, 3, drop_before_shares=(3,))
    assert_fedavg(seen, models, weights, [0, 1, 2, 4])


def test_too_many_dropouts_fail_the_round_in_one_line() -> None:
    with pytest.raises(secagg.SecAggError, match=r"^site \d+'s self-mask: 1 shares returned, the threshold is 2$"):
        play_round(site_models(3), weights_of(3), 2, drop_before_unmask=(0, 1))


@pytest.mark.parametrize(
    ("num_sites", "threshold", "degree", "message"),
    [
        (2, 2, None, r"^secagg needs at least 3 sites, got 2: .*; add sites or use --secure-aggregation he$"),
        (3, 4, None, r"^secagg threshold 4 cannot be met: each site's seeds are shared among 3 sites; use 2 to 3$"),
        (5, 2, None, r"^secagg threshold 2 is not a majority of the 5 share holders .*; use 3 to 5$"),
        (6, 2, 3, r"^secagg neighbourhood degree 3: use an even number from 2 to 4, or 5$"),
    ],
)
def test_bad_parameters_refused_in_one_line(num_sites, threshold, degree, message) -> None:
    problem = secagg.protocol_problem(num_sites, threshold, degree)
    assert problem is not None and "\n" not in problem
    with pytest.raises(secagg.SecAggError, match=message):
        secagg.check_protocol(num_sites, threshold, degree)


def test_a_holder_never_returns_both_shares_of_one_site() -> None:
    """The server that names a summed site as dropped too (to get its key and its seed) gets nothing."""
    models, weights = site_models(3), weights_of(3)
    _, sites = play_round(models, weights, 2)
    with pytest.raises(secagg.SecAggError, match=r"^site 0: sites \[1\] asked as both summed and dropped"):
        secagg.unmask_shares(0, sites[0].opened, [0, 1, 2], [1], 2)
    with pytest.raises(secagg.SecAggError, match="fewer than the threshold"):
        secagg.unmask_shares(0, sites[0].opened, [0], [1, 2], 2)


def test_a_misrouted_or_forged_share_is_refused() -> None:
    n = 3
    sites = [secagg.make_keys() for _ in range(n)]
    shares = secagg.share_secrets(secagg.new_seed(), sites[0].mask_sk, 2, n)
    sealed = secagg.seal_shares(0, sites[0], shares, [0, 1, 2], {j: k.channel_pk for j, k in enumerate(sites)})
    assert secagg.open_share(1, 0, sites[1], sites[0].channel_pk, sealed[1]) == shares[1]
    with pytest.raises(secagg.SecAggError, match="does not open"):  # site 2's share handed to site 1
        secagg.open_share(1, 0, sites[1], sites[0].channel_pk, sealed[2])
    with pytest.raises(secagg.SecAggError, match="does not open"):
        secagg.open_share(1, 0, sites[1], sites[0].channel_pk, sealed[1][:-4] + b"AAAA")


def test_the_wire_form_is_six_bytes_a_coordinate_and_round_trips() -> None:
    values = {"a": np.array([[0, 1, 2**48 - 1]], dtype=np.uint64), "b": np.array([2**47 + 5], dtype=np.uint64)}
    packed = secagg.pack(values)
    assert packed["a"].dtype == np.uint8 and packed["a"].size == 3 * 6 and packed["b"].size == 6
    unpacked = secagg.unpack(packed, {"a": (1, 3), "b": (1,)})
    for name in values:
        np.testing.assert_array_equal(unpacked[name], values[name])
    with pytest.raises(secagg.SecAggError, match="masked entry 'b': 5 bytes, expected 6"):
        secagg.unpack({"a": packed["a"], "b": packed["b"][:5]}, {"a": (1, 3), "b": (1,)})


def test_a_total_weight_the_modulus_cannot_hold_is_refused() -> None:
    secagg.check_total_weight(2**24 - 1)
    with pytest.raises(secagg.SecAggError, match=r"at most 16777215 training samples in a round$"):
        secagg.check_total_weight(2**24)


def test_out_of_range_update_is_refused_not_clipped() -> None:
    with pytest.raises(secagg.SecAggError, match=r"^update entry 'w' reaches 9, outside the quantisation range"):
        secagg.quantise({"w": np.array([0.5, -9.0])})


# --- The collusion test ---------------------------------------------------------------------------------------------

VICTIM, COLLUDER = 0, 1


def secagg_coalition_estimate(seen: Transcript, sites: list[Site], extra_seeds: dict[int, bytes]) -> dict:
    """The server + site COLLUDER's best estimate of VICTIM's weighted quantised update: the victim's masked input
    less every mask the coalition can compute (the self-mask, rebuilt from the shares the server legitimately got;
    the pairwise mask with the colluder; any pairwise seed in ``extra_seeds``, peer -> seed)."""
    colluder = sites[COLLUDER]
    n, threshold = len(sites), 2
    shapes = {name: np.shape(v) for name, v in seen.masked[VICTIM].items()}
    b_shares = [r[VICTIM] for r in seen.returned.values() if VICTIM in r]
    estimate = dict(seen.masked[VICTIM])
    mask48 = np.uint64(2**48 - 1)
    estimate = _minus(estimate, secagg.prg(secagg.rebuild(b_shares, threshold, "b"), 3, shapes))
    seeds = {COLLUDER: secagg.pairwise_seed(colluder.keys.mask_sk, seen.public[VICTIM][1]), **extra_seeds}
    for peer, seed in seeds.items():
        mask = secagg.prg(seed, 3, shapes)
        estimate = _minus(estimate, mask) if peer > VICTIM else _plus(estimate, mask)
    assert n == 3
    return {k: v & mask48 for k, v in estimate.items()}


def _minus(a: dict, b: dict) -> dict:
    return {k: a[k] - b[k] for k in a}


def _plus(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def test_collusion_secagg_server_plus_one_site_cannot_recover_another_sites_update() -> None:
    models, weights = site_models(3), weights_of(3)
    seen, sites = play_round(models, weights, threshold=2)
    truth = sites[VICTIM].weighted
    estimate = secagg_coalition_estimate(seen, sites, {})
    for name in GLOBAL:
        # still under the honest third site's pairwise mask: uniform below 2^48, no coordinate near the truth
        diff = (estimate[name] - truth[name]) & np.uint64(2**48 - 1)
        gap = np.minimum(diff, np.uint64(2**48) - diff)
        assert np.all(gap > np.uint64(2**30))
    # Nor can the coalition rebuild the victim's mask key: the server got none of its key shares (it was summed),
    # and the colluder's one share is below the threshold.
    key_share = sites[COLLUDER].opened[VICTIM][1]
    assert all(VICTIM not in r or r[VICTIM] != key_share for r in seen.returned.values())
    with pytest.raises(secagg.SecAggError, match="threshold is 2"):
        secagg.rebuild([key_share], 2, "the victim's mask key")
    # Control: the same procedure given the one seed it lacks (the victim's pairwise seed with the honest site)
    # recovers the update exactly, so the failure above is the protocol's doing, not the attack's.
    honest = 2
    missing = secagg.pairwise_seed(sites[honest].keys.mask_sk, seen.public[VICTIM][1])
    recovered = secagg_coalition_estimate(seen, sites, {honest: missing})
    for name in GLOBAL:
        np.testing.assert_array_equal(recovered[name], truth[name])


def test_collusion_shared_key_he_server_plus_one_site_recovers_another_sites_update() -> None:
    """NVFlare's HEBuilder model: one CKKS context with its secret key at every site, the server's copy public only.
    The server sees each site's ciphertext; the colluding site decrypts the victim's with its own context."""
    ts = pytest.importorskip("tenseal")
    context = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40, 60])
    context.global_scale = 2**40
    site_context = context.serialize(save_secret_key=True)  # what provisioning gives every site
    server_context = ts.context_from(site_context)
    server_context.make_context_public()
    models, weights = site_models(3), weights_of(3)
    victim = np.concatenate([weights[VICTIM] * models[VICTIM][n].ravel() for n in GLOBAL]).astype(np.float64)
    sent = ts.ckks_vector(ts.context_from(site_context), victim.tolist()).serialize()  # what the server sees
    with pytest.raises(ValueError):  # the server alone cannot decrypt
        ts.ckks_vector_from(server_context, sent).decrypt()
    colluder_context = ts.context_from(site_context)  # the colluding site's own provisioned context
    recovered = np.array(ts.ckks_vector_from(colluder_context, sent).decrypt())
    np.testing.assert_allclose(recovered, victim, atol=1e-3)
