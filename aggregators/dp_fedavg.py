"""DP-FedAvg: client-level differential privacy at the server, with fixed or adaptive clipping.

References: McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent Language Models", ICLR 2018,
arXiv:1710.06963 (DP-FedAvg); Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021, arXiv:1905.03871 (the clip norm follows a noisy quantile of the update norms);
Mironov, Talwar, Zhang, "Rényi Differential Privacy of the Sampled Gaussian Mechanism", arXiv:1908.10530 (the
accountant); Balle et al., "Hypothesis Testing Interpretations and Renyi Differential Privacy", AISTATS 2020 (RDP
to (epsilon, delta)). docs/privacy.md, "Client-level DP", says what it protects and when it is worth it.

Per round, over the m sites expected to report (the sites the rule sampled), with S the clip norm:

    Delta_i  = y_i - x                                   (every shared float entry of the site's model)
    hat_i    = Delta_i * min(1, S / ||Delta_i||)         (one norm over all those entries together)
    Delta    = (sum_i hat_i + N(0, (z_Delta S)^2 I)) / m
    x       <- the server optimizer's step on Delta      (FedAvg: x + eta Delta; FedAdam/Yogi/Adagrad/AvgM on it)

Adaptive clipping (``adaptive=True``, Andrew et al. 2021, Algorithm 1 and Theorem 1):

    b_i      = 1[||Delta_i|| <= S]
    b        = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2     (the centred count)
    b       <- min(1, max(0, b))                                   (a share: TF-Privacy's QuantileEstimatorQuery)
    S       <- S exp(-eta_C (b - gamma))

The clamp is post-processing of the noisy count (no privacy cost) and matches the reference implementation
(TensorFlow Privacy's ``QuantileEstimatorQuery.get_noised_result`` clips the noised estimate to [0, 1] before the
geometric step). Without it, on a few sites the count noise (sigma_b >= z) pushes b outside [0, 1] often, and S
moves by e^(eta_C |b - gamma|), unbounded: at 3 sites, z = 1 (sigma_b = 1) and b_i fair coins, 57 of 300
simulated rounds had b outside [0, 1] and the largest step was e^0.249; with the clamp a step is at most
e^(eta_C max(gamma, 1 - gamma)) = e^0.1 at the defaults.

Centring is what makes the count's sensitivity 1/2: adding or removing one site moves sum_i (b_i - 1/2) by
exactly 1/2 whatever b_i is, where sum_i b_i would move by 1 (or 0). The count is then a Gaussian mechanism of
multiplier 2 sigma_b, and the update takes z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), so that the pair of releases
has the overall noise multiplier z (1 / z^2 = 1 / z_Delta^2 + 1 / (2 sigma_b)^2; with fixed clipping
z_Delta = z). An uncentred count (sensitivity 1) with the same split would make the pair's multiplier
(z_Delta^-2 + sigma_b^-2)^(-1/2) < z, and the reported epsilon too small (19.8 reported against 27.6 at the
defaults over 10 rounds of 3 sites; tests/aggregators/test_agg_dp_fedavg_accounting.py). The sampled Gaussian
mechanism with rate q = m / N (N sites in the population) and multiplier z, composed over the rounds in Rényi DP
and converted to (epsilon, delta), is reported every round under ``rule_diagnostics`` (`EPSILON` ...).

What the rule guarantees and what it assumes:

- the released global models are (epsilon, delta)-DP with respect to adding or removing one whole site; the server
  sees the individual updates (it is trusted), and anything else a site sends (training loss, sample counts) is not
  covered: the server records it, the model does not carry it;
- the sites of a round are drawn by the rule itself (`DPFedAvg.select_sites`) from a generator only the server
  knows, since amplification by sampling needs a sample the adversary cannot predict (the engine's own sampling is
  seeded by the job's public seed);
- Delta covers the trainable entries; every other entry of the shared model keeps its global value, since averaging
  it outside the clipped, noised sum would release it unprotected: integer counters, and float buffers (BatchNorm
  statistics), for which the job builder refuses the job (keep them at the sites with ``--local-keys batchnorm``, or
  use GroupNorm/LayerNorm);
- the noise is secret: its generator is seeded by (a seed, round), the seed drawn from the operating system's
  entropy when the run starts (`secret_seed`, in `init_state`) and kept in the server process's memory only, on the
  rule object: never in the rule's state, which the server checkpoints beside the global model and the records
  (``server_state.pt``), so whoever is handed the run folder cannot regenerate the noise (the checkpoint used to
  hold it, and a reviewer stripped a round's noise to 1.1e-7 from it). A resumed job (a restarted server) draws a
  fresh seed: its rounds get fresh, independent noise and a fresh site sample, which protects them as well (each
  round's noise only has to be unknown and independent of the updates), but a resumed run no longer repeats the
  uninterrupted one's noise. A pickled rule leaves the seed behind too. A fixed ``seed`` (runs repeat bit for bit,
  and whoever knows it can subtract the noise) is refused with noise (``noise_multiplier`` > 0), so also when the
  job is built: it only seeds the site sample of noiseless comparisons. Tests that need repeatable noise replace
  `secret_seed` in-process.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_args

import numpy as np

from aggregators.contracts import meta_keys
from aggregators.contracts.hparams import CHECKED_TOGETHER, hparam
from aggregators.deltas import delta_sq_norms, trainable_keys
from aggregators.fedavg import FedAvg
from aggregators.fedopt import FEDOPT_RULES
from aggregators.functional import by_site, weighted_sum
from aggregators.types import (
    AggregationError,
    AggregationResult,
    AggregationRule,
    ClientUpdate,
    RoundContext,
    RuleHParams,
)

#: Server optimizers that take the noisy mean as their one pseudo-gradient: the rules whose step is a function of
#: the sum of the updates only.
ServerOptimizer = Literal["fedavg", "fedadam", "fedyogi", "fedadagrad", "fedavgm"]
SERVER_OPTIMIZERS: dict[str, type] = {FedAvg.name: FedAvg, **{rule.name: rule for rule in FEDOPT_RULES}}
assert tuple(SERVER_OPTIMIZERS) == get_args(ServerOptimizer)  # one list, two spellings
#: Why the other rules cannot run under DP-FedAvg (the refusal's note).
NOT_A_SUM = (
    "DP-FedAvg noises the sum of the clipped updates, so the server step must be a function of that sum; median, "
    "trimmed_mean, krum, fedatt, fedadp and attack_adaptive need the individual updates, and scaffold, feddyn, "
    "fedmos and fednova per-site state or meta that the noise does not cover"
)
#: Rényi orders of the accountant: integers, where the sampled Gaussian's RDP has a closed form (any order gives a
#: valid bound; fractional orders below 2 would only tighten very large epsilons).
ORDERS: tuple[int, ...] = tuple(range(2, 257))

#: Names of the scalars written to each round's ``rule_diagnostics``.
EPSILON, DELTA = "dp_fedavg.epsilon", "dp_fedavg.delta"
NOISE_MULTIPLIER, CLIP_NORM = "dp_fedavg.noise_multiplier", "dp_fedavg.clip_norm"
SAMPLING_RATE, ROUNDS = "dp_fedavg.sampling_rate", "dp_fedavg.rounds"

#: Streams of the rule's generator, keyed with (seed, round): the update noise, the clip-count noise, the sampling.
_UPDATE_NOISE, _COUNT_NOISE, _SAMPLING = 0, 1, 2


# --------------------------------------------------------------------------------------------------------------------
# Accounting: the sampled Gaussian mechanism in Rényi DP
# --------------------------------------------------------------------------------------------------------------------
def sampled_gaussian_rdp(q: float, noise_multiplier: float, orders: Sequence[int] = ORDERS) -> np.ndarray:
    """RDP of one round of the sampled Gaussian mechanism (rate ``q``, noise std ``noise_multiplier`` x the
    sensitivity) at integer ``orders``: log(A_a) / (a - 1) with
    A_a = sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 z^2)) (Mironov, Talwar, Zhang 2019, section 3.3),
    summed in log space; a / (2 z^2) when q = 1 (the Gaussian mechanism), 0 when q = 0, inf when z = 0."""
    if not 0 <= q <= 1 or noise_multiplier < 0:
        raise ValueError(
            f"sampling rate must be in [0, 1] and the noise multiplier >= 0, got q={q}, z={noise_multiplier}"
        )
    alphas = np.asarray(orders, dtype=np.float64)
    if q == 0:
        return np.zeros_like(alphas)
    if noise_multiplier == 0:
        return np.full_like(alphas, np.inf)
    if q == 1:
        return alphas / (2 * noise_multiplier**2)
    return np.array([_log_a(int(a), q, noise_multiplier) / (a - 1) for a in orders])


def _log_a(alpha: int, q: float, z: float) -> float:
    k = np.arange(alpha + 1, dtype=np.float64)
    log_binomial = math.lgamma(alpha + 1) - np.array([math.lgamma(i + 1) + math.lgamma(alpha - i + 1) for i in k])
    terms = log_binomial + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * z * z)
    top = terms.max()
    return float(top + math.log(np.exp(terms - top).sum()))


def rdp_epsilon(rdp: Sequence[float], delta: float, orders: Sequence[int] = ORDERS) -> float:
    """The smallest epsilon over the orders for accumulated RDP values ``rdp``, by Balle et al. 2020 (Theorem 21):
    eps = rdp_a + log((a - 1) / a) - (log delta + log a) / (a - 1)."""
    alphas = np.asarray(orders, dtype=np.float64)
    values = (
        np.asarray(rdp, dtype=np.float64) + np.log1p(-1 / alphas) - (math.log(delta) + np.log(alphas)) / (alphas - 1)
    )
    return max(0.0, float(np.nanmin(values)))


def dp_fedavg_epsilon(q: float, noise_multiplier: float, rounds: int, delta: float) -> float:
    """Epsilon after ``rounds`` rounds at a constant sampling rate ``q`` (inf without noise)."""
    return rdp_epsilon(rounds * sampled_gaussian_rdp(q, noise_multiplier), delta)


# --------------------------------------------------------------------------------------------------------------------
# The pieces of a round
# --------------------------------------------------------------------------------------------------------------------
def update_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): the update's share of the overall multiplier z when the clip count
    is released with noise sigma_b too (Andrew et al. 2021, Theorem 1); z itself when sigma_b = 0 (nothing else
    is released), 0 when z = 0."""
    if noise_multiplier == 0 or count_stddev == 0:
        return noise_multiplier
    remaining = noise_multiplier**-2 - (2 * count_stddev) ** -2
    if remaining <= 0:
        raise AggregationError(
            f"dp_fedavg: clip_count_stddev {count_stddev:g} must exceed noise_multiplier / 2 = "
            f"{noise_multiplier / 2:g}: the clip count alone would spend the whole privacy budget"
        )
    return remaining**-0.5


