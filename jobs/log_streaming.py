"""NVFlare 2.9's log streaming: what it sends from a site, and what the bundle turns off (docs/privacy.md, threat
model: "NVFlare's own channels").

NVFlare 2.9 has two ways for a site's logs to reach the server, both in the clear and outside the bundle's release
filter (nothing in them is accounted):

- **error-log streaming, on by default in provisioned sites**: ``nvflare provision`` puts a ``SiteLogStreamer`` for
  ``error_log.txt`` in every site's ``resources.json``; it injects a ``JobLogStreamer`` into each job's client
  configuration (live stream) and, when a job ends, uploads the site's ``error_log.txt`` from the site's parent
  process; the server's ``JobLogReceiver`` stores it in its job store. An ERROR record can name people counts, file
  paths, label counts, scores. Only the site can stop the upload: ``allow_log_streaming: false`` in its
  ``resources.json`` (``allow_log_streaming: false`` on the participant in ``project.yml`` writes it).
- **log streaming a job asks for**: ``Recipe.enable_log_streaming(...)`` adds ``JobLogStreamer`` to the sites (the
  whole ``log.txt`` or ``log.json``: every round's training loss, withheld scores) and ``JobLogReceiver`` to the server.

What the bundle does: its provisioning (``jobs/provision/project.yml``, `jobs.provision.loopback.write_project`)
sets ``allow_log_streaming: false`` on every site, for every job (a site's first error is then read in its own
workspace, not in the downloaded result); a job under DP (DP-SGD at the sites or DP-FedAvg) that asks to stream
logs is refused when it is built (`log_streaming_problem`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: The participant property (project.yml) and resources.json variable that allow a site's logs to be streamed.
ALLOW_LOG_STREAMING = "allow_log_streaming"
#: The class name NVFlare's SiteLogStreamer looks for in a job's client components (a job that declares one gets no
#: injected streamer; the site strips it when streaming is not allowed).
JOB_LOG_STREAMER = "JobLogStreamer"


def job_is_private(spec: Any) -> bool:
    """DP-SGD at the sites (``dp_noise_multiplier`` or ``dp_target_epsilon``) or client-level DP at the server (a
    rule that declares ``client_level_dp``: DP-FedAvg)."""
    from jobs.spec import client_level_dp
    from lightning_modules.privacy.job_checks import is_private

    return is_private(spec) or client_level_dp(spec) is not None


def log_streaming_problem(spec: Any, streamed: Iterable[str]) -> str | None:
    """Why a job may not stream the site logs ``streamed`` (file names) to the server, or ``None``."""
    files = sorted(streamed)
    if not files or not job_is_private(spec):
        return None
    return (
        f"log streaming {files} under DP: NVFlare's JobLogStreamer sends the site's log to the server in the clear, "
        "outside the DP release (training loss, withheld scores, error messages); allowed under DP: no log "
        f"streaming (and {ALLOW_LOG_STREAMING}: false in each site's resources.json, as the bundle provisions)"
    )


def streamed_logs(job_folder: Path) -> list[str]:
    """The log files an exported job's client configurations ask NVFlare's JobLogStreamer to stream."""
    files = []
    for config in sorted(job_folder.glob("**/config_fed_client.json")):
        for component in json.loads(config.read_text()).get("components", []):
            if JOB_LOG_STREAMER in str(component.get("path", "")):
                files.append(str(component.get("args", {}).get("log_file_name", "log.txt")))
    return files
