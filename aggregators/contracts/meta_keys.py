"""Every metadata key this bundle puts on the wire, in one place.

Keys are dotted and namespaced (``<namespace>.<name>``). NVFlare 2.9 switches on its own Lightning
SCAFFOLD/FedProx handlers when it sees ``scaffold_c_global`` or ``fedprox_mu`` in the received meta,
so this bundle never sends those names: a correction must never be applied twice (docs/design.md, decision 3).

This module is pure Python so that both sides (the Lightning client and the NVFlare server) can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Client -> server: what every client reports after local training.
NUM_SAMPLES = "train.num_samples"  # training samples of the site: the FedAvg weight (docs/design.md, decision 6)
NUM_STEPS = "train.num_steps"  # optimizer steps actually executed this round
TRAIN_LOSS = "train.loss"  # mean training loss over the round's steps
FIT_SECONDS = "train.fit_seconds"  # wall seconds of the site's trainer.fit (compute, vs. round wall time)
TRAIN_ACCURACY = "train.accuracy"  # share of correct predictions over the round's training batches
CLIENT_ALGORITHM = "client.algorithm"  # name of the client algorithm that produced the update
PARAM_KEYS = "train.param_keys"  # names of the trainable parameters; every other entry is a buffer
# The server round the result was trained in (the broadcast's server.round, echoed): a result that arrives in another
# round (late, or replayed by the transport) is rejected instead of being aggregated against the wrong global model.
TRAINED_ROUND = "train.round"
# The round of a masked result under --secure-aggregation secagg (aggregators/secagg.py): its masks are that round's.
SECAGG_ROUND = "secagg.round"

# Server -> client: round bookkeeping broadcast with the global model.
ROUND = "server.round"
NUM_ROUNDS = "server.num_rounds"
AGGREGATION_RULE = "server.rule"
RUN_ID = "server.run_id"  # identifies one run of a job: client state from another run is never reused
# {site: last round whose aggregate included that site's result}: a site commits the state it wrote in its previous
# round only if that round is its entry, and discards it otherwise (transactional client state).
LAST_AGGREGATED = "server.last_aggregated"
# {site: last round in which the server received a result from that site, aggregated or not}: a DP site that has
# released anything keeps counting its privacy spend even when its ledger file is lost (it stops instead).
LAST_RELEASED = "server.last_released"
# {site: the DP-SGD steps (privacy.steps) of that site's last result the server received}: a DP site whose ledger
# holds fewer steps (restored from an old backup) stops instead of under-reporting its epsilon.
RELEASED_STEPS = "server.released_steps"

# SCAFFOLD (Karimireddy et al. 2020): global control c down, control change delta c_i up; fp32, trainable params only.
SCAFFOLD_CTRL_GLOBAL = "scaffold.ctrl.global"
SCAFFOLD_CTRL_DIFF = "scaffold.ctrl.diff"
# Diagnostics (scalars): a site's ||delta c_i|| and ||c_i|| after the round; the server's ||c|| per round.
SCAFFOLD_CTRL_DIFF_NORM = "scaffold.ctrl.diff_norm"
SCAFFOLD_CTRL_LOCAL_NORM = "scaffold.ctrl.local_norm"
SCAFFOLD_CTRL_GLOBAL_NORM = "scaffold.ctrl.global_norm"

# FedProx (Li et al. 2020): the proximal coefficient mu the client trained with, client -> server (for the logs).
FEDPROX_MU = "fedprox.mu"

# FedDyn (Acar et al. 2021): the global alpha, server -> client; the alpha_k the client actually used and the names of
# the trainable parameters its dynamic-regulariser state H_k covers, client -> server (the rest are buffers).
FEDDYN_ALPHA = "feddyn.alpha"
FEDDYN_ALPHA_K = "feddyn.alpha_k"
FEDDYN_PARAM_KEYS = "feddyn.param_keys"

# Attack simulation (lightning_modules/attacks.py), client -> server: whether this site altered its update or labels
# this round, and how. Experiments only: the attack-adaptive rule reads it to label captured rounds, never to weight.
ATTACK_APPLIED = "attack.applied"
ATTACK_NAME = "attack.name"

# FedNova (Wang et al. 2020), client -> server: optimizer steps tau_i and the L1 norm of the local solver's
# gradient-weight vector a_i, in units of the round's first learning rate (docs/server_rules.md, FedNova).
FEDNOVA_TAU = "fednova.tau"
FEDNOVA_A_NORM = "fednova.a_norm"

# FedMoS (Wang et al. 2023): the client's momentum parameter a and proximal mu, client -> server (for the logs).
FEDMOS_A = "fedmos.a"
FEDMOS_MU = "fedmos.mu"

# MOON (Li, He, Song 2021), client -> server (for the logs): the contrastive weight mu and temperature, the number of
# negatives used, and how many of them were previous local models read from the site's history (0 = first
# participation: the received model stood in).
MOON_MU = "moon.mu"
MOON_TEMPERATURE = "moon.temperature"
MOON_NUM_NEGATIVES = "moon.num_negatives"
MOON_HISTORY_MODELS = "moon.history_models"

# Ditto (Li et al. 2021), client -> server (for the logs): the pull lam of the personal model towards the received
# global model, and the personal steps taken this round (the local-only baseline matches the site's compute with them).
DITTO_LAM = "ditto.lam"
DITTO_PERSONAL_STEPS = "ditto.personal_steps"

# APFL (Deng, Kamani, Mahdavi 2020), client -> server: the site's mixing weight alpha after the round (learned from the
# site's data: withheld under DP, where APFL is refused anyway) and the personal steps taken this round.
APFL_ALPHA = "apfl.alpha"
APFL_PERSONAL_STEPS = "apfl.personal_steps"

# Sample-level DP-SGD at the site (lightning_modules/privacy/), client -> server: the site's epsilon over every DP-SGD
# step it has taken in this run (its ledger), at delta, and what it was computed from (the last noise multiplier and
# sample rate, the cumulative steps, the clipping norm C); ``privacy.withheld``: the names of the data-dependent
# statistics the site held back this round because DP does not protect them (docs/privacy.md).
PRIVACY_EPSILON = "privacy.epsilon"
PRIVACY_DELTA = "privacy.delta"
PRIVACY_NOISE_MULTIPLIER = "privacy.noise_multiplier"
PRIVACY_SAMPLE_RATE = "privacy.sample_rate"
PRIVACY_STEPS = "privacy.steps"
PRIVACY_MAX_GRAD_NORM = "privacy.max_grad_norm"
PRIVACY_WITHHELD = "privacy.withheld"
#: A DP site's budget (dp_target_epsilon) and the epsilon its next round would reach: the server stops sending it
#: rounds it cannot afford, before it trains (controllers/budget.py).
PRIVACY_TARGET_EPSILON = "privacy.target_epsilon"
PRIVACY_NEXT_EPSILON = "privacy.next_round_epsilon"
#: Items a DP site sends although no epsilon covers them, because the job says so (``--dp-release-site-scores``).
PRIVACY_UNACCOUNTED = "privacy.unaccounted"

# NVFlare's own reserved keys: never sent by this bundle (a test pins it).
NVFLARE_RESERVED = ("scaffold_c_global", "scaffold_c_diff", "fedprox_mu")


def eval_key(metric: str) -> str:
    """``eval.<metric>``: a site's score of the global model it received, on its own validation split."""
    return f"eval.{metric}"


def eval_metric(key: str) -> str | None:
    """The metric name of an ``eval.<metric>`` key, else ``None``."""
    return key[len("eval.") :] if key.startswith("eval.") and len(key) > len("eval.") else None


def privacy_of(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A DP site's ``privacy.*`` scalars without the prefix (``epsilon``, ``delta``, ``noise_multiplier``,
    ``sample_rate``, ``steps``, ``max_grad_norm``): the ``privacy`` entry of a round's metrics line."""
    prefix = "privacy."
    return {
        key[len(prefix) :]: value
        for key, value in meta.items()
        if key.startswith(prefix) and key != PRIVACY_WITHHELD and isinstance(value, int | float)
    }


def is_namespaced(key: str) -> bool:
    """True when ``key`` has the ``namespace.name`` form this bundle uses for everything it sends."""
    head, sep, tail = key.partition(".")
    return bool(head) and bool(sep) and bool(tail)
