"""BGEN, UK Biobank's imputed format (v1.2/v1.3, layout 2): read with cbgen, written here from the format's public
specification (test fixtures, the I/O benchmark).

**Reading.** The variants' metadata come from a metafile cbgen writes into a temporary folder (nothing is written
beside the site's file). Each record's probabilities are hard-called by the dosage rule of every other format
(`data_prep.genotypes.formats`, the same functions a VCF ``GP`` goes through): PLINK 2's dosage P(het) + 2 P(hom)
of the record's second allele, called when the expected distance from the nearest count is within the threshold.
Phased records (two haplotype probabilities per copy) give the genotype distribution of independent haplotypes. The
call's ploidy is the file's: a one-copy call on X, Y or MT counts as 0 or 2 (the X rule), a one-copy call on an
autosome is missing; a sample flagged missing is missing. The counted allele is the record's second (with plink2's
``ref-first``, UK Biobank's first allele is REF); the harmoniser aligns every record to the SNP table, so which of the
two a file puts first does not matter. A chromosome written with leading zeros (UK Biobank's ``01``) is read as ``1``.

**Sample IDs.** From the ``.sample`` file beside the ``.bgen`` (``FILE.sample`` or ``FILE.bgen.sample``; the Oxford
layout: a header line, a line of column types starting ``0``, then one person a line; the ID is ``ID_2``, as
plink2 reads it, else the first column), else from the IDs the ``.bgen`` embeds. A ``.sample`` listing another number
of people than the ``.bgen`` holds, or other IDs than the ones it embeds (``ID_2``, ``ID_1`` or plink2's
``ID_1_ID_2``), and a ``.bgen`` with neither, are refused
in one line: one person more or less would give everyone after them another person's genotypes.
"""

from __future__ import annotations

import struct
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes import formats as f
from data_prep.optional import require

__all__ = ["read_bgen", "sample_path", "write_bgen"]

SUFFIX = ".bgen"
CHUNK = 512  # records decoded, then called together


def sample_path(path: Path) -> Path | None:
    """The ``.sample`` file beside a ``.bgen``: ``FILE.sample``, else ``FILE.bgen.sample``; None if neither exists."""
    for candidate in (path.with_suffix(".sample"), path.with_name(path.name + ".sample")):
        if candidate.is_file():
            return candidate
    return None


