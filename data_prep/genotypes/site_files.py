"""Which genotype files a site reads, and the rule that a provisioned site never trains on data it did not name.

Each of the three paths comes from the first of (a job ships the same arguments to every site, so the site's own
settings are what normally name them):

1. the data module's argument (``data_file``, ``snp_table``, ``labels_file``);
2. the site's environment: ``$FEDALG_SITE_GENOTYPES``, ``$FEDALG_SNP_TABLE``, ``$FEDALG_SITE_LABELS``;
3. the site's local config file ``<site workspace>/local/fedalg_site_data.json`` (the kit's ``local/`` folder belongs
   to the site and NVFlare never overwrites it), keys ``"genotypes"``, ``"snp_table"``, ``"labels"``; a relative path
   is relative to that file's folder. The same file may hold the image datasets' ``"train"``.

``{site}`` in a path is replaced by the site's name.

A provisioned site (its workspace holds ``startup/fed_client.json``, as every NVFlare startup kit does; the simulator's
has none: `data_prep.site_config.is_simulated_site`) that names no genotype file is refused in one line: deriving
the public 1000 Genomes panel there would train a consortium job on public data, with the panel's classes, without a
word. In simulation a job that names the consortium's ``classes`` but no file is refused too, for the same reason.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from data_prep.errors import DataPrepError
from data_prep.genotypes.site import GENOTYPES_ENV, LABELS_ENV, SNP_TABLE_ENV
from data_prep.site_config import LOCAL_CONFIG, SITE_DATA_ENV

__all__ = [
    "LOCAL_KEYS",
    "GenotypeFiles",
    "Named",
    "missing_file_problem",
    "read_line",
    "site_genotype_files",
]

#: (path, where it was named: ``data_args``, ``$VARIABLE`` or the local config file's path).
Named = tuple[str, str]
#: The local config's key for each path, and the environment variable it stands beside.
LOCAL_KEYS = {"genotypes": GENOTYPES_ENV, "snp_table": SNP_TABLE_ENV, "labels": LABELS_ENV}


@dataclass(frozen=True)
class GenotypeFiles:
    """The site's genotype file, SNP table and labels file, each with where it was named (or ``None``)."""

    genotypes: Named | None = None
    snp_table: Named | None = None
    labels: Named | None = None

    def path(self, key: str) -> str | None:
        named = getattr(self, key)
        return named[0] if named else None


def site_genotype_files(
    site: str,
    workspace: Path,
    environ: Mapping[str, str],
    data_file: str | None = None,
    snp_table: str | None = None,
    labels_file: str | None = None,
) -> GenotypeFiles:
    """Each path from the first of: argument, environment, local config (module docstring)."""
    config = Path(workspace) / LOCAL_CONFIG
    local = _local_paths(site, config)
    arguments = {"genotypes": data_file, "snp_table": snp_table, "labels": labels_file}
    found: dict[str, Named | None] = {}
    for key, variable in LOCAL_KEYS.items():
        candidates = ((arguments[key], "data_args"), (environ.get(variable, "").strip(), f"${variable}"))
        named = next(((path, origin) for path, origin in candidates if path), None)
        if named is None and key in local:
            named = (local[key], str(config))
        found[key] = (named[0].replace("{site}", site), named[1]) if named else None
    return GenotypeFiles(**found)


def _local_paths(site: str, config: Path) -> dict[str, str]:
    """The genotype keys of the site's local config (relative paths made relative to its folder); none if absent."""
    if not config.is_file():
        return {}
    try:
        content = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataPrepError(f"{site}: cannot read the site's local config {config}: {exc}") from None
    if not isinstance(content, dict):
        raise DataPrepError(f"{site}: the site's local config {config} must be a JSON object, got {type(content)}")
    paths = {}
    for key in LOCAL_KEYS:
        value = content.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value.strip():
            raise DataPrepError(f'{site}: {config}: "{key}" must be a file path (a string), got {value!r}')
        path = Path(value).expanduser()
        paths[key] = str(path if path.is_absolute() else config.parent / path)
    return paths


def missing_file_problem(
    site: str,
    files: GenotypeFiles,
    workspace: Path,
    environ: Mapping[str, str],
    simulated: bool,
    classes: Sequence[str] | None,
) -> str | None:
    """Why this site may not go on without a genotype file (one line naming the setting and the fix), or ``None``."""
    if files.genotypes is not None:
        return None
    config = Path(workspace) / LOCAL_CONFIG
    fix = (
        f"set {GENOTYPES_ENV}=/path/to/{site}.npz (the .npz of 'python -m data_prep.genotypes harmonise', or a "
        f"VCF/BCF/PLINK file with {SNP_TABLE_ENV}) in the site's environment or write {config} containing "
        f'{{"genotypes": "/path/to/{site}.npz"}}'
    )
    image_data = environ.get(SITE_DATA_ENV, "").strip()
    if image_data and not simulated:
        # The deployment tutorial's variable: the image datasets' training file, which this module never reads.
        return (
            f"{site}: {SITE_DATA_ENV}={image_data} is set, but it names the image datasets' training file; a genomics "
            f'site reads {GENOTYPES_ENV}: set {GENOTYPES_ENV}={image_data} instead (or name it as "genotypes" in '
            f"{config}); nothing trained"
        )
    if not simulated:
        return (
            f"{site}: no genotype file named: a provisioned site trains on its own file, never the public panel; "
            f"{fix}; nothing trained"
        )
    if classes is not None:
        return (
            f"{site}: classes {list(classes)} are the labels of a site's own genotype file, but none is named: {fix} "
            "(in simulation, drop classes to derive a share of the public panel, with its own classes)"
        )
    return None


def read_line(site: str, files: GenotypeFiles, people: int, snps: int, classes: Sequence[str] | None = None) -> str:
    """The line every site prints about the file it read: path, people, SNPs, classes and the table it matched."""
    path, origin = files.genotypes or ("?", "?")
    if files.snp_table is None:
        table = f"no SNP table named: the file's own {snps} SNPs, unchecked"
    else:
        table = f"SNP table {files.snp_table[0]} (from {files.snp_table[1]}), matched"
    labels = "" if classes is None else f", classes {list(classes)}"
    return f"{site}: genotypes {path} (from {origin}): {people} people x {snps} SNPs{labels}; {table}"
