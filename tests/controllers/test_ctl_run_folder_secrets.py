"""The run folder keeps no secret: DP-FedAvg's noise seed is never written where the model and
the records go, so whoever is handed a finished run folder cannot regenerate a round's noise and subtract it.

The attack: run a short DP-FedAvg job through the real controller (NVFlare's engine faked in-process, the harness of
tests/controllers/test_ctl_resume.py, with the OS's secret seed and every record the controller can write: the model,
the rule state, the metrics, the client-update captures), then read every file of the run folder and try every
integer found there as the seed: in decimal text, as every 8-byte little-endian word of the raw bytes, and every
integer inside the torch payloads. A candidate strips the noise if the update noise it regenerates for the last
round matches the noise actually added, which the test knows from the sites' updates it computed itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from aggregators import dp_fedavg
from aggregators.dp_fedavg import _UPDATE_NOISE, clip_factors
from controllers.checkpoint import GLOBAL_MODEL_FILE
from controllers.fedalg_controller import STATE_FILE
from tests.controllers.test_ctl_resume import FakeEngineController, client_result

ROUNDS, SAMPLED, CLIP, Z = 3, 2, 0.5, 1.0
KEY = "conv.weight"  # the one trainable entry of the harness's model (the others are buffers the rule keeps)
SETTINGS = {
    "server": "dp_fedavg",
    "server_args": {"noise_multiplier": Z, "clip_norm": CLIP, "adaptive": False},
    "clients_per_round": SAMPLED,
    "save_client_updates": True,
}


class RecordingController(FakeEngineController):
    """The harness, also keeping the global model each round sent (what the test needs to know the true noise)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent_params: list[dict[str, np.ndarray]] = []

    def send_model_and_wait(self, targets, data, min_responses=None, timeout=0):
        self.sent_params.append({k: np.array(v, copy=True) for k, v in data.params.items()})
        return super().send_model_and_wait(targets, data, min_responses, timeout)


def ints_in(value: object) -> Iterator[int]:
    """Every integer inside a loaded payload (nested mappings, sequences, integer tensors)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, torch.Tensor) and not value.is_floating_point():
        yield from (int(v) for v in value.flatten().tolist())
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from ints_in(key)
            yield from ints_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from ints_in(item)


def seed_candidates(run_dir: Path) -> set[int]:
    """Every integer an attacker reading every file of ``run_dir`` could try as the seed."""
    candidates: set[int] = set()
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert files
    for path in files:
        raw = path.read_bytes()
        candidates.update(int(token) for token in re.findall(rb"\d+", raw))
        words = np.frombuffer(raw[: len(raw) - len(raw) % 8], dtype="<u8") if len(raw) >= 8 else np.array([])
        for shift in range(1, 8):  # every alignment of the 8-byte windows
            tail = raw[shift:]
            words = np.concatenate([words, np.frombuffer(tail[: len(tail) - len(tail) % 8], dtype="<u8")])
        candidates.update(int(w) for w in words)
        if path.suffix == ".pt":
            candidates.update(ints_in(torch.load(path, weights_only=True)))
    return {c for c in candidates if 0 <= c < 2**64}


def last_round_noise(ctl: RecordingController, final: Mapping[str, np.ndarray]) -> np.ndarray:
    """The noise the rule added to the mean in the last round: released mean minus the clipped mean of the sampled
    sites' updates (recomputed from the deterministic sites of the harness)."""
    x = ctl.sent_params[-1]
    round_num = ROUNDS - 1
    deltas = [
        client_result(site, round_num, x, ctl.sent_meta[-1]).params[KEY].astype(np.float64) - x[KEY]
        for site in ctl.sent_targets[-1]
    ]
    factors = clip_factors(np.array([np.linalg.norm(d) for d in deltas]), CLIP)
    clipped_mean = sum(f * d for f, d in zip(factors, deltas, strict=True)) / SAMPLED
    return final[KEY].astype(np.float64) - x[KEY] - clipped_mean


def regenerated_noise(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """The last round's update noise on the mean that ``seed`` would give (the rule's stream of (seed, round))."""
    rng = np.random.default_rng([seed, ROUNDS - 1, _UPDATE_NOISE])
    return rng.normal(0.0, Z * CLIP / SAMPLED, size=shape)


def finished_run(run_dir: Path) -> np.ndarray:
    """Run the job into ``run_dir``; the noise its last round added to the mean."""
    ctl = RecordingController(run_dir / "app", num_rounds=ROUNDS, **SETTINGS)
    ctl.run()
    final = torch.load(run_dir / "app" / GLOBAL_MODEL_FILE, weights_only=True)["model"]
    return last_round_noise(ctl, {k: v.numpy() for k, v in final.items()})


def test_a_finished_dp_fedavg_run_folder_does_not_give_the_noise_away(tmp_path):
    run_dir = tmp_path / "run"
    noise = finished_run(run_dir)
    assert np.linalg.norm(noise) > 0.1  # there is noise to strip: z S / m = 0.25 per entry

    candidates = seed_candidates(run_dir)
    assert len(candidates) > 1000  # the attacker did read the files
    errors = [
        np.linalg.norm(noise - regenerated_noise(seed, noise.shape)) / np.linalg.norm(noise) for seed in candidates
    ]
    best = min(errors)
    assert best > 0.5, f"the noise was stripped from the run folder: relative error {best:.2e}"


def test_the_attack_strips_the_noise_when_the_seed_is_known(tmp_path, monkeypatch):
    """The attack is sound: with the seed the rule used (fixed in-process), it strips the noise to float32
    rounding, so the test above passes only because the run folder lacks the seed."""
    seed = dp_fedavg.secret_seed()
    monkeypatch.setattr(dp_fedavg, "secret_seed", lambda: seed)
    run_dir = tmp_path / "run"
    noise = finished_run(run_dir)
    error = np.linalg.norm(noise - regenerated_noise(seed, noise.shape)) / np.linalg.norm(noise)
    assert error < 1e-5
    assert (run_dir / "app" / STATE_FILE).is_file()  # the state is still checkpointed (resume), without the seed
