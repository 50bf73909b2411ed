"""The QC counts' noise mechanism (data_prep/genotypes/qc_noise.py) in closed form: one person's sensitivity, the
discrete Gaussian's law and scale, the settings' refusals, and what the noisy QC reads from a noisy sum."""

from __future__ import annotations

import math

import numpy as np
import pytest

from data_prep.errors import DataPrepError
from data_prep.genotypes.federated_qc import combine_counts
from data_prep.genotypes.qc import genotype_counts
from data_prep.genotypes.qc_noise import (
    DEFAULT_DELTA,
    QcNoise,
    discrete_gaussian,
    discrete_gaussian_pmf,
    l1_sensitivity,
    l2_sensitivity,
    noisy_counts,
    usable_counts,
)
from data_prep.genotypes.secure_qc import round_counts


def cohort(people: int, snps: int, seed: int) -> np.ndarray:
    """0/1/2 copies and missing (3) at random."""
    return np.random.default_rng(seed).integers(0, 4, size=(people, snps)).astype(np.int8)


@pytest.mark.parametrize("snps", [1, 127, 1_000])
def test_adding_or_removing_one_person_moves_the_counts_by_exactly_sqrt_s(snps: int) -> None:
    site = cohort(40, snps, seed=snps)
    person = cohort(1, snps, seed=snps + 1)
    change = genotype_counts(np.vstack([site, person])) - genotype_counts(site)
    assert math.isclose(float(np.linalg.norm(change)), l2_sensitivity(snps), rel_tol=0, abs_tol=1e-12)
    assert math.isclose(l2_sensitivity(snps), math.sqrt(snps), abs_tol=1e-12)
    assert int(np.abs(change).sum()) == l1_sensitivity(snps) == snps


@pytest.mark.parametrize("snps", [1, 127, 1_000])
def test_substituting_a_person_who_differs_everywhere_moves_them_by_sqrt_2s(snps: int) -> None:
    site = cohort(40, snps, seed=snps)
    other = site.copy()
    other[0] = (site[0] + 1) % 4  # another genotype state at every SNP
    change = genotype_counts(other) - genotype_counts(site)
    assert math.isclose(float(np.linalg.norm(change)), l2_sensitivity(snps, "substitution"), abs_tol=1e-12)
    assert math.isclose(l2_sensitivity(snps, "substitution"), math.sqrt(2 * snps), abs_tol=1e-12)
    assert int(np.abs(change).sum()) == l1_sensitivity(snps, "substitution") == 2 * snps


def test_no_single_person_moves_the_counts_further_than_the_bound() -> None:
    rng = np.random.default_rng(0)
    site = cohort(30, 50, seed=1)
    for _ in range(200):
        other = site.copy()
        other[rng.integers(30)] = rng.integers(0, 4, size=50)
        assert np.linalg.norm(genotype_counts(other) - genotype_counts(site)) <= l2_sensitivity(50, "substitution")
        assert np.linalg.norm(genotype_counts(site[1:]) - genotype_counts(site)) <= l2_sensitivity(50) + 1e-12


@pytest.mark.parametrize("sigma", [0.7, 1.0, 3.0, 25.0])
def test_the_pmf_is_the_normalised_gaussian_on_the_integers_with_variance_sigma_squared(sigma: float) -> None:
    support = np.arange(-math.ceil(40 * sigma), math.ceil(40 * sigma) + 1)
    pmf = discrete_gaussian_pmf(support, sigma)
    assert math.isclose(pmf.sum(), 1.0, abs_tol=1e-12)
    assert math.isclose(pmf[support == 1][0] / pmf[support == 0][0], math.exp(-1 / (2 * sigma**2)), rel_tol=1e-12)
    # Its variance is below sigma^2 (Canonne et al. 2020 bound it), by a term of order exp(-2 pi^2 sigma^2): within
    # 1e-6 from sigma = 1 on, so the QC's sigmas (tens) are the noise's standard deviations
    variance = float((support**2 * pmf).sum())
    assert variance <= sigma**2 and (sigma < 1 or sigma**2 - variance < 1e-6 * sigma**2)


