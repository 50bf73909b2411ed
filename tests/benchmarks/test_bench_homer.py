"""benchmarks/homer.py plays the attacker: Homer's statistic on a hand case (closed form), the AUC and TPR helpers
on hand scores, and the attack finding the members of a small site (so it detects leakage where there is some)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.homer import auc, homer_statistic, main, pool_frequencies, run_cell, tpr_at_fpr
from data_prep.genotypes.qc import genotype_counts

REFERENCE = np.array([0.3, 0.2, 0.6])


def test_the_statistic_on_three_snps_matches_the_closed_form() -> None:
    y = np.array([[0, 1, 2]])  # halves: 0, 0.5, 1
    pool = np.array([0.1, 0.5, 0.8])
    # (0.3 - 0.1) + (0.3 - 0) + (0.4 - 0.2)
    assert homer_statistic(y, pool, REFERENCE)[0] == pytest.approx(0.7, abs=1e-6)


def test_the_statistic_reads_the_pool_from_a_sites_counts() -> None:
    site = np.array([[0, 1, 2], [0, 1, 1]], np.int8)
    pool = pool_frequencies(genotype_counts(site))
    np.testing.assert_allclose(pool, [0.0, 0.5, 0.75], atol=1e-12)
    # person 0: (0.3 - 0) + (0.3 - 0) + (0.4 - 0.25); person 1 (halves 0, 0.5, 0.5): 0.3 + 0.3 + (0.1 - 0.25)
    np.testing.assert_allclose(homer_statistic(site, pool, REFERENCE), [0.75, 0.45], atol=1e-6)


def test_a_one_person_site_gives_the_largest_possible_score_and_unknown_terms_count_zero() -> None:
    y = np.array([[0.0, 1.0, 2.0]])
    assert homer_statistic(y, y[0] / 2, REFERENCE)[0] == pytest.approx(0.3 + 0.3 + 0.4, abs=1e-6)
    missing = np.array([[0.0, np.nan, 2.0]])
    assert homer_statistic(missing, np.array([0.1, 0.5, 0.8]), REFERENCE)[0] == pytest.approx(0.4, abs=1e-6)


def test_auc_counts_ties_half_and_tpr_uses_the_non_members_quantile() -> None:
    assert auc(np.array([3.0, 2.0]), np.array([1.0, 2.0])) == pytest.approx(3.5 / 4)
    assert auc(np.array([5.0]), np.array([1.0, 2.0, 3.0])) == 1.0
    non_members = np.arange(100.0)  # the 99th percentile ("higher") is 99: nobody strictly above it
    assert tpr_at_fpr(np.array([99.0, 100.0, 150.0, 0.0]), non_members) == pytest.approx(0.5)


@pytest.mark.parametrize("site_people", [1, 5])
def test_the_attack_finds_the_members_of_a_small_site(site_people: int) -> None:
    cell = run_cell(2_000, site_people, seed=0, members=40, non_members=200, reference=200)
    assert cell.auc > 0.99 and cell.tpr > 0.9


def test_the_attack_is_near_chance_when_the_site_dwarfs_the_snps() -> None:
    cell = run_cell(20, 2_000, seed=0, members=2_000, non_members=400, reference=400)
    assert 0.4 < cell.auc < 0.65


def test_the_command_prints_a_table_and_writes_it(tmp_path, capsys) -> None:
    out = tmp_path / "homer.md"
    argv = ["--snps", "50", "--site-people", "1", "20", "--seeds", "0", "1", "--members", "20"]
    argv += ["--non-members", "50", "--reference", "50", "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    assert "`python -m benchmarks.homer --snps 50 --site-people 1 20" in text
    assert "| 50 | 1 | 1.000 [1.000-1.000] |" in text and "| 50 | 20 |" in text
    assert text in capsys.readouterr().out + "\n"


def test_help_and_bad_settings(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "--site-people" in capsys.readouterr().out
    assert main(["--site-people", "0"]) == 2
    assert "--site-people out of range" in capsys.readouterr().out
