"""Write genotype files (VCF / VCF.gz / BCF, PLINK 1, PLINK 2, BGEN) from a dosage matrix: test fixtures, simulated
site files and the I/O benchmark. The binary files are written by the same libraries that read them.

``genotypes`` are people x SNPs, copies of ``alt`` (0/1/2), 3 = missing. ``alt`` may hold several comma-separated
alleles (a multi-allelic record; its calls are written as if only the first ALT existed).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_prep.genotypes.bgen import write_bgen
from data_prep.genotypes.formats import EXTRA, MISSING, genotype_format
from data_prep.optional import require

__all__ = ["Sites", "write_genotype_file"]

_VCF_CALLS = np.array(["0/0", "0/1", "1/1", "./."])


@dataclass(frozen=True)
class Sites:
    """The records to write: chromosome (as it should appear in the file), position, ID, REF, ALT."""

    chrom: Sequence[str]
    pos: Sequence[int]
    ids: Sequence[str]
    ref: Sequence[str]
    alt: Sequence[str]


def write_genotype_file(path: str | Path, genotypes: np.ndarray, samples: Sequence[str], sites: Sites) -> Path:
    """Write ``path`` in the format its extension names (``.vcf``, ``.vcf.gz``, ``.bcf``, ``.bed``, ``.pgen``,
    ``.bgen``: 8-bit probabilities of the calls, REF first, with its ``.sample``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    genotypes = np.asarray(genotypes, dtype=np.int8)
    kind = genotype_format(path)
    if kind == "plink1":
        _write_plink1(path, genotypes, samples, sites)
    elif kind == "plink2":
        _write_plink2(path, genotypes, samples, sites)
    elif kind == "bgen":
        probabilities = np.eye(3)[np.minimum(genotypes, 2)]  # a call is certain
        alleles = list(zip(sites.ref, sites.alt, strict=True))
        write_bgen(path, probabilities, samples, sites.chrom, sites.pos, sites.ids, alleles,
                   missing=genotypes == MISSING)  # fmt: skip
    elif str(path).endswith(".vcf"):
        _write_vcf_text(path, genotypes, samples, sites)
    else:  # .vcf.gz / .bcf: a text VCF first, then htslib compresses it through cyvcf2
        text = path.with_name(path.name + f".{os.getpid()}.tmp.vcf")
        _write_vcf_text(text, genotypes, samples, sites)
        cyvcf2 = require("cyvcf2", EXTRA, "writing VCF/BCF files")
        template = cyvcf2.VCF(str(text))
        writer = cyvcf2.Writer(str(path), template, mode="wb" if str(path).endswith(".bcf") else "wz")
        writer.write_header()
        for variant in template:
            writer.write_record(variant)
        writer.close()
        template.close()
        text.unlink()
    return path


def _write_vcf_text(path: Path, genotypes: np.ndarray, samples: Sequence[str], sites: Sites) -> None:
    contigs = list(dict.fromkeys(str(c) for c in sites.chrom))
    header = ["##fileformat=VCFv4.2", *(f"##contig=<ID={c}>" for c in contigs)]
    header.append('##FORMAT=<ID=GT,Number=1,Type=String,Description="Genotype">')
    header.append("\t".join(["#CHROM", "POS", "ID", "REF", "ALT", "QUAL", "FILTER", "INFO", "FORMAT", *samples]))
    with open(path, "w") as handle:
        handle.write("\n".join(header) + "\n")
        for j in range(genotypes.shape[1]):
            calls = "\t".join(_VCF_CALLS[genotypes[:, j]])
            fixed = [str(sites.chrom[j]), str(sites.pos[j]), sites.ids[j], sites.ref[j], sites.alt[j], ".", "PASS", "."]
            handle.write("\t".join(fixed) + "\tGT\t" + calls + "\n")


def _write_plink1(path: Path, genotypes: np.ndarray, samples: Sequence[str], sites: Sites) -> None:
    """Allele 1 (``.bim`` column 5) is written as ALT, so bed-reader's allele-1 counts are the ALT counts."""
    bed_reader = require("bed_reader", EXTRA, "writing PLINK 1 .bed files")
    values = genotypes.astype(np.float32)
    values[genotypes == MISSING] = np.nan
    properties = {
        "iid": list(samples),
        "sid": list(sites.ids),
        "chromosome": [str(c) for c in sites.chrom],
        "bp_position": list(sites.pos),
        "allele_1": list(sites.alt),
        "allele_2": list(sites.ref),
    }
    bed_reader.to_bed(path, values, properties=properties, count_A1=True)


def _write_plink2(path: Path, genotypes: np.ndarray, samples: Sequence[str], sites: Sites) -> None:
    pgenlib = require("pgenlib", EXTRA, "writing PLINK 2 .pgen files")
    allele_ct = max((a.count(",") + 2 for a in sites.alt), default=2)
    writer = pgenlib.PgenWriter(bytes(path), len(samples), genotypes.shape[1], False, allele_ct_limit=allele_ct)
    for j in range(genotypes.shape[1]):
        column = genotypes[:, j].copy()
        column[column == MISSING] = -9
        writer.append_biallelic(column)
    writer.close()
    with open(path.with_suffix(".pvar"), "w") as handle:
        handle.write("#CHROM\tPOS\tID\tREF\tALT\n")
        for j in range(genotypes.shape[1]):
            handle.write(f"{sites.chrom[j]}\t{sites.pos[j]}\t{sites.ids[j]}\t{sites.ref[j]}\t{sites.alt[j]}\n")
    with open(path.with_suffix(".psam"), "w") as handle:
        handle.write("#IID\n" + "".join(f"{s}\n" for s in samples))
