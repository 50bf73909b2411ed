"""Harmonise a site's genotype file against the consortium's SNP table.

The table (a CSV with the columns ``snp,chrom,pos,ref,alt``; ``snp,ref,alt`` tables still work, matched by SNP ID)
fixes, for every SNP, which allele is counted: the result counts copies of the **table's** alt allele (0/1/2), 3 =
missing call or unusable SNP, one column per table SNP in table order, people in file order.

Records are found by chromosome and position (site-local SNP IDs differ between releases and tools; ``chr6``, ``6``
and ``CHR6`` are one chromosome, and PLINK's numeric 23/24/25/26 are X/Y/XY/MT), then aligned by their alleles.
With the file's counted allele ``c`` and other allele ``o`` and the table's ``ref``/``alt``:

=================  ==============================  ==========================
status             alleles                         table-alt count
=================  ==============================  ==========================
``same``           c = alt, o = ref                g
``swapped``        c = ref, o = alt                2 - g
``flipped``        comp(c) = alt, comp(o) = ref    g (other strand)
``flipped_swapped`` comp(c) = ref, comp(o) = alt   2 - g
=================  ==============================  ==========================

Unusable (the column is all 3): ``ambiguous`` (the table's alleles are A/T or C/G: a strand flip cannot be told
from a swap, so such SNPs are dropped rather than resolved by allele frequency), ``multiallelic`` (a record with more
than one ALT, or several records at the position whose alleles fit the SNP), ``mismatch`` (alleles that fit in no
orientation) and ``absent`` (no record at the position).
"""

from __future__ import annotations

import csv
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes.formats import MISSING, FileRecords, read_genotype_file

__all__ = [
    "STATUSES",
    "USABLE",
    "Harmonised",
    "ReferenceTable",
    "align",
    "harmonise",
    "harmonise_file",
    "normalise_chrom",
    "read_snp_table",
]

USABLE = ("same", "swapped", "flipped", "flipped_swapped")
STATUSES = (*USABLE, "ambiguous", "multiallelic", "mismatch", "absent")
_COMPLEMENT = str.maketrans("ACGT", "TGCA")
_PLINK_CODES = {"23": "X", "24": "Y", "25": "XY", "26": "MT", "M": "MT"}
_KNOWN = {str(i) for i in range(1, 23)} | {"X", "Y", "XY", "MT"}


@dataclass(frozen=True)
class ReferenceTable:
    """The consortium's SNPs in table order; ``chrom``/``pos`` are None for an ID-only (``snp,ref,alt``) table."""

    snps: tuple[str, ...]
    ref: tuple[str, ...]
    alt: tuple[str, ...]
    chrom: tuple[str, ...] | None = None  # normalised (normalise_chrom)
    pos: tuple[int, ...] | None = None
    path: str = "SNP table"

    @property
    def by_position(self) -> bool:
        return self.chrom is not None

    def key(self, j: int) -> tuple[str, int] | str:
        return (self.chrom[j], self.pos[j]) if self.chrom is not None and self.pos is not None else self.snps[j]

    def rows(self, keep: np.ndarray | None = None) -> list[dict[str, object]]:
        """The table as CSV rows (``keep``: a boolean mask of the SNPs to write)."""
        index = range(len(self.snps)) if keep is None else np.flatnonzero(keep)
        rows = []
        for j in index:
            row: dict[str, object] = {"snp": self.snps[j]}
            if self.chrom is not None and self.pos is not None:
                row |= {"chrom": self.chrom[j], "pos": self.pos[j]}
            rows.append(row | {"ref": self.ref[j], "alt": self.alt[j]})
        return rows

    def write(self, path: str | Path, keep: np.ndarray | None = None) -> Path:
        rows = self.rows(keep)
        columns = ["snp", "chrom", "pos", "ref", "alt"] if self.by_position else ["snp", "ref", "alt"]
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
        return Path(path)


