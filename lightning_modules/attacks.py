"""Simulated malicious clients: what a Byzantine site does to the update it sends, or to its labels.

For robustness experiments only (the attack-adaptive pretraining data and benchmarks/robustness.py). A site is
malicious when it is in the job's malicious set; from ``start_round`` on (0-based, as NVFlare counts rounds) it
replaces its honest update Delta = y - x (trainable parameters only, buffers untouched) by

* ``sign_flip``   Delta' = -s * Delta              (s = strength, default 4: a boosted reversed step)
* ``scale``       Delta' =  s * Delta              (s = strength, default 10: a boosted update)
* ``gaussian``    Delta' =  Delta + s * N(0, I)    (s = noise std, default 0.3; seeded per site and round)

or, for ``label_flip``, trains honestly on flipped labels c -> C - 1 - c (strength unused). The attacked update
is sent as the model x + Delta'. The site reports ``attack.applied`` / ``attack.name`` in its meta (used only to
label captured rounds; aggregation rules never read it).

Math in pure functions; the Lightning glue is `lightning_modules.attack_callback.AttackCallback`, in a module of its
own so that building a job (which resolves the attacked sites here) never imports Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

UPDATE_ATTACKS = ("sign_flip", "scale", "gaussian")
ATTACKS = ("none", *UPDATE_ATTACKS, "label_flip")
DEFAULT_STRENGTH = {"none": 0.0, "sign_flip": 4.0, "scale": 10.0, "gaussian": 0.3, "label_flip": 0.0}


def sign_flip(delta: Tensor, strength: float) -> Tensor:
    return -strength * delta


def scale(delta: Tensor, strength: float) -> Tensor:
    return strength * delta


def gaussian(delta: Tensor, strength: float, generator: torch.Generator) -> Tensor:
    noise = torch.randn(delta.shape, generator=generator, dtype=delta.dtype)
    return delta + strength * noise


def flip_labels(labels: np.ndarray, num_classes: int) -> np.ndarray:
    """c -> C - 1 - c (a fixed permutation without fixed points for even C); returns a new array."""
    labels = np.asarray(labels)
    return (num_classes - 1 - labels).astype(labels.dtype)


def attack_update(
    name: str, deltas: Mapping[str, Tensor], strength: float, generator: torch.Generator
) -> dict[str, Tensor]:
    """The attacked deltas for an update attack (key order kept, so the noise draw order is deterministic)."""
    if name == "sign_flip":
        return {key: sign_flip(d, strength) for key, d in deltas.items()}
    if name == "scale":
        return {key: scale(d, strength) for key, d in deltas.items()}
    if name == "gaussian":
        return {key: gaussian(d, strength, generator) for key, d in deltas.items()}
    raise ValueError(f"'{name}' is not an update attack; choose one of {UPDATE_ATTACKS}")


def choose_malicious_sites(num_sites: int, fraction: float, seed: int) -> tuple[str, ...]:
    """fraction * N (rounded half up) of site-1..site-N, drawn with ``seed`` (sorted by index)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"malicious fraction must be in [0, 1], got {fraction}")
    count = math.floor(fraction * num_sites + 0.5)  # half up, not Python's round-half-even
    chosen = np.random.default_rng(seed).choice(num_sites, size=count, replace=False)
    return tuple(f"site-{i + 1}" for i in sorted(chosen.tolist()))


@dataclass(frozen=True)
class AttackConfig:
    """Which sites attack, how, how hard, from which round (0-based). ``strength=None`` takes the attack's default."""

    name: str = "none"
    malicious_sites: tuple[str, ...] = ()
    strength: float | None = None
    start_round: int = 0
    seed: int = 0
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.name not in ATTACKS:
            raise ValueError(f"unknown attack '{self.name}'; choose one of {list(ATTACKS)}")
        if self.start_round < 0:
            raise ValueError(f"attack start round must be >= 0, got {self.start_round}")
        if self.strength is not None and not np.isfinite(self.strength):
            raise ValueError(f"attack strength must be finite, got {self.strength}")
        object.__setattr__(self, "malicious_sites", tuple(self.malicious_sites))

    @property
    def effective_strength(self) -> float:
        return DEFAULT_STRENGTH[self.name] if self.strength is None else float(self.strength)

    def active(self, site: str, round_num: int) -> bool:
        return self.name != "none" and site in self.malicious_sites and round_num >= self.start_round

    def generator(self, site_index: int, round_num: int) -> torch.Generator:
        """The noise stream of one site and round (reruns draw the same noise)."""
        seed = int(np.random.SeedSequence([self.seed, site_index, round_num, 6]).generate_state(1)[0])
        return torch.Generator().manual_seed(seed)


