"""The HE cost benchmark's summary (benchmarks/secure_aggregation.py): round 1 apart, the recorder's own measuring
time taken out, results summed over the sites; the run itself is tests/e2e/test_e2e_secure_aggregation.py's."""

from __future__ import annotations

import pytest

from benchmarks.secure_aggregation import markdown, summarise


def _record(round_num: int, elapsed: float, measure: float, per_site: int, down: int | None) -> dict:
    sites = {"site-1": per_site, "site-2": per_site}
    return {"round": round_num, "elapsed_s": elapsed, "measure_s": measure, "result_bytes": sites, "global_bytes": down}


def test_the_summary_keeps_round_one_apart_and_takes_the_measuring_out():
    runs = {
        "plain": [[_record(0, 5.0, 0.0, 100, 50), _record(1, 1.0, 0.0, 100, 50), _record(2, 1.2, 0.0, 100, 50)]],
        "he": [[_record(0, 8.0, 1.0, 1000, 50), _record(1, 2.5, 0.5, 1000, 400), _record(2, 2.5, 0.5, 1000, 400)]],
    }
    summary = summarise(runs)
    assert summary["plain"]["first_round_s"] == 5.0 and summary["he"]["first_round_s"] == 7.0
    assert summary["plain"]["later_round_s"] == pytest.approx(1.1) and summary["he"]["later_round_s"] == 2.0
    assert summary["he"]["result_bytes_per_round"] == 2000 and summary["he"]["global_bytes_per_round"] == 400
    text = markdown(summary, {"num_rounds": 3}, {"he_vs_plain": 1e-7, "plain_vs_plain": 2e-8})
    assert "| later rounds, s per round | 1.1 | 2 | 1.8x |" in text and "1.00e-07" in text


def test_a_models_table_replaces_its_own_section_and_keeps_the_others():
    from benchmarks.secure_aggregation import replace_section

    lenet, genomics = "## lenet5\n\nold\n", "## genomics.model:SnpClassifier\n\nG\n"
    assert replace_section("Settings: ...\n\n| table |\n", lenet) == lenet  # an older file without headings
    both = replace_section(lenet, genomics)
    assert both == f"{lenet}\n{genomics}"
    assert replace_section(both, "## lenet5\n\nnew\n") == f"## lenet5\n\nnew\n\n{genomics}"
    assert replace_section(f"# Results\n\n{lenet}", genomics) == f"# Results\n\n{lenet}\n{genomics}"


def test_secaggs_stage_cost_is_summarised_from_the_later_rounds_and_shown_beside_plain():
    def secagg(round_num: int, setup: float) -> dict:
        cost = {"setup_s": setup, "unmask_s": 0.2, "up_bytes": 30, "down_bytes": 40}
        return {**_record(round_num, 2.0, 0.0, 150, 50), "secagg": cost}

    runs = {
        "plain": [[_record(0, 5.0, 0.0, 100, 50), _record(1, 1.0, 0.0, 100, 50), _record(2, 1.0, 0.0, 100, 50)]],
        "secagg": [[secagg(0, 9.0), secagg(1, 0.5), secagg(2, 0.7)]],
    }
    summary = summarise(runs)
    assert summary["secagg"]["stage_setup_s"] == pytest.approx(0.6)  # round 1's start-up left out
    assert summary["plain"]["stage_setup_s"] == 0.0
    text = markdown(summary, {"num_rounds": 3}, {"secagg_vs_plain": 1e-6, "plain_vs_plain": 2e-8})
    assert "| | plain | secagg | secagg / plain |" in text
    assert "| results up (all sites), MB per round | 0.0002 | 0.0003 | 1.5x |" in text
    assert "| of which SecAgg+ key set-up (advertise, share keys), s per round | 0 | 0.6 | - |" in text
    assert "a SecAgg+ job's and a plain job's 1.00e-06" in text and "ciphertexts" not in text
