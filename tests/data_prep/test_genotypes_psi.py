"""A person enrolled at two sites found by private set intersection on genotype fingerprints, and counted once by
the federated QC (data_prep/genotypes/fingerprint.py, psi.py). The intersection is NVFlare's own DH-PSI client and
server classes (the ones its DhPSITaskHandler runs at each site) in process; the slow test runs the exported pair
job in ``nvflare simulator``. Before these modules the QC counted a duplicated person twice (a review counted 120 people
for 109 distinct)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from math import comb
from pathlib import Path

import numpy as np
import pytest

from data_prep.errors import DataPrepError
from data_prep.genotypes.fingerprint import false_match_probability, fingerprint_panel, matched_people
from data_prep.genotypes.psi import counted_once, export_psi_jobs, person_items, record_shared_people
from data_prep.genotypes.qc import genotype_counts

N_SNPS, N_PEOPLE = 200, 30
SNPS = [f"rs{j}" for j in range(N_SNPS)]
CHROMS = [str(1 + j % 22) for j in range(N_SNPS)]
SETTINGS = (8, 16, 3)  # the defaults: 8 sub-panels of 16 SNPs, 3 to match


def cohort(seed: int) -> np.ndarray:
    """People x SNPs of unrelated people, allele frequency 0.5 (Hardy-Weinberg)."""
    return np.random.default_rng(seed).binomial(2, 0.5, size=(N_PEOPLE, N_SNPS)).astype(np.int8)


def two_sites(discordant: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Site 1 and site 2, distinct people, except site 2's person 7, who is site 1's person 3 with ``discordant``
    calls changed, each in another sub-panel."""
    site_1, site_2 = cohort(1), cohort(2)
    site_2[7] = site_1[3]
    panel = fingerprint_panel(SNPS, CHROMS, *SETTINGS)
    for k in range(discordant):
        column = panel.columns[k][0]
        site_2[7, column] = (site_2[7, column] + 1) % 3
    return site_1, site_2


def dh_psi(items_a: list[str], items_b: list[str]) -> tuple[list[str], list[str]]:
    """Each site's view of the intersection through NVFlare's DH-PSI classes, in the order NVFlare's workflow runs
    them for two sites (forward pass, then the backward pass to the other site)."""
    pytest.importorskip("private_set_intersection")
    from nvflare.app_opt.psi.dh_psi.dh_psi_client import PSIClient

    from data_prep.genotypes.psi_site import ExactPSIServer  # what the bundle's PSI job runs

    def one_way(server_items: list[str], client_items: list[str]) -> list[str]:
        server, client = ExactPSIServer(server_items, 1e-11), PSIClient(client_items)
        client.receive_setup(server.setup(len(client_items)))
        return client.get_intersection(server.process_request(client.get_request(client_items)))

    at_b = one_way(items_a, items_b)
    return one_way(at_b, items_a), at_b


def found(discordant: int) -> tuple[list[int], list[int]]:
    site_1, site_2 = two_sites(discordant)
    panel, people_1, items_1 = person_items(site_1, SNPS, CHROMS, *SETTINGS)
    _, people_2, items_2 = person_items(site_2, SNPS, CHROMS, *SETTINGS)
    seen_1, seen_2 = dh_psi(items_1, items_2)
    assert sorted(seen_1) == sorted(seen_2)  # both sites hold the same intersection
    return matched_people(people_1, seen_1, panel.min_panels), matched_people(people_2, seen_2, panel.min_panels)


@pytest.mark.parametrize("discordant", [0, 1, 2, 5])
def test_a_person_at_two_sites_is_found_and_nobody_else(discordant: int) -> None:
    assert found(discordant) == ([3], [7])


def test_more_discordant_sub_panels_than_the_rule_allows_are_not_a_match() -> None:
    assert found(6) == ([], [])  # 6 of 8 sub-panels differ: 2 shared fingerprints, 3 needed