@dataclass(frozen=True)
class Harmonised:
    """People x table SNPs, int8 copies of the table's alt allele (3 = missing), with each SNP's alignment status."""

    genotypes: np.ndarray
    samples: tuple[str, ...]
    snps: tuple[str, ...]
    status: tuple[str, ...]
    path: str

    def counts(self) -> dict[str, int]:
        found = Counter(self.status)
        return {status: found.get(status, 0) for status in STATUSES}


def normalise_chrom(name: str) -> str:
    """``chr6``/``Chr6``/``6`` -> ``6``; ``chrX``/``23`` -> ``X``; ``chrM``/``26`` -> ``MT``; others upper-cased."""
    text = str(name).strip()
    if text.lower().startswith("chr"):
        text = text[3:]
    text = text.upper()
    return _PLINK_CODES.get(text, text)


def read_snp_table(path: str | Path) -> ReferenceTable:
    """The consortium's table: ``snp,ref,alt`` columns required, ``chrom,pos`` together or not at all."""
    try:
        with open(path, newline="") as handle:
            lines = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataPrepError(f"{path}: cannot read the SNP table ({exc})") from None
    header = [c.strip().lower() for c in lines[0]] if lines else []
    missing = [c for c in ("snp", "ref", "alt") if c not in header]
    half = [c for c in ("chrom", "pos") if c not in header] if ("chrom" in header) != ("pos" in header) else []
    if missing or half:
        raise DataPrepError(
            f"{path}: line 1: the SNP table lacks column(s) {missing + half}; "
            "expected a header snp,chrom,pos,ref,alt (or snp,ref,alt to match by SNP ID)"
        )
    rows = []
    for number, fields in enumerate(lines[1:], start=2):
        if not any(f.strip() for f in fields):
            continue
        if len(fields) != len(header):
            raise DataPrepError(f"{path}: line {number}: {len(fields)} fields, the header names {len(header)}")
        rows.append((number, {c: f.strip() for c, f in zip(header, fields, strict=True)}))
    if not rows:
        raise DataPrepError(f"{path}: the SNP table has no SNPs")
    return _table_from_rows(str(path), rows, "chrom" in header)


def _table_from_rows(path: str, rows: list[tuple[int, dict[str, str]]], by_position: bool) -> ReferenceTable:
    first: dict[object, int] = {}
    chrom, pos = [], []
    for number, row in rows:
        keys: list[object] = [row["snp"]]
        if by_position:
            chrom.append(normalise_chrom(row["chrom"]))
            pos.append(_int(row["pos"], path, number))
            keys.append((chrom[-1], pos[-1]))
        for key in keys:
            if key in first:
                raise DataPrepError(f"{path}: line {number}: {_describe(key)} is also on line {first[key]}")
            first[key] = number
        if not row["ref"] or not row["alt"] or row["ref"].upper() == row["alt"].upper():
            raise DataPrepError(
                f"{path}: line {number}: ref/alt must be two different alleles, got {row['ref']!r}/{row['alt']!r}"
            )
    return ReferenceTable(
        snps=tuple(row["snp"] for _, row in rows),
        ref=tuple(row["ref"].upper() for _, row in rows),
        alt=tuple(row["alt"].upper() for _, row in rows),
        chrom=tuple(chrom) if by_position else None,
        pos=tuple(pos) if by_position else None,
        path=path,
    )


def _describe(key: object) -> str:
    return f"position {key[0]}:{key[1]}" if isinstance(key, tuple) else f"SNP {key!r}"