def attacked_params(
    params: Mapping[str, Tensor],
    global_params: Mapping[str, Tensor],
    config: AttackConfig,
    generator: torch.Generator,
) -> dict[str, Tensor]:
    """x + Delta' for every key of ``global_params`` (the trainable ones); other entries of ``params`` unchanged."""
    deltas = {key: params[key].detach() - global_params[key] for key in global_params}
    attacked = attack_update(config.name, deltas, config.effective_strength, generator)
    return {**params, **{key: global_params[key] + attacked[key] for key in global_params}}


def site_labels(labels: np.ndarray, config: AttackConfig, site: str, round_num: int) -> np.ndarray:
    """The labels a site trains on this round: flipped for an active label-flipping site, else unchanged."""
    if config.name == "label_flip" and config.active(site, round_num):
        return flip_labels(labels, config.num_classes)
    return labels


def parse_sites(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"site-2,site-5"`` (or a list) -> a tuple of names; empty/None -> ()."""
    if not text:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    return tuple(item.strip() for item in items if item.strip())


def add_attack_arguments(parser: Any) -> None:
    """The client script's attack options (experiments only; default: no attack)."""
    group = parser.add_argument_group("simulated attack (robustness experiments)")
    group.add_argument("--attack", default="none", choices=ATTACKS, help="what malicious sites do")
    group.add_argument("--attack-strength", type=float, default=None, help=f"default per attack: {DEFAULT_STRENGTH}")
    group.add_argument("--attack-start-round", type=int, default=0, help="first attacked round (0-based)")
    group.add_argument("--malicious-sites", default="", help="comma-separated site names that attack")


def attack_config_from_args(args: Any, num_classes: int) -> AttackConfig:
    return AttackConfig(
        name=args.attack,
        malicious_sites=parse_sites(args.malicious_sites),
        strength=args.attack_strength,
        start_round=args.attack_start_round,
        seed=args.seed,
        num_classes=num_classes,
    )


def resolve_malicious_sites(num_sites: int, fraction: float, explicit: str, seed: int) -> tuple[str, ...]:
    """The job's malicious set: the explicit comma-separated list if given, else a seeded share of the sites."""
    sites = parse_sites(explicit)
    if not sites:
        return choose_malicious_sites(num_sites, fraction, seed)
    valid = {f"site-{i + 1}" for i in range(num_sites)}
    unknown = [s for s in sites if s not in valid]
    if unknown:
        raise ValueError(f"malicious_sites {unknown} are not among site-1 .. site-{num_sites}")
    return tuple(sorted(set(sites), key=lambda s: int(s.split("-")[1])))


def attack_script_args(
    name: str, strength: float | None, start_round: int, sites: Sequence[str], num_sites: int
) -> list[str]:
    """The client-script options of an attack; none at all without one (job exports stay unchanged)."""
    if name not in ATTACKS:
        raise ValueError(f"unknown attack '{name}'; choose one of {list(ATTACKS)}")
    if name == "none":
        return []
    if not sites:
        raise ValueError(f"attack '{name}' needs malicious sites: set malicious_fraction or malicious_sites")
    if start_round < 0:
        raise ValueError(f"attack_start_round must be >= 0, got {start_round}")
    parts = [f"--attack {name}", f"--attack-start-round {start_round}", f"--malicious-sites {','.join(sites)}"]
    if strength is not None:
        parts.append(f"--attack-strength {strength}")
    return parts