def clip_factors(norms: np.ndarray, clip_norm: float | None) -> np.ndarray:
    """min(1, S / ||Delta_i||) per site (1 for a zero update, all 1 without clipping)."""
    if clip_norm is None:
        return np.ones_like(norms)
    return np.minimum(1.0, clip_norm / np.maximum(norms, np.finfo(np.float64).tiny))


def centred_count(unclipped: np.ndarray) -> float:
    """sum_i (b_i - 1/2) over the reporting sites' indicators b_i = 1[||Delta_i|| <= S]: each site adds +-1/2, so
    adding or removing one site moves it by exactly 1/2 (the sensitivity the split of z assumes)."""
    return float(np.sum(np.asarray(unclipped, dtype=np.float64) - 0.5))


def noisy_unclipped_share(centred: float, count_noise: float, expected: float) -> float:
    """b = min(1, max(0, (sum_i (b_i - 1/2) + noise) / m + 1/2)): the released estimate of the share of unclipped
    updates (the 1/2 added back is a public constant, so it costs no privacy). A share lies in [0, 1], so the noisy
    estimate is clamped there, as TF-Privacy's quantile estimator does (post-processing: free)."""
    return min(1.0, max(0.0, (centred + count_noise) / expected + 0.5))


def next_clip_norm(clip_norm: float, share: float, quantile: float, lr: float) -> float:
    """S exp(-eta_C (b - gamma)): the geometric step of the clip norm towards the ``quantile`` of the update norms,
    from the noisy share ``b``."""
    return float(clip_norm * math.exp(-lr * (share - quantile)))


