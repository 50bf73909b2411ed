"""Read a site's genotype file: VCF / VCF.gz / BCF (cyvcf2), PLINK 1 ``.bed/.bim/.fam`` (bed-reader), PLINK 2
``.pgen/.pvar/.psam`` (pgenlib), BGEN ``.bgen`` with its ``.sample`` (cbgen, `data_prep.genotypes.bgen`), chosen by the
file's extension.

The binary genotype blocks are decoded by those libraries only; the small text side files (``.bim``, ``.fam``,
``.pvar``, ``.psam``) are read here, line by line, so that a malformed line is reported by its number. A ``.fam`` and
a ``.psam`` are read as plink2 reads both: '#' lines before the people are comments, ``#FID``/``#IID`` the header; a
header without its '#' or a '#' line among the people is refused, and so is a ``.fam``/``.psam`` listing other people
than the ``.bed``/``.pgen`` holds (`_check_bed_padding`, the ``.pgen``'s sample count): one line more or less would
give every person after it another person's genotypes.

A reader returns the records a caller selects (by chromosome, position and ID: the harmoniser asks for the table's
SNPs) and, for each selected biallelic record, the count of one of its alleles per person, ``int8``, 3 = missing:

- VCF/BCF and PLINK 2: the count of the ALT allele; REF is the other allele. BGEN: the count of the record's second
  allele (UK Biobank's ALT).
- PLINK 1: the count of allele 1 (``.bim`` column 5); allele 2 (column 6) is the other. Which of them is a VCF "ALT"
  depends on the tool that wrote the file (PLINK 1.9 puts the minor allele in column 5), so nothing here assumes it:
  the harmoniser aligns every record to the consortium's table.

How a call becomes a count, the same in every format (each rule's calls are tallied per record, ``CALL_NOTES``):

- **One copy of a chromosome** (the X rule). A person with one copy of X (a male, outside the pseudo-autosomal
  regions), of Y or of MT has 0 or 2 copies of an allele, never 1: PLINK stores such a call as a homozygote, and a VCF
  haploid call (``0``, ``1``) is counted the same way, as 0 or 2. A heterozygous call where the person has one copy is
  impossible and counts as missing. Who has one copy: in a VCF the call's ploidy says it (haploid); in PLINK the
  ``.fam``/``.psam`` sex (1 = male) on chromosome X (23), and everybody on Y (24) and MT (26); PLINK's XY (25, the
  pseudo-autosomal regions) is diploid. A haploid call elsewhere (an autosome) and a call of more than two alleles
  are missing. A person of unknown sex is taken as the file writes them.
- **Dosages** (the dosage rule): where the file holds a dosage (VCF ``DS``, else ``GP``, which then take precedence
  over ``GT``, else, only without a ``GT``, ``PL`` as probabilities under a flat prior; PLINK 2 dosages), the call
  is the nearest whole count when the dosage lies within ``hard_call_threshold`` (default ``HARD_CALL_THRESHOLD`` =
  0.1, PLINK 2's own default) of it, and missing otherwise. The dosage of probabilities is PLINK 2's, P(het) +
  2 P(hom alt), and their distance from the count c the expected one, sum_g |g - c| P(g): the same as a DS's for
  probabilities of two adjacent counts, 1 for (0.5, 0, 0.5), whose dosage 1 is no heterozygote. Dosages and
  distances are first rounded to PLINK 2's resolution (``DOSAGE_UNIT``), so a value gives one call in every format.
  A dosage outside [0, 2] is invalid (missing). On X, Y and MT a VCF dosage is used only with a ``GT`` that gives
  the call's ploidy (a haploid call's dosage, 0-1, is doubled); without one it is missing.
- **Alleles a record does not have** (``0/2`` in a biallelic record, ``1`` in a record whose ALT is ``.``) are
  missing.
- Records whose VCF/``.pvar`` FILTER is neither ``PASS`` nor ``.`` are marked (``FileRecords.filtered``); the
  harmoniser does not use them.

A record with one known allele (VCF/``.pvar`` ALT ``.``, a PLINK 1 allele ``0``: a SNP monomorphic in the file) is
returned as it is, its unknown allele written ``.`` or ``0``; the harmoniser counts it against the table.
Multi-allelic records (more than one ALT) are returned without genotypes (the harmoniser cannot use them).

Bad input raises `data_prep.errors.DataPrepError` in one line naming the file, the line or record and what is
wrong.
"""

from __future__ import annotations

import functools
import gzip
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.optional import require

__all__ = [
    "BUILDS",
    "CALL_NOTES",
    "FORMATS",
    "HARD_CALL_THRESHOLD",
    "MISSING",
    "MISSING_REASONS",
    "UNKNOWN_ALLELES",
    "FileRecords",
    "Selector",
    "check_hard_call_threshold",
    "declared_build",
    "genotype_format",
    "normalise_chrom",
    "read_genotype_file",
]

