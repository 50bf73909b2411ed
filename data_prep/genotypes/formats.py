"""Read a site's genotype file: VCF / VCF.gz / BCF (cyvcf2), PLINK 1 ``.bed/.bim/.fam`` (bed-reader), PLINK 2
``.pgen/.pvar/.psam`` (pgenlib), chosen by the file's extension.

The binary genotype blocks are decoded by those libraries only; the small text side files (``.bim``, ``.fam``,
``.pvar``, ``.psam``) are read here, line by line, so that a malformed line is reported by its number.

A reader returns the records a caller selects (by chromosome, position and ID: the harmoniser asks for the table's
SNPs) and, for each selected biallelic record, the count of one of its alleles per person, ``int8``, 3 = missing:

- VCF/BCF and PLINK 2: the count of the ALT allele; REF is the other allele.
- PLINK 1: the count of allele 1 (``.bim`` column 5); allele 2 (column 6) is the other. Which of them is a VCF "ALT"
  depends on the tool that wrote the file (PLINK 1.9 puts the minor allele in column 5), so nothing here assumes it:
  the harmoniser aligns every record to the consortium's table.

A diploid call with a missing allele (``./.``, ``./1``) is missing; so is a haploid call (``0``), which autosomal
SNPs do not have. Multi-allelic records (more than one ALT) are returned without genotypes (the harmoniser cannot
use them).

Bad input raises :class:`~data_prep.errors.DataPrepError` in one line naming the file, the line or record and what is
wrong.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.optional import require

__all__ = ["FORMATS", "MISSING", "FileRecords", "Selector", "genotype_format", "read_genotype_file"]

MISSING = 3  # the same code as data_prep.genomics.MISSING (imported from here would make a circle)
EXTRA = "genotypes"
FORMATS = {".vcf": "vcf", ".vcf.gz": "vcf", ".vcf.bgz": "vcf", ".bcf": "vcf", ".bed": "plink1", ".pgen": "plink2"}

#: ``select(chrom, pos, snp_id)``: whether the caller wants a record (chromosome as written in the file).
Selector = Callable[[str, int, str], bool]


@dataclass
class FileRecords:
    """The selected records of a genotype file and the counts of their ``counted`` allele (people x records)."""

    path: str
    samples: tuple[str, ...]
    chrom: list[str] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    counted: list[str] = field(default_factory=list)  # the allele whose copies `genotypes` counts
    other: list[str] = field(default_factory=list)  # the record's other allele(s), comma-separated if multi-allelic
    multiallelic: list[bool] = field(default_factory=list)
    genotypes: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int8))  # int8, 3 = missing
    n_records: int = 0  # every record in the file, selected or not
    chromosomes: dict[str, int] = field(default_factory=dict)  # each chromosome name -> its first record number

    def add(self, chrom: str, pos: int, snp_id: str, counted: str, other: str, multiallelic: bool) -> None:
        self.chrom.append(chrom)
        self.pos.append(pos)
        self.ids.append(snp_id)
        self.counted.append(counted)
        self.other.append(other)
        self.multiallelic.append(multiallelic)


def genotype_format(path: str | Path) -> str:
    """``vcf``, ``plink1`` or ``plink2`` from the file name; anything else is refused naming the allowed endings."""
    name = str(path).lower()
    for suffix, kind in FORMATS.items():
        if name.endswith(suffix):
            return kind
    raise DataPrepError(f"{path}: not a genotype file; expected one of {', '.join(FORMATS)} (PLINK: the .bed or .pgen)")


def read_genotype_file(path: str | Path, select: Selector) -> FileRecords:
    """The records of ``path`` that ``select`` keeps, with their genotypes (module docstring)."""
    kind = genotype_format(path)
    if not Path(path).is_file():
        raise DataPrepError(f"{path}: no such file")
    reader = {"vcf": _read_vcf, "plink1": _read_plink1, "plink2": _read_plink2}[kind]
    records = reader(Path(path), select)
    _check_unique_samples(records.samples, str(path))
    return records


# ---- VCF / BCF --------------------------------------------------------------------------------------------------


def _read_vcf(path: Path, select: Selector) -> FileRecords:
    cyvcf2 = require("cyvcf2", EXTRA, "reading VCF/BCF files")
    if not str(path).lower().endswith(".bcf"):
        _check_unique_samples(_vcf_header_samples(path), str(path))  # htslib refuses them with a vague message
    try:
        vcf = cyvcf2.VCF(str(path), lazy=True)
    except Exception as exc:  # OSError for a non-VCF file, a bare Exception for a header htslib cannot parse
        raise DataPrepError(f"{path}: not a readable VCF/BCF file ({_one_line(exc)})") from None
    records = FileRecords(str(path), tuple(vcf.samples))
    if not records.samples:
        raise DataPrepError(f"{path}: the header names no samples (a sites-only VCF has no genotypes)")
    columns = []
    last = "the header"
    variants = iter(vcf)
    while True:
        try:
            variant = next(variants)
        except StopIteration:
            break
        except Exception as exc:  # cyvcf2 raises a bare Exception carrying htslib's parse error
            raise DataPrepError(
                f"{path}: record {records.n_records + 1} (after {last}) does not parse: {_one_line(exc)}"
            ) from None
        records.n_records += 1
        chrom, pos, snp_id = variant.CHROM, variant.POS, variant.ID or "."
        records.chromosomes.setdefault(chrom, records.n_records)
        last = f"{chrom}:{pos}"
        if not select(chrom, pos, snp_id):
            continue
        alts = variant.ALT
        records.add(chrom, pos, snp_id, alts[0] if alts else ".", variant.REF, len(alts) > 1)
        columns.append(_vcf_counts(variant.genotype, len(records.samples)) if len(alts) == 1 else None)
    vcf.close()
    records.genotypes = _stack(columns, len(records.samples))
    return records


def _vcf_header_samples(path: Path) -> tuple[str, ...]:
    """The sample names of a text VCF's ``#CHROM`` line (plain or gzip/bgzip), empty if it has none."""
    try:
        with (gzip.open if path.suffix in (".gz", ".bgz") else open)(path, "rt") as handle:
            for line in handle:
                if line.startswith("#CHROM"):
                    return tuple(line.rstrip("\n").split("\t")[9:])
                if not line.startswith("##"):
                    break
    except (OSError, UnicodeDecodeError, EOFError):
        pass  # not text: cyvcf2 reports it
    return ()


