"""The genotype matrix type that the panel reader (``data_prep.genomics``) and the cohort simulator
(``data_prep.genomics_sim``) both return.

Its own module because the panel reader calls the simulator for ``source_data("sim")``, so the simulator must not
import the panel reader. ``data_prep.genomics`` re-exports it: import it from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["GenotypeData"]


@dataclass(frozen=True, eq=False)
class GenotypeData:
    """People x SNPs genotype states with their class labels (and, for simulated cohorts, ancestry proportions)."""

    genotypes: np.ndarray  # int8 (N, S), values 0, 1, 2 or data_prep.genomics.MISSING (3)
    labels: np.ndarray  # int64 (N,)
    classes: tuple[str, ...]
    snps: tuple[str, ...]
    proportions: np.ndarray | None = None  # float32 (N, K): share of each person's genome from each population
    name: str = "genotypes"

    @property
    def num_classes(self) -> int:
        return len(self.classes)