MISSING = 3  # the same code as data_prep.genomics.MISSING (imported from here would make a circle)
EXTRA = "genotypes"
FORMATS = {
    ".vcf": "vcf", ".vcf.gz": "vcf", ".vcf.bgz": "vcf", ".bcf": "vcf", ".bed": "plink1", ".pgen": "plink2",
    ".bgen": "bgen",
}  # fmt: skip
#: How a file writes the allele a monomorphic record lacks: VCF/.pvar ALT ``.``, PLINK 1.9's allele ``0``.
UNKNOWN_ALLELES = frozenset({".", "0"})
#: The default dosage certainty: a dosage within this distance of a whole count is hard-called (PLINK 2's default
#: ``--hard-call-threshold``); farther away the call is missing.
HARD_CALL_THRESHOLD = 0.1
#: What the readers did to calls, tallied per record (``FileRecords.notes``) and summed in the harmonise report:
#: two kinds of calls kept as counts, then the reasons a call was set missing (``MISSING_REASONS``).
CALL_NOTES = (
    "one_copy_as_homozygous",  # a one-copy call (VCF haploid on X/Y/MT; PLINK male X, Y, MT) counted as 0 or 2
    "dosage_hard_called",  # a non-integer dosage within the threshold of a count
    "invalid_allele",  # an allele the record does not have (0/2 in a biallelic record), a dosage outside [0, 2]
    "half_call",  # one allele called, the other missing (./1, 0/.)
    "haploid",  # a haploid call where the person has two copies (an autosome, XY)
    "polyploid",  # a call of three or more alleles
    "heterozygous_one_copy",  # a heterozygous call where the person has one copy
    "dosage_uncertain",  # a dosage farther than the threshold from every count
    "dosage_ploidy_unknown",  # a VCF dosage on X/Y/MT without a GT saying one copy or two
)
MISSING_REASONS = CALL_NOTES[2:]
#: Genome builds the harmoniser can tell from a header (``declared_build``).
BUILDS = ("GRCh37", "GRCh38")
_PLINK_CODES = {"23": "X", "24": "Y", "25": "XY", "26": "MT", "M": "MT"}
#: gVCF alleles: the "any other allele" of a gVCF (GATK <NON_REF>, bcftools <*>), never an allele of a SNP.
_GVCF_ALLELES = frozenset({"<NON_REF>", "<*>"})
#: The VCF FORMAT fields a call is read from (GT; DS, GP and PL by the dosage rule).
_CALL_FIELDS_ORDER = ("GT", "DS", "GP", "PL")
_CALL_FIELDS = frozenset(_CALL_FIELDS_ORDER)
_PADDING_CHECK_SNPS = 32  # a .fam person reading as .bed padding at this many SNPs is refused (_check_bed_padding)

#: ``select(chrom, pos, snp_id)``: whether the caller wants a record (chromosome as written in the file).
Selector = Callable[[str, int, str], bool]

# ---- call codes ------------------------------------------------------------------------------------------------
# Every call of a record becomes one code; _COUNT maps it to the count (3 = missing), _NOTE to its CALL_NOTES entry.
_HOM_REF, _HET, _HOM_ALT, _MISS, _HEMI_REF, _HEMI_ALT, _HAPLOID, _INVALID, _HEMI_HET = range(9)
_DOSE_0, _DOSE_1, _DOSE_2, _DOSE_UNCERTAIN, _HALF, _POLYPLOID, _DOSE_PLOIDY = range(9, 16)
_N_CODES = 16
_COUNT = np.array([0, 1, 2, MISSING, 0, 2, MISSING, MISSING, MISSING, 0, 1, 2] + [MISSING] * 4, np.int8)
_NOTE = np.zeros((_N_CODES, len(CALL_NOTES)), np.int64)
_NOTED = {
    "one_copy_as_homozygous": (_HEMI_REF, _HEMI_ALT),
    "dosage_hard_called": (_DOSE_0, _DOSE_1, _DOSE_2),
    "invalid_allele": (_INVALID,),
    "half_call": (_HALF,),
    "haploid": (_HAPLOID,),
    "polyploid": (_POLYPLOID,),
    "heterozygous_one_copy": (_HEMI_HET,),
    "dosage_uncertain": (_DOSE_UNCERTAIN,),
    "dosage_ploidy_unknown": (_DOSE_PLOIDY,),
}
for _note, _codes in _NOTED.items():
    _NOTE[list(_codes), CALL_NOTES.index(_note)] = 1
_DIPLOID, _X, _ONE_COPY = 0, 1, 2  # chromosome kinds: autosomes (and XY, unplaced), X, Y and MT
_EPSILON = 1e-4  # a dosage this close to a count is that count (VCF DS is written with 3-4 decimals)
#: PLINK 2's dosage resolution, 1/16384 of a copy: what a .pgen stores, and how plink2 rounds a VCF DS on import.
#: Every dosage is rounded to it before the threshold (one rule in every format: a VCF DS of 0.1, float32
#: 0.10000000149, and its .pgen value 1638/16384 = 0.09998 are both within 0.1 of 0).
DOSAGE_UNIT = 16384


def _gt_code(a0: int, a1: int, n_alts: int, kind: int) -> int:
    """The code of one VCF call from its first two allele indices (-1 missing, -2 no second allele: haploid; 2
    stands for any index >= 2), the record's ALT count and the chromosome's kind."""
    if a0 == -2:  # no first allele: not a call
        return _MISS
    if a1 == -2:  # haploid
        if a0 < 0:
            return _MISS
        if a0 > n_alts:
            return _INVALID
        return _HAPLOID if kind == _DIPLOID else (_HEMI_ALT if a0 == 1 else _HEMI_REF)
    if a0 < 0 and a1 < 0:
        return _MISS
    if a0 < 0 or a1 < 0:  # ./1, 0/.: half a call is no call
        return _HALF if max(a0, a1) <= n_alts else _INVALID
    if a0 > n_alts or a1 > n_alts:
        return _INVALID
    copies = (a0 == 1) + (a1 == 1)
    return _HEMI_HET if copies == 1 and kind == _ONE_COPY else copies


#: _GT_LUT[kind, n_alts][a0 + 2, a1 + 2] with the indices clipped to [-2, 2].
_GT_LUT = {
    (kind, n_alts): np.array([[_gt_code(a0, a1, n_alts, kind) for a1 in range(-2, 3)] for a0 in range(-2, 3)], np.int8)
    for kind in (_DIPLOID, _X, _ONE_COPY)
    for n_alts in (0, 1)
}


@functools.lru_cache(maxsize=4096)
def _chrom_kind(name: str) -> int:
    chrom = normalise_chrom(name)
    return _X if chrom == "X" else _ONE_COPY if chrom in ("Y", "MT") else _DIPLOID


