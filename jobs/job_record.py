"""The spec an exported job folder was built from, recorded in it, and the ``job.py`` that runs it with NVFlare's
recipe API (`jobs.job_entry`).

The exporter (`jobs.assembly.export_job`, `jobs.recipe.FedAlgRecipe.export`) writes `SPEC_FILE` (every setting of
the `jobs.spec.JobSpec`, defaults included, so that the record does not follow later default changes) and
`JOB_SCRIPT` beside the job's meta.json. NVFlare ignores both: the simulator and a server deploy the apps that
meta.json's deploy_map names. Package folders shipped with the job (``--ship``, ``--script``) are recorded relative
to the folder, as its own ``app/custom/`` copies, so a moved or cloned folder stays complete.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from aggregators.contracts.job_settings import SERVER
from jobs.settings import JobBuildError
from jobs.spec import JobSpec, shipped_folders, spec_from_values

#: The recorded spec, beside the job's meta.json.
SPEC_FILE = "job_spec.json"
#: The recipe entry point written into every exported job folder.
JOB_SCRIPT = "job.py"

JOB_SCRIPT_TEXT = '''"""Run this job with NVFlare's recipe API: ``python job.py`` (SimEnv), ``--env poc`` (PocEnv),
``--env prod --startup-kit DIR`` (ProdEnv); ``python job.py --help`` lists the options.

The job's settings are in job_spec.json beside this file, recorded by the bundle's job builder when it wrote this
folder; this script builds the bundle's recipe (jobs.recipe.FedAlgRecipe) from them, so it runs the job this folder
holds, as ``nvflare simulator <this folder> -w WS -n N`` does. Written by the bundle's job builder
(``python -m jobs.build``): rebuild the job instead of editing this copy.
"""

import sys
from pathlib import Path

try:
    from jobs.job_entry import main
except ImportError as missing:  # no bundle (or a broken install) in this Python: say what it lacks
    sys.exit(f"error: job.py needs the nvflare-noniid bundle installed (app/custom/site_requirements.txt): {missing}")

if __name__ == "__main__":
    sys.exit(main(Path(__file__).resolve().parent))
'''


def spec_record(spec: JobSpec, job_folder: Path) -> dict[str, Any]:
    """Every setting of ``spec`` (defaults included: the record must not follow later default changes), with the
    shipped package folders and the training script named by their copies inside ``job_folder``."""
    settings = {
        f.name: getattr(spec, f.name)
        for f in dataclasses.fields(JobSpec)
        if f.name != "name" and not _unrecorded_switch(f, spec)
    }
    settings["ship"] = ",".join(_copy_in(job_folder, folder.name) for folder in shipped_folders(spec))
    if spec.script is not None:
        settings["script"] = _copy_in(job_folder, Path(spec.script).name)
    return {
        "about": "the settings this job folder was built from (python -m jobs.build); job.py builds it from them",
        "name": spec.name,
        "settings": settings,
    }


def _unrecorded_switch(spec_field: dataclasses.Field, spec: JobSpec) -> bool:
    """An opt-in server switch declared with ``exported_when`` (``cross_site_eval``) is recorded only when on: off it
    changes nothing, and the jobs built before it existed keep their record."""
    exported_when = spec_field.metadata.get("exported_when")
    return (
        spec_field.metadata.get("side") == SERVER
        and spec_field.default is False
        and exported_when is not None
        and not exported_when(spec)
    )


def _copy_in(job_folder: Path, name: str) -> str:
    """The job-relative path of the app's copy of a shipped file or folder (``app/custom/<name>``)."""
    copies = sorted(job_folder.glob(f"*/custom/{name}"))
    if not copies:
        raise JobBuildError(f"ship: {name!r} was not copied into {job_folder}/<app>/custom/")
    return copies[0].relative_to(job_folder).as_posix()


def write_job_entry(job_folder: Path, spec: JobSpec) -> None:
    """Write `SPEC_FILE` and `JOB_SCRIPT` into an exported job folder."""
    record = json.dumps(spec_record(spec, job_folder), indent=4, sort_keys=False)
    (job_folder / SPEC_FILE).write_text(record + "\n")
    (job_folder / JOB_SCRIPT).write_text(JOB_SCRIPT_TEXT)


def recorded_spec(job_folder: Path) -> JobSpec:
    """The `JobSpec` recorded in ``job_folder``, its shipped paths resolved against the folder."""
    path = job_folder / SPEC_FILE
    try:
        record = json.loads(path.read_text())
        name, settings = record["name"], dict(record["settings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise JobBuildError(f"{path}: not a job spec written by python -m jobs.build ({exc})") from exc
    shipped = [p for p in settings.get("ship", "").split(",") if p]
    settings["ship"] = ",".join(str(job_folder / p) for p in shipped)
    if settings.get("script") is not None:
        settings["script"] = str(job_folder / settings["script"])
    return spec_from_values(name, settings)
