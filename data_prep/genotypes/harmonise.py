"""Harmonise a site's genotype file against the consortium's SNP table.

The table (a CSV with the columns ``snp,chrom,pos,ref,alt``; ``snp,ref,alt`` tables still work, matched by SNP ID)
fixes, for every SNP, which allele is counted: the result counts copies of the **table's** alt allele (0/1/2), 3 =
missing call or unusable SNP, one column per table SNP in table order, people in file order.

Records are found by chromosome and position (site-local SNP IDs differ between releases and tools; ``chr6``, ``6``
and ``CHR6`` are one chromosome, PLINK's numeric 23/24/25/26 are X/Y/XY/MT, and PLINK's XY, the pseudo-autosomal
part of X, is matched as X), then aligned by their alleles. With the file's counted allele ``c`` and other allele
``o`` and the table's ``ref``/``alt``:

=================  ==============================  ==========================
status             alleles                         table-alt count
=================  ==============================  ==========================
``same``           c = alt, o = ref                g
``swapped``        c = ref, o = alt                2 - g
``flipped``        comp(c) = alt, comp(o) = ref    g (other strand)
``flipped_swapped`` comp(c) = ref, comp(o) = alt   2 - g
``monomorphic``    one known allele k (the other   2 if k (or comp(k)) = alt,
                   ``.`` or ``0``), k ~ ref or alt 0 if k ~ ref
=================  ==============================  ==========================

``monomorphic`` is a record of a SNP nobody in the file carries in two forms (VCF ALT ``.``, PLINK 1.9's allele
``0``): everybody called has two copies of k; a call of the unknown allele is invalid (missing, counted).

Unusable (the column is all 3): ``ambiguous`` (the table's alleles are A/T or C/G: a strand flip cannot be told
from a swap, so such SNPs are dropped rather than resolved by allele frequency), ``multiallelic`` (a multi-allelic
record at the SNP, or, at a single-base SNP, several single-base records: a multi-allelic site split into biallelic
records), ``duplicate`` (two records that both fit), ``mismatch`` (alleles that fit in no orientation),
``filtered`` (the record's FILTER is neither PASS nor ``.``), ``id_mismatch`` (the record at the position names
another SNP) and ``absent`` (no record at the position). At a single-base SNP, records with longer alleles (indels
at the same position) are other variants and are passed over.

**Genome build.** Positions mean something only on one build. A file whose header declares a build (``##reference``,
``##contig`` names or lengths; `data_prep.genotypes.formats.declared_build`) other than the consortium's
(``HarmoniseSettings.genome_build``) is refused. Whether or not a header says anything, the IDs at the matched
positions are compared with the table's (`_same_id`): when more than ``max_id_disagreement`` (default
`MAX_ID_DISAGREEMENT`, 5 %) of those compared disagree, the file is on another build or coordinate convention
and is refused; below it, the disagreeing SNPs are dropped (``id_mismatch``: a renamed rsID or a chance neighbour).
"""

from __future__ import annotations

import csv
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes.bgen import read_bgen
from data_prep.genotypes.formats import (
    BUILDS,
    CALL_NOTES,
    HARD_CALL_THRESHOLD,
    MISSING,
    MISSING_REASONS,
    UNKNOWN_ALLELES,
    FileRecords,
    check_hard_call_threshold,
    normalise_chrom,
    read_genotype_file,
)

__all__ = [
    "MAX_ID_DISAGREEMENT",
    "MIN_PERSON_CALL_RATE",
    "STATUSES",
    "USABLE",
    "HarmoniseSettings",
    "Harmonised",
    "ReferenceTable",
    "align",
    "harmonise",
    "harmonise_file",
    "normalise_chrom",
    "read_snp_table",
]