@pytest.mark.parametrize("sigma", [0.8, 2.5, 7.0])
def test_the_sampler_draws_the_discrete_gaussian(sigma: float) -> None:
    draws = discrete_gaussian((400_000,), sigma, np.random.default_rng(11))
    assert draws.dtype == np.int64
    values, counts = np.unique(draws, return_counts=True)
    expected = discrete_gaussian_pmf(values, sigma) * len(draws)
    # every value's count within 5 binomial standard errors of its expectation (seeded: deterministic)
    assert (np.abs(counts - expected) <= 5 * np.sqrt(expected) + 1).all()
    assert abs(draws.mean()) < 5 * sigma / math.sqrt(len(draws))


def test_noise_at_the_qcs_scale_has_the_stated_standard_deviation() -> None:
    sigma = 0.6 * math.sqrt(10_000)  # z = 0.6 at 10,000 SNPs: what epsilon 8 calibrates to
    counts = np.full((10_000, 4), 80, np.int64)
    noise = noisy_counts(counts, sigma, np.random.default_rng(5)) - counts
    # 40,000 draws: the sample standard deviation's relative standard error is 1/sqrt(2 n) = 0.35 %
    assert abs(noise.std() / sigma - 1) < 5 / math.sqrt(2 * noise.size)
    assert abs(noise.mean()) < 5 * sigma / math.sqrt(noise.size)


def test_noise_without_a_budget_is_refused_in_one_line() -> None:
    with pytest.raises(DataPrepError, match="without a privacy budget") as refused:
        QcNoise.from_options(1.0, None, None)
    assert "\n" not in str(refused.value) and "--dp-target-epsilon" in str(refused.value)


@pytest.mark.parametrize(
    ("z", "target", "delta", "what"),
    [(0.0, 1.0, None, "dp_noise_multiplier"), (None, -1.0, None, "dp_target_epsilon"), (None, 1.0, 1.0, "dp_delta")],
)
def test_settings_out_of_range_are_refused(z: float | None, target: float, delta: float | None, what: str) -> None:
    with pytest.raises(DataPrepError, match=what):
        QcNoise.from_options(z, target, delta)


def test_no_option_means_no_noise_and_the_default_delta_is_dp_sgds() -> None:
    assert QcNoise.from_options(None, None, None) is None
    assert QcNoise.from_options(None, 4.0, None) == QcNoise(None, 4.0, DEFAULT_DELTA) and DEFAULT_DELTA == 1e-5
    with pytest.raises(DataPrepError, match="--dp-delta without"):
        QcNoise.from_options(None, None, 1e-6)


def test_noisy_sums_pass_the_servers_and_the_he_sites_checks_and_the_filter_reads_them_at_zero() -> None:
    snps = ("rs0", "rs1")
    noisy = {"site-1": (snps, np.array([[-3, 5, 2, 0], [7, -1, 0, 1]])), "site-2": (snps, np.array([[1, 1, 1, 1]] * 2))}
    with pytest.raises(DataPrepError, match="site-1 sent counts of shape"):
        combine_counts(noisy)  # the exact path refuses negative counts
    _, total = combine_counts(noisy, noisy=True)
    np.testing.assert_array_equal(total, [[-2, 6, 3, 1], [8, 0, 1, 2]])
    np.testing.assert_array_equal(usable_counts(total), [[0, 6, 3, 1], [8, 0, 1, 2]])
    values = total.reshape(-1).astype(np.float64) + 1e-9
    with pytest.raises(DataPrepError, match="negative counts"):
        round_counts("site-3", values, 2)
    rounded, _ = round_counts("site-3", values, 2, noisy=True)
    np.testing.assert_array_equal(rounded, total)
    with pytest.raises(DataPrepError, match="from an integer"):
        round_counts("site-3", values + 0.3, 2, noisy=True)  # integer noise keeps the integrality check
