"""A person enrolled at two sites, found without sharing identities: NVFlare's Diffie-Hellman private set
intersection (``DhPSIController`` / ``DhPSITaskHandler`` over OpenMined's ``openmined.psi``) on genotype
fingerprints (`data_prep.genotypes.fingerprint`), then the federated QC counts each such person once.

**The jobs.** NVFlare's DH-PSI workflow intersects the items of *all* the sites of a job; a person at two of three
sites is in no all-site intersection. So the consortium runs one PSI job per pair of sites (``export_psi_jobs``:
``genotype_psi_<a>__<b>``, deployed to those two sites only; n sites, n(n-1)/2 small jobs). Each site's items are
the fingerprints of its people (`GenotypeFingerprintPSI.load_items`, from the same genotype file and SNP table as
the QC); each site learns which of its own items the other site also holds, and from them which of its people are
there too (at least ``min_panels`` of their fingerprints shared), and writes them to its shared-people file
(``local/fedalg_shared_people.json`` in the site's workspace, or ``FEDALG_SHARED_PEOPLE`` with ``{site}`` replaced):
its own sample IDs under the other site's name. Nothing leaves the site but the protocol's messages (`psi_releases`;
the egress gate, last on each site's PSI results, strips or refuses anything else): its item count, its items under
its own key (setup; as a plain list: `psi_site.ExactPSIServer`), its items blinded (request), the other site's
blinded items blinded again (response), and the intersection's size. The server relays them and learns the sites'
item counts and the intersection's size.

**Counted once.** A person at two sites is counted by the site whose name sorts first; the other site leaves them out
of its QC counts (`counted_once`, called by the QC site before it counts). Both sites know the pair's result, so no
further message is needed.

What a site learns beyond its matched people: the number of the other site's fingerprints, and that an item of one of
its people (16 calls of a sub-panel) is also at the other site when fewer than ``min_panels`` match (a relative, or a
person with many discordant calls).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from aggregators.contracts.egress import Release
from data_prep.errors import DataPrepError
from data_prep.genotypes.fingerprint import (
    DEFAULT_MIN_PANELS,
    DEFAULT_PANEL_SIZE,
    DEFAULT_PANELS,
    Panel,
    fingerprint_panel,
    fingerprints,
    matched_people,
)

__all__ = [
    "SHARED_PEOPLE",
    "SHARED_PEOPLE_ENV",
    "counted_once",
    "export_psi_jobs",
    "person_items",
    "psi_releases",
    "read_shared_people",
    "record_shared_people",
    "shared_people_path",
]

SHARED_PEOPLE = Path("local") / "fedalg_shared_people.json"
SHARED_PEOPLE_ENV = "FEDALG_SHARED_PEOPLE"
PSI_EXTRA = "psi"


def shared_people_path(site: str, workspace: Path, environ: Mapping[str, str]) -> Path:
    """``FEDALG_SHARED_PEOPLE`` (``{site}`` replaced by the site's name), else the workspace's ``SHARED_PEOPLE``."""
    if environ.get(SHARED_PEOPLE_ENV):
        return Path(environ[SHARED_PEOPLE_ENV].replace("{site}", site))
    return workspace / SHARED_PEOPLE


def person_items(genotypes: np.ndarray, snps: Sequence[str], chroms: Sequence[str], panels: int, panel_size: int,
                 min_panels: int) -> tuple[Panel, list[list[str]], list[str]]:  # fmt: skip
    """(panel, each person's fingerprints, the site's PSI items: every fingerprint once, sorted)."""
    panel = fingerprint_panel(snps, chroms, panels, panel_size, min_panels)
    per_person = fingerprints(genotypes, panel)
    return panel, per_person, sorted({item for items in per_person for item in items})


def record_shared_people(path: Path, other_site: str, people: Sequence[str], panel: Panel) -> None:
    """Write (or update) the site's shared-people file: ``people`` (its own IDs) are also at ``other_site``."""
    data = read_shared_people(path) if path.is_file() else {}
    data.setdefault("shared", {})[other_site] = sorted(people)
    data["panel"] = {"identity": panel.identity, "panels": len(panel.columns), "min_panels": panel.min_panels}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_shared_people(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataPrepError(f"{path}: not a shared-people file written by the PSI job ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("shared", {}), dict):
        raise DataPrepError(f"{path}: not a shared-people file written by the PSI job (no 'shared' mapping)")
    return data


def counted_once(site: str, genotypes: np.ndarray, samples: Sequence[str], path: Path) -> np.ndarray:
    """The rows of ``genotypes`` this site counts: without the people its shared-people file (if any) lists under a
    site whose name sorts before ``site`` (that site counts them). A listed ID the site does not hold is refused:
    the file was written for another genotype file."""
    if not path.is_file():
        return genotypes
    shared = read_shared_people(path).get("shared", {})
    index = {sample: i for i, sample in enumerate(samples)}
    leave_out: set[int] = set()
    for other, people in shared.items():
        unknown = [p for p in people if p not in index]
        if unknown:
            raise DataPrepError(
                f"{site}: {path} lists {unknown[0]!r} as also at {other}, but this site's genotype file has no such "
                "person: the file is from another genotype file; run the PSI jobs again"
            )
        if other < site:
            leave_out.update(index[p] for p in people)
    if leave_out:
        print(f"{site}: {len(leave_out)} of {len(samples)} people are also at an earlier-named site, which counts "
              f"them; left out of this site's counts ({path})", flush=True)  # fmt: skip
    keep = np.ones(len(samples), bool)
    keep[list(leave_out)] = False
    return genotypes[keep]


# ---- NVFlare glue --------------------------------------------------------------------------------------------------

try:
    from nvflare.app_common.psi.psi_spec import PSI as _PSIBase
except ImportError:  # pragma: no cover - nvflare is a core dependency; the fallback keeps the pure part importable
    _PSIBase = object


class GenotypeFingerprintPSI(_PSIBase):
    """The site's items for NVFlare's DH-PSI: its people's fingerprints; on the result, its shared-people file."""

    def __init__(self, psi_writer_id: str, sites: list[str], panels: int = DEFAULT_PANELS,
                 panel_size: int = DEFAULT_PANEL_SIZE, min_panels: int = DEFAULT_MIN_PANELS) -> None:  # fmt: skip
        super().__init__(psi_writer_id)
        self.sites = list(sites)  # NVFlare's job API stores each constructor argument under its own name
        self.panels, self.panel_size, self.min_panels = panels, panel_size, min_panels
        self._people: tuple[str, ...] = ()
        self._items: list[list[str]] = []
        self._panel: Panel | None = None

    def _site(self) -> str:
        return self.fl_ctx.get_identity_name()

    def load_items(self) -> list[str]:
        from data_prep.genotypes.harmonise import read_snp_table
        from data_prep.genotypes.site import GENOTYPES_ENV, SNP_TABLE_ENV, load_harmonised
        from data_prep.genotypes.site_files import site_genotype_files
        from data_prep.site_config import site_workspace

        site = self._site()
        files = site_genotype_files(site, site_workspace(), os.environ)
        data_file, table_path = files.path("genotypes"), files.path("snp_table")
        if not data_file or not table_path:
            raise DataPrepError(f"{site}: the PSI job needs {GENOTYPES_ENV} and {SNP_TABLE_ENV}, as the QC job does")
        genotypes, samples, snps, _ = load_harmonised(data_file, table_path)
        table = read_snp_table(table_path)
        if table.chrom is None:
            raise DataPrepError(f"{site}: {table_path} has no chromosomes; the fingerprint panel takes autosomal SNPs")
        chrom_of = dict(zip(table.snps, table.chrom, strict=True))
        chroms = [chrom_of[snp] for snp in snps]
        try:
            self._panel, self._items, items = person_items(genotypes, snps, chroms, self.panels, self.panel_size,
                                                           self.min_panels)  # fmt: skip
        except DataPrepError as exc:
            raise DataPrepError(f"{site}: {exc}") from None
        self._people = tuple(samples)
        print(f"{site}: {len(items)} genotype fingerprints of {len(samples)} people for the PSI with "
              f"{self._other(site)}", flush=True)  # fmt: skip
        return items

    def _other(self, site: str) -> str:
        others = [s for s in self.sites if s != site]
        if len(others) != 1:
            raise DataPrepError(f"{site}: the PSI job is for the pair {self.sites}, which this site is not one of")
        return others[0]

    def save(self, intersection: list[str]) -> None:
        from data_prep.site_config import site_workspace

        super().save(intersection)
        site = self._site()
        people = [self._people[i] for i in matched_people(self._items, intersection, self.min_panels)]
        path = shared_people_path(site, site_workspace(), os.environ)
        record_shared_people(path, self._other(site), people, self._panel)
        print(f"{site}: {len(people)} of {len(self._people)} people also at {self._other(site)} ({path})", flush=True)


def psi_releases() -> tuple[Release, ...]:
    """What a PSI site declares it sends (docs/privacy.md, the PSI row), for the egress gate: NVFlare 2.9's DH-PSI
    answers every stage of its one task ``PSI`` with a ``PSI`` DXO, no meta, whose data is the task handler's
    Shareable (its ``__headers__``, empty, and one of: the item count (prepare; intersect: the intersection's size),
    the setup message (the site's items under its key, a plain list; under the backward pass one per size), the
    request (its items blinded), the response (the other site's request blinded again))."""
    from nvflare.app_common.app_constant import PSIConst

    data = (PSIConst.ITEMS_SIZE, PSIConst.SETUP_MSG, PSIConst.REQUEST_MSG, PSIConst.RESPONSE_MSG, "__headers__")
    return (Release(PSIConst.TASK, ("PSI",), data, ()),)


def export_psi_jobs(output_dir: Path, sites: Sequence[str], panels: int = DEFAULT_PANELS,
                    panel_size: int = DEFAULT_PANEL_SIZE, min_panels: int = DEFAULT_MIN_PANELS,
                    name: str = "genotype_psi") -> list[Path]:  # fmt: skip
    """One NVFlare DH-PSI job per pair of ``sites`` (module docstring), each deployed to its two sites."""
    if len(set(sites)) < 2 or len(set(sites)) != len(sites):
        raise DataPrepError(f"PSI jobs: need at least two distinct site names, got {list(sites)}")
    fingerprint_panel([f"s{j}" for j in range(panels * panel_size)], ["1"] * (panels * panel_size), panels,
                      panel_size, min_panels)  # the settings' checks, before anything is written  # fmt: skip
    from nvflare.app_common.psi.dh_psi.dh_psi_controller import DhPSIController
    from nvflare.app_common.psi.file_psi_writer import FilePSIWriter
    from nvflare.app_common.psi.psi_executor import PSIExecutor
    from nvflare.job_config.api import FedJob
    from nvflare.job_config.defs import FilterType

    from aggregators.contracts.bundle import APP_PACKAGES
    from aggregators.contracts.egress_gate import EgressGate

    site_component, task_handler = _site_component(), _site_component("ExactDhPSITaskHandler")
    out = []
    for first, second in itertools.combinations(sorted(sites), 2):
        job = FedJob(name=f"{name}_{first}__{second}", min_clients=2)
        job.set_app_packages(list(APP_PACKAGES))
        job.to_server(DhPSIController(), id="DhPSIController")
        for site in (first, second):
            job.to(PSIExecutor(psi_algo_id="dh_psi"), site, id="psi_executor", tasks=["PSI"])
            job.to(task_handler(local_psi_id="local_psi"), site, id="dh_psi")  # an exact intersection: psi_site
            job.to(site_component("psi_writer", [first, second], panels, panel_size, min_panels), site,
                   id="local_psi")  # fmt: skip
            job.to(FilePSIWriter(output_path="psi/intersection.txt"), site, id="psi_writer")
            for release in psi_releases():  # the last result filter: the job adds none other
                job.to(
                    EgressGate(**release.to_config()), site, tasks=[release.task], filter_type=FilterType.TASK_RESULT
                )
        job.export_job(str(Path(output_dir).resolve()))
        out.append(Path(output_dir).resolve() / job.name)
    return out


def _site_component(name: str = "FingerprintPSI") -> type:
    """``psi_site.<name>`` (the fingerprints' site component, or the exact DH-PSI task handler), imported as a
    top-level module so that NVFlare's job API copies ``psi_site.py`` into the job's custom/ folder (module docstring
    of ``psi_site``)."""
    import importlib
    import sys

    folder = str(Path(__file__).parent)
    sys.path.append(folder)
    try:
        return getattr(importlib.import_module("psi_site"), name)
    finally:
        sys.path.remove(folder)  # the package's other modules stay importable by their package names only


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.genotypes.psi",
        description="Export one NVFlare PSI job per pair of sites: each site learns which of its people are also at "
        "the other site (genotype fingerprints, docs/genomics.md); the federated QC then counts them once.",
    )
    parser.add_argument("--sites", nargs="+", required=True, help="the sites' names (at least two)")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--panels", type=int, default=DEFAULT_PANELS, help="sub-panels per person")
    parser.add_argument("--panel-size", type=int, default=DEFAULT_PANEL_SIZE, help="SNPs per sub-panel")
    parser.add_argument("--min-panels", type=int, default=DEFAULT_MIN_PANELS, help="shared fingerprints for a match")
    args = parser.parse_args(argv)
    try:
        jobs = export_psi_jobs(args.output_dir, args.sites, args.panels, args.panel_size, args.min_panels)
    except DataPrepError as exc:
        print(f"error: {exc}")
        return 2
    for job in jobs:
        print(job)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
