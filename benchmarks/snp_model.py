"""The genomics model the benchmarks share, below every harness that builds it.

`benchmarks.step_overhead` (the machinery), `benchmarks.client_algorithms` (built on it), `benchmarks.genomics` (the
consortium table) and `benchmarks.gpu` (which runs the genomics grid) all need the consortium's package and the large
``cnn_transformer``; defining both here keeps those harnesses from importing each other in a circle.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

#: The genomics ``cnn_transformer`` at the size a GPU is for (benchmarks/results/gpu.md measured FedAvg and SCAFFOLD
#: with it): 10,000 SNPs in patches of 16, d_model 256, 4 layers of 8 heads, 5 classes. The step-cost benchmarks
#: (``benchmarks.step_overhead``, ``benchmarks.dp_overhead``) build it as ``cnn_transformer_large``, ``--snps``
#: changing only the SNP count.
LARGE_SNP_MODEL: dict[str, Any] = {
    "arch": "cnn_transformer",
    "n_snps": 10_000,
    "num_classes": 5,
    "d_model": 256,
    "layers": 4,
    "heads": 8,
    "patch": 16,
}


def examples_importable() -> None:
    """The consortium's package (examples/genomics) importable as ``genomics``, as a job ships it."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