def test_a_missing_call_gives_no_fingerprint_for_its_sub_panel() -> None:
    genotypes = cohort(1)[:2].copy()
    genotypes[1] = genotypes[0]
    panel = fingerprint_panel(SNPS, CHROMS, *SETTINGS)
    genotypes[1, [panel.columns[0][0], panel.columns[1][3]]] = 3
    _, people, items = person_items(genotypes, SNPS, CHROMS, *SETTINGS)
    assert len(people[0]) == 8 and len(people[1]) == 6 and len(items) == 8  # 6 shared items, one list


def test_the_panel_is_the_same_at_every_site_and_autosomal() -> None:
    chroms = ["X" if j % 5 == 0 else c for j, c in enumerate(CHROMS)]
    panel = fingerprint_panel(SNPS, chroms, *SETTINGS)
    assert panel == fingerprint_panel(list(SNPS), list(chroms), *SETTINGS)
    used = [j for columns in panel.columns for j in columns]
    assert len(set(used)) == 128 and all(chroms[j] != "X" for j in used)
    with pytest.raises(DataPrepError, match=r"the SNP table has 100 autosomal SNPs, the panel needs 8 x 16 = 128"):
        fingerprint_panel(SNPS[:100], CHROMS[:100], *SETTINGS)


def test_the_false_match_rate_in_closed_form() -> None:
    q = 0.375**16  # s(0.5) = 1/16 + 1/4 + 1/16 per SNP, 16 SNPs a sub-panel
    expected = sum(comb(8, k) * q**k * (1 - q) ** (8 - k) for k in range(3, 9))
    assert false_match_probability([[0.5] * 16] * 8, 3) == pytest.approx(expected, rel=1e-6)
    s = 0.8**4 + 4 * 0.04 * 0.64 + 0.2**4
    assert false_match_probability([[0.2]] * 2, 1) == pytest.approx(1 - (1 - s) ** 2, rel=1e-9)


def test_the_qc_counts_a_shared_person_once(tmp_path: Path) -> None:
    site_1, site_2 = two_sites(discordant=1)
    samples_1, samples_2 = [f"a{i}" for i in range(N_PEOPLE)], [f"b{i}" for i in range(N_PEOPLE)]
    panel = fingerprint_panel(SNPS, CHROMS, *SETTINGS)
    record_shared_people(tmp_path / "site-1.json", "site-2", ["a3"], panel)
    record_shared_people(tmp_path / "site-2.json", "site-1", ["b7"], panel)
    kept_1 = counted_once("site-1", site_1, samples_1, tmp_path / "site-1.json")
    kept_2 = counted_once("site-2", site_2, samples_2, tmp_path / "site-2.json")
    assert len(kept_1) == N_PEOPLE and len(kept_2) == N_PEOPLE - 1  # the later-named site leaves them out
    total = genotype_counts(kept_1) + genotype_counts(kept_2)
    assert total[0].sum() == 2 * N_PEOPLE - 1  # people counted at the first SNP: 59 for 59 distinct (was 60)
    np.testing.assert_array_equal(total, genotype_counts(np.vstack([site_1, np.delete(site_2, 7, axis=0)])))
    assert counted_once("site-2", site_2, samples_2, tmp_path / "none.json") is site_2  # no PSI run: all counted


def test_a_shared_people_file_of_other_people_is_refused(tmp_path: Path) -> None:
    panel = fingerprint_panel(SNPS, CHROMS, *SETTINGS)
    record_shared_people(tmp_path / "shared.json", "site-1", ["zz9"], panel)
    with pytest.raises(DataPrepError, match=r"site-2: .*shared\.json lists 'zz9' as also at site-1, but this site's "
                       r"genotype file has no such person"):  # fmt: skip
        counted_once("site-2", cohort(2), [f"b{i}" for i in range(N_PEOPLE)], tmp_path / "shared.json")


def test_one_job_per_pair_of_sites(tmp_path: Path) -> None:
    jobs = export_psi_jobs(tmp_path, ["site-3", "site-1", "site-2"])
    assert [job.name for job in jobs] == [
        "genotype_psi_site-1__site-2", "genotype_psi_site-1__site-3", "genotype_psi_site-2__site-3"]  # fmt: skip
    meta = json.loads((jobs[0] / "meta.json").read_text())
    assert sorted(meta["deploy_map"]) == ["app_server", "app_site-1", "app_site-2"]
    with pytest.raises(DataPrepError, match=r"need at least two distinct site names"):
        export_psi_jobs(tmp_path, ["site-1"])


