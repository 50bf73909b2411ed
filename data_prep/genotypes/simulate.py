"""A simulated consortium on disk: ``python -m data_prep.genotypes simulate-sites`` writes one genotype file per site
(what a real site holds), the consortium's SNP table and each site's labels, from an msprime cohort
(``data_prep.genomics_sim``, the ``genomics-sim`` extra).

The cohort's SNPs come from independent simulated regions (``sim<region>_<position>``); on disk they are laid end to
end on chromosome 1 (region r, 0-based position p -> position ``r * region_length + p + 1``), so every SNP has its own
chromosome and position for harmonisation to match on. The simulation has only ancestral (0) and derived (1)
alleles, so each SNP is given a REF/ALT pair drawn (seeded) from the eight pairs that are not strand-ambiguous (A/T
and C/G would be unusable after harmonisation); the table's ALT is the derived allele, so the files' dosages are the
cohort's.

People are split over the sites with one of ``data_prep.partition``'s schemes. Output, in ``--out``:

- ``site-1.vcf.gz``, ... (or the ``--format`` given; a comma-separated list gives each site its own format, in site
  order, e.g. ``vcf.gz,bcf,vcf,bed,pgen``): the site's people, all table SNPs;
- ``site-1.labels.csv``, ...: ``sample,population`` for the site's people;
- ``snp_table.csv``: ``snp,chrom,pos,ref,alt``, the consortium's table;
- ``cohort.json``: the classes (population names, in label order), the SNP count, the people per site and each
  site's file name (``files``).
"""

from __future__ import annotations

import csv
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes import GenotypeData
from data_prep.genotypes.harmonise import ReferenceTable
from data_prep.genotypes.writers import Sites, write_genotype_file
from data_prep.partition import partition

__all__ = [
    "ALLELE_PAIRS",
    "SITE_FORMATS",
    "cohort_table",
    "simulate_sites",
    "site_formats",
    "split_people",
    "write_sites",
]

#: REF/ALT pairs a strand flip cannot be confused with (A/T and C/G are their own complement).
ALLELE_PAIRS = (("A", "C"), ("A", "G"), ("C", "A"), ("C", "T"), ("G", "A"), ("G", "T"), ("T", "C"), ("T", "G"))
SITE_FORMATS = ("vcf", "vcf.gz", "bcf", "bed", "pgen")


def cohort_table(snps: Sequence[str], region_length: int, seed: int) -> ReferenceTable:
    """The SNP table of a simulated cohort: chromosome 1, the regions end to end, seeded REF/ALT (module docstring)."""
    positions = []
    for snp in snps:
        region, _, offset = snp.removeprefix("sim").partition("_")
        if not (region.isdigit() and offset.isdigit()):
            raise DataPrepError(f"simulated SNP ID {snp!r} is not sim<region>_<position>")
        positions.append(int(region) * region_length + int(offset) + 1)
    if len(set(positions)) != len(positions):
        raise DataPrepError(f"two simulated SNPs share a position; region_length {region_length} is too short")
    pairs = np.random.default_rng([seed, 2]).integers(len(ALLELE_PAIRS), size=len(snps))
    ref = tuple(ALLELE_PAIRS[k][0] for k in pairs)
    alt = tuple(ALLELE_PAIRS[k][1] for k in pairs)
    return ReferenceTable(tuple(snps), ref, alt, ("1",) * len(snps), tuple(positions))


def split_people(labels: np.ndarray, num_sites: int, scheme: str, seed: int, alpha: float) -> list[np.ndarray]:
    """Each site's people (sorted indices), by ``data_prep.partition`` (min 1 person per site for the skewed
    schemes, so a small test cohort still splits)."""
    return partition(labels, num_sites, scheme, seed=seed, alpha=alpha, min_samples=1)


def site_formats(fmt: str, num_sites: int) -> list[str]:
    """Each site's format: ``fmt`` is one of `SITE_FORMATS` for every site, or a comma-separated list given in site
    order and repeated when there are more sites (``vcf.gz,bcf,vcf,bed,pgen``: each site in its own format)."""
    formats = [part.strip() for part in fmt.split(",") if part.strip()]
    bad = [part for part in formats if part not in SITE_FORMATS]
    if bad or not formats:
        raise DataPrepError(
            f"--format must be one of {', '.join(SITE_FORMATS)}, got {fmt!r} (or a comma-separated list of them, "
            "one per site)"
        )
    return [formats[i % len(formats)] for i in range(num_sites)]


def write_sites(
    out: str | Path, cohort: GenotypeData, table: ReferenceTable, parts: Sequence[np.ndarray], fmt: str = "vcf.gz"
) -> list[Path]:
    """Write the site files, labels, table and ``cohort.json`` into ``out`` (module docstring); all files are
    written in a scratch folder beside ``out`` first and moved in at the end, so a failure leaves nothing."""
    formats = site_formats(fmt, len(parts))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    samples = np.array([f"{cohort.classes[c]}_{i}" for i, c in enumerate(cohort.labels)])
    sites = Sites(table.chrom, table.pos, table.snps, table.ref, table.alt)
    with tempfile.TemporaryDirectory(prefix=".simulate-", dir=out) as scratch:
        folder = Path(scratch)
        for index, people in enumerate(parts):
            site = f"site-{index + 1}"
            name = f"{site}.{formats[index]}"
            write_genotype_file(folder / name, cohort.genotypes[people], samples[people].tolist(), sites)
            _write_labels(folder / f"{site}.labels.csv", samples[people], cohort.classes, cohort.labels[people])
        table.write(folder / "snp_table.csv")
        summary = {
            "classes": list(cohort.classes),
            "snps": len(table.snps),
            "people": {f"site-{i + 1}": len(p) for i, p in enumerate(parts)},
            "genotypes": f"{{site}}.{fmt}" if len(set(formats)) == 1 else None,
            "files": {f"site-{i + 1}": f"site-{i + 1}.{f}" for i, f in enumerate(formats)},
            "labels": "{site}.labels.csv",
        }
        (folder / "cohort.json").write_text(json.dumps(summary, indent=2) + "\n")
        written = []
        for path in sorted(folder.iterdir()):
            os.replace(path, out / path.name)
            written.append(out / path.name)
    return written


def simulate_sites(
    out: str | Path,
    snps: int,
    samples_per_population: int,
    num_sites: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    fmt: str = "vcf.gz",
    seed: int = 0,
    regions: int = 40,
    region_length: int = 250_000,
) -> list[Path]:
    """Simulate the cohort (``data_prep.genomics_sim``, cached), split it and write the sites (module docstring)."""
    from data_prep.genomics_sim import simulate_cohort

    site_formats(fmt, num_sites)  # a bad --format before minutes of simulation
    cohort = simulate_cohort(
        n_snps=snps,
        samples_per_population=samples_per_population,
        regions=regions,
        region_length=region_length,
        seed=seed,
    )
    table = cohort_table(cohort.snps, region_length, seed)
    parts = split_people(cohort.labels, num_sites, scheme, seed, alpha)
    return write_sites(out, cohort, table, parts, fmt)


def _write_labels(path: Path, samples: np.ndarray, classes: Sequence[str], labels: np.ndarray) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sample", "population"])
        writer.writerows(zip(samples.tolist(), (classes[c] for c in labels), strict=True))
