"""A real site's genotypes for training: its VCF/BCF/PLINK file harmonised on the fly, or the ``.npz`` that
``python -m data_prep.genotypes harmonise`` wrote (memory-mapped), with each person's label.

Paths come from the data module's arguments or the site's environment (a job ships the same arguments to every site):
``$FEDALG_SITE_GENOTYPES`` (the genotype file or ``.npz``), ``$FEDALG_SNP_TABLE`` (the consortium's SNP table, needed
to harmonise a raw file; optional for an ``.npz``, which then must hold exactly the table's SNPs in order) and
``$FEDALG_SITE_LABELS`` (a CSV ``sample,<label column>``; optional for an ``.npz`` written with ``--labels``).
``{site}`` in a path is replaced by the site's name, so one simulator run can give every site its own file.
"""

from __future__ import annotations

import csv
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes.formats import FORMATS
from data_prep.genotypes.harmonise import harmonise_file, read_snp_table

__all__ = [
    "GENOTYPES_ENV",
    "LABELS_ENV",
    "SNP_TABLE_ENV",
    "SiteGenotypes",
    "is_genotype_input",
    "load_harmonised",
    "read_labels",
    "site_genotypes",
]

GENOTYPES_ENV, SNP_TABLE_ENV, LABELS_ENV = "FEDALG_SITE_GENOTYPES", "FEDALG_SNP_TABLE", "FEDALG_SITE_LABELS"


@dataclass(frozen=True)
class SiteGenotypes:
    genotypes: np.ndarray  # int8 people x table SNPs (a memory map for an .npz)
    labels: np.ndarray  # int64 class index per person
    classes: tuple[str, ...]
    snps: tuple[str, ...]
    source: str


def is_genotype_input(path: str) -> bool:
    """A VCF/BCF/PLINK file or a harmonised ``.npz`` (rather than the bundle's genotype CSV)."""
    name = str(path).lower()
    return name.endswith(".npz") or any(name.endswith(suffix) for suffix in FORMATS)


def resolve(path: str | None, env: str, site: str, environ: Mapping[str, str]) -> str | None:
    """``path`` or ``$env``, with ``{site}`` replaced by the site's name."""
    value = path or environ.get(env) or None
    return value.replace("{site}", site) if value else None


def site_genotypes(
    site: str,
    data_file: str,
    classes: Sequence[str],
    snp_table: str | None = None,
    labels_file: str | None = None,
    label_column: str = "population",
) -> SiteGenotypes:
    """The site's harmonised genotypes and labels (module docstring); errors name the site."""
    try:
        genotypes, samples, snps, stored = load_harmonised(data_file, snp_table)
        if labels_file:
            raw = read_labels(labels_file, label_column, samples)
        elif stored is not None:
            raw = stored
        else:
            raise DataPrepError(
                f"{data_file}: no labels: set {LABELS_ENV} (a CSV sample,{label_column}) or labels_file"
            )
    except DataPrepError as exc:
        raise DataPrepError(f"{site}: {exc}") from None
    unknown = sorted(set(raw.tolist()) - set(classes))
    if unknown:
        raise DataPrepError(f"{site}: labels {unknown[:5]} are not among the classes {list(classes)}")
    labels = np.array([list(classes).index(v) for v in raw.tolist()], dtype=np.int64)
    return SiteGenotypes(genotypes, labels, tuple(classes), snps, data_file)


def read_labels(path: str, column: str, samples: Sequence[str]) -> np.ndarray:
    """Each sample's label (strings, in ``samples`` order) from a CSV with a ``sample`` column and ``column``."""
    try:
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataPrepError(f"{path}: cannot read the labels file ({exc})") from None
    header = list(rows[0]) if rows else []
    if "sample" not in header or column not in header:
        raise DataPrepError(f"{path}: line 1: the labels file needs columns 'sample' and {column!r}, got {header}")
    by_sample = {row["sample"]: row[column] for row in rows}
    missing = [s for s in samples if s not in by_sample]
    if missing:
        raise DataPrepError(f"{path}: no label for sample(s) {missing[:5]} of the genotype file")
    return np.array([by_sample[s] for s in samples])


def load_harmonised(
    data_file: str, snp_table: str | None
) -> tuple[np.ndarray, tuple[str, ...], tuple[str, ...], np.ndarray | None]:
    """(int8 genotypes, samples, table SNPs, stored labels or None) of a genotype file or harmonised ``.npz``."""
    if data_file.lower().endswith(".npz"):
        return _from_npz(data_file, snp_table)
    if snp_table is None:
        raise DataPrepError(f"{data_file}: harmonising a genotype file needs the consortium's SNP table")
    result = harmonise_file(data_file, read_snp_table(snp_table))
    return result.genotypes, result.samples, result.snps, None


def _from_npz(path: str, snp_table: str | None):
    from data_prep.genotypes.loader import open_matrix  # here: the loader imports torch, harmonising does not

    if not Path(path).is_file():
        raise DataPrepError(f"{path}: no such file")
    genotypes = open_matrix(path)
    try:
        with np.load(path, allow_pickle=False) as stored:
            samples, snps = tuple(stored["samples"].tolist()), tuple(stored["snps"].tolist())
            labels = stored["labels"] if "labels" in stored.files else None
    except (KeyError, OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataPrepError(f"{path}: not a harmonised genotype file ({exc})") from None
    if snp_table is not None:
        expected = read_snp_table(snp_table).snps
        if snps != expected:
            differ = next((j for j, (a, b) in enumerate(zip(snps, expected, strict=False)) if a != b), len(snps))
            raise DataPrepError(
                f"{path}: its SNPs are not those of {snp_table} in order ({len(snps)} vs {len(expected)} SNPs, first "
                f"difference at column {differ + 1}); harmonise it again against this table"
            )
    if genotypes.shape != (len(samples), len(snps)):
        raise DataPrepError(f"{path}: genotypes of shape {genotypes.shape} for {len(samples)} samples x {len(snps)}")
    return genotypes, samples, snps, labels