USABLE = ("same", "swapped", "flipped", "flipped_swapped", "monomorphic")
STATUSES = (*USABLE, "ambiguous", "multiallelic", "duplicate", "mismatch", "filtered", "id_mismatch", "absent")
#: The largest share of rsID disagreements (among the table SNPs found by position where both the table and the file
#: have an rsID) a file may have; above it the file is refused as being on another build (module docstring). Merged
#: and renamed rsIDs between dbSNP releases stay well below it; a file on another build is far above it.
MAX_ID_DISAGREEMENT = 0.05
#: The report names every person whose call rate over the usable SNPs is below this (PLINK's ``--mind 0.1``).
MIN_PERSON_CALL_RATE = 0.9
_COMPLEMENT = str.maketrans("ACGT", "TGCA")
_BASES = re.compile(r"[ACGT]+")
_KNOWN = {str(i) for i in range(1, 23)} | {"X", "Y", "XY", "MT"}
# How a usable SNP's table-alt count comes from the file's count g (0, 1, 2, 3): _TRANSFORM[kind * 4 + g].
_SAME, _SWAP, _NONE, _MONO_UNKNOWN_ALT, _MONO_UNKNOWN_REF, _MONO_KNOWN_ALT, _MONO_KNOWN_REF = range(7)
_TRANSFORM = np.array(
    [
        [0, 1, 2, MISSING],  # same, flipped
        [2, 1, 0, MISSING],  # swapped, flipped_swapped
        [MISSING] * 4,  # unusable
        [2, MISSING, MISSING, MISSING],  # monomorphic, the unknown allele counted (must be 0), known = table alt
        [0, MISSING, MISSING, MISSING],  # ... known = table ref
        [MISSING, MISSING, 2, MISSING],  # monomorphic, the known allele counted (must be 2), known = table alt
        [MISSING, MISSING, 0, MISSING],  # ... known = table ref
    ],
    np.int8,
).ravel()
_VALID_MONO_COUNT = {_MONO_UNKNOWN_ALT: 0, _MONO_UNKNOWN_REF: 0, _MONO_KNOWN_ALT: 2, _MONO_KNOWN_REF: 2}


@dataclass(frozen=True)
class HarmoniseSettings:
    """The harmoniser's settings (``harmonise`` command options): the dosage rule's threshold, the rsID disagreement
    share above which a file is refused, and the consortium's genome build (None: not checked against headers)."""

    hard_call_threshold: float = HARD_CALL_THRESHOLD
    max_id_disagreement: float = MAX_ID_DISAGREEMENT
    genome_build: str | None = None
    min_person_call_rate: float = MIN_PERSON_CALL_RATE  # the report names the people below it (nobody is dropped)

    def __post_init__(self) -> None:
        check_hard_call_threshold(self.hard_call_threshold)
        for name in ("max_id_disagreement", "min_person_call_rate"):
            share = getattr(self, name)
            if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
                raise DataPrepError(f"{name} must be a share in [0, 1], got {share!r}")
        if self.genome_build is not None and self.genome_build not in BUILDS:
            raise DataPrepError(f"genome_build must be one of {', '.join(BUILDS)}, got {self.genome_build!r}")

    def as_dict(self) -> dict[str, object]:
        return {
            "hard_call_threshold": self.hard_call_threshold,
            "max_id_disagreement": self.max_id_disagreement,
            "genome_build": self.genome_build,
            "min_person_call_rate": self.min_person_call_rate,
        }


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