def _vcf_counts(genotype, n_people: int) -> np.ndarray:
    """Copies of ALT (allele 1) per person from cyvcf2's (people, ploidy + 1) allele array; -1/-2: missing/haploid."""
    if genotype is None:
        return np.full(n_people, MISSING, np.int8)
    alleles = genotype.array()[:, :2]
    counts = (alleles == 1).sum(axis=1).astype(np.int8)
    counts[(alleles < 0).any(axis=1)] = MISSING
    return counts


def _stack(columns: list[np.ndarray | None], n_people: int) -> np.ndarray:
    out = np.full((n_people, len(columns)), MISSING, np.int8)
    for j, column in enumerate(columns):
        if column is not None:
            out[:, j] = column
    return out


# ---- PLINK 1 ------------------------------------------------------------------------------------------------------


def _read_plink1(path: Path, select: Selector) -> FileRecords:
    bim, fam = _side_file(path, ".bim"), _side_file(path, ".fam")
    samples = tuple(fields[1] for _, fields in _table_lines(fam, 6, "FID IID father mother sex phenotype"))
    records = FileRecords(str(path), samples)
    wanted = []
    for number, fields in _table_lines(bim, 6, "chrom id cM pos allele1 allele2"):
        chrom, snp_id, pos = fields[0], fields[1], _position(fields[3], bim, number)
        records.n_records += 1
        records.chromosomes.setdefault(chrom, number)
        if select(chrom, pos, snp_id):
            records.add(chrom, pos, snp_id, fields[4], fields[5], False)
            wanted.append(records.n_records - 1)
    bed_reader = require("bed_reader", EXTRA, "reading PLINK 1 .bed files")
    try:
        with bed_reader.open_bed(path, iid_count=len(samples), sid_count=records.n_records) as bed:
            counts = bed.read(index=np.s_[:, wanted], dtype="int8", order="C") if wanted else None
    except Exception as exc:  # bed-reader reports a bad magic number or a short file as a ValueError/RuntimeError
        raise DataPrepError(f"{path}: not a readable PLINK 1 .bed file ({_one_line(exc)})") from None
    records.genotypes = np.zeros((len(samples), 0), np.int8) if counts is None else counts
    records.genotypes[records.genotypes < 0] = MISSING  # bed-reader's int8 missing value is -127
    return records


# ---- PLINK 2 ------------------------------------------------------------------------------------------------------


