"""What a job asks of each site's machine: GPUs, CPUs and memory, as NVFlare 2.9's ``resource_spec`` in meta.json.

    python -m jobs.build --client fedavg --server fedavg --site-resources gpus=1,mem_gb=16
    python -m jobs.build ... --site-resources 'gpus=1,mem_gb=16;site-3:gpus=0,mem_gb=8'

The text is entries separated by ``;``; an entry is ``[SITE:]key=value,...`` with the keys ``gpus`` (>= 0),
``cpus`` (>= 1) and ``mem_gb`` (>= 1, GiB), whole numbers. An entry without a site applies to every site (NVFlare's
``@default``), an entry with one overrides it for that site. meta.json then carries NVFlare's portable fields::

    "resource_spec": {"@default": {"num_of_gpus": 1, "memory": "16Gi"}, "site-3": {"num_of_gpus": 0, "memory": "8Gi"}}

which every NVFlare 2.9 launcher reads (``nvflare.utils.job_launcher_utils.get_portable_resource_spec``): Docker
requests the GPUs and limits the container's memory, Kubernetes sets the job pod's ``nvidia.com/gpu`` limit and its
memory, Slurm submits with ``--gpus-per-node``, ``--cpus-per-task`` and ``--mem``; a process-mode site's
GPUResourceManager holds the job until that many GPUs are free. No option: ``"resource_spec": {}`` as before.

Standard library only, so the builder's parser can use it before anything heavy is imported.
"""

from __future__ import annotations

import re
from typing import Any

#: The option's keys -> NVFlare's portable field and how the value is written there.
KEYS = {"gpus": "num_of_gpus", "cpus": "num_of_cpus", "mem_gb": "memory"}
MINIMUM = {"gpus": 0, "cpus": 1, "mem_gb": 1}
#: NVFlare's key for the entry that applies to every site.
DEFAULT_SITE = "@default"
_SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]*$")
_NUMBER = re.compile(r"^[0-9]+$")


class ResourceSpecError(ValueError):
    """``--site-resources`` cannot be read; the message names the entry and what is allowed."""


def portable_value(key: str, number: int) -> Any:
    """NVFlare's portable value: memory as ``"<n>Gi"``, counts as integers."""
    return f"{number}Gi" if key == "mem_gb" else number


def parse_entry(entry: str) -> tuple[str, dict[str, Any]]:
    """``[SITE:]key=value,...`` -> (site or ``@default``, NVFlare's portable fields)."""
    site, _, assignments = entry.rpartition(":")
    site = site.strip() or DEFAULT_SITE
    if site != DEFAULT_SITE and not _SITE_NAME.fullmatch(site):
        raise ResourceSpecError(f"site {site!r} in {entry!r} is not a site name (letters, digits, '.', '_', '-')")
    fields: dict[str, Any] = {}
    for assignment in assignments.split(","):
        key, equals, value = (part.strip() for part in assignment.partition("="))
        if key not in KEYS or not equals:
            raise ResourceSpecError(f"{assignment.strip()!r} in {entry!r}: expected key=value, key one of {list(KEYS)}")
        if not _NUMBER.fullmatch(value) or int(value) < MINIMUM[key]:
            raise ResourceSpecError(f"{key}={value} in {entry!r}: {key} is a whole number >= {MINIMUM[key]}")
        if KEYS[key] in fields:
            raise ResourceSpecError(f"{key} is given twice in {entry!r}")
        fields[KEYS[key]] = portable_value(key, int(value))
    return site, fields


def parse_site_resources(text: str) -> dict[str, dict[str, Any]]:
    """The ``resource_spec`` of meta.json for ``text`` (empty text: ``{}``, the jobs as they are)."""
    spec: dict[str, dict[str, Any]] = {}
    if not text.strip():
        return spec
    for entry in text.split(";"):
        if not entry.strip():
            raise ResourceSpecError(f"empty entry in {text!r}: entries are [SITE:]key=value,... separated by ';'")
        site, fields = parse_entry(entry.strip())
        if site in spec:
            name = "every site (no SITE:)" if site == DEFAULT_SITE else site
            raise ResourceSpecError(f"{name} is given twice in {text!r}")
        spec[site] = fields
    return spec


def site_resources_arg(text: str) -> dict[str, dict[str, Any]]:
    """The builder's argparse type: a refusal becomes argparse's one-line error naming ``--site-resources``."""
    import argparse

    try:
        return parse_site_resources(text)
    except ResourceSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_resource_spec(job: Any, spec: dict[str, dict[str, Any]]) -> None:
    """Put ``spec`` into an NVFlare ``FedJob``'s meta.json (its job config holds one entry per site name)."""
    for site, fields in spec.items():
        job.job.add_resource_spec(site, dict(fields))
