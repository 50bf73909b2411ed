"""The federated QC job's minimum site size: a site below ``min_site_people`` refuses before sending anything, the
server refuses such counts too (by site), a site exactly at the minimum passes, the setting travels in the exported
job, and the server uses only the sum of the counts and says that it sees each site's counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel

from data_prep.errors import DataPrepError
from data_prep.genotypes.federated_qc import (
    CLEAR_COUNTS_WARNING,
    QC_TABLE,
    GenotypeQcController,
    combine_counts,
    global_qc,
    site_main,
)
from data_prep.genotypes.qc import MIN_SITE_PEOPLE, QcThresholds, check_site_size, genotype_counts, implied_people
from tests.helpers import FakeFlare as InboxFlare

SNPS = ("rs0", "rs1", "rs2")
THRESHOLDS = QcThresholds(min_call_rate=0.9, min_maf=0.0)


def people(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 3, size=(n, len(SNPS))).astype(np.int8)


# ---- the setting ----------------------------------------------------------------------------------------------------


def test_a_one_person_site_is_refused_in_one_line_naming_site_count_and_setting() -> None:
    with pytest.raises(DataPrepError) as refused:
        check_site_size("site-7", 1, 50, "refused at the site")
    message = str(refused.value)
    assert "\n" not in message
    assert "site-7 has 1 person, below the job's min_site_people = 50" in message
    assert "allowed: 50 people or more" in message


def test_a_site_exactly_at_the_minimum_passes() -> None:
    check_site_size("site-1", 50, 50, "refused")  # no error
    check_site_size("site-1", 1, 1, "refused")


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "50"])
def test_a_minimum_that_is_not_a_whole_number_of_people_is_refused(bad: object) -> None:
    with pytest.raises(DataPrepError, match="min_site_people must be a whole number of people >= 1"):
        check_site_size("site-1", 100, bad, "refused")  # type: ignore[arg-type]


def test_the_counts_of_a_one_person_site_are_that_persons_genotypes() -> None:
    """Why the minimum exists: the trivial case of the membership attack needs no statistics at all."""
    person = people(1)[0]
    counts = genotype_counts(person[None, :])
    assert implied_people(counts) == 1
    np.testing.assert_array_equal(counts[:, :3].argmax(axis=1), person)


# ---- the server (defence in depth) ----------------------------------------------------------------------------------


def test_the_server_refuses_a_site_below_the_minimum_by_name() -> None:
    sites = {"site-1": (SNPS, genotype_counts(people(50))), "site-2": (SNPS, genotype_counts(people(1)))}
    with pytest.raises(DataPrepError) as refused:
        combine_counts(sites, min_site_people=50)
    assert "site-2 has 1 person, below the job's min_site_people = 50" in str(refused.value)
    assert "the server refuses its counts and writes nothing" in str(refused.value)


def test_the_server_accepts_sites_exactly_at_the_minimum_and_sums_them() -> None:
    a, b = people(50, seed=1), people(50, seed=2)
    snps, total = combine_counts({"site-1": (SNPS, genotype_counts(a)), "site-2": (SNPS, genotype_counts(b))}, 50)
    np.testing.assert_array_equal(total, genotype_counts(np.concatenate([a, b])))
    assert implied_people(total) == 100 and snps == SNPS


def test_counts_whose_rows_imply_different_people_are_refused_by_site() -> None:
    counts = genotype_counts(people(60))
    counts[1, 0] += 5  # SNP 1 claims 65 people
    with pytest.raises(DataPrepError, match=r"site-3 sent malformed counts: .*60 at SNP 0, 65 at SNP 1"):
        combine_counts({"site-3": (SNPS, counts)}, 50)


def test_the_filter_and_report_come_from_the_sum_only() -> None:
    a, b = people(60, seed=3), people(70, seed=4)
    total = genotype_counts(a) + genotype_counts(b)
    keep, report = global_qc(SNPS, total, THRESHOLDS, ["site-2", "site-1"], 50)
    pooled_keep, pooled_report = global_qc(SNPS, genotype_counts(np.concatenate([a, b])), THRESHOLDS, ["x", "y"], 50)
    np.testing.assert_array_equal(keep, pooled_keep)
    assert report["global_qc"] == pooled_report["global_qc"] and report["people"] == 130
    assert report["thresholds"]["min_site_people"] == 50
    # Sites by name, everything else from the sum: no per-site figure.
    assert set(report) == {"sites", "thresholds", "people", "table_snps", "kept_snps", "global_qc", "kept"}


class FakeRun:
    """Stands in for NVFlare around the controller: the sites' answers, the run folder and the log."""

    def __init__(self, tmp_path: Path, sites: dict[str, np.ndarray]) -> None:
        self.sites, self.run_dir, self.log = sites, tmp_path, []

    def attach(self, controller: GenotypeQcController) -> GenotypeQcController:
        controller.send_model_and_wait = self.send  # type: ignore[method-assign]
        controller.get_run_dir = lambda: str(self.run_dir)  # type: ignore[method-assign]
        controller.warning = lambda msg: self.log.append(("warning", msg))  # type: ignore[method-assign]
        controller.info = lambda msg: self.log.append(("info", msg))  # type: ignore[method-assign]
        controller.abort_signal = Signal()
        return controller

    def send(self, task_name: str, data: FLModel) -> list[FLModel]:
        if task_name != "qc_counts":
            return []
        return [
            FLModel(params={"counts": genotype_counts(g)}, meta={"client_name": site, "snps": list(SNPS)})
            for site, g in self.sites.items()
        ]


