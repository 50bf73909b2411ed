"""A site's noisy QC release, accounted in its privacy ledger: the site-runtime half of ``genotypes.qc_noise``.

When a QC job adds noise (``qc-job --dp-target-epsilon``), the job's client script is ``qc_noise_site.py`` beside this
module, which runs the QC site (``federated_qc.site_main``) with `release_counts` as its release. Before a site's
counts leave it:

1. its ledger for this run is read (``ledger.read_ledger``: the site's state store, ``<root>/<job id>/<site>/``);
2. the noise multiplier z is the job's, or calibrated so that the release spends exactly the budget the ledger has
   left (``accountant.noise_for_budget`` at sample rate 1, one step);
3. a release that would take the ledger's epsilon above ``target_epsilon`` is refused (`QcBudgetExhausted`, one line,
   nothing sent);
4. the ledger with one more step (sample rate 1, z) is written, before anything is sent (the steps are spent
   whatever happens next, as in DP-SGD);
5. the noise is drawn from a generator seeded with the operating system's entropy (``secret.entropy_seed``, as
   DP-SGD's), never from the job's seed, and kept in memory only.

The accounting of the discrete Gaussian as a Gaussian mechanism step is argued in ``qc_noise``'s docstring: Opacus's
RDP analysis at q = 1 computes alpha / (2 z^2) per order, the curve the discrete Gaussian stays under.

A QC run's ledger is its own (ledgers are per run, as DP-SGD's): a training run after the QC starts a new ledger, so a
site's spend over both is the sum of the two runs' epsilons, which the bundle reports per run and does not add up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from aggregators.contracts import meta_keys
from data_prep.errors import DataPrepError
from data_prep.genotypes.qc_noise import QcNoise, l2_sensitivity, noisy_counts
from lightning_modules.privacy.accountant import AccountantUnavailable, noise_for_budget
from lightning_modules.privacy.ledger import Ledger, read_ledger, segments_text, write_ledger
from lightning_modules.privacy.secret import entropy_seed
from lightning_modules.state_store import ClientStateStore, default_state_root

__all__ = ["QC_SAMPLE_RATE", "QcBudgetExhausted", "QcRelease", "release_counts", "secret_rng", "site_main"]

#: A QC release uses every person's counts: the Gaussian mechanism without sampling.
QC_SAMPLE_RATE = 1.0


class QcBudgetExhausted(DataPrepError):
    """The release would take the site's epsilon beyond the job's budget: the site sends nothing."""


class QcRelease(dict):
    """What a site released, for its log and report: ``noise_multiplier``, ``sigma``, ``epsilon``, ``delta``, the
    ``l2_sensitivity`` and the ledger's file (never the draws)."""


def secret_rng() -> np.random.Generator:
    """A numpy generator seeded from the operating system's entropy (``secret.entropy_seed``), as DP-SGD's noise."""
    return np.random.default_rng(entropy_seed())


def release_counts(
    site: str,
    counts: np.ndarray,
    noise: QcNoise,
    store: ClientStateStore,
    run_id: str,
    rng: np.random.Generator | None = None,
) -> tuple[np.ndarray, QcRelease]:
    """The site's noisy counts and what they cost, after the ledger has recorded the spend (module docstring).
    ``rng`` is for tests of the distribution only; a site always draws from `secret_rng`."""
    store.use_run(run_id)
    meta = {meta_keys.RUN_ID: run_id, meta_keys.ROUND: 0}  # one release per run: a site that has none may start
    ledger = read_ledger(store, site, meta, noise.delta)
    try:
        z = _noise_multiplier(site, noise, ledger)
        after = ledger.spend(QC_SAMPLE_RATE, z, 1)
        spent_before, spent_after = ledger.epsilon(), after.epsilon()
    except AccountantUnavailable as exc:
        problem = f"federated QC: {site}: noisy counts are accounted by Opacus: {exc}; nothing sent"
        raise DataPrepError(problem) from None
    if not spent_after <= noise.target_epsilon * (1 + 1e-9):
        raise QcBudgetExhausted(
            f"federated QC: {site}: privacy budget: releasing its counts with noise multiplier {z:.4g} would take "
            f"epsilon from {spent_before:.4g} to {spent_after:.4g} > dp_target_epsilon "
            f"{noise.target_epsilon:g} (delta {noise.delta:g}; spent in this run: "
            f"{segments_text(ledger.segments) or 'nothing'}); raise --dp-target-epsilon or the noise multiplier, or "
            "leave the multiplier out to calibrate it; nothing sent"
        )
    write_ledger(store, after, 0)
    sensitivity = l2_sensitivity(len(counts))
    sigma = z * sensitivity
    noisy = noisy_counts(counts, sigma, secret_rng() if rng is None else rng)
    spent = {"noise_multiplier": z, "sigma": sigma, "l2_sensitivity": sensitivity, "epsilon": spent_after}
    return noisy, QcRelease(spent, delta=noise.delta, ledger=str(store.path("privacy")))


def _noise_multiplier(site: str, noise: QcNoise, ledger: Ledger) -> float:
    if noise.noise_multiplier is not None:
        return float(noise.noise_multiplier)
    try:
        return noise_for_budget(noise.target_epsilon, noise.delta, QC_SAMPLE_RATE, 1, spent=ledger.segments)
    except ValueError as exc:
        raise QcBudgetExhausted(f"federated QC: {site}: dp_target_epsilon: {exc}; nothing sent") from None


def site_main(argv: Sequence[str] | None = None) -> None:
    """The QC site with noise: ``federated_qc.site_main`` releasing through `release_counts`, with the site's state
    store and NVFlare's job id as the run."""
    import nvflare.client as flare

    from data_prep.genotypes.federated_qc import site_main as qc_site_main

    def release(site: str, counts: np.ndarray, noise: QcNoise) -> tuple[np.ndarray, dict[str, Any]]:
        store = ClientStateStore(default_state_root(), site, per_run=True)
        return release_counts(site, counts, noise, store, str(flare.get_job_id()))

    qc_site_main(argv, release=release)
