"""Simulated genotype cohorts with a published human demography (msprime + stdpopsim), cached on disk.

msprime and stdpopsim are GPL-3 licensed while this bundle is Apache-2.0, so they are an optional extra
(``pip install -e ".[genomics-sim]"``) and only this module imports them, only when a cohort is not cached yet.

What a cohort is: ``samples_per_population`` diploid people from each population of a stdpopsim ``HomSap``
demographic model (default ``AmericanAdmixture_4B18``: African, European, East Asian and an admixed American
population formed 12 generations ago), simulated as ``regions`` independent genomic regions of ``region_length``
bases (independent regions stand in for different chromosomes, so an admixed person carries many ancestry segments,
as a real genome does), with the model's mutation rate and stdpopsim's generic recombination rate; no genetic map
is needed, so it runs offline. Mutations are biallelic (0 = ancestral, 1 = derived); genotypes are dosages 0/1/2.
SNPs with a minor-allele frequency below ``maf`` (over the whole cohort) are dropped and ``n_snps`` of the rest are
drawn, seeded.

Each person's true ancestry proportions are known: a census just before the model's most recent demographic event
(the admixture) records which population every ancestral lineage is in, and the proportions are the shares of the
person's sequence inherited through each population (``TableCollection.link_ancestors``). They are the targets of
the ancestry-proportion ("deconvolution") task.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from data_prep.errors import DataPrepError
from data_prep.genotypes import GenotypeData

__all__ = ["CohortSettings", "cache_dir", "simulate_cohort"]

CACHE_ENV = "FEDALG_CACHE_DIR"
_GENERIC_RECOMBINATION_RATE = 1.28e-8  # stdpopsim's HomSap genome-wide average, per base per generation
_CENSUS_OFFSET = 0.5  # generations above the most recent event: lineages are back in their source populations


@dataclass(frozen=True)
class CohortSettings:
    model: str = "AmericanAdmixture_4B18"
    samples_per_population: int = 250
    n_snps: int = 1000
    regions: int = 40
    region_length: int = 250_000
    maf: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("samples_per_population", "n_snps", "regions", "region_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DataPrepError(f"simulated cohort: {name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.maf < 0.5:
            raise DataPrepError(f"simulated cohort: maf must lie in [0, 0.5), got {self.maf}")

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "fedalg") / "genomics"


def simulate_cohort(settings: CohortSettings | None = None, **overrides: object) -> GenotypeData:
    """The cohort of ``settings`` (module docstring), from the cache or simulated and cached (atomic write)."""
    settings = settings or CohortSettings(**overrides)  # type: ignore[arg-type]
    path = cache_dir() / f"cohort_{settings.model}_{settings.key()}.npz"
    if not path.exists():
        arrays = _simulate(settings)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez_compressed(partial, **arrays)
        os.replace(partial, path)  # sites simulating at once each write whole files; the last rename wins
    stored = np.load(path)
    return GenotypeData(
        genotypes=stored["genotypes"],
        labels=stored["labels"],
        classes=tuple(str(c) for c in stored["classes"]),
        snps=tuple(str(s) for s in stored["snps"]),
        proportions=stored["proportions"],
        name=f"sim_{settings.model}",
    )


def _simulate(settings: CohortSettings) -> dict[str, np.ndarray]:
    msprime, demography, populations = _demography(settings.model)
    census_time = min(event.time for event in demography.events) + _CENSUS_OFFSET
    demography.add_census(time=census_time)
    demography.sort_events()
    samples = [msprime.SampleSet(settings.samples_per_population, population=p, ploidy=2) for p in populations]
    rng = np.random.default_rng(settings.seed)
    dosages, shares, snp_ids = [], 0.0, []
    for region in range(settings.regions):
        seeds = rng.integers(1, 2**31 - 1, size=2)
        ts = msprime.sim_ancestry(
            samples=samples,
            demography=demography,
            sequence_length=settings.region_length,
            recombination_rate=_GENERIC_RECOMBINATION_RATE,
            random_seed=int(seeds[0]),
        )
        shares = shares + _ancestry_shares(ts, census_time, demography.num_populations)
        ts = msprime.sim_mutations(ts, rate=2.36e-8, model=msprime.BinaryMutationModel(), random_seed=int(seeds[1]))
        haplotypes = ts.genotype_matrix()  # sites x haploid genomes, 0/1
        dosages.append(haplotypes.reshape(len(haplotypes), -1, 2).sum(axis=2).T.astype(np.int8))
        snp_ids += [f"sim{region}_{int(site.position)}" for site in ts.sites()]
    genotypes = np.concatenate(dosages, axis=1)
    frequency = genotypes.mean(axis=0) / 2
    common = np.flatnonzero(np.minimum(frequency, 1 - frequency) >= settings.maf)
    if len(common) < settings.n_snps:
        raise DataPrepError(
            f"simulated cohort: only {len(common)} SNPs pass maf >= {settings.maf}; raise regions or region_length "
            f"or lower n_snps ({settings.n_snps})"
        )
    chosen = np.sort(rng.choice(common, size=settings.n_snps, replace=False))
    labels = np.repeat(np.arange(len(populations), dtype=np.int64), settings.samples_per_population)
    return {
        "genotypes": genotypes[:, chosen],
        "labels": labels,
        "classes": np.array(populations),
        "snps": np.array(snp_ids)[chosen],
        # Columns: the sampled populations (the census can also find lineages in unsampled ancestral ones).
        "proportions": (shares[:, [demography[p].id for p in populations]] / settings.regions).astype(np.float32),
    }


def _demography(model_name: str):
    try:
        import msprime
        import stdpopsim
    except ImportError:
        raise DataPrepError(
            'simulated cohorts need the optional extra: pip install -e ".[genomics-sim]" (msprime and stdpopsim, '
            "GPL-3; make setup installs it)"
        ) from None
    species = stdpopsim.get_species("HomSap")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # renamed-model notices
            model = species.get_demographic_model(model_name)
    except ValueError:
        names = [m.id for m in species.demographic_models]
        raise DataPrepError(f"unknown HomSap demographic model {model_name!r}; choose one of {names}") from None
    demography = model.model.copy()
    populations = [p.name for p in model.populations if p.allow_samples]
    return msprime, demography, populations


def _ancestry_shares(ts, census_time: float, num_populations: int) -> np.ndarray:
    """(people, populations): the share of each person's sequence inherited through each population at the census."""
    nodes = ts.tables.nodes
    census = np.flatnonzero(np.isclose(nodes.time, census_time))
    edges = ts.tables.link_ancestors(ts.samples(), census)
    haploid = np.zeros((ts.num_samples, num_populations))
    span = edges.right - edges.left
    np.add.at(haploid, (edges.child, nodes.population[edges.parent]), span)
    haploid /= ts.sequence_length
    return haploid.reshape(-1, 2, num_populations).mean(axis=1)