def test_the_controller_warns_that_it_sees_each_sites_counts_and_refuses_a_small_site(tmp_path: Path) -> None:
    fake = FakeRun(tmp_path, {"site-1": people(5), "site-2": people(1)})
    controller = fake.attach(GenotypeQcController(min_site_people=5))
    with pytest.raises(DataPrepError, match="site-2 has 1 person, below the job's min_site_people = 5"):
        controller.run()
    assert fake.log[0] == ("warning", CLEAR_COUNTS_WARNING)
    assert "visible to the server unless the deployment uses secure aggregation" in CLEAR_COUNTS_WARNING
    assert not (tmp_path / "qc_report.json").exists()


def test_the_controller_writes_the_report_when_every_site_is_large_enough(tmp_path: Path) -> None:
    fake = FakeRun(tmp_path, {"site-1": people(5), "site-2": people(6, seed=1)})
    fake.attach(GenotypeQcController(min_call_rate=0.9, min_maf=0.0, min_site_people=5)).run()
    report = json.loads((tmp_path / "qc_report.json").read_text())
    assert report["people"] == 11 and report["thresholds"]["min_site_people"] == 5


# ---- the site -------------------------------------------------------------------------------------------------------


class FakeFlare(InboxFlare):
    """The NVFlare client API as site_main uses it: one counts request, then one filter message."""

    def __init__(self, site: str) -> None:
        super().__init__(
            site,
            [
                FLModel(params={"none": np.zeros(1)}, meta={"step": "qc_counts"}),
                FLModel(params={"keep": np.ones(len(SNPS), np.int8)}, meta={"step": "qc_filter", "snps": list(SNPS)}),
            ],
        )


def write_npz(path: Path, genotypes: np.ndarray) -> Path:
    """A harmonised .npz of ``genotypes`` over SNPS, as ``python -m data_prep.genotypes harmonise`` writes it."""
    samples = np.array([f"{path.stem}-{i}" for i in range(len(genotypes))])
    np.savez(path, genotypes=genotypes, samples=samples, snps=np.array(SNPS), status=np.array(["same"] * len(SNPS)))
    return path


def write_table(folder: Path) -> Path:
    table = folder / "table.csv"
    table.write_text("snp,chrom,pos,ref,alt\n" + "".join(f"{s},1,{10 * (j + 1)},A,G\n" for j, s in enumerate(SNPS)))
    return table


