"""A genomics site trains on the file it named, never silently on the public panel.

A provisioned site (its workspace holds ``startup/fed_client.json``, as every NVFlare startup kit does) with no
genotype file named, or with the image datasets' ``FEDALG_SITE_DATA`` set instead of ``FEDALG_SITE_GENOTYPES``, is
refused in one line naming the variable and the file expected; a simulated site whose job names the consortium's
classes but no file is refused too (the panel's own classes would silently replace the job's). Every site prints which
file it read: path, people, SNPs, the table it matched.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.errors import DataPrepError
from data_prep.genotypes.cli import write_npz
from data_prep.genotypes.harmonise import Harmonised
from data_prep.genotypes.site_files import GenotypeFiles, missing_file_problem, site_genotype_files

SITE_VARIABLES = ("FEDALG_SITE_GENOTYPES", "FEDALG_SNP_TABLE", "FEDALG_SITE_LABELS", "FEDALG_SITE_DATA")
CLASSES = ["AFR", "EUR"]


@pytest.fixture
def snp_sites(monkeypatch: pytest.MonkeyPatch):
    for name in SITE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "examples"))
    monkeypatch.delitem(sys.modules, "genomics.data", raising=False)
    from genomics.data import SnpSites

    return SnpSites


def provisioned_kit(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site's startup kit as ``nvflare provision`` writes it (only the marker file matters), as the working folder."""
    (root / "startup").mkdir(parents=True)
    (root / "startup" / "fed_client.json").write_text("{}")
    (root / "local").mkdir()
    monkeypatch.chdir(root)
    return root


