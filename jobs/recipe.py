"""NVFlare 2.9 recipe for this bundle: one recipe for any client algorithm × server rule, runnable in every
NVFlare execution environment.

    from nvflare.recipe import SimEnv, PocEnv, ProdEnv
    from jobs.recipe import FedAlgRecipe

    recipe = FedAlgRecipe(client="scaffold", server="scaffold", num_rounds=20, min_clients=3, alpha=0.1)
    run = recipe.execute(SimEnv(num_clients=3))                 # simulator, one process per site
    run = recipe.execute(PocEnv(num_clients=3))                 # POC deployment on this machine
    run = recipe.execute(ProdEnv(startup_kit_location="/path/to/admin@org/"))   # provisioned sites
    recipe.export("/tmp/jobs")                                  # a job folder, as `python -m jobs.build` writes
    recipe = FedAlgRecipe.from_spec(spec)                       # any `jobs.spec.JobSpec`, e.g. a job folder's own

Every exported job folder carries ``job.py``, which builds this recipe from the settings the folder recorded
(`jobs.job_entry`): ``python jobs/scaffold/job.py --env sim|poc|prod``.

The recipe is a thin wrapper: its job is exactly what `jobs.build.build_job` builds from a
`jobs.build.JobSpec` with the same settings, so recipes, the CLI builder and the committed ``jobs/<name>/``
folders never disagree (tested). Unknown algorithms, meaningless combinations, bad settings and unknown keywords
fail when the recipe is created with the builder's `jobs.build.JobBuildError` and its one-line message, the
valid choices included.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

from nvflare.recipe.spec import ExecEnv, Recipe

from jobs.assembly import sort_filter_tasks, write_site_requirements
from jobs.build import JOBS_DIR, JobBuildError, JobSpec, build_job, inside_directory
from jobs.job_record import write_job_entry
from jobs.log_streaming import log_streaming_problem, streamed_logs
from jobs.spec import spec_from_values


class FedAlgRecipe(Recipe):
    """A client algorithm (``client``, ``client_args``) with a server rule (``server``, ``server_args``).

    Args:
        name: job name (folder name on export).
        client: client algorithm (``fedavg``, ``scaffold``, ``fedprox``, ``feddyn``, ...).
        client_args: its hyperparameters, e.g. ``{"mu": 0.01}`` for FedProx.
        server: server aggregation rule (``fedavg``, ``scaffold``, ``feddyn``, ``fedyogi``, ...).
        server_args: its hyperparameters, e.g. ``{"alpha": 0.01}`` for FedDyn.
        num_rounds: federated rounds.
        min_clients: sites the job needs (NVFlare waits for this many before it starts the job; also the number of
            simulated shards).
        **settings: any other `jobs.build.JobSpec` field (data, local training, precision, sampling,
            ``min_responses``, ``train_timeout``, ``tracking="mlflow"``, ...; not ``num_sites``, which is
            ``min_clients`` here); see
            ``python -m jobs.build --help``.
    """

    def __init__(
        self,
        *,
        name: str = "fedalg",
        client: str = "fedavg",
        client_args: dict[str, Any] | None = None,
        server: str = "fedavg",
        server_args: dict[str, Any] | None = None,
        num_rounds: int = 10,
        min_clients: int = 3,
        **settings: Any,
    ) -> None:
        if "num_sites" in settings:  # the recipe's min_clients is the job's num_sites: one name for one number
            raise JobBuildError(
                f"num_sites {settings['num_sites']!r}: the recipe takes the number of sites as min_clients; "
                f"use min_clients={settings['num_sites']!r}"
            )
        values = {
            "client": client,
            "client_args": dict(client_args or {}),
            "server": server,
            "server_args": dict(server_args or {}),
            "num_rounds": num_rounds,
            "num_sites": min_clients,
            **settings,
        }
        # The builder's path: unknown keywords are refused as the builder refuses them, not with a raw TypeError.
        self.spec: JobSpec = spec_from_values(name, values)
        # NVFlare resolves the client script path relative to the working directory when the job is assembled and
        # again when it is written, so both happen inside jobs/, where client.py lives (as jobs.build.export_job).
        with inside_directory(JOBS_DIR):
            job = build_job(self.spec)
        super().__init__(job)

    @classmethod
    def from_spec(cls, spec: JobSpec) -> FedAlgRecipe:
        """The recipe of an existing spec (e.g. one a job folder recorded, `jobs.job_record.recorded_spec`)."""
        settings = {f.name: getattr(spec, f.name) for f in dataclasses.fields(JobSpec)}
        del settings["num_sites"]  # the recipe's min_clients
        return cls(min_clients=spec.num_sites, **settings)

    def enable_log_streaming(self, *file_names: str) -> None:
        """NVFlare's live log streaming (every site's ``log.json`` by default), refused under DP: the log leaves
        the site in the clear, outside the DP release (`jobs.log_streaming`)."""
        problem = log_streaming_problem(self.spec, file_names or ("log.json",))
        if problem:
            raise JobBuildError(problem)
        super().enable_log_streaming(*file_names)

    def export(self, job_dir: str, *args: Any, **kwargs: Any) -> None:
        target = str(Path(job_dir).resolve())  # relative to the caller's directory, before changing into jobs/
        with inside_directory(JOBS_DIR):
            super().export(target, *args, **kwargs)
        # A streamer added to the job some other way (NVFlare's job API on the recipe's job): refused as well,
        # the folder removed, so that nothing that would stream a DP site's log is left to submit.
        problem = log_streaming_problem(self.spec, streamed_logs(Path(target) / self.spec.name))
        if problem:
            shutil.rmtree(Path(target) / self.spec.name)
            raise JobBuildError(problem)
        # What jobs.assembly.export_job adds to NVFlare's export, so that both write the same folder (HE filters!).
        sort_filter_tasks(Path(target) / self.spec.name)
        write_site_requirements(Path(target) / self.spec.name, self.spec)
        write_job_entry(Path(target) / self.spec.name, self.spec)

    def run(self, env: ExecEnv, *args: Any, **kwargs: Any) -> Any:
        with inside_directory(JOBS_DIR):
            return super().run(env, *args, **kwargs)