def write_site(tmp_path: Path, genotypes: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The site's data and table, named by its environment; returns where its filtered table would go."""
    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(write_npz(tmp_path / "site.npz", genotypes)))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(write_table(tmp_path)))
    return tmp_path / "filtered.csv"


def test_a_one_person_site_refuses_before_sending_anything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = write_site(tmp_path, people(1), monkeypatch)
    flare = FakeFlare("site-9")
    flare.install(monkeypatch)
    with pytest.raises(DataPrepError) as refused:
        site_main(["--out", str(out)])  # the default minimum, MIN_SITE_PEOPLE
    assert str(refused.value).startswith(
        f"federated QC: site-9 has 1 person, below the job's min_site_people = {MIN_SITE_PEOPLE}"
    )
    assert "refused at the site, nothing sent or written" in str(refused.value)
    assert flare.sent == [] and len(flare.inbox) == 2 and not out.exists()


def test_a_site_exactly_at_the_minimum_sends_its_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    genotypes = people(4)
    out = write_site(tmp_path, genotypes, monkeypatch)
    flare = FakeFlare("site-1")
    flare.install(monkeypatch)
    site_main(["--out", str(out), "--min-site-people", "4"])
    np.testing.assert_array_equal(flare.sent[0].params["counts"], genotype_counts(genotypes))
    assert out.read_text().splitlines()[1:] == ["rs0,1,10,A,G", "rs1,1,20,A,G", "rs2,1,30,A,G"]


# ---- the exported job -----------------------------------------------------------------------------------------------


def export(output_dir: Path, *options: str) -> int:
    from data_prep.genotypes.cli import main

    return main(["qc-job", "--output-dir", str(output_dir), *options])


def job_config(output_dir: Path, side: str) -> dict:
    return json.loads((output_dir / "genotype_qc" / "app" / "config" / f"config_fed_{side}.json").read_text())


def test_the_minimum_travels_to_both_sides_of_the_exported_job(tmp_path: Path) -> None:
    assert export(tmp_path, "--num-sites", "2", "--min-site-people", "20") == 0
    assert job_config(tmp_path, "server")["workflows"][0]["args"] == {"min_site_people": 20}
    client = job_config(tmp_path, "client")["executors"][0]["executor"]["args"]
    assert client["task_script_args"] == "--min-site-people 20"


def test_the_default_minimum_is_written_into_the_sites_arguments(tmp_path: Path) -> None:
    assert export(tmp_path) == 0
    client = job_config(tmp_path, "client")["executors"][0]["executor"]["args"]
    assert client["task_script_args"] == f"--min-site-people {MIN_SITE_PEOPLE}"


def test_a_minimum_below_one_stops_the_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert export(tmp_path, "--min-site-people", "0") == 2
    assert "min_site_people must be a whole number of people >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "genotype_qc").exists()


@pytest.mark.slow
def test_in_the_simulator_a_one_person_site_ends_the_job_and_nothing_is_written(tmp_path: Path) -> None:
    table = write_table(tmp_path)
    write_npz(tmp_path / "site-1.npz", people(3))
    write_npz(tmp_path / "site-2.npz", people(1))
    assert export(tmp_path / "jobs", "--num-sites", "2", "--min-site-people", "3") == 0
    env = os.environ | {"FEDALG_SITE_GENOTYPES": str(tmp_path / "{site}.npz"), "FEDALG_SNP_TABLE": str(table)}
    workspace = tmp_path / "ws"
    command = [Path(sys.executable).with_name("nvflare"), "simulator", tmp_path / "jobs" / "genotype_qc"]
    done = subprocess.run(
        [*map(str, command), "-w", str(workspace), "-n", "2", "-t", "2"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "site-2 has 1 person, below the job's min_site_people = 3" in output
    assert CLEAR_COUNTS_WARNING in output
    assert not list(workspace.rglob("qc_report.json")) and not list(workspace.rglob(QC_TABLE.name))