def site_npz(path: Path, people: int = 20, snps: int = 6) -> Path:
    genotypes = np.random.default_rng(0).integers(0, 4, size=(people, snps)).astype(np.int8)
    result = Harmonised(
        genotypes, tuple(f"p{i}" for i in range(people)), tuple(f"rs{j}" for j in range(snps)), ("same",) * snps, "t"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_npz(path, result, np.array([CLASSES[i % 2] for i in range(people)]))


def snp_table(path: Path, snps: int = 6) -> Path:
    path.write_text("snp,chrom,pos,ref,alt\n" + "".join(f"rs{j},1,{10 * (j + 1)},A,G\n" for j in range(snps)))
    return path


# ---- hostile: what today's code trained on without a word -----------------------------------------------------------


def test_a_provisioned_site_without_a_genotype_file_is_refused_not_given_the_public_panel(
    tmp_path, monkeypatch, snp_sites
) -> None:
    kit = provisioned_kit(tmp_path / "site-1", monkeypatch)
    with pytest.raises(DataPrepError) as refused:
        snp_sites(site="site-1", classes=["CHB", "GBR", "PUR"])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("site-1: no genotype file named")
    assert "FEDALG_SITE_GENOTYPES" in message and str(kit / "local" / "fedalg_site_data.json") in message


def test_a_provisioned_site_never_derives_the_panel_even_without_classes(tmp_path, monkeypatch, snp_sites) -> None:
    provisioned_kit(tmp_path / "site-2", monkeypatch)
    with pytest.raises(DataPrepError, match=r"^site-2: no genotype file named.*never the public panel"):
        snp_sites(site="site-2", source="1kg")


def test_the_image_datasets_variable_set_instead_is_named(tmp_path, monkeypatch, snp_sites) -> None:
    """The deployment tutorial's FEDALG_SITE_DATA, set on a genomics site: refused, naming both variables."""
    provisioned_kit(tmp_path / "site-1", monkeypatch)
    monkeypatch.setenv("FEDALG_SITE_DATA", "/data/site-1/genotypes.npz")
    with pytest.raises(DataPrepError) as refused:
        snp_sites(site="site-1", classes=CLASSES)
    message = str(refused.value)
    assert "\n" not in message
    assert "FEDALG_SITE_DATA=/data/site-1/genotypes.npz" in message
    assert "FEDALG_SITE_GENOTYPES=/data/site-1/genotypes.npz" in message  # the fix, with the site's own path


def test_a_simulated_site_whose_job_names_classes_but_no_file_is_refused(tmp_path, monkeypatch, snp_sites) -> None:
    """Today: the panel's five super-populations replace the job's three classes, silently."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataPrepError, match=r"^site-1: classes \['CHB', 'GBR', 'PUR'\] are the labels of a site's own"):
        snp_sites(site="site-1", classes=["CHB", "GBR", "PUR"])


def test_every_site_says_which_file_it_read(tmp_path, monkeypatch, snp_sites, capsys) -> None:
    provisioned_kit(tmp_path / "site-1", monkeypatch)
    data_file, table = site_npz(tmp_path / "data" / "site-1.npz"), snp_table(tmp_path / "table.csv")
    monkeypatch.setenv("FEDALG_SITE_GENOTYPES", str(tmp_path / "data" / "{site}.npz"))
    monkeypatch.setenv("FEDALG_SNP_TABLE", str(table))
    snp_sites(site="site-1", classes=CLASSES)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"site-1: genotypes {data_file} (from $FEDALG_SITE_GENOTYPES): 20 people x 6 SNPs")
    assert f"SNP table {table} (from $FEDALG_SNP_TABLE), matched" in line
    assert "classes ['AFR', 'EUR']" in line


def test_a_file_read_without_a_table_says_so(tmp_path, monkeypatch, snp_sites, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    data_file = site_npz(tmp_path / "site-3.npz", people=12, snps=4)
    snp_sites(site="site-3", data_file=str(data_file), classes=CLASSES)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith(f"site-3: genotypes {data_file} (from data_args): 12 people x 4 SNPs")
    assert "no SNP table named: the file's own 4 SNPs, unchecked" in line


def test_a_simulated_site_says_it_derived_its_share(tmp_path, monkeypatch, snp_sites, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    data = snp_sites(site="site-2", num_sites=3, source="1kg")
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("site-2: simulation: no genotype file of its own; derived share of source '1kg'")
    assert f"{len(data.train) + len(data.val)} people x 127 SNPs" in line


# ---- the site-local config file: what a deployed site writes in its kit's local/ ------------------------------------


def test_the_site_local_config_names_the_files(tmp_path, monkeypatch, snp_sites, capsys) -> None:
    kit = provisioned_kit(tmp_path / "site-2", monkeypatch)
    site_npz(kit / "data" / "genotypes.npz")
    snp_table(tmp_path / "table.csv")
    config = {"genotypes": "../data/genotypes.npz", "snp_table": str(tmp_path / "table.csv")}
    (kit / "local" / "fedalg_site_data.json").write_text(json.dumps(config))
    data = snp_sites(site="site-2", classes=CLASSES)
    assert data.num_snps == 6 and len(data.train) + len(data.val) == 20
    line = capsys.readouterr().out.strip().splitlines()[-1]
    origin = f"(from {kit / 'local' / 'fedalg_site_data.json'})"
    assert line.startswith(f"site-2: genotypes {kit / 'local' / '..' / 'data' / 'genotypes.npz'} {origin}")


def test_the_environment_and_the_arguments_come_before_the_local_config(tmp_path) -> None:
    (tmp_path / "local").mkdir()
    local = {"genotypes": "/local/{site}.npz", "snp_table": "/local/table.csv", "labels": "/local/labels.csv"}
    (tmp_path / "local" / "fedalg_site_data.json").write_text(json.dumps(local))
    environ = {"FEDALG_SITE_GENOTYPES": "/env/{site}.npz"}
    files = site_genotype_files("site-4", tmp_path, environ, labels_file="/args/labels.csv")
    config = str(tmp_path / "local" / "fedalg_site_data.json")
    assert files == GenotypeFiles(
        ("/env/site-4.npz", "$FEDALG_SITE_GENOTYPES"),
        ("/local/table.csv", config),
        ("/args/labels.csv", "data_args"),
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[1, 2]", "must be a JSON object"),
        ('{"genotypes": 3}', r'"genotypes" must be a file path \(a string\), got 3'),
        ("{not json", "cannot read"),
    ],
)
def test_a_broken_site_local_config_is_refused_in_one_line(tmp_path, content, expected) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "fedalg_site_data.json").write_text(content)
    with pytest.raises(DataPrepError, match=f"^site-1: .*{expected}") as refused:
        site_genotype_files("site-1", tmp_path, {})
    assert "\n" not in str(refused.value)


def test_no_problem_when_a_file_is_named_or_a_simulated_job_derives(tmp_path) -> None:
    named = GenotypeFiles(("/data/s.npz", "data_args"))
    assert missing_file_problem("site-1", named, tmp_path, {}, simulated=False, classes=None) is None
    assert missing_file_problem("site-1", GenotypeFiles(), tmp_path, {}, simulated=True, classes=None) is None


# ---- the federated QC job reads the same site-local config ----------------------------------------------------------


def test_the_qc_site_reads_its_files_from_its_kit(tmp_path, monkeypatch, capsys) -> None:
    """A deployed site named its files in its kit only (no environment): before, "federated QC needs
    FEDALG_SITE_GENOTYPES and FEDALG_SNP_TABLE set at the site"."""
    from nvflare.app_common.abstract.fl_model import FLModel

    from data_prep.genotypes.federated_qc import site_main
    from tests.helpers import FakeFlare

    for name in SITE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    kit = provisioned_kit(tmp_path / "site-1", monkeypatch)
    data_file, table = site_npz(tmp_path / "site-1.npz", people=12), snp_table(tmp_path / "table.csv")
    local = {"genotypes": str(tmp_path / "{site}.npz"), "snp_table": str(table)}
    (kit / "local" / "fedalg_site_data.json").write_text(json.dumps(local))
    inbox = [FLModel(params={"none": np.zeros(1)}, meta={"step": "qc_counts"})]
    flare = FakeFlare("site-1", inbox)
    flare.install(monkeypatch)
    site_main(["--min-site-people", "10"])
    assert flare.sent[0].meta["snps"] == [f"rs{j}" for j in range(6)]
    out = capsys.readouterr().out
    config = kit / "local" / "fedalg_site_data.json"
    assert f"site-1: genotypes {data_file} (from {config}): 12 people x 6 SNPs; SNP table {table}" in out


def test_a_qc_site_with_no_files_named_is_refused_naming_the_variables_and_its_kit(tmp_path, monkeypatch) -> None:
    from data_prep.genotypes.federated_qc import site_main
    from tests.helpers import FakeFlare

    for name in SITE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    kit = provisioned_kit(tmp_path / "site-2", monkeypatch)
    FakeFlare("site-2", []).install(monkeypatch)
    with pytest.raises(DataPrepError) as refused:
        site_main([])
    assert str(refused.value) == (
        'site-2: federated QC needs FEDALG_SITE_GENOTYPES and FEDALG_SNP_TABLE set at the site, or "genotypes" and '
        f'"snp_table" in {kit / "local" / "fedalg_site_data.json"}; nothing sent'
    )