def simulate(job: Path, workspace: Path, env: dict[str, str]) -> None:
    nvflare = Path(sys.executable).with_name("nvflare")
    done = subprocess.run(
        [str(nvflare), "simulator", str(job), "-w", str(workspace), "-n", "2", "-t", "2", "-c", "site-1,site-2"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def write_pair_sites(tmp_path: Path) -> dict[str, str]:
    """``two_sites(discordant=2)`` as site-1's and site-2's VCF files and a SNP table; the sites' environment."""
    from data_prep.genotypes.writers import Sites, write_genotype_file

    site_1, site_2 = two_sites(discordant=2)
    sites = Sites(CHROMS, [1000 * (j + 1) for j in range(N_SNPS)], SNPS, ["A"] * N_SNPS, ["G"] * N_SNPS)
    write_genotype_file(tmp_path / "site-1.vcf", site_1, [f"a{i}" for i in range(N_PEOPLE)], sites)
    write_genotype_file(tmp_path / "site-2.vcf", site_2, [f"b{i}" for i in range(N_PEOPLE)], sites)
    table = tmp_path / "table.csv"
    table.write_text("snp,chrom,pos,ref,alt\n" + "".join(
        f"{s},{c},{1000 * (j + 1)},A,G\n" for j, (s, c) in enumerate(zip(SNPS, CHROMS, strict=True))))  # fmt: skip
    env = os.environ | {"FEDALG_SITE_GENOTYPES": str(tmp_path / "{site}.vcf"), "FEDALG_SNP_TABLE": str(table),
                        "FEDALG_SHARED_PEOPLE": str(tmp_path / "{site}_shared.json")}  # fmt: skip
    return env


@pytest.mark.slow
def test_the_pair_job_in_the_simulator_finds_the_shared_person_and_the_qc_counts_them_once(tmp_path: Path) -> None:
    pytest.importorskip("private_set_intersection")
    pytest.importorskip("cyvcf2")
    from data_prep.genotypes.cli import main

    env = write_pair_sites(tmp_path)
    (job,) = export_psi_jobs(tmp_path / "jobs", ["site-1", "site-2"])
    simulate(job, tmp_path / "psi_ws", env)
    shared = {
        site: json.loads((tmp_path / f"{site}_shared.json").read_text())["shared"] for site in ("site-1", "site-2")
    }
    assert shared == {"site-1": {"site-2": ["a3"]}, "site-2": {"site-1": ["b7"]}}
    assert main(["qc-job", "--output-dir", str(tmp_path / "jobs"), "--num-sites", "2", "--min-site-people", "10"]) == 0
    simulate(tmp_path / "jobs" / "genotype_qc", tmp_path / "qc_ws", env)
    report = json.loads((tmp_path / "qc_ws" / "server" / "simulate_job" / "qc_report.json").read_text())
    assert report["people"] == 2 * N_PEOPLE - 1  # 59 distinct people (was 60: the shared person counted twice)


def test_the_exact_server_never_adds_an_item_the_bloom_filter_adds() -> None:
    """NVFlare's Bloom-filter setup message gave the client an item the server did not hold in 3-12 of 300 runs
    (psi_site's docstring: 1-4 %, so 60 runs show one with probability 0.45-0.9); the bundle's raw setup must give the
    exact intersection every run."""
    pytest.importorskip("private_set_intersection")
    import hashlib

    from nvflare.app_opt.psi.dh_psi.dh_psi_client import PSIClient

    from data_prep.genotypes.psi_site import ExactPSIServer

    def items(tag: str, n: int) -> list[str]:
        return [hashlib.sha256(f"{tag}{i}".encode()).hexdigest() for i in range(n)]

    shared = items("s", 6)
    server_items, client_items = shared + items("a", 234), shared + items("b", 234)
    for _ in range(60):
        server, client = ExactPSIServer(server_items, 1e-11), PSIClient(client_items)
        client.receive_setup(server.setup(len(client_items)))
        assert sorted(client.get_intersection(server.process_request(client.get_request(client_items)))) == sorted(
            shared
        )
