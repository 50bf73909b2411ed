"""The loopback driver runs the genomics path: a federated QC job under HE is recognised (the kits
get HE contexts without ``--he``), a QC job that finished COMPLETED with its report is a success (it writes no round
metrics), each site is pointed at its own genotype files through its kit's ``local/fedalg_site_data.json`` (the
caller's environment is not passed through), and an HE job on a deployment without contexts is refused in one line
before anything is submitted. No deployment is started here: only the decisions and the files they write."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from data_prep.genotypes.federated_qc import export_qc_job
from data_prep.genotypes.qc import QcThresholds
from data_prep.genotypes.site_files import site_genotype_files
from jobs.provision import loopback
from jobs.provision.loopback import (
    Deployment,
    DeploymentError,
    configure_site_genotypes,
    he_contexts_problem,
    job_problems,
    needs_he_contexts,
    qc_settings,
    without_site_variables,
)

REPO = Path(__file__).resolve().parents[2]
DONE = {"status": "FINISHED:COMPLETED"}


@pytest.fixture(scope="module")
def qc_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("qc_jobs")
    return {
        mode: export_qc_job(out, QcThresholds(), num_sites=3, name=f"qc_{mode}", secure_aggregation=mode)
        for mode in ("none", "he")
    }


def deployment(root: Path, contexts: bool) -> Deployment:
    """Kit folders as ``nvflare provision`` lays them out; with ``contexts``, the files HEBuilder adds."""
    sites = {name: root / name for name in ("site-1", "site-2", "site-3")}
    for kit in [root / "server", *sites.values()]:
        (kit / "startup").mkdir(parents=True)
        (kit / "local").mkdir()
    if contexts:
        (root / "server" / "startup" / "server_context.tenseal").write_bytes(b"x")
        for kit in sites.values():
            (kit / "startup" / "client_context.tenseal").write_bytes(b"x")
    return Deployment(root, root / "server", sites, root / "admin", 0)


# ---- HE detected for the QC job --------------------------------------------------------------------------------------


def test_an_he_qc_job_needs_he_contexts(qc_jobs) -> None:
    """Before: only NVFlare's HE components were looked for, which the QC job does not use (``--he`` by hand)."""
    assert needs_he_contexts(qc_jobs["he"])
    assert not needs_he_contexts(qc_jobs["none"])
    assert needs_he_contexts(REPO / "jobs" / "fedavg_he") and not needs_he_contexts(REPO / "jobs" / "fedavg")


def test_a_qc_job_is_recognised_by_its_controller(qc_jobs) -> None:
    assert qc_settings(qc_jobs["he"]) == {"secure_aggregation": "he"}
    assert qc_settings(qc_jobs["none"]) is not None
    assert qc_settings(REPO / "jobs" / "fedavg") is None


def test_an_he_job_on_a_deployment_without_contexts_is_refused_before_it_is_submitted(tmp_path, qc_jobs) -> None:
    bare = deployment(tmp_path / "bare", contexts=False)
    problem = he_contexts_problem(bare, qc_jobs["he"])
    assert problem is not None and "\n" not in problem
    assert problem.startswith("qc_he: secure_aggregation 'he' needs the HE contexts of NVFlare's HEBuilder")
    assert str(bare.server / "startup" / "server_context.tenseal") in problem and "nothing submitted" in problem
    with pytest.raises(DeploymentError, match=r"^qc_he: secure_aggregation 'he' needs"):
        loopback.run_job(None, bare, qc_jobs["he"], timeout=1.0)  # no session touched: refused first
    assert he_contexts_problem(deployment(tmp_path / "he", contexts=True), qc_jobs["he"]) is None
    assert he_contexts_problem(bare, qc_jobs["none"]) is None


# ---- exit 0 for a completed QC job -----------------------------------------------------------------------------------


