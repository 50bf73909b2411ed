"""The consortium's LightningDataModule: each site's genotypes, a validation split, and a held-out test set.

In simulation (no ``data_file``, and no ``classes``) every site derives its share from one source, with no
coordination:

- ``source="1kg"``: the 1000 Genomes people at 127 ancestry-informative SNPs (``data_prep.genomics``), labelled by
  super-population (5 classes) or, with ``label="population"``, population (``populations`` keeps a subset, e.g.
  ``["CHB", "GBR", "PUR"]``);
- ``source="sim"``: a simulated cohort (``data_prep.genomics_sim``; ``n_snps``, ``samples_per_population``),
  with each person's true ancestry proportions for ``target="proportions"``.

A fixed stratified 20 % of the people is held out as a test set that no site trains on (``test_dataloader``, and
``pooled_test_dataloader``: the "next patient" view; for benchmarks only: a real federation has no such set). The
rest is split over the sites with ``split``: ``iid``, ``dirichlet`` (over populations, concentration ``alpha``) or
``population`` (site = population). Each site keeps ``val_fraction`` of its share for validation (the site
evaluation of the global model, and the selection of ``--keep best``) and, with ``test_fraction`` > 0, a further
disjoint ``test_fraction`` as its OWN test split: then ``test_dataloader`` is that split (the site's reporting
split: ``eval.*_test_*``), in simulation and on a real site alike. The three parts come from one permutation seeded
by ``seed``: the validation split is the same with and without a test split. With ``holdout="stratified"`` they
hold every population of the site in the same share (the same sizes): a site that selects on its validation split
then selects on the population mix it reports on.

With ``pooled_val_fraction`` > 0 (simulation only) that share of the held-out people, stratified by class and the
same at every site, is a pooled VALIDATION split instead (``pooled_val_dataloader``: what a site choosing with
``keep_view pooled`` chooses on), and the pooled test view is the rest: the two never share a person. At 0 (the
default) there is no pooled validation split and the pooled test view is every held-out person, as before. A real
site that holds a reference set of the population it serves (e.g. a public reference panel) would return it from
``pooled_val_dataloader`` instead.

A real site reads its own genotype CSV (``sample``, one column per SNP, a ``population`` column) with the
consortium's SNP table (a CSV of ``snp,ref,alt`` rows) and the agreed ``classes`` (population names, in order). The
job ships the same arguments to every site, so the paths come from the site: ``$FEDALG_SITE_GENOTYPES`` and
``$FEDALG_SNP_TABLE``, or ``"genotypes"`` / ``"snp_table"`` in its ``local/fedalg_site_data.json`` (or the
``data_file`` / ``snp_table`` arguments; ``data_prep.genotypes.site_files``). A provisioned site that names no file is
refused in one line; it never derives the public panel. Every site prints the file it read (path, people, SNPs,
classes, the SNP table it matched). ``data_file`` may also be a VCF / VCF.gz / BCF, a PLINK 1 ``.bed``, a PLINK 2
``.pgen`` or a BGEN ``.bgen`` (harmonised against a ``snp,chrom,pos,ref,alt`` table on the fly) or the ``.npz`` of
``python -m data_prep.genotypes harmonise``, with labels from ``$FEDALG_SITE_LABELS`` / ``labels_file``
(``data_prep.genotypes.site``); those stay int8 (memory-mapped for an ``.npz``), travel to the training device as
int8 batches and are widened to int64 there (``on_after_batch_transfer``).

Batches are ``(states, target)``: int64 genotype states (0/1/2 copies of the alternative allele, 3 = missing) and the
class index, or the float ancestry proportions for ``target="proportions"``.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from data_prep import DataPrepError, partition, site_index
from data_prep.genomics import GenotypeData, SnpTable, held_out_split, read_genotype_csv, source_data
from data_prep.genotypes.loader import GenotypeRows, as_tokens, genotype_loader
from data_prep.genotypes.site import is_genotype_input, site_genotypes
from data_prep.genotypes.site_files import missing_file_problem, read_line, site_genotype_files
from data_prep.site_config import is_simulated_site, site_workspace
from data_prep.splits import HOLDOUTS, stratified_roles

TEST_FRACTION = 0.2
MIN_TEST_SAMPLES = 10  # the bundle's minimum test split per site (jobs/spec.py MIN_TEST_SAMPLES)


class SnpSites(pl.LightningDataModule):
    def __init__(
        self,
        site: str = "site-1",
        num_sites: int = 3,
        source: str = "1kg",
        split: str = "dirichlet",
        alpha: float = 0.1,
        label: str = "superpopulation",
        populations: Sequence[str] | None = None,
        n_snps: int = 1000,
        samples_per_population: int = 250,
        target: str = "population",
        seed: int = 0,
        val_fraction: float = 0.2,
        batch_size: int = 128,
        data_file: str | None = None,
        snp_table: str | None = None,
        classes: Sequence[str] | None = None,
        labels_file: str | None = None,
        test_fraction: float = 0.0,
        pooled_val_fraction: float = 0.0,
        holdout: str = "random",
    ) -> None:
        super().__init__()
        if target not in ("population", "proportions"):
            raise DataPrepError(f"{site}: target must be 'population' or 'proportions', got {target!r}")
        if not 0 <= test_fraction < 0.5 or not 0 <= val_fraction < 1 - test_fraction:
            raise DataPrepError(
                f"{site}: test_fraction must be in [0, 0.5) and val_fraction + test_fraction below 1, got "
                f"{test_fraction!r} and {val_fraction!r}"
            )
        self.site, self.target, self.batch_size, self.val_fraction = site, target, batch_size, val_fraction
        if not 0 <= pooled_val_fraction < 1:
            raise DataPrepError(f"{site}: pooled_val_fraction must be in [0, 1), got {pooled_val_fraction!r}")
        if holdout not in HOLDOUTS:
            raise DataPrepError(f"{site}: holdout must be one of {list(HOLDOUTS)}, got {holdout!r}")
        self.seed, self.test_fraction, self.holdout = seed, test_fraction, holdout
        self.pooled_val = self.pooled_people = self.pooled_val_people = None
        workspace = site_workspace()
        files = site_genotype_files(site, workspace, os.environ, data_file, snp_table, labels_file)
        problem = missing_file_problem(site, files, workspace, os.environ, is_simulated_site(workspace), classes)
        if problem:  # a provisioned site never derives the public panel; nor does a job that names the classes
            raise DataPrepError(problem)
        data_file, snp_table = files.path("genotypes"), files.path("snp_table")
        if data_file and is_genotype_input(data_file):
            self.data_source = data_file
            people = self._genotype_file(data_file, snp_table, files.path("labels"), classes)
            print(read_line(site, files, people, self.num_snps, self.classes), flush=True)
            return
        if data_file:
            own, self.data_source = _site_file(site, data_file, snp_table, classes), data_file
            print(read_line(site, files, len(own.labels), own.genotypes.shape[1], own.classes), flush=True)
            self.test = self.pooled = None
        else:
            data = source_data(source, label, populations, n_snps, samples_per_population)
            if target == "proportions" and data.proportions is None:
                raise DataPrepError(f"{site}: target 'proportions' needs source='sim' (true ancestry is known there)")
            train, test = held_out_split(data.labels, TEST_FRACTION)
            parts = partition(data.labels[train], num_sites, split, seed=seed, alpha=alpha)
            own = _subset(data, train[parts[site_index(site, num_sites)]])
            self.data_source = f"a derived share of source {source!r}"
            self.pooled_people, self.pooled_val_people = pooled_parts(data.labels, test, pooled_val_fraction)
            self.test = self.pooled = self._tensors(_subset(data, self.pooled_people))
            if len(self.pooled_val_people):
                self.pooled_val = self._tensors(_subset(data, self.pooled_val_people))
            print(
                f"{site}: simulation: no genotype file of its own; derived share of source {source!r}: "
                f"{len(own.labels)} people x {own.genotypes.shape[1]} SNPs, classes {list(own.classes)}",
                flush=True,
            )
        val, test, train = self._site_split(own.labels)
        self.val = self._tensors(_subset(own, val))
        self.train = self._tensors(_subset(own, train))
        if test_fraction > 0:  # the site's own test split replaces the pooled benchmark set
            self.test = self._tensors(_subset(own, test))
        self.num_snps, self.classes = own.genotypes.shape[1], own.classes

    def _site_split(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(validation, test, training) positions of the site's people (``labels``: their populations): one
        permutation seeded by ``seed``, validation first, then test, the rest trains; with ``holdout="stratified"``
        the same sizes drawn per population (`data_prep.splits.stratified_roles`)."""
        n = len(labels)
        rng = np.random.default_rng([self.seed, 1])
        n_val, n_test = round(self.val_fraction * n), round(self.test_fraction * n)
        if self.test_fraction > 0 and n_test < MIN_TEST_SAMPLES:  # one person would move its accuracy > 10 points
            raise DataPrepError(
                f"{self.site}: test_fraction {self.test_fraction:g} leaves {n_test} test people of {n}; a site needs "
                f"at least {MIN_TEST_SAMPLES}: raise test_fraction"
            )
        if self.holdout == "stratified":
            return stratified_roles(labels, n_val, n_test, rng)
        order = rng.permutation(n)
        return order[:n_val], order[n_val : n_val + n_test], order[n_val + n_test :]

    def _tensors(self, data: GenotypeData) -> TensorDataset:
        x = torch.as_tensor(np.asarray(data.genotypes), dtype=torch.long)
        if self.target == "proportions":
            return TensorDataset(x, torch.as_tensor(data.proportions, dtype=torch.float32))
        return TensorDataset(x, torch.as_tensor(np.asarray(data.labels), dtype=torch.long))

    def _genotype_file(
        self, data_file: str, snp_table: str | None, labels_file: str | None, classes: Sequence[str] | None
    ) -> int:
        """A VCF/BCF/PLINK file or harmonised .npz: int8 rows streamed a batch at a time (no int64 matrix); returns
        the number of people read."""
        if classes is None or self.target != "population":
            raise DataPrepError(f"{self.site}: a genotype file needs the agreed classes and target 'population'")
        own = site_genotypes(self.site, data_file, classes, snp_table, labels_file)
        val, test, train = (np.sort(part) for part in self._site_split(np.asarray(own.labels)))
        self.val = GenotypeRows(own.genotypes, own.labels[val], val)
        self.train = GenotypeRows(own.genotypes, own.labels[train], train)
        self.test = GenotypeRows(own.genotypes, own.labels[test], test) if self.test_fraction > 0 else None
        self.pooled = None
        self.num_snps, self.classes = own.genotypes.shape[1], own.classes
        return len(own.labels)

    def on_after_batch_transfer(self, batch, dataloader_idx: int):
        """Genotype files stream int8 batches (8x less host memory traffic and transfer than int64): widened to the
        embedding's int64 here, on the training device. Other batches are int64 already and pass unchanged."""
        return as_tokens(batch)

    def train_dataloader(self) -> DataLoader:
        if isinstance(self.train, GenotypeRows):
            return genotype_loader(self.train, self.batch_size, shuffle=True)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        if isinstance(self.val, GenotypeRows):
            return genotype_loader(self.val, 512)
        return DataLoader(self.val, batch_size=512)

    def pooled_test_dataloader(self) -> DataLoader | None:
        """The "next patient" view in simulation: the held-out people of every population, which no site trains on
        (``None`` at a site reading its own file: a real site has no such set). The bundle scores every candidate on
        it beside the site's own test split (``eval.kept_pooled_test_accuracy``, ``eval.local_pooled_test_*``)."""
        return None if self.pooled is None else DataLoader(self.pooled, batch_size=512)

    def pooled_val_dataloader(self) -> DataLoader | None:
        """The pooled validation split (``pooled_val_fraction`` of the held-out people, none of the pooled test view's)
        that a site with ``keep_view pooled`` chooses its own and its kept model on; ``None`` without one."""
        return None if self.pooled_val is None else DataLoader(self.pooled_val, batch_size=512)

    def test_dataloader(self) -> DataLoader:
        if self.test is None:
            raise DataPrepError(
                f"{self.site}: a site reading its own data_file has no shared test set; give test_fraction > 0 to "
                "hold out the site's own"
            )
        if isinstance(self.test, GenotypeRows):
            return genotype_loader(self.test, 512)
        return DataLoader(self.test, batch_size=512)


def pooled_parts(labels: np.ndarray, held_out: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The held-out people (indices into ``labels``) as (pooled test, pooled validation): per class
    ``round(fraction * n_class)`` of them to validation, by a fixed seed; at 0 all of them to the pooled test view."""
    if not fraction:
        return held_out, held_out[:0]
    rest, val = held_out_split(labels[held_out], fraction, seed=1)
    return held_out[rest], held_out[val]


def _subset(data: GenotypeData, index: np.ndarray) -> GenotypeData:
    proportions = None if data.proportions is None else data.proportions[index]
    return GenotypeData(data.genotypes[index], data.labels[index], data.classes, data.snps, proportions, data.name)


def _site_file(site: str, data_file: str, snp_table: str | None, classes: Sequence[str] | None) -> GenotypeData:
    if snp_table is None or classes is None:
        raise DataPrepError(f"{site}: a data_file needs the consortium's snp_table (snp,ref,alt CSV) and classes")
    with open(snp_table, newline="") as handle:
        rows = [row for row in csv.reader(handle) if row and row[0] != "snp"]
    table = SnpTable(tuple(r[0] for r in rows), tuple((r[1], r[2]) for r in rows))
    return read_genotype_csv(data_file, table, site=site, classes=classes)