@dataclass(frozen=True, eq=False)
class Harmonised:
    """People x table SNPs, int8 copies of the table's alt allele (3 = missing), with each SNP's alignment status and
    what was done to the file's calls (`checks`)."""

    genotypes: np.ndarray
    samples: tuple[str, ...]
    snps: tuple[str, ...]
    status: tuple[str, ...]
    path: str
    calls: dict[str, int] = field(default_factory=dict)  # CALL_NOTES summed over the usable SNPs
    ids: dict[str, object] = field(default_factory=dict)  # the rsID comparison (harmonise)
    build: dict[str, object] = field(default_factory=dict)  # what the header declares and what was required
    sex: dict[str, int] | None = None  # people per sex (PLINK .fam/.psam); None: the file records none (VCF)
    person_call_rate: np.ndarray | None = None  # per person, over the usable SNPs
    settings: HarmoniseSettings = field(default_factory=HarmoniseSettings)

    def counts(self) -> dict[str, int]:
        found = Counter(self.status)
        return {status: found.get(status, 0) for status in STATUSES}

    def dropped(self) -> dict[str, list[str]]:
        """The table SNPs that are not usable, by status."""
        out: dict[str, list[str]] = {}
        for snp, status in zip(self.snps, self.status, strict=True):
            if status not in USABLE:
                out.setdefault(status, []).append(snp)
        return out

    def checks(self) -> dict[str, object]:
        """What harmonising did beyond alignment, for the report (docs/genomics.md lists every entry)."""
        return {
            "dropped": self.dropped(),
            "calls": {
                "one_copy_as_homozygous": self.calls.get("one_copy_as_homozygous", 0),
                "dosage_hard_called": self.calls.get("dosage_hard_called", 0),
                "set_missing": {reason: self.calls.get(reason, 0) for reason in MISSING_REASONS},
            },
            "person_call_rate": self._person_summary(),
            "ids": self.ids,
            "genome_build": self.build,
            "sex": self.sex,
            "settings": self.settings.as_dict(),
        }

    def _person_summary(self) -> dict[str, object]:
        rate = self.person_call_rate
        if rate is None or not len(rate) or np.isnan(rate).all():
            return {"mean": None, "min": None, "threshold": self.settings.min_person_call_rate, "below": []}
        low = np.flatnonzero(rate < self.settings.min_person_call_rate)
        return {
            "mean": round(float(rate.mean()), 6),
            "min": round(float(rate.min()), 6),
            "threshold": self.settings.min_person_call_rate,
            "below": [{"sample": self.samples[i], "call_rate": round(float(rate[i]), 6)} for i in low],
        }


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
            if pos[-1] < 1:
                raise DataPrepError(
                    f"{path}: line {number}: pos {pos[-1]} is not a position (>= 1): an unplaced probe ('0 0' in a "
                    ".bim) has none; drop the row"
                )
            keys.append((chrom[-1], pos[-1]))
        for key in keys:
            if key in first:
                raise DataPrepError(f"{path}: line {number}: {_describe(key)} is also on line {first[key]}")
            first[key] = number
        if not row["ref"] or not row["alt"] or row["ref"].upper() == row["alt"].upper():
            raise DataPrepError(
                f"{path}: line {number}: ref/alt must be two different alleles, got {row['ref']!r}/{row['alt']!r}"
            )
        if not (_BASES.fullmatch(row["ref"].upper()) and _BASES.fullmatch(row["alt"].upper())):
            raise DataPrepError(
                f"{path}: line {number}: alleles {row['ref']!r}/{row['alt']!r} are not A/C/G/T: the table fixes the "
                "counted allele by its bases (an array's 1/2 or A/B coding names none); write the bases"
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
    if (counted in UNKNOWN_ALLELES) != (other in UNKNOWN_ALLELES):  # one known allele: a monomorphic record
        return "monomorphic" if _monomorphic(ref, alt, counted, other) is not None else "mismatch"
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


def _monomorphic(ref: str, alt: str, counted: str, other: str) -> int | None:
    """The transform of a monomorphic record (upper-case alleles, exactly one unknown), None if its known allele
    is neither table allele on either strand (a non-ambiguous pair and its complement share no allele)."""
    unknown_counted = counted in UNKNOWN_ALLELES
    known = other if unknown_counted else counted
    flipped = known.translate(_COMPLEMENT) if len(known) == 1 else None
    if alt in (known, flipped):
        return _MONO_UNKNOWN_ALT if unknown_counted else _MONO_KNOWN_ALT
    if ref in (known, flipped):
        return _MONO_UNKNOWN_REF if unknown_counted else _MONO_KNOWN_REF
    return None


def harmonise_file(path: str | Path, table: ReferenceTable, settings: HarmoniseSettings | None = None) -> Harmonised:
    """Read the table's SNPs out of ``path`` and harmonise them (module docstring)."""
    settings = settings or HarmoniseSettings()
    if table.by_position:
        wanted = {(_match_chrom(c), p) for c, p in zip(table.chrom or (), table.pos or (), strict=True)}
        chroms: dict[str, str] = {}

        def select(chrom: str, pos: int, snp_id: str) -> bool:
            key = chroms.get(chrom)
            if key is None:
                key = chroms[chrom] = _match_chrom(chrom)
            return (key, pos) in wanted
    else:
        wanted_ids = set(table.snps)

        def select(chrom: str, pos: int, snp_id: str) -> bool:
            return snp_id in wanted_ids or (";" in snp_id and not wanted_ids.isdisjoint(snp_id.split(";")))

    records = read_genotype_file(path, select, settings.hard_call_threshold, readers={"bgen": read_bgen})
    return harmonise(records, table, settings)


def _match_chrom(name: str) -> str:
    """The chromosome a record is looked up under: normalised, PLINK's XY (the pseudo-autosomal part of X) as X."""
    chrom = normalise_chrom(name)
    return "X" if chrom == "XY" else chrom


def harmonise(records: FileRecords, table: ReferenceTable, settings: HarmoniseSettings | None = None) -> Harmonised:
    """The table-ordered matrix of the selected records (each aligned by `align`), after the genome-build and
    rsID checks (module docstring)."""
    settings = settings or HarmoniseSettings()
    if records.gvcf:
        raise DataPrepError(_gvcf_refusal(records, table))
    if not records.pos:
        raise DataPrepError(_nothing_found(records, table))
    build = _check_build(records, table, settings)
    _check_mitochondrion(records, table)
    candidates: dict[object, list[int]] = {}
    if table.by_position:
        chroms: dict[str, str] = {}
        for i, (chrom, pos) in enumerate(zip(records.chrom, records.pos, strict=True)):
            key = chroms.get(chrom)
            if key is None:
                key = chroms[chrom] = _match_chrom(chrom)
            candidates.setdefault((key, pos), []).append(i)
    else:
        for i, snp_id in enumerate(records.ids):
            for part in snp_id.split(";") if ";" in snp_id else (snp_id,):
                candidates.setdefault(part, []).append(i)
    n_snps = len(table.snps)
    status = ["absent"] * n_snps
    kinds = np.full(n_snps, _NONE, np.int8)
    source = np.zeros(n_snps, np.intp)
    agree, disagree = 0, []
    table_ids = {_id_key(snp) for snp in table.snps}
    for j in range(n_snps):
        found = candidates.get(_table_key(table, j))
        if not found:
            continue
        found_status, record = _resolve(found, records, table.ref[j], table.alt[j])
        if table.by_position:
            same_id = _same_id(table.snps[j], found, records, table_ids)
            if same_id is True:
                agree += 1
            elif same_id is False:
                disagree.append(j)
                if found_status in USABLE:
                    found_status = "id_mismatch"
        status[j] = found_status
        if found_status in USABLE:
            source[j] = record
            kinds[j] = _kind(found_status, table.ref[j], table.alt[j], records, record)
    ids = _check_ids(agree, disagree, records, table, settings)
    genotypes, invalid = _apply(records, kinds, source)
    usable = kinds != _NONE
    calls = records.notes[source[usable]].sum(axis=0) if usable.any() else np.zeros(len(CALL_NOTES), np.int64)
    calls[CALL_NOTES.index("invalid_allele")] += invalid
    person_call_rate = _person_call_rate(genotypes, int(usable.sum()))
    _check_usable(records, table, status, person_call_rate, calls)
    sex = None
    if records.sex is not None:
        sex = {"male": int((records.sex == 1).sum()), "female": int((records.sex == 2).sum())}
        sex["unknown"] = len(records.samples) - sex["male"] - sex["female"]
    return Harmonised(
        genotypes, records.samples, table.snps, tuple(status), records.path,
        calls={note: int(n) for note, n in zip(CALL_NOTES, calls, strict=True)}, ids=ids, build=build, sex=sex,
        person_call_rate=person_call_rate, settings=settings,
    )  # fmt: skip


def _table_key(table: ReferenceTable, j: int) -> object:
    if table.chrom is None or table.pos is None:
        return table.snps[j]
    chrom = table.chrom[j]
    return ("X" if chrom == "XY" else chrom, table.pos[j])


def _kind(status: str, ref: str, alt: str, records: FileRecords, record: int) -> int:
    if status == "monomorphic":
        kind = _monomorphic(ref.upper(), alt.upper(), records.counted[record].upper(), records.other[record].upper())
        assert kind is not None  # align said monomorphic
        return kind
    return _SWAP if status.endswith("swapped") else _SAME


def _is_rsid(text: str) -> bool:
    return text[:2].lower() == "rs" and len(text) > 2


_RS_VERSION = re.compile(r"\.\d+$")


def _id_key(text: str) -> str:
    """An ID as compared with the table's: an rsID in lower case without a version suffix (``RS101``, ``rs101.1``
    and ``rs101`` are one SNP written in other styles, not a sign of another build); other IDs as written."""
    return _RS_VERSION.sub("", text.lower()) if _is_rsid(text) else text


def _same_id(snp: str, found: list[int], records: FileRecords, table_ids: set[str]) -> bool | None:
    """Whether the records at a table SNP's position name it: True when one of their IDs (``;``-separated in a VCF;
    compared by `_id_key`) is the table's; False when they name another SNP of the table, or carry rsIDs only other
    than the table's rsID; None otherwise (site-local IDs such as ``1:1000:A:G`` or ``.`` say nothing)."""
    parts = [_id_key(part) for i in found for part in records.ids[i].split(";")]
    snp = _id_key(snp)
    if snp in parts:
        return True
    if not table_ids.isdisjoint(parts) or (_is_rsid(snp) and any(_is_rsid(part) for part in parts)):
        return False
    return None


def _person_call_rate(genotypes: np.ndarray, usable: int, chunk: int = 2**24) -> np.ndarray:
    """Each person's share of called genotypes over the usable SNPs (the unusable columns are all missing), NaN when
    no SNP is usable; counted a block of people at a time (no full-size temporary)."""
    n_people, n_snps = genotypes.shape
    if not usable:
        return np.full(n_people, np.nan)
    missing = np.empty(n_people, np.int64)
    rows = max(1, chunk // max(n_snps, 1))
    for start in range(0, n_people, rows):
        missing[start : start + rows] = (genotypes[start : start + rows] == MISSING).sum(axis=1)
    return 1.0 - (missing - (n_snps - usable)) / usable


def _check_ids(
    agree: int, disagree: list[int], records: FileRecords, table: ReferenceTable, settings: HarmoniseSettings
) -> dict[str, object]:
    """The rsID comparison for the report; refuses the file above ``settings.max_id_disagreement``."""
    compared = agree + len(disagree)
    share = len(disagree) / compared if compared else 0.0
    if share > settings.max_id_disagreement:
        key = _table_key(table, disagree[0])
        raise DataPrepError(
            f"{records.path}: {len(disagree)} of the {compared} table SNPs found by position carry another ID in the "
            f"file ({share:.1%}, above max_id_disagreement {settings.max_id_disagreement:.1%}; e.g. "
            f"{table.snps[disagree[0]]} at {key[0]}:{key[1]} is {_ids_at(records, key)}): it is on another genome "
            f"build or coordinate convention than {table.path}; lift it over to the table's build"
        )
    at = _ids_by_position(records, {_table_key(table, j) for j in disagree})
    listed = [{"snp": table.snps[j], "position": "{}:{}".format(*_table_key(table, j)),
               "file_ids": at[_table_key(table, j)]} for j in disagree]  # fmt: skip
    return {
        "compared": compared,
        "disagree": len(disagree),
        "share": round(share, 6),
        "max_share": settings.max_id_disagreement,
        "disagreements": listed,
    }


def _ids_at(records: FileRecords, key: object) -> str:
    return _ids_by_position(records, {key})[key]


def _ids_by_position(records: FileRecords, keys: set) -> dict[object, str]:
    """The IDs of the records at each of ``keys`` ((chromosome, position)), comma-separated."""
    found: dict[object, list[str]] = {key: [] for key in keys}
    for chrom, pos, snp_id in zip(records.chrom, records.pos, records.ids, strict=True):
        key = (_match_chrom(chrom), pos)
        if key in found:
            found[key].append(snp_id)
    return {key: ",".join(ids) for key, ids in found.items()}


def _check_mitochondrion(records: FileRecords, table: ReferenceTable) -> None:
    """Refuse a file whose mitochondrial records at table SNPs are on hg19's chrM (`formats.HG19_CHRM_LENGTH`): the
    table's MT positions, on GRCh37 or GRCh38, are on the rCRS, another sequence."""
    if records.hg19_mt and any(normalise_chrom(chrom) == "MT" for chrom in records.chrom):
        raise DataPrepError(
            f"{records.path}: its mitochondrial records are on hg19's chrM ({records.hg19_mt}; NC_001807), the table "
            f"{table.path}'s MT SNPs on the rCRS (16,569 bp; GRCh37's MT, GRCh38's chrM), another sequence: drop them "
            "from the file (bcftools view -t ^chrM) or lift them over to the rCRS"
        )


def _check_build(records: FileRecords, table: ReferenceTable, settings: HarmoniseSettings) -> dict[str, object]:
    """The build the header declares, refused when the consortium's build is set and the header says another."""
    expected = settings.genome_build
    if expected is not None and records.build is not None and records.build != expected:
        declared = "conflicting genome builds" if records.build == "conflicting" else f"genome build {records.build}"
        raise DataPrepError(
            f"{records.path}: its header declares {declared} ({records.build_evidence}), the consortium's table "
            f"{table.path} is on {expected} (--genome-build): lift the file over first"
        )
    return {"declared": records.build, "evidence": records.build_evidence, "required": expected}


def _apply(records: FileRecords, kinds: np.ndarray, source: np.ndarray, chunk: int = 2**24) -> tuple[np.ndarray, int]:
    """The table-ordered matrix: each table SNP's record column through its transform (``_TRANSFORM``), a block of
    people at a time; the identity (every table SNP usable, unchanged, in the file's order) is returned as read.
    Also the calls of monomorphic records that named their unknown allele (set missing)."""
    genotypes = records.genotypes
    n_people, n_snps = genotypes.shape[0], len(kinds)
    invalid = 0
    for kind, valid in _VALID_MONO_COUNT.items():
        columns = source[kinds == kind]
        if len(columns):
            block = genotypes[:, columns]
            invalid += int(((block != valid) & (block != MISSING)).sum())
    if genotypes.shape[1] == n_snps and (kinds == _SAME).all() and (source == np.arange(n_snps)).all():
        return genotypes, invalid
    out = np.empty((n_people, n_snps), np.int8)
    offset = (4 * kinds).astype(np.int8)
    rows = max(1, chunk // max(n_snps, 1))
    for start in range(0, n_people, rows):
        block = np.take(genotypes[start : start + rows], source, axis=1)
        block += offset
        np.take(_TRANSFORM, block, out=out[start : start + rows])
    return out, invalid


def _resolve(found: list[int], records: FileRecords, ref: str, alt: str) -> tuple[str, int]:
    """(status, record) of one table SNP given the records at its position (or with its ID). At a single-base SNP,
    records with a longer allele (indels, an unnormalised ``C>CA,CAA``) are other variants and are passed over;
    several single-base records are one multi-allelic site split into biallelic records (``multiallelic``), or the
    same SNP twice (``duplicate``: two records that both fit)."""
    if len(ref) == len(alt) == 1:
        found = [i for i in found if _single_base(records, i)]
        if not found:
            return "mismatch", -1
    if any(records.multiallelic[i] for i in found):
        return "multiallelic", -1
    statuses = [(align(ref, alt, records.counted[i], records.other[i]), i) for i in found]
    if statuses[0][0] == "ambiguous":
        return statuses[0]
    fitting = [(s, i) for s, i in statuses if s in USABLE]
    if len(fitting) > 1:
        return "duplicate", -1
    if not fitting:
        return "mismatch", -1
    if len(found) > 1 and len(ref) == len(alt) == 1:  # one fits, another single-base record is the same site
        return "multiallelic", -1
    return ("filtered", -1) if records.filtered[fitting[0][1]] else fitting[0]


def _single_base(records: FileRecords, i: int) -> bool:
    return len(records.other[i]) == 1 and all(len(a) == 1 for a in records.counted[i].split(","))


#: A file is refused when fewer than this share of the table SNPs found in it (neither absent nor ambiguous) are
#: usable, or when its people are called at fewer than this share of the usable SNPs on average: such a file
#: holds the SNPs in a form the harmoniser cannot read, and as a site of the federated QC it would drop every SNP.
MIN_USABLE_SHARE = 0.1
_MIN_FOUND_TO_JUDGE = 10  # fewer table SNPs found in a file say too little about it (a test table, a tiny panel)
#: Allele codings a SNP array's export may use instead of A/C/G/T: (the alleles, what it is, how to get bases).
_CODINGS = (
    (frozenset("012"), "coded 1/2 (plink --recode12: 1 = minor, 2 = major; the bases are gone)",
     "export the file again with its bases, or set them from the array's manifest: plink2 --bfile site "
     "--update-alleles manifest_alleles.txt --make-bed --out site_acgt"),
    (frozenset("01234"), "coded 1/2/3/4 (1 = A, 2 = C, 3 = G, 4 = T)",
     "recode them as bases with PLINK 1.9: plink --bfile site --alleleACGT --make-bed --out site_acgt"),
    (frozenset("0AB"), "coded A/B (Illumina)",
     "set the bases from the array's manifest (its A/B-to-TOP or -to-forward columns): plink2 --bfile site "
     "--update-alleles manifest_alleles.txt --make-bed --out site_acgt"),
)  # fmt: skip
#: What a file whose SNPs are mostly of one unusable status probably holds, and what to do.
_STATUS_CAUSES = {
    "mismatch": "their alleles fit the table's in no orientation (another allele coding or another reference): "
    "compare a few records with the table",
    "multiallelic": "multi-allelic records (ALT alleles nobody carries: bcftools view --trim-alt-alleles)",
    "filtered": "records failing their FILTER (the caller flagged them)",
    "duplicate": "every SNP twice (plink2 --rm-dup, bcftools norm --rm-dup all)",
    "id_mismatch": "other IDs than the table's at its positions",
}


def _allele_coding(records: FileRecords) -> tuple[str, str] | None:
    """(what, fix) when at least 90 % of the selected records write their alleles in one array coding
    (`_CODINGS`, tried in order: 1/2 before 1/2/3/4) and one of its own codes (2, 3/4 or B) occurs."""
    alleles = [{*records.counted[i].upper().split(","), records.other[i].upper()} for i in range(len(records.pos))]
    for used, what, fix in _CODINGS:
        inside = [rec for rec in alleles if rec <= used]
        marker = used - {"0", "1", "A"}
        if inside and len(inside) >= 0.9 * len(alleles) and any(rec & marker for rec in inside):
            return what, fix
    return None


def _check_usable(
    records: FileRecords, table: ReferenceTable, status: list[str], call_rate: np.ndarray, calls: np.ndarray
) -> None:
    """Refuse a file of which (almost) no table SNP can be used, or (almost) nobody is called at the usable ones,
    naming the likely cause and its fix (`MIN_USABLE_SHARE`)."""
    found = Counter(s for s in status if s not in ("absent", "ambiguous"))
    n_found = sum(found.values())
    usable = sum(found[s] for s in USABLE)
    coding = _allele_coding(records)
    if coding is not None and usable < MIN_USABLE_SHARE * n_found:
        raise DataPrepError(
            f"{records.path}: its alleles are {coding[0]}, not A/C/G/T: {usable} of the {n_found} table SNPs found in "
            f"it can be used; {coding[1]}"
        )
    if n_found < _MIN_FOUND_TO_JUDGE:
        return
    dropped = ", ".join(f"{s} {n}" for s, n in found.most_common() if s not in USABLE)
    if usable < MIN_USABLE_SHARE * n_found:
        worst = next(s for s, _ in found.most_common() if s not in USABLE)
        gvcf = " (its header has gVCF lines: convert it as for a gVCF)" if records.gvcf_header else ""
        raise DataPrepError(
            f"{records.path}: only {usable} of the {n_found} table SNPs found in it can be used ({dropped}): mostly "
            f"{_STATUS_CAUSES.get(worst, worst)}{gvcf}; a site with this file would drop every SNP of the federated "
            "QC"
        )
    mean_rate = float(np.nanmean(call_rate)) if len(call_rate) else 1.0
    if mean_rate < MIN_USABLE_SHARE:
        reasons = sorted(zip(calls[2:], CALL_NOTES[2:], strict=True), reverse=True)
        why = ", ".join(f"{note} {int(n)}" for n, note in reasons if n) or "missing in the file"
        raise DataPrepError(
            f"{records.path}: its people are called at {mean_rate:.1%} of the {usable} usable table SNPs on average "
            f"(calls set missing: {why}): almost no genotype can be read from it; check its call fields (GT, DS) "
            "and --hard-call-threshold"
        )


def _gvcf_refusal(records: FileRecords, table: ReferenceTable) -> str:
    """A gVCF: its reference blocks (``END=``) start elsewhere than the table's positions and its variant records carry
    a ``<NON_REF>`` allele, so no SNP reads right; bcftools makes a VCF of it (checked: the harmoniser reads that
    output exactly)."""
    return (
        f"{records.path}: a gVCF ({records.gvcf}): its reference blocks are not records at the table's positions and "
        "its variant records are multi-allelic, so no SNP can be read from it; convert it first: bcftools convert "
        f"--gvcf2vcf --fasta-ref REF.fa {records.path} -Ou | bcftools view --trim-alt-alleles -T positions.tsv -Oz -o "
        f"site.vcf.gz (positions.tsv: CHROM and POS of {table.path}'s SNPs, named as in the file)"
    )


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
