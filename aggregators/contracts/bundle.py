"""What build time, the server and the sites agree on about the installed bundle, below all three.

The job builder (`jobs`), the genotype QC job (`data_prep.genotypes`) and the server's and sites' components read
these names; keeping them here lets each of those layers use them without importing another (docs/design.md,
"Layers").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

#: The bundle's packages an exported job declares as NVFlare app packages: installed at every site, never copied.
APP_PACKAGES = ("aggregators", "controllers", "data_prep", "jobs", "lightning_modules")
#: The TenSEAL context files NVFlare's ``HEBuilder`` writes into the server's and each site's startup kit, under
#: the names NVFlare's HE filters and the bundle's secure QC read them by.
SERVER_CONTEXT, CLIENT_CONTEXT = "server_context.tenseal", "client_context.tenseal"


@contextlib.contextmanager
def inside_directory(directory: Path) -> Iterator[None]:
    """Run the block in ``directory``: NVFlare's job API writes a script path into the job config as given, so it
    must be relative to the job's custom/ folder."""
    previous = Path.cwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(previous)
