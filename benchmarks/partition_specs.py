"""How the harnesses name a partition on the command line (``--partitions`` / ``--splits``), and what it means.

    iid        every site a uniform random share (near-equal sizes)
    dir<a>     Dirichlet(a) label skew, any a > 0: dir0.3, dir0.1, dir1 (smaller a: fewer labels per site, unequal
               sizes)
    qty<b>     quantity skew with small sites (data_prep.partition.small_sites): labels IID; the first
               round(b x sites) sites, 0 < b < 1, hold 50 to 150 samples (evenly spaced; one small site: 100),
               the others share the rest equally: qty0.3 with 10 sites = 50, 100, 150 samples beside 7 large sites
    C<k>       "#C=k" label skew, every site exactly k labels, labels shared evenly (shards): C2, C3
    C<k>nb     "#C=k" dealt as NIID-Bench deals it (label_quantity; unequal sizes): C2nb
    population site = population (genomics only: each site holds whole populations)

Sizes under ``qty`` are of a site's whole shard, before it holds out its validation and test splits. The names are
parsed once, here; a name that parses to nothing is refused in one line naming what is allowed.
"""

from __future__ import annotations

import math
import re
from typing import Any

#: One line for --help.
HELP = (
    "partitions by name: iid, dir<alpha> (Dirichlet label skew, any alpha > 0: dir0.3), qty<beta> (quantity skew: "
    "the first round(beta x sites) sites hold 50..150 samples, evenly spaced, the others share the rest equally; "
    "0 < beta < 1: qty0.3), C<k> (#C=k label skew, every site k labels), C<k>nb (#C=k as NIID-Bench deals it)"
)
_PATTERN = re.compile(r"(?P<kind>dir|qty|C)(?P<value>[0-9]*\.?[0-9]+(?:e-?[0-9]+)?)(?P<nb>nb)?")


class PartitionNameError(ValueError):
    """A partition name the harnesses do not know."""


def partition_settings(name: str, *, genomics: bool = False) -> dict[str, Any]:
    """The data settings a partition name stands for: JobSpec fields (``scheme``, ``alpha``,
    ``classes_per_site``), or with ``genomics`` the data module's (``split``, ``alpha``)."""
    allowed = "iid, dir<alpha>, qty<beta>" + (", population" if genomics else ", C<k>, C<k>nb")
    if name in ("iid", "population") and (genomics or name == "iid"):
        return {"split": name} if genomics else {"scheme": name}
    match = _PATTERN.fullmatch(name)
    if match is None or (genomics and match["kind"] == "C") or (match["nb"] and match["kind"] != "C"):
        raise PartitionNameError(f"unknown partition {name!r}; use {allowed}")
    value = float(match["value"])
    if match["kind"] == "C":
        if not value.is_integer() or value < 1:
            raise PartitionNameError(f"partition {name!r}: k in C<k> must be a whole number >= 1")
        return {"scheme": "label_quantity" if match["nb"] else "shards", "classes_per_site": int(value)}
    if match["kind"] == "qty" and not 0 < value < 1:
        raise PartitionNameError(f"partition {name!r}: beta in qty<beta> is the share of small sites, in (0, 1)")
    if not math.isfinite(value) or value <= 0:
        raise PartitionNameError(f"partition {name!r}: alpha in dir<alpha> must be > 0")
    scheme = "dirichlet" if match["kind"] == "dir" else "small_sites"  # small_sites reads beta from alpha
    return {"split" if genomics else "scheme": scheme, "alpha": value}


def argparse_partition(genomics: bool = False) -> Any:
    """An argparse ``type`` that checks a partition name and keeps it as it was written."""
    import argparse

    def check(name: str) -> str:
        try:
            partition_settings(name, genomics=genomics)
        except PartitionNameError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return name

    return check