def _int(text: str, path: str, number: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataPrepError(f"{path}: line {number}: pos {text!r} is not an integer") from None


def align(table_ref: str, table_alt: str, counted: str, other: str) -> str:
    """The status of one biallelic record against one table SNP (module docstring); alleles compared upper-case."""
    ref, alt, counted, other = table_ref.upper(), table_alt.upper(), counted.upper(), other.upper()
    if {ref, alt} in ({"A", "T"}, {"C", "G"}):
        return "ambiguous"
    if (counted, other) == (alt, ref):
        return "same"
    if (counted, other) == (ref, alt):
        return "swapped"
    flipped = (counted.translate(_COMPLEMENT), other.translate(_COMPLEMENT))
    if len(counted) == len(other) == 1 and flipped == (alt, ref):
        return "flipped"
    if len(counted) == len(other) == 1 and flipped == (ref, alt):
        return "flipped_swapped"
    return "mismatch"


def harmonise_file(path: str | Path, table: ReferenceTable) -> Harmonised:
    """Read the table's SNPs out of ``path`` and harmonise them (module docstring)."""
    if table.by_position:
        wanted = set(zip(table.chrom or (), table.pos or (), strict=True))

        def select(chrom: str, pos: int, snp_id: str) -> bool:
            return (normalise_chrom(chrom), pos) in wanted
    else:
        wanted_ids = set(table.snps)

        def select(chrom: str, pos: int, snp_id: str) -> bool:
            return snp_id in wanted_ids

    return harmonise(read_genotype_file(path, select), table)


def harmonise(records: FileRecords, table: ReferenceTable) -> Harmonised:
    """The table-ordered matrix of the selected records (each aligned by :func:`align`)."""
    if not records.pos:
        raise DataPrepError(_nothing_found(records, table))
    candidates: dict[object, list[int]] = {}
    for i in range(len(records.pos)):
        key = (normalise_chrom(records.chrom[i]), records.pos[i]) if table.by_position else records.ids[i]
        candidates.setdefault(key, []).append(i)
    out = np.full((len(records.samples), len(table.snps)), MISSING, np.int8)
    status = []
    for j in range(len(table.snps)):
        found, record = _resolve(candidates.get(table.key(j), []), records, table.ref[j], table.alt[j])
        status.append(found)
        if found in USABLE:
            g = records.genotypes[:, record]
            out[:, j] = np.where(g == MISSING, MISSING, 2 - g) if found.endswith("swapped") else g
    return Harmonised(out, records.samples, table.snps, tuple(status), records.path)


def _resolve(found: list[int], records: FileRecords, ref: str, alt: str) -> tuple[str, int]:
    """(status, record) of one table SNP given the records at its position (or with its ID)."""
    if not found:
        return "absent", -1
    if any(records.multiallelic[i] for i in found):
        return "multiallelic", -1
    statuses = [(align(ref, alt, records.counted[i], records.other[i]), i) for i in found]
    if statuses[0][0] == "ambiguous":
        return statuses[0]
    fitting = [(s, i) for s, i in statuses if s in USABLE]
    if len(fitting) > 1:  # a multi-allelic site split into biallelic records
        return "multiallelic", -1
    return fitting[0] if fitting else ("mismatch", -1)


def _nothing_found(records: FileRecords, table: ReferenceTable) -> str:
    if not table.by_position:
        return f"{records.path}: no SNP ID of {table.path} found in its {records.n_records} records"
    file_chroms = {normalise_chrom(c): (c, n) for c, n in records.chromosomes.items()}
    if file_chroms and not set(file_chroms) & set(table.chrom or ()):
        name, number = next(iter(file_chroms.values()))
        unknown = next(((c, n) for key, (c, n) in file_chroms.items() if key not in _KNOWN), (name, number))
        return (
            f"{records.path}: record {unknown[1]}: chromosome {unknown[0]!r} cannot be reconciled with the chromosomes "
            f"of {table.path} ({', '.join(sorted(set(table.chrom or ()))[:5])}); expected 1-22, X, Y, XY or MT, "
            "with or without 'chr'"
        )
    return (
        f"{records.path}: none of the {len(table.snps)} SNPs of {table.path} found by chromosome and position in its "
        f"{records.n_records} records"
    )