def test_a_completed_qc_job_with_its_report_is_fine(tmp_path) -> None:
    """Before: "no metrics file at .../round_metrics.jsonl", exit 1, for a QC job that did its work."""
    (tmp_path / "qc_report.json").write_text("{}")
    assert job_problems(DONE, tmp_path, qc=True) == []


def test_a_qc_job_without_its_report_or_not_completed_is_named(tmp_path) -> None:
    assert job_problems(DONE, tmp_path, qc=True) == [f"no QC report at {tmp_path / 'qc_report.json'}"]
    (tmp_path / "qc_report.json").write_text("{}")
    failed = {"status": "FINISHED:EXECUTION_EXCEPTION"}
    assert job_problems(failed, tmp_path, qc=True) == ["job status is FINISHED:EXECUTION_EXCEPTION"]


# ---- each site's own files, named in its kit -------------------------------------------------------------------------


def test_each_site_is_pointed_at_its_own_files_in_its_kit(tmp_path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for site in ("site-1", "site-2"):
        (data / f"{site}.npz").write_bytes(b"")
        (data / f"{site}.labels.csv").write_text("sample,population\n")
    (data / "table.csv").write_text("snp,chrom,pos,ref,alt\n")
    kit = tmp_path / "site-2"
    (kit / "local").mkdir(parents=True)
    (kit / "local" / "fedalg_site_data.json").write_text(json.dumps({"train": "/data/train.npz"}))
    config = configure_site_genotypes(
        kit, "site-2", str(data / "{site}.npz"), str(data / "table.csv"), str(data / "{site}.labels.csv")
    )
    assert json.loads(config.read_text()) == {
        "train": "/data/train.npz",  # the image datasets' entry stays
        "genotypes": str(data / "site-2.npz"),
        "snp_table": str(data / "table.csv"),
        "labels": str(data / "site-2.labels.csv"),
    }
    files = site_genotype_files("site-2", kit, {})  # what the site reads, with nothing in its environment
    assert files.path("genotypes") == str(data / "site-2.npz") and files.genotypes[1] == str(config)


def test_a_site_file_that_does_not_exist_is_refused_by_the_driver(tmp_path) -> None:
    (tmp_path / "site-3" / "local").mkdir(parents=True)
    with pytest.raises(DeploymentError) as refused:
        configure_site_genotypes(tmp_path / "site-3", "site-3", str(tmp_path / "{site}.npz"), None, None)
    assert str(refused.value) == (
        f"--genotypes {tmp_path / '{site}.npz'}: site-3's file {tmp_path / 'site-3.npz'} does not exist"
    )


def test_the_callers_site_variables_are_not_passed_to_the_sites() -> None:
    environ = {"PATH": "/bin", "FEDALG_SITE_GENOTYPES": "/x/{site}.npz", "FEDALG_SNP_TABLE": "/t.csv", "HOME": "/h"}
    environ |= {"FEDALG_SITE_LABELS": "/l.csv", "FEDALG_SITE_DATA": "/d.npz"}
    assert without_site_variables(environ) == {"PATH": "/bin", "HOME": "/h"}


def test_a_qc_job_without_site_files_is_refused_before_provisioning(tmp_path, qc_jobs, capsys) -> None:
    assert loopback.main([str(qc_jobs["he"]), "--workspace", str(tmp_path / "ws")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "error: qc_he is a federated QC job: every site needs its genotype file and the consortium's SNP table; pass "
        "--genotypes PATH (with {site}) and --snp-table PATH (docs/deployment.md)"
    )
    assert not (tmp_path / "ws").exists()


# ---- make poc --------------------------------------------------------------------------------------------------------


def test_make_poc_takes_the_site_count_and_driver_arguments() -> None:
    done = subprocess.run(
        ["make", "-n", "poc", "POC_SITES=5", "POC_ARGS=--genotypes /d/{site}.npz --snp-table /d/t.csv"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    line = next(x for x in done.stdout.splitlines() if "jobs.provision.loopback" in x)
    assert "--sites 5" in line and "--genotypes /d/{site}.npz --snp-table /d/t.csv" in line