def read_sample_file(path: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(IDs, the names each ID may be embedded under) of an Oxford ``.sample`` file (module docstring); a malformed
    file is refused naming the line. A ``.bgen`` may embed ``ID_2``, ``ID_1`` or plink2's ``ID_1_ID_2``."""
    lines = [(number, line.split()) for number, line in f._text_lines(path)]
    if len(lines) < 2 or not lines[1][1] or lines[1][1][0] != "0":
        raise DataPrepError(
            f"{path}: not an Oxford .sample file (expected a header 'ID_1 ID_2 missing ...', then a line of column "
            "types starting with 0, then one person a line)"
        )
    header = lines[0][1]
    column = header.index("ID_2") if "ID_2" in header else 0
    samples, names = [], []
    for number, fields in lines[2:]:
        if len(fields) != len(header):
            raise DataPrepError(f"{path}: line {number}: {len(fields)} columns, the header names {len(header)}")
        samples.append(fields[column])
        names.append(frozenset({fields[column], fields[0], f"{fields[0]}_{fields[column]}"}))
    return tuple(samples), tuple(names)


def _samples(path: Path, bgen) -> tuple[str, ...]:
    """The people of the ``.bgen`` in file order (module docstring, sample IDs)."""
    n_people = bgen.nsamples
    embedded = tuple(s.decode() for s in bgen.read_samples()) if bgen.contain_samples else None
    side = sample_path(path)
    if side is None:
        if embedded is None:
            raise DataPrepError(
                f"{path}: no sample IDs: the .bgen embeds none and no .sample file is beside it ({path.stem}.sample); "
                "copy the .sample file written with this .bgen next to it under that name"
            )
        return embedded
    samples, names = read_sample_file(side)
    if len(samples) != n_people:
        raise DataPrepError(
            f"{path} holds {n_people} people, its sample file {side} lists {len(samples)}: use the .sample written "
            "with this .bgen (a line added or deleted shifts every person after it)"
        )
    differ = [i for i, name in enumerate(embedded or ()) if name not in names[i]]
    if embedded is not None and differ:
        first = differ[0]
        raise DataPrepError(
            f"{path} embeds other sample IDs than {side} lists (person {first + 1}: {embedded[first]!r} in the .bgen, "
            f"{samples[first]!r} in the .sample): use the .sample written with this .bgen"
        )
    return samples


def _chrom(name: str) -> str:
    return str(int(name)) if name.isdigit() else name  # UK Biobank writes chromosome 1 as '01'


def read_bgen(path: Path, select: f.Selector, threshold: float) -> f.FileRecords:
    """The records of a ``.bgen`` that ``select`` keeps, hard-called (module docstring)."""
    cbgen = require("cbgen", f.EXTRA, "reading BGEN files")
    try:
        bgen = cbgen.bgen_file(path)
    except Exception as exc:  # cbgen raises RuntimeError for a file it cannot parse
        raise DataPrepError(f"{path}: not a readable BGEN file ({f._one_line(exc)})") from None
    with bgen, tempfile.TemporaryDirectory(prefix="fedalg-bgen-") as scratch:
        samples = _samples(path, bgen)
        records = f.FileRecords(str(path), samples)
        offsets: list[int] = []
        try:
            bgen.create_metafile(Path(scratch) / "variants.metafile")
            metafile = cbgen.bgen_metafile(Path(scratch) / "variants.metafile")
        except Exception as exc:
            raise DataPrepError(f"{path}: the variant blocks do not parse ({f._one_line(exc)})") from None
        with metafile:
            for index in range(metafile.npartitions):
                variants = metafile.read_partition(index).variants
                for k in range(len(variants.offset)):
                    _add_variant(records, variants, k, select, offsets)
        n_people = len(samples)
        records.genotypes = np.full((n_people, len(offsets)), f.MISSING, np.int8)
        records.notes = np.zeros((len(offsets), len(f.CALL_NOTES)), np.int64)
        kinds = [f._chrom_kind(chrom) for chrom in records.chrom]
        for columns in _chunks(offsets, kinds):
            _read_chunk(path, bgen, records, offsets, columns, kinds[columns[0]], threshold)
    return records


def _chunks(offsets: list[int], kinds: list[int], size: int = CHUNK) -> list[list[int]]:
    """Runs of at most ``size`` biallelic records (columns) on chromosomes of one kind, read and called together."""
    runs: list[list[int]] = []
    for column, offset in enumerate(offsets):
        if offset < 0:  # multi-allelic: no genotypes
            continue
        if runs and len(runs[-1]) < size and kinds[runs[-1][-1]] == kinds[column]:
            runs[-1].append(column)
        else:
            runs.append([column])
    return runs


def _read_chunk(path: Path, bgen, records: f.FileRecords, offsets: list[int], columns: list[int], kind: int,
                threshold: float) -> None:  # fmt: skip
    """Decode the records ``columns`` and call them all at once (the rule works per call, whatever its record)."""
    n_people = len(records.samples)
    distribution = np.empty((len(columns), n_people, 3))
    ploidy = np.empty((len(columns), n_people), np.uint8)
    missing = np.empty((len(columns), n_people), bool)
    for row, column in enumerate(columns):
        try:
            genotype = bgen.read_genotype(offsets[column], precision=64)
        except Exception as exc:
            raise DataPrepError(
                f"{path}: the probabilities of record {records.chrom[column]}:{records.pos[column]} do not "
                f"decode ({f._one_line(exc)}): the file is truncated or damaged, copy it again"
            ) from None
        distribution[row] = _distribution(genotype)
        ploidy[row], missing[row] = genotype.ploidy, genotype.missing
    codes = _codes(distribution.reshape(-1, 3), ploidy.ravel(), missing.ravel(), kind, threshold)
    codes = codes.reshape(len(columns), n_people)
    records.genotypes[:, columns] = f._COUNT[codes].T
    flat = (np.arange(len(columns))[:, None] * f._N_CODES + codes).ravel()
    records.notes[columns] = np.bincount(flat, minlength=len(columns) * f._N_CODES).reshape(-1, f._N_CODES) @ f._NOTE


def _add_variant(records: f.FileRecords, variants, k: int, select: f.Selector, offsets: list[int]) -> None:
    records.n_records += 1
    chrom = _chrom(variants.chromosome[k].decode())
    pos = int(variants.position[k])
    rsid = variants.rsid[k].decode() or variants.id[k].decode() or "."
    records.chromosomes.setdefault(chrom, records.n_records)
    if not select(chrom, pos, rsid):
        return
    alleles = variants.allele_ids[k].decode().split(",")
    multi = len(alleles) != 2
    records.add(chrom, pos, rsid, ",".join(alleles[1:]) or ".", alleles[0], multi)
    offsets.append(-1 if multi else int(variants.offset[k]))


def _distribution(genotype) -> np.ndarray:
    """A record's people x 3 probabilities of 0, 1, 2 copies of its second allele (a one-copy call's two values in
    the first two columns); a phased record's two copies combined as independent haplotypes."""
    probs = np.asarray(genotype.probability, np.float64)
    out = np.full((len(probs), 3), np.nan)
    if not genotype.phased:
        out[:, : min(3, probs.shape[1])] = probs[:, :3]
        return out
    first = probs[:, 0:2]  # per copy: P(allele 1), P(allele 2)
    second = probs[:, 2:4] if probs.shape[1] >= 4 else np.full((len(probs), 2), np.nan)
    diploid = np.stack(
        [first[:, 0] * second[:, 0], first[:, 0] * second[:, 1] + first[:, 1] * second[:, 0],
         first[:, 1] * second[:, 1]], axis=1)  # fmt: skip
    haploid = np.asarray(genotype.ploidy) == 1
    out[~haploid] = diploid[~haploid]
    out[haploid, :2] = first[haploid]
    return out


def _codes(
    distribution: np.ndarray, ploidy: np.ndarray, missing: np.ndarray, kind: int, threshold: float
) -> np.ndarray:
    """Call codes from probabilities, ploidy and missingness (one row a call, any number of records of one
    chromosome kind; module docstring)."""
    haploid = ploidy == 1
    base = np.full(len(ploidy), f._MISS, np.int8)
    base[ploidy == 2] = f._HOM_REF  # a placeholder: the dosage replaces it
    base[haploid] = f._HAPLOID if kind == f._DIPLOID else f._HEMI_REF
    base[ploidy > 2] = f._POLYPLOID
    base[missing] = f._MISS
    certain = np.zeros(len(base), bool)
    if kind == f._DIPLOID:  # a certain diploid call (one probability 1, two 0: most of an imputed file) is its count,
        # which is what the rule gives it; the rule runs on the others
        p0, p1, p2 = distribution[:, 0], distribution[:, 1], distribution[:, 2]
        one_hot = ((p0 == 1.0) & (p1 == 0.0) & (p2 == 0.0)) | ((p1 == 1.0) & (p0 == 0.0) & (p2 == 0.0))
        one_hot |= (p2 == 1.0) & (p0 == 0.0) & (p1 == 0.0)
        certain = (base == f._HOM_REF) & one_hot
        base = np.where(certain, np.where(certain, p1 + 2 * p2, 0).astype(np.int8), base)  # counts 0-2 = codes 0-2
    rest = np.flatnonzero(~certain)
    part = distribution[rest]
    part[(base[rest] == f._MISS) | (base[rest] == f._POLYPLOID)] = np.nan
    dosage, spread = f._probability_dosage(part, haploid[rest])
    base[rest] = f._vcf_dosage(base[rest], dosage, True, kind, threshold, spread)
    return base


# ---- writing (BGEN v1.2, layout 2, zlib; unphased) -------------------------------------------------------------


def write_bgen(
    path: str | Path,
    probabilities: np.ndarray,
    samples: Sequence[str],
    chrom: Sequence[str],
    pos: Sequence[int],
    ids: Sequence[str],
    alleles: Sequence[tuple[str, str]],
    bits: int = 8,
    ploidy: np.ndarray | None = None,
    missing: np.ndarray | None = None,
    embed_samples: bool = True,
    sample_file: bool = True,
) -> Path:
    """Write ``path`` as BGEN v1.2 (layout 2, zlib, unphased). ``probabilities`` are people x records x 3: P(0, 1, 2
    copies of the record's second allele), a one-copy call's (P(first), P(second)) in the first two; each is stored as
    the nearest multiple of 1 / (2^bits - 1) (the last value of a call is implied). ``ploidy`` (people x records, 1 or
    2, default 2) and ``missing`` (bool) as the format stores them; ``embed_samples`` writes the IDs into the file,
    ``sample_file`` writes ``FILE.sample`` beside it."""
    path = Path(path)
    probs = np.asarray(probabilities, np.float64)
    n_people, n_records = probs.shape[:2]
    ploidy = np.full((n_people, n_records), 2, np.uint8) if ploidy is None else np.asarray(ploidy, np.uint8)
    missing = np.zeros((n_people, n_records), bool) if missing is None else np.asarray(missing, bool)
    flags = 1 | (2 << 2) | ((1 << 31) if embed_samples else 0)  # zlib, layout 2, sample IDs
    sample_block = b""
    if embed_samples:
        body = b"".join(_string(s, "<H") for s in samples)
        sample_block = struct.pack("<II", 8 + len(body), n_people) + body
    header = struct.pack("<III", 20, n_records, n_people) + b"bgen" + struct.pack("<I", flags)
    with open(path, "wb") as out:
        out.write(struct.pack("<I", len(header) + len(sample_block)) + header + sample_block)
        for j in range(n_records):
            first, second = alleles[j]
            out.write(_string(ids[j], "<H") + _string(ids[j], "<H") + _string(str(chrom[j]), "<H"))
            out.write(struct.pack("<IH", int(pos[j]), 2) + _string(first, "<I") + _string(second, "<I"))
            data = _probability_block(probs[:, j], ploidy[:, j], missing[:, j], bits)
            packed = zlib.compress(data)
            out.write(struct.pack("<II", len(packed) + 4, len(data)) + packed)
    if sample_file:
        lines = ["ID_1 ID_2 missing", "0 0 0", *(f"{s} {s} 0" for s in samples)]
        path.with_suffix(".sample").write_text("\n".join(lines) + "\n")
    return path


def _string(text: str, length: str) -> bytes:
    raw = text.encode()
    return struct.pack(length, len(raw)) + raw


def _to_integers(probs: np.ndarray, ploidy: np.ndarray, scale: int) -> np.ndarray:
    """Each call's probabilities (3, or 2 for a one-copy call) as integers summing to ``scale``, the specification's
    rounding: each value floored, the remainder given one unit at a time to the largest fractional parts."""
    width = np.where(ploidy == 1, 2, 3)
    values = np.where(np.arange(3)[None, :] < width[:, None], np.nan_to_num(probs[:, :3]), 0.0)
    total = values.sum(axis=1, keepdims=True)
    values = np.divide(values, total, out=np.zeros_like(values), where=total > 0) * scale
    floors = np.floor(values)
    short = (scale - floors.sum(axis=1)).astype(np.int64)
    order = np.argsort(-(values - floors), axis=1, kind="stable")
    rank = np.argsort(order, axis=1)
    return (floors + (rank < short[:, None])).astype(np.int64)


def _probability_block(probs: np.ndarray, ploidy: np.ndarray, missing: np.ndarray, bits: int) -> bytes:
    """One record's uncompressed probability data (layout 2): the stored values, all but each call's last, packed
    ``bits`` each, least significant bit first."""
    integers = _to_integers(probs, ploidy, (1 << bits) - 1)
    stored = np.where(missing[:, None], 0, integers[:, :2])  # a missing call's values are stored as zeros
    keep = np.column_stack([ploidy >= 1, ploidy >= 2])  # a diploid call stores 2 of its 3 values, a haploid 1 of 2
    values = stored[keep].astype(np.uint64)
    head = struct.pack("<IHBB", len(ploidy), 2, int(ploidy.min()), int(ploidy.max()))
    head += (ploidy.astype(np.uint8) | np.where(missing, 0x80, 0).astype(np.uint8)).tobytes()
    head += struct.pack("<BB", 0, bits)
    bit_matrix = ((values[:, None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)).astype(np.uint8)
    return head + np.packbits(bit_matrix.ravel(), bitorder="little").tobytes()