def secret_seed() -> int:
    """A seed for the noise and the site sample from the operating system's entropy, drawn once per run (tests
    that need repeatable noise replace this function)."""
    return secrets.randbits(63)


@dataclass(frozen=True)
class DPFedAvg(RuleHParams, AggregationRule):
    """DP-FedAvg with fixed or adaptive clipping, composed with a server optimizer (module docstring).

    Args:
        noise_multiplier: z, the noise std over the clip norm for the pair (update, clip count); 0 adds none (no
            privacy: for comparisons only).
        clip_norm: S, the clip norm (the initial one with ``adaptive``); unset: no clipping (only with z = 0).
        adaptive: follow the ``target_quantile`` of the update norms (Andrew et al. 2021).
        target_quantile: gamma, the share of updates left unclipped that S aims at.
        clip_lr: eta_C, the geometric learning rate of S.
        clip_count_stddev: sigma_b, the noise on the count of unclipped updates; unset: max(m / 20, z) (m / 20 is
            the paper's choice for many sites; z keeps z_Delta within 16 % of z on a few).
        expected_sites: m, the divisor of the sum; unset: the number of sites the rule samples each round.
        delta: the delta of the reported (epsilon, delta).
        server_optimizer: the rule that steps on the noisy mean (FedAvg or a FedOpt variant).
        optimizer_args: its hyperparameters (e.g. ``{"server_lr": 1.0}``).
        seed: seeds the site sample with the round, only without noise (z = 0; refused otherwise, since whoever
            knows it could subtract the noise); unset: a secret seed per run (`secret_seed`), kept in the
            server's memory only, never in the checkpointed state.
    """

    noise_multiplier: float = hparam(1.0, low=0, note="z, noise std / clip norm; 0: no privacy")
    clip_norm: float | None = hparam(0.1, low=0, low_open=True, note="S; unset: no clipping (only with z = 0)")
    adaptive: bool = True
    target_quantile: float = hparam(0.5, low=0, high=1, low_open=True, high_open=True, note="gamma")
    clip_lr: float = hparam(0.2, low=0, low_open=True, note="eta_C, the geometric step of the clip norm")
    clip_count_stddev: float | None = hparam(None, low=0, note="sigma_b; unset: max(m / 20, z)")
    expected_sites: int | None = hparam(None, low=1, note="m; unset: the sites sampled per round")
    delta: float = hparam(1e-5, low=0, high=1, low_open=True, high_open=True, note="of the reported epsilon")
    server_optimizer: ServerOptimizer = field(default="fedavg", metadata={"note": NOT_A_SUM})
    optimizer_args: dict[str, Any] = field(default_factory=dict, metadata=CHECKED_TOGETHER)
    seed: int | None = hparam(None, low=0, note="unset: a secret seed per run; set: only with noise_multiplier 0")
    optimizer: AggregationRule = field(init=False, repr=False, compare=False)
    #: The run's secret seed, drawn by `init_state`: process memory only, never in the state (module docstring).
    _secret: int | None = field(default=None, init=False, repr=False, compare=False)

    name: ClassVar[str] = "dp_fedavg"
    secure_sum: ClassVar[str] = "clips every individual update at the server before it noises the sum"
    translation_equivariant: ClassVar[str | None] = None
    partial_sharing_refused: ClassVar[str | None] = None
    client_level_dp: ClassVar[str | None] = "DP-FedAvg"  # its clipped, noised sum is the client-level DP release
    #: The noisy mean is divided by the expected number of sites, and noised: not the clients' common model.
    mean_type: ClassVar[bool] = False

    def check_together(self) -> None:
        if self.clip_norm is None and (self.noise_multiplier > 0 or self.adaptive):
            self.refuse(
                "clip_norm", "a number > 0", None, "the noise is calibrated to it and adaptive clipping starts from it"
            )
        sigma_b, z = self.clip_count_stddev, self.noise_multiplier
        if self.adaptive and sigma_b is not None and z > 0 and 2 * sigma_b <= z:
            self.refuse(
                "clip_count_stddev",
                f"a number > noise_multiplier / 2 = {z / 2:g}",
                sigma_b,
                "the clip count alone would spend the whole privacy budget",
            )
        if self.seed is not None and z > 0:
            self.refuse(
                "seed",
                "unset when noise_multiplier > 0",
                self.seed,
                "the noise must be secret: whoever knows a fixed seed can regenerate the noise and subtract it; "
                "unset, each run draws a secret one",
            )
        if not isinstance(self.optimizer_args, Mapping):
            self.refuse("optimizer_args", "a JSON object", self.optimizer_args)
        if "weighting" in self.optimizer_args:
            self.refuse(
                "optimizer_args",
                "settings other than 'weighting'",
                dict(self.optimizer_args),
                "every site's clipped update counts once: that is what bounds its influence",
            )
        try:
            optimizer = SERVER_OPTIMIZERS[self.server_optimizer](**self.optimizer_args)
        except TypeError as exc:
            self.refuse("optimizer_args", f"settings of {self.server_optimizer}", dict(self.optimizer_args), str(exc))
        object.__setattr__(self, "optimizer", optimizer)

    # -- state ------------------------------------------------------------------------------------------------------
    def init_state(self, global_params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """A run starts (fresh or resumed: the controller calls this before it loads a checkpoint): a new secret
        seed, kept on the rule object, out of the returned state that the server checkpoints."""
        object.__setattr__(self, "_secret", None if self.seed is not None else secret_seed())
        return {
            "clip_norm": self.clip_norm,
            "rounds": 0,
            "rdp": [0.0] * len(ORDERS),
            "sampling_rate": 0.0,
            "optimizer": self.optimizer.init_state(global_params),
        }

    def noise_seed(self) -> int:
        """The seed of the noise and the site sample: the public ``seed`` of a noiseless run, else the run's secret
        one (drawn here if `init_state` did not run in this process, e.g. on a rule that was pickled)."""
        if self.seed is not None:
            return self.seed
        if self._secret is None:
            object.__setattr__(self, "_secret", secret_seed())
        return self._secret

    def __getstate__(self) -> dict[str, Any]:
        # Pickling (a copy of the job's components, a crash dump) must not carry the secret out of the process.
        return {**self.__dict__, "_secret": None}

    def diagnostics(self, state: Mapping[str, Any]) -> dict[str, float]:
        values = {
            NOISE_MULTIPLIER: self.noise_multiplier,
            DELTA: self.delta,
            SAMPLING_RATE: float(state["sampling_rate"]),
            ROUNDS: float(state["rounds"]),
        }
        if state["clip_norm"] is not None:
            values[CLIP_NORM] = float(state["clip_norm"])
        if self.noise_multiplier > 0:  # without noise there is no finite epsilon to report
            values[EPSILON] = rdp_epsilon(state["rdp"], self.delta)
        values.update(self.optimizer.diagnostics(state["optimizer"]))
        return values

    # -- sampling ---------------------------------------------------------------------------------------------------
    def select_sites(
        self, population: Sequence[str], count: int, state: Mapping[str, Any], seed: int, round_num: int
    ) -> tuple[list[str], dict[str, Any]]:
        """``count`` sites uniformly at random from the rule's own generator (the job's ``seed`` is public, so a
        sample drawn from it would not amplify privacy); the count is kept as the round's m."""
        ordered = sorted(population)
        if count < len(ordered):
            rng = np.random.default_rng([self.noise_seed(), round_num, _SAMPLING])
            ordered = sorted(ordered[i] for i in rng.choice(len(ordered), size=count, replace=False))
        return ordered, {**state, "sampled": count}

    # -- aggregation ------------------------------------------------------------------------------------------------
    def aggregate(
        self,
        global_params: Mapping[str, np.ndarray],
        updates: Sequence[ClientUpdate],
        state: Mapping[str, Any],
        context: RoundContext,
    ) -> AggregationResult:
        updates = by_site(updates)
        if not updates:
            raise AggregationError("dp_fedavg: no client update to aggregate")
        keys = trainable_keys(global_params, updates)
        expected = float(self.expected_sites or state.get("sampled") or len(updates))
        clip = state["clip_norm"]
        norms = update_norms(global_params, updates, keys)
        count_stddev = self.count_stddev(expected)
        z_update = (
            update_noise_multiplier(self.noise_multiplier, count_stddev) if self.adaptive else self.noise_multiplier
        )
        rng = np.random.default_rng([self.noise_seed(), context.round_num, _UPDATE_NOISE])
        noise_std = 0.0 if clip is None else z_update * clip
        mean_delta = noisy_mean_delta(global_params, updates, keys, clip_factors(norms, clip), expected, noise_std, rng)
        pseudo = {
            **global_params,
            **{k: (global_params[k] + mean_delta[k]).astype(global_params[k].dtype) for k in keys},
        }
        moved = self.optimizer.aggregate(
            global_params,
            [ClientUpdate(site="dp_fedavg", params=pseudo, num_samples=1, meta={meta_keys.PARAM_KEYS: keys})],
            state["optimizer"],
            context,
        )
        new_clip = clip
        if self.adaptive and clip is not None:
            # Only the noisy count leaves the server (through S): the exact one stays out of the records.
            centred = centred_count(norms <= clip)
            count_rng = np.random.default_rng([self.noise_seed(), context.round_num, _COUNT_NOISE])
            count_noise = float(count_rng.normal(0.0, count_stddev)) if count_stddev > 0 else 0.0
            share = noisy_unclipped_share(centred, count_noise, expected)
            new_clip = next_clip_norm(clip, share, self.target_quantile, self.clip_lr)
        rate = min(1.0, expected / max(len(context.population), 1))
        rdp = np.asarray(state["rdp"]) + (
            sampled_gaussian_rdp(rate, self.noise_multiplier) if self.noise_multiplier else 0
        )
        private = set(keys)  # buffers keep the global value: nothing outside the noised sum is released
        params = {key: (moved.params[key] if key in private else global_params[key]) for key in global_params}
        new_state = {
            **state,
            "clip_norm": new_clip,
            "rounds": int(state["rounds"]) + 1,
            "rdp": [float(v) for v in rdp],
            "sampling_rate": rate,
            "optimizer": moved.state,
        }
        return AggregationResult(params=params, state=new_state, meta=moved.meta)

    def count_stddev(self, expected: float) -> float:
        """sigma_b: as set, else max(m / 20, z) (0 without noise: nothing private to protect)."""
        if self.clip_count_stddev is not None:
            return self.clip_count_stddev
        return max(expected / 20, self.noise_multiplier) if self.noise_multiplier > 0 else 0.0


#: What to do about float buffers (the build-time refusal's advice).
FLOAT_BUFFER_ADVICE = (
    "averaging them outside the clipped, noised sum would release them unprotected, so DP-FedAvg keeps their "
    "initial value on the server; keep them at the sites (--local-keys batchnorm) or use a model without them "
    "(GroupNorm or LayerNorm instead of BatchNorm)"
)


def update_norms(
    global_params: Mapping[str, np.ndarray], updates: Sequence[ClientUpdate], keys: Sequence[str]
) -> np.ndarray:
    """||y_i - x|| over all ``keys`` together, per site (float64)."""
    squared = np.zeros(len(updates))
    for key in keys:
        squared += delta_sq_norms(global_params[key], [u.params[key] for u in updates])
    return np.sqrt(squared)


def noisy_mean_delta(
    global_params: Mapping[str, np.ndarray],
    updates: Sequence[ClientUpdate],
    keys: Sequence[str],
    factors: np.ndarray,
    expected: float,
    noise_std: float,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """(sum_i c_i (y_i - x) + N(0, noise_std^2 I)) / m per key, in float64 (noise drawn key by key in model order)."""
    weights = factors / expected
    mean = {}
    for key in keys:
        x = np.asarray(global_params[key])
        total = weighted_sum([u.params[key] for u in updates], weights, x, minus=x, dtype=np.float64)
        if noise_std > 0:
            total += rng.normal(0.0, noise_std / expected, size=x.shape)
        mean[key] = total
    return mean