def normalise_chrom(name: str) -> str:
    """``chr6``/``Chr6``/``6`` -> ``6``; ``chrX``/``23`` -> ``X``; ``chrM``/``26`` -> ``MT``; others upper-cased."""
    text = str(name).strip()
    if text.lower().startswith("chr"):
        text = text[3:]
    text = text.upper()
    return _PLINK_CODES.get(text, text)


def check_hard_call_threshold(value: object) -> float:
    """The dosage rule's threshold, refused unless it is a number in [0, 0.5)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 0.5:
        raise DataPrepError(f"hard_call_threshold must be a number in [0, 0.5), got {value!r}")
    return float(value)


@dataclass
class FileRecords:
    """The selected records of a genotype file and the counts of their ``counted`` allele (people x records)."""

    path: str
    samples: tuple[str, ...]
    chrom: list[str] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    counted: list[str] = field(default_factory=list)  # the allele whose copies `genotypes` counts (all ALTs of a
    # multi-allelic record, comma-separated; it has no genotypes)
    other: list[str] = field(default_factory=list)  # the record's other allele
    multiallelic: list[bool] = field(default_factory=list)
    filtered: list[bool] = field(default_factory=list)  # FILTER neither PASS nor '.' (VCF, .pvar)
    genotypes: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.int8))  # int8, 3 = missing
    notes: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CALL_NOTES)), np.int64))  # records x notes
    sex: np.ndarray | None = None  # per person 1 male, 2 female, 0 unknown (PLINK); None: the format has none (VCF)
    build: str | None = None  # the genome build the header declares (declared_build), None if it declares none
    build_evidence: str = ""
    hg19_mt: str = ""  # the header line declaring hg19's chrM (hg19_mitochondrion), empty if none
    n_records: int = 0  # every record in the file, selected or not
    chromosomes: dict[str, int] = field(default_factory=dict)  # each chromosome name -> its first record number
    gvcf: str = ""  # a selected VCF record with a gVCF allele (<NON_REF>, <*>): the file is an unconverted gVCF
    gvcf_header: bool = False  # the header has gVCF lines (##GVCFBlock, ##ALT=<ID=NON_REF>): kept after conversion

    def add(
        self, chrom: str, pos: int, snp_id: str, counted: str, other: str, multiallelic: bool, filtered: bool = False
    ) -> None:
        self.chrom.append(chrom)
        self.pos.append(pos)
        self.ids.append(snp_id)
        self.counted.append(counted)
        self.other.append(other)
        self.multiallelic.append(multiallelic)
        self.filtered.append(filtered)


def genotype_format(path: str | Path) -> str:
    """``vcf``, ``plink1``, ``plink2`` or ``bgen`` from the file name; anything else is refused naming the endings."""
    name = str(path).lower()
    for suffix, kind in FORMATS.items():
        if name.endswith(suffix):
            return kind
    raise DataPrepError(f"{path}: not a genotype file; expected one of {', '.join(FORMATS)} (PLINK: the .bed or .pgen)")


#: ``reader(path, select, threshold)``: a format's reader.
Reader = Callable[[Path, Selector, float], "FileRecords"]


def read_genotype_file(
    path: str | Path,
    select: Selector,
    hard_call_threshold: float = HARD_CALL_THRESHOLD,
    readers: Mapping[str, Reader] | None = None,
) -> FileRecords:
    """The records of ``path`` that ``select`` keeps, with their genotypes (module docstring). ``readers`` adds the
    readers of formats defined outside this module (BGEN: ``data_prep.genotypes.bgen.read_bgen``, which reads this
    module's rules and so cannot be imported by it; the harmoniser passes it)."""
    kind = genotype_format(path)
    threshold = check_hard_call_threshold(hard_call_threshold)
    if not Path(path).is_file():
        raise DataPrepError(f"{path}: no such file")
    known: dict[str, Reader] = {"vcf": _read_vcf, "plink1": _read_plink1, "plink2": _read_plink2, **(readers or {})}
    if kind not in known:
        raise DataPrepError(f"{path}: a {kind} file is read by data_prep.genotypes.harmonise.harmonise_file")
    records = known[kind](Path(path), select, threshold)
    _check_unique_samples(records.samples, str(path))
    return records


# ---- genome build -------------------------------------------------------------------------------------------------

#: Lengths of chromosomes 1, 2 and X in each build (hg19 = GRCh37, hg38 = GRCh38 for these).
_LENGTHS = {
    ("1", 249250621): "GRCh37", ("2", 243199373): "GRCh37", ("X", 155270560): "GRCh37",
    ("1", 248956422): "GRCh38", ("2", 242193529): "GRCh38", ("X", 156040895): "GRCh38",
}  # fmt: skip
_BUILD_NAMES = (
    (re.compile(r"grch37|hg19|\bb37\b|hs37|g1k_v37|_v37\b", re.IGNORECASE), "GRCh37"),
    (re.compile(r"grch38|hg38|\bb38\b|hs38", re.IGNORECASE), "GRCh38"),
)
_CONTIG = re.compile(r"^##contig=<(.*)>\s*$")


#: hg19's mitochondrion (UCSC chrM, NC_001807) is 16,571 bp; GRCh37's MT and GRCh38's chrM are the rCRS
#: (NC_012920), 16,569 bp: another sequence, on which the same position is another base.
HG19_CHRM_LENGTH = 16571


def hg19_mitochondrion(header: list[str] | str) -> str:
    """The ``##contig`` line (shortened) declaring hg19's chrM (`HG19_CHRM_LENGTH`), empty if the header has none."""
    lines = header.splitlines() if isinstance(header, str) else header
    for line in lines:
        contig = _CONTIG.match(line)
        if contig:
            fields = dict(part.split("=", 1) for part in contig.group(1).split(",") if "=" in part)
            if normalise_chrom(fields.get("ID", "")) == "MT" and fields.get("length") == str(HG19_CHRM_LENGTH):
                return f"##contig {fields['ID']} length={HG19_CHRM_LENGTH}"
    return ""


def declared_build(header: list[str] | str) -> tuple[str | None, str]:
    """(build, evidence) from a VCF or ``.pvar`` header's ``##reference`` and ``##contig`` lines (names such as
    GRCh38/hg19/b37 and the lengths of chromosomes 1, 2 and X); ``(None, "")`` when it declares none, ``("conflicting",
    evidence)`` when its lines disagree."""
    lines = header.splitlines() if isinstance(header, str) else header
    found: dict[str, str] = {}
    for line in lines:
        if line.startswith("##reference="):
            for pattern, build in _BUILD_NAMES:
                if pattern.search(line):
                    found.setdefault(build, line.strip()[:80])
            continue
        contig = _CONTIG.match(line)
        if not contig:
            continue
        fields = dict(part.split("=", 1) for part in contig.group(1).split(",") if "=" in part)
        for pattern, build in _BUILD_NAMES:
            if pattern.search(fields.get("assembly", "")):
                found.setdefault(build, f"##contig {fields.get('ID')} assembly={fields['assembly']}")
        length = fields.get("length", "")
        build = _LENGTHS.get((normalise_chrom(fields.get("ID", "")), int(length) if length.isdigit() else -1))
        if build:
            found.setdefault(build, f"##contig {fields.get('ID')} length={length}")
    if not found:
        return None, ""
    if len(found) > 1:
        return "conflicting", "; ".join(f"{b}: {e}" for b, e in found.items())
    ((build, evidence),) = found.items()
    return build, evidence


# ---- how calls become counts -------------------------------------------------------------------------------------


def _quantise(values: np.ndarray) -> np.ndarray:
    """Values at PLINK 2's dosage resolution, `DOSAGE_UNIT` (module docstring, the dosage rule)."""
    return np.rint(values * DOSAGE_UNIT) / DOSAGE_UNIT


def _dosage_codes(dosage: np.ndarray, threshold: float, probs: np.ndarray | None = None) -> np.ndarray:
    """Codes of diploid dosages (copies of the counted allele, 0-2; NaN or negative values of a missing call are
    handled by the caller): a whole count, one within the threshold, uncertain, or invalid outside [0, 2]. The
    distance to the nearest count is |dosage - count|, or, where ``probs`` (people x 3, the genotype distribution of
    GP/PL) has a finite row, the expected distance sum_g |g - count| P(g): the same for a dosage of two adjacent
    counts, larger for a spread such as (0.5, 0, 0.5), whose dosage 1 is no heterozygote."""
    dosage = _quantise(dosage)
    nearest = np.rint(dosage)
    off = np.abs(dosage - nearest)
    if probs is not None:
        spread = np.abs(np.arange(3.0)[None, :] - nearest[:, None])
        expected = _quantise((probs * spread).sum(axis=1))
        off = np.where(np.isfinite(expected), expected, off)
    codes = np.where(off <= threshold, nearest + _DOSE_0, _DOSE_UNCERTAIN)
    codes = np.where(off <= _EPSILON, nearest, codes)
    codes[(dosage < -_EPSILON) | (dosage > 2 + _EPSILON)] = _INVALID
    return codes.astype(np.int8)


def _probability_dosage(probs: np.ndarray, haploid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dosage, distribution) of per-person genotype probabilities (GP, or PL made probabilities): a haploid call's
    two values give a per-copy dosage (doubled by the dosage rule, as a haploid DS), a diploid call's three the dosage
    P(het) + 2 P(hom alt) (PLINK 2's) and the distribution the rule measures the call's distance over (NaN rows:
    the DS distance). Probabilities are scaled to sum to 1; a person without them, or with a negative one, gets NaN
    (no dosage: the GT, if any, stands)."""
    values = np.full((len(probs), 3), np.nan)
    values[:, : min(3, probs.shape[1])] = probs[:, :3]
    values[haploid, 2] = 0.0  # a one-copy call has two probabilities
    total = values.sum(axis=1)
    good = np.isfinite(total) & (total > 0) & ~(values < 0).any(axis=1)
    values[good] /= total[good, None]
    values[~good] = np.nan
    dosage = np.where(haploid, values[:, 1], values[:, 1] + 2.0 * values[:, 2])
    distribution = np.where(haploid[:, None], np.nan, values)
    return dosage, distribution


def _pl_probabilities(pl: np.ndarray) -> np.ndarray:
    """PL (phred-scaled genotype likelihoods) as probabilities under a flat prior (as ``bcftools +tag2tag --PL-to-GP``);
    htslib's missing and vector-end integers become NaN."""
    values = pl.astype(np.float64)
    values[pl <= -2147483647] = np.nan
    return 10.0 ** (-values / 10.0)


def _vcf_codes(genotype, n_people: int, n_alts: int, kind: int) -> np.ndarray:
    """Codes of one record's GT calls (cyvcf2's (people, ploidy + 1) allele array; -1 missing, -2 no more alleles)."""
    if genotype is None:
        return np.full(n_people, _MISS, np.int8)
    alleles = genotype.array()
    ploidy = alleles.shape[1] - 1  # the last column is the phasing flag
    first = np.minimum(alleles[:, 0] + 2, 4)  # htslib's indices are >= -2
    second = np.minimum(alleles[:, 1] + 2, 4) if ploidy >= 2 else np.zeros(n_people, np.intp)  # all haploid: -2
    codes = _GT_LUT[kind, n_alts][first, second]
    if ploidy > 2:  # a third allele: not a diploid call
        codes[(alleles[:, 2:ploidy] != -2).any(axis=1)] = _POLYPLOID
    return codes


def _vcf_dosage(
    codes: np.ndarray, dosage: np.ndarray, has_gt: bool, kind: int, threshold: float, probs: np.ndarray | None = None
) -> np.ndarray:
    """The codes after the record's dosages (DS, or GP/PL through `_probability_dosage`; module docstring, the dosage
    rule), for the people who have one."""
    have = np.isfinite(dosage)
    if not have.any():
        return codes
    haploid = (codes == _HEMI_REF) | (codes == _HEMI_ALT)
    scaled = np.where(haploid, 2.0 * dosage, dosage).astype(np.float64)
    new = _dosage_codes(np.where(have, scaled, 0.0), threshold, probs)
    het = (new == _HET) | (new == _DOSE_1)
    new[het & haploid] = _DOSE_UNCERTAIN  # half a copy of a one-copy chromosome
    if kind == _ONE_COPY:
        new[het & ~haploid] = _HEMI_HET
    new[haploid & (new == _HOM_REF)] = _HEMI_REF
    new[haploid & (new == _HOM_ALT)] = _HEMI_ALT
    if kind != _DIPLOID and not has_gt:  # a dosage on X/Y/MT without a call saying one copy or two
        new[:] = _DOSE_PLOIDY
    keep = ~have | (codes == _HAPLOID) | (codes == _POLYPLOID) | (codes == _INVALID)
    return np.where(keep, codes, new)


def _tally(codes: np.ndarray) -> np.ndarray:
    return np.bincount(codes, minlength=_N_CODES) @ _NOTE


def _one_copy_rule(records: FileRecords) -> None:
    """PLINK 1/2: males on X, everybody on Y and MT carry one copy; a heterozygous call there becomes missing and
    the other calls are tallied as one-copy calls (module docstring, the X rule). In place, on the selected records."""
    kinds = np.array([_chrom_kind(c) for c in records.chrom], np.int8)
    males = records.sex == 1 if records.sex is not None else np.zeros(len(records.samples), bool)
    genotypes = records.genotypes
    for kind, people in ((_X, np.flatnonzero(males)), (_ONE_COPY, np.arange(len(records.samples)))):
        columns = np.flatnonzero(kinds == kind)
        if not len(columns) or not len(people):
            continue
        block = genotypes[np.ix_(people, columns)]
        het = block == 1
        records.notes[columns, CALL_NOTES.index("one_copy_as_homozygous")] += ((block == 0) | (block == 2)).sum(axis=0)
        records.notes[columns, CALL_NOTES.index("heterozygous_one_copy")] += het.sum(axis=0)
        if het.any():
            block[het] = MISSING
            genotypes[np.ix_(people, columns)] = block


# ---- VCF / BCF --------------------------------------------------------------------------------------------------


def _read_vcf(path: Path, select: Selector, threshold: float) -> FileRecords:
    cyvcf2 = require("cyvcf2", EXTRA, "reading VCF/BCF files")
    if not str(path).lower().endswith(".bcf"):
        _check_unique_samples(_vcf_header_samples(path), str(path))  # htslib refuses them with a vague message
    try:
        vcf = cyvcf2.VCF(str(path), lazy=True)
    except Exception as exc:  # OSError for a non-VCF file, a bare Exception for a header htslib cannot parse
        raise DataPrepError(f"{path}: not a readable VCF/BCF file ({_one_line(exc)})") from None
    records = FileRecords(str(path), tuple(vcf.samples))
    n_people = len(records.samples)
    if not records.samples:
        raise DataPrepError(f"{path}: the header names no samples (a sites-only VCF has no genotypes)")
    records.build, records.build_evidence = declared_build(vcf.raw_header)
    records.hg19_mt = hg19_mitochondrion(vcf.raw_header)
    records.gvcf_header = any(line in vcf.raw_header for line in ("##GVCFBlock", "##ALT=<ID=NON_REF"))
    fields = frozenset(name for name in ("DS", "GP", "PL") if vcf.contains(name))
    no_call_field = ""  # the first selected record without any field a call can be read from
    with_call_field = 0
    columns: list[np.ndarray | None] = []
    notes: list[np.ndarray | None] = []
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
        if not records.gvcf and any(alt in _GVCF_ALLELES for alt in alts):
            records.gvcf = f"record {chrom}:{pos} has ALT {','.join(alts)}"
        filtered = variant.FILTER is not None  # cyvcf2: None for PASS and '.'
        records.add(chrom, pos, snp_id, ",".join(alts) if alts else ".", variant.REF, len(alts) > 1, filtered)
        if len(alts) > 1 or filtered:  # not used by the harmoniser: its genotypes are not decoded
            columns.append(None)
            notes.append(None)
            continue
        kind = _chrom_kind(chrom)
        try:
            genotype = variant.genotype
        except Exception:  # cyvcf2's bare Exception for a record without GT
            genotype = None
        codes = _vcf_codes(genotype, n_people, len(alts), kind)
        dosage = _record_dosage(variant, fields, codes, genotype is not None)
        if dosage is not None:
            codes = _vcf_dosage(codes, dosage[0], genotype is not None, kind, threshold, dosage[1])
        if genotype is None and dosage is None and _CALL_FIELDS.isdisjoint(variant.FORMAT):  # FORMAT: after format()
            no_call_field = (
                no_call_field or f"record {chrom}:{pos} has no call field (FORMAT {':'.join(variant.FORMAT)}"
            )
        else:
            with_call_field += 1
        columns.append(_COUNT[codes])
        notes.append(_tally(codes))
    vcf.close()
    if no_call_field and not with_call_field:
        raise DataPrepError(
            f"{path}: {no_call_field}; none of {', '.join(_CALL_FIELDS_ORDER)}), nor has any record at the table's "
            "SNPs: no genotype can be read from it; export it with its genotypes (GT) or dosages (DS, GP)"
        )
    records.genotypes = _stack(columns, n_people)
    records.notes = np.array([np.zeros(len(CALL_NOTES), np.int64) if n is None else n for n in notes], np.int64)
    records.notes = records.notes.reshape(len(notes), len(CALL_NOTES))
    return records


def _record_dosage(
    variant, fields: frozenset[str], codes: np.ndarray, has_gt: bool
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """(dosage, distribution or None) of a record's dosage field, the first it has of DS, GP, and (only without a GT,
    which a caller's PL is the evidence for) PL; None when it has none (module docstring, the dosage rule)."""
    if "DS" in fields:
        ds = variant.format("DS")
        if ds is not None:
            return ds[:, 0], None
    haploid = (codes == _HEMI_REF) | (codes == _HEMI_ALT)
    if "GP" in fields:
        gp = variant.format("GP")
        if gp is not None:
            return _probability_dosage(gp, haploid)
    if "PL" in fields and not has_gt:
        pl = variant.format("PL")
        if pl is not None:
            return _probability_dosage(_pl_probabilities(pl), haploid)
    return None


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


def _stack(columns: list[np.ndarray | None], n_people: int) -> np.ndarray:
    out = np.full((n_people, len(columns)), MISSING, np.int8)
    for j, column in enumerate(columns):
        if column is not None:
            out[:, j] = column
    return out


# ---- PLINK 1 ------------------------------------------------------------------------------------------------------


def _read_plink1(path: Path, select: Selector, threshold: float) -> FileRecords:
    bim, fam = _side_file(path, ".bim"), _side_file(path, ".fam")
    samples, sex, fids = _sample_file(fam, fam=True)
    if fids is not None:
        _check_fid_iid(fids, list(samples), path, fam)
    records = FileRecords(str(path), samples)
    records.sex = sex if sex is not None else np.zeros(len(samples), np.int8)
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
        with bed_reader.open_bed(path, iid_count=len(records.samples), sid_count=records.n_records) as bed:
            counts = bed.read(index=np.s_[:, wanted], dtype="int8", order="C") if wanted else None
    except Exception as exc:  # bed-reader reports a bad magic number or a short file as a ValueError/RuntimeError
        raise DataPrepError(f"{path}: not a readable PLINK 1 .bed file ({_one_line(exc)})") from None
    records.genotypes = np.zeros((len(records.samples), 0), np.int8) if counts is None else counts
    records.genotypes[records.genotypes < 0] = MISSING  # bed-reader's int8 missing value is -127
    _check_bed_padding(path, fam, records.samples, records.n_records)
    records.notes = np.zeros((len(wanted), len(CALL_NOTES)), np.int64)
    _one_copy_rule(records)
    return records


def _check_bed_padding(path: Path, fam: Path, samples: tuple[str, ...], n_snps: int) -> None:
    """A ``.fam`` listing other people than the ``.bed`` holds, found in the ``.bed`` itself. A ``.bed`` stores each
    SNP in whole bytes, 4 people to a byte, so a ``.fam`` up to 3 lines too long or too short gives a file of the
    right size (bed-reader checks only the size). PLINK writes the unused bits of each SNP's last byte as 00:

    - a ``.fam`` too short: the ``.bed`` has calls in those bits (a person the ``.fam`` does not list; a line
      deleted in the middle shifts everyone after it), refused at the first SNP where they are not 00;
    - a ``.fam`` too long: its last person is read from those bits, two copies of allele 1 at every SNP; refused
      when that holds at all of the ``.bed``'s SNPs (``_PADDING_CHECK_SNPS`` or more: no real person reads so).

    Both are read from the raw bytes of every SNP, not only the table's, whatever the number of people."""
    n_people = len(samples)
    width = (n_people + 3) // 4
    if not n_people or not n_snps or path.stat().st_size != 3 + width * n_snps:
        return  # bed-reader has refused a wrong size; an empty file has nothing to check
    blocks = np.memmap(path, np.uint8, "r", offset=3, shape=(n_snps, width))
    used = n_people % 4
    if used:
        past = (blocks[:, -1] & np.uint8((0xFF << (2 * used)) & 0xFF)) != 0
        if past.any():
            raise DataPrepError(
                f"{path} holds calls past the {n_people} people of {fam} (in the padding bits of SNP "
                f"{int(np.argmax(past)) + 1}): the .fam lists fewer people than the .bed was written for (a line "
                "deleted, which shifts everyone after it, or a .fam of another fileset); use the .fam written with "
                "this .bed"
            )
    last = n_people - 1
    allele_1_twice = ((blocks[:, last // 4] >> np.uint8(2 * (last % 4))) & np.uint8(3)) == 0
    if n_snps >= _PADDING_CHECK_SNPS and allele_1_twice.all():
        raise DataPrepError(
            f"{path}: the last person of {fam} ({samples[-1]!r}) reads as two copies of allele 1 at all {n_snps} "
            "SNPs of the .bed, which is what the .bed's padding bits hold: the .fam lists more people than the .bed "
            "was written for (a line added, or a .fam of another fileset); use the .fam written with this .bed"
        )


def _check_fid_iid(fids: list[str], iids: list[str], path: Path, side: Path) -> None:
    """PLINK keys a person by FID+IID, this bundle (labels, the .npz) by IID: one IID under two FIDs is refused here
    with that said (an IID repeated under one FID is left to the general duplicate check)."""
    first: dict[str, int] = {}
    for number, iid in enumerate(iids):
        if iid in first and fids[first[iid]] != fids[number]:
            raise DataPrepError(
                f"{path}: IID {iid!r} is in {side} twice, under FIDs {fids[first[iid]]!r} and {fids[number]!r} "
                f"(samples {first[iid] + 1} and {number + 1}): PLINK tells people apart by FID+IID, the consortium's "
                "files (labels, the .npz) by IID alone; give each person an IID of their own"
            )
        first.setdefault(iid, number)


def _sex(text: str) -> int:
    """PLINK's sex code: 1 male, 2 female, anything else unknown (0); .psam files may write male/female, M/F."""
    value = text.strip().lower()
    return 1 if value in ("1", "m", "male") else 2 if value in ("2", "f", "female") else 0


# ---- PLINK 2 ------------------------------------------------------------------------------------------------------


def _read_plink2(path: Path, select: Selector, threshold: float) -> FileRecords:
    pvar, psam = _side_file(path, ".pvar"), _side_file(path, ".psam")
    samples, sex, fids = _sample_file(psam, fam=False)
    if fids is not None:
        _check_fid_iid(fids, list(samples), path, psam)
    records = FileRecords(str(path), samples, sex=sex)
    wanted, allele_counts, header = [], [], []
    for number, chrom, pos, snp_id, ref, alt, filtered in _pvar_records(pvar, header):
        records.n_records += 1
        records.chromosomes.setdefault(chrom, number)
        alts = alt.split(",")
        allele_counts.append(1 + len(alts))
        if select(chrom, pos, snp_id):
            records.add(chrom, pos, snp_id, alt, ref, len(alts) > 1, filtered)
            wanted.append(records.n_records - 1)
    records.build, records.build_evidence = declared_build(header)
    records.hg19_mt = hg19_mitochondrion(header)
    pgenlib = require("pgenlib", EXTRA, "reading PLINK 2 .pgen files")
    n_people = len(records.samples)
    used = [j for j, (multi, filtered) in enumerate(zip(records.multiallelic, records.filtered, strict=True))
            if not multi and not filtered]  # fmt: skip
    offsets = None
    if max(allele_counts, default=2) > 2:  # pgenlib needs the allele index offsets to decode multi-allelic files
        offsets = np.concatenate([[0], np.cumsum(allele_counts)]).astype(np.uintp)
    records.genotypes = np.full((n_people, len(wanted)), MISSING, np.int8)
    records.notes = np.zeros((len(wanted), len(CALL_NOTES)), np.int64)
    try:
        reader = pgenlib.PgenReader(
            bytes(path), raw_sample_ct=n_people, variant_ct=records.n_records, allele_idx_offsets=offsets
        )
        _read_pgen_columns(reader, records, np.array(wanted, np.uint32)[used], used, _pgen_may_hold_dosages(path),
                           threshold)  # fmt: skip
        reader.close()
    except Exception as exc:  # pgenlib raises RuntimeError/ValueError naming the decoding problem
        if "error 4" in str(exc):  # pgenlib's kPglRetReadFail: a record ends past the end of the file
            raise DataPrepError(
                f"{path}: the .pgen ends before the records its header indexes ({path.stat().st_size:,} bytes; "
                f"pgenlib: {_one_line(exc)}): the file is truncated, copy it again"
            ) from None
        counts = _SAMPLE_COUNT.search(str(exc))
        if counts:  # the .pgen's header stores its sample count: a .psam of other people shows here
            raise DataPrepError(
                f"{path} holds {counts.group(2)} people, its .psam {psam} lists {counts.group(1)}: use the .psam "
                "written with this .pgen (a line added or deleted shifts every label after it)"
            ) from None
        raise DataPrepError(f"{path}: not a readable PLINK 2 .pgen file ({_one_line(exc)})") from None
    _one_copy_rule(records)
    return records


_SAMPLE_COUNT = re.compile(r"raw_sample_ct == (\d+), but .* contains (\d+) samples")


def _read_pgen_columns(reader, records: FileRecords, variants: np.ndarray, columns: list[int], dosages: bool,
                       threshold: float, chunk: int = 2048) -> None:  # fmt: skip
    """Fill ``records.genotypes[:, columns]`` from the pgen's ``variants``, ``chunk`` variants at a time: hard calls,
    or, in a file that may hold dosages, dosages through the dosage rule."""
    n_people = len(records.samples)
    calls = np.empty((min(chunk, len(variants)), n_people), np.int8)
    values = np.empty((min(chunk, len(variants)), n_people), np.float64) if dosages else None
    for start in range(0, len(variants), chunk):
        part, where = variants[start : start + chunk], columns[start : start + chunk]
        if values is None:
            reader.read_list(part, calls[: len(part)])
            block = calls[: len(part)]
            block[block < 0] = MISSING  # pgenlib's missing call is -9
        else:
            reader.read_dosages_list(part, values[: len(part)])
            dosage = values[: len(part)]
            codes = _dosage_codes(np.where(dosage < 0, 0.0, dosage), threshold)
            codes[dosage == -9] = _MISS  # pgenlib's missing dosage
            records.notes[where] += np.stack([_tally(row) for row in codes])
            block = _COUNT[codes]
        records.genotypes[:, where] = block.T


def _pgen_may_hold_dosages(path: Path) -> bool:
    """Whether the .pgen's header allows dosages: the standard layout (mode 0x10/0x11) with 8-bit record types (header
    control bits 0-3 from 4 to 7, or the one-sample encodings 12 and 14); a fixed-width layout without dosages (mode
    0x01 or 0x02) does not. When it cannot tell, it says yes: the dosage path is right for hard calls too."""
    with open(path, "rb") as handle:
        head = handle.read(12)
    if len(head) < 3 or head[:2] != b"\x6c\x1b":
        return True  # pgenlib reports it
    if head[2] in (0x01, 0x02):
        return False
    if head[2] in (0x10, 0x11) and len(head) == 12:
        storage = head[11] & 15
        return 4 <= storage < 8 or storage in (12, 14)
    return True


#: Column names of plink2's .fam/.psam header; a line starting with two of them, one IID, is a header (_is_header).
_SAMPLE_COLUMNS = frozenset({"FID", "IID", "SID", "PAT", "MAT", "SEX", "PHENOTYPE", "PHENO1"})


def _is_header(fields: list[str]) -> bool:
    """Whether a line without '#' is a header all the same (``FID IID PAT MAT SEX PHENOTYPE``, ``IID SEX``)."""
    names = [field.upper() for field in fields[:2]]
    return len(names) == 2 and "IID" in names and all(name in _SAMPLE_COLUMNS for name in names)


def _sample_lines(path: Path) -> tuple[list[str] | None, list[tuple[int, list[str]]]]:
    """(header, people) of a ``.fam``/``.psam`` as plink2 reads both: lines starting with '#' before the first person
    are comments, except a ``#FID``/``#IID`` line, the header, which ends them; a '#' line after the header or the
    first person, and a header written without its '#', are refused (read as people they would shift every label)."""
    header: list[str] | None = None
    people: list[tuple[int, list[str]]] = []
    for number, line in _text_lines(path):
        fields = line.split()
        if line.startswith("#"):
            if people or header is not None:
                after = f"the first person (line {people[0][0]})" if people else "the '#FID'/'#IID' header"
                raise DataPrepError(
                    f"{path}: line {number} starts with '#' after {after}: PLINK allows '#' lines only before the "
                    "people, the header last (two files pasted together?); remove the line"
                )
            if fields[0] in ("#FID", "#IID"):
                header = fields
            continue
        if _is_header(fields):
            raise DataPrepError(
                f"{path}: line {number} is a header ({' '.join(fields)[:60]!r}) without PLINK's leading '#': read as "
                "a person it would shift every label by one (plink2 refuses it); write it as '#FID IID ...' (or "
                "'#IID ...') or delete it"
            )
        people.append((number, fields))
    return header, people


def _sample_file(path: Path, fam: bool) -> tuple[tuple[str, ...], np.ndarray | None, list[str] | None]:
    """The sample IDs of a ``.fam`` or ``.psam`` (`_sample_lines`), each person's sex (1/2/0) when it has a SEX column
    (headerless: the .fam layout, column 5) and the FIDs when it has them."""
    header, body = _sample_lines(path)
    if not body:
        raise DataPrepError(f"{path}: no people; expected a header '#IID ...' or '#FID IID ...', one line a person")
    if header is not None:
        if "IID" not in header and header[0] != "#IID":
            raise DataPrepError(f"{path}: the header names no IID column: {' '.join(header)!r}")
        column = 0 if header[0] == "#IID" else header.index("IID")
        sex_column = header.index("SEX") if "SEX" in header else None
        fid_column = 0 if header[0] == "#FID" else None
        width = len(header)
    else:  # no header: the .fam layout (FID IID father mother sex phenotype)
        column, width, sex_column, fid_column = 1, 6, 4, 0
    samples, sex, fids = [], [], []
    for number, fields in body:
        if fam and header is None and len(fields) != 6:
            raise DataPrepError(
                f"{path}: line {number}: expected 6 columns (FID IID father mother sex phenotype), got {len(fields)}"
            )
        if len(fields) < max(column + 1, min(width, 2)):
            raise DataPrepError(f"{path}: line {number}: expected {width} columns, got {len(fields)}")
        samples.append(fields[column])
        sex.append(_sex(fields[sex_column]) if sex_column is not None and sex_column < len(fields) else 0)
        fids.append(fields[fid_column] if fid_column is not None else "")
    return (
        tuple(samples),
        (np.array(sex, np.int8) if sex_column is not None else None),
        (fids if fid_column is not None else None),
    )


def _pvar_records(pvar: Path, header: list[str]) -> Iterator[tuple[int, str, int, str, str, str, bool]]:
    """(line, chrom, pos, id, ref, alt, filtered) per record of a ``.pvar`` (with a ``#CHROM`` header) or
    ``.bim``-style file; its ``##`` lines are appended to ``header``."""
    columns = None
    for number, line in _text_lines(pvar):
        if line.startswith("##"):
            header.append(line)
            continue
        fields = (
            line.split("\t") if "\t" in line else line.split()
        )  # plink2 splits a .pvar at tabs (INFO may hold spaces)
        if line.startswith("#CHROM"):
            columns = [name.lstrip("#") for name in fields]
            missing = [c for c in ("CHROM", "POS", "ID", "REF", "ALT") if c not in columns]
            if missing:
                raise DataPrepError(f"{pvar}: line {number}: the header lacks column(s) {missing}")
            continue
        if columns is None:  # .bim layout: chrom id cM pos alt ref
            if len(fields) != 6:
                raise DataPrepError(f"{pvar}: line {number}: expected a '#CHROM' header or 6 .bim-style columns")
            yield number, fields[0], _position(fields[3], pvar, number), fields[1], fields[5], fields[4], False
            continue
        if len(fields) != len(columns):
            raise DataPrepError(f"{pvar}: line {number}: {len(fields)} columns, the header names {len(columns)}")
        row = dict(zip(columns, fields, strict=True))
        filtered = row.get("FILTER", ".") not in ("PASS", ".")
        yield number, row["CHROM"], _position(row["POS"], pvar, number), row["ID"], row["REF"], row["ALT"], filtered


# ---- shared text helpers ------------------------------------------------------------------------------------------


def _side_file(path: Path, suffix: str) -> Path:
    side = path.with_suffix(suffix)
    compressed = path.with_suffix(suffix + ".zst")
    if not side.is_file() and compressed.is_file():  # PLINK 2's 'vzs': read by plink2, not by this reader
        raise DataPrepError(
            f"{path}: its {suffix} is zstd-compressed ({compressed}), which this reader does not decompress: write "
            f"{side} beside it (zstd -d {compressed}) and run again"
        )
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