def _read_plink2(path: Path, select: Selector) -> FileRecords:
    pvar, psam = _side_file(path, ".pvar"), _side_file(path, ".psam")
    records = FileRecords(str(path), _psam_samples(psam))
    wanted, allele_counts = [], []
    for number, chrom, pos, snp_id, ref, alt in _pvar_records(pvar):
        records.n_records += 1
        records.chromosomes.setdefault(chrom, number)
        alts = alt.split(",")
        allele_counts.append(1 + len(alts))
        if select(chrom, pos, snp_id):
            records.add(chrom, pos, snp_id, alts[0], ref, len(alts) > 1)
            wanted.append(records.n_records - 1)
    pgenlib = require("pgenlib", EXTRA, "reading PLINK 2 .pgen files")
    biallelic = [i for i, multi in zip(wanted, records.multiallelic, strict=True) if not multi]
    offsets = None
    if max(allele_counts, default=2) > 2:  # pgenlib needs the allele index offsets to decode multi-allelic files
        offsets = np.concatenate([[0], np.cumsum(allele_counts)]).astype(np.uintp)
    counts = np.empty((len(biallelic), len(records.samples)), np.int8)
    try:
        reader = pgenlib.PgenReader(
            bytes(path), raw_sample_ct=len(records.samples), variant_ct=records.n_records, allele_idx_offsets=offsets
        )
        if biallelic:
            reader.read_list(np.array(biallelic, dtype=np.uint32), counts)
        reader.close()
    except Exception as exc:  # pgenlib raises RuntimeError/ValueError naming the decoding problem
        raise DataPrepError(f"{path}: not a readable PLINK 2 .pgen file ({_one_line(exc)})") from None
    counts[counts < 0] = MISSING  # pgenlib's missing call is -9
    columns: list[np.ndarray | None] = []
    rows = iter(counts)
    for multi in records.multiallelic:
        columns.append(None if multi else next(rows))
    records.genotypes = _stack(columns, len(records.samples))
    return records


def _psam_samples(psam: Path) -> tuple[str, ...]:
    lines = list(_text_lines(psam))
    if not lines:
        raise DataPrepError(f"{psam}: empty; expected a header '#IID ...' or '#FID IID ...' and one line per sample")
    header = lines[0][1].split()
    if header[0] in ("#IID", "#FID"):
        if "IID" not in header and header[0] != "#IID":
            raise DataPrepError(f"{psam}: line {lines[0][0]}: the header names no IID column: {lines[0][1]!r}")
        column = 0 if header[0] == "#IID" else header.index("IID")
        body, width = lines[1:], len(header)
    else:  # no header: the .fam layout (FID IID father mother sex phenotype)
        column, body, width = 1, lines, 6
    samples = []
    for number, line in body:
        fields = line.split()
        if len(fields) < max(column + 1, min(width, 2)):
            raise DataPrepError(f"{psam}: line {number}: expected {width} columns, got {len(fields)}: {line!r}")
        samples.append(fields[column])
    return tuple(samples)


def _pvar_records(pvar: Path) -> Iterator[tuple[int, str, int, str, str, str]]:
    """(line, chrom, pos, id, ref, alt) per record of a ``.pvar`` (with a ``#CHROM`` header) or ``.bim``-style file."""
    columns = None
    for number, line in _text_lines(pvar):
        if line.startswith("##"):
            continue
        fields = line.split()
        if line.startswith("#CHROM"):
            columns = [name.lstrip("#") for name in fields]
            missing = [c for c in ("CHROM", "POS", "ID", "REF", "ALT") if c not in columns]
            if missing:
                raise DataPrepError(f"{pvar}: line {number}: the header lacks column(s) {missing}")
            continue
        if columns is None:  # .bim layout: chrom id cM pos alt ref
            if len(fields) != 6:
                raise DataPrepError(f"{pvar}: line {number}: expected a '#CHROM' header or 6 .bim-style columns")
            yield number, fields[0], _position(fields[3], pvar, number), fields[1], fields[5], fields[4]
            continue
        if len(fields) != len(columns):
            raise DataPrepError(f"{pvar}: line {number}: {len(fields)} columns, the header names {len(columns)}")
        row = dict(zip(columns, fields, strict=True))
        yield number, row["CHROM"], _position(row["POS"], pvar, number), row["ID"], row["REF"], row["ALT"]


# ---- shared text helpers ------------------------------------------------------------------------------------------


def _side_file(path: Path, suffix: str) -> Path:
    side = path.with_suffix(suffix)
    if not side.is_file():
        raise DataPrepError(f"{path}: its {suffix} file {side} is missing (PLINK keeps it beside the genotypes)")
    return side


def _text_lines(path: Path) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line.rstrip("\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataPrepError(f"{path}: cannot read it as text ({_one_line(exc)})") from None


def _table_lines(path: Path, width: int, layout: str) -> Iterator[tuple[int, list[str]]]:
    for number, line in _text_lines(path):
        fields = line.split()
        if len(fields) != width:
            raise DataPrepError(f"{path}: line {number}: expected {width} columns ({layout}), got {len(fields)}")
        yield number, fields


def _position(text: str, path: Path, number: int) -> int:
    try:
        return int(text)
    except ValueError:
        raise DataPrepError(f"{path}: line {number}: position {text!r} is not an integer") from None


def _check_unique_samples(samples: tuple[str, ...], path: str) -> None:
    first: dict[str, int] = {}
    for number, sample in enumerate(samples, start=1):
        if sample in first:
            raise DataPrepError(
                f"{path}: duplicated sample ID {sample!r} (samples {first[sample]} and {number}); each person once"
            )
        first[sample] = number


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
