"""A site that drops out of a SecAgg+ round after sending its masked update: it never answers the unmask stage.

Not part of the bundle. `install` copies this file into an exported secagg job's ``app/custom/`` and puts
`DropsBeforeUnmask` in place of the sites' ``SecAggExecutor``: at the site named ``site`` it raises on the
``secagg_unmask`` task (the site's reply is an error, no shares), everywhere else it is the bundle's executor. Used
by tests/e2e/test_e2e_secagg.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from aggregators.secagg import UNMASK_TASK
from controllers.secagg_site import SecAggExecutor

EXECUTOR = "controllers.secagg_site.SecAggExecutor"


class DropsBeforeUnmask(SecAggExecutor):
    def __init__(self, site: str = "site-2") -> None:
        super().__init__()
        self.site = site

    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        if task_name == UNMASK_TASK and fl_ctx.get_identity_name() == self.site:
            raise RuntimeError(f"{self.site} dropped out before the unmask stage")
        return super().execute(task_name, shareable, fl_ctx, abort_signal)


def install(job: Path, site: str) -> None:
    shutil.copy(Path(__file__), Path(job) / "app" / "custom" / Path(__file__).name)
    config_file = Path(job) / "app" / "config" / "config_fed_client.json"
    config = json.loads(config_file.read_text())
    (entry,) = [e for e in config["executors"] if e["executor"]["path"] == EXECUTOR]
    entry["executor"] = {"path": "secagg_dropout.DropsBeforeUnmask", "args": {"site": site}}
    config_file.write_text(json.dumps(config, indent=2))
