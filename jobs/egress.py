"""What a training job declares its sites release, per task, and the egress gates that enforce it (docs/privacy.md).

`job_releases` computes, once at build time, the `aggregators.contracts.egress.Release` of each task a training job's
sites answer (``train``; ``validate``, the final site evaluation): the weights are the job model's state_dict entries
but the local ones (``--local-keys``, the personal head), or anything for a ``--script`` job (the user's script builds
its own model); the meta is what `lightning_modules.privacy.release.declared_meta` declares for the client
algorithm and the DP settings, plus what the mechanism's filters add (`jobs.secure_aggregation.sum_result_meta`)
and NVFlare's step count; the metrics (NVFlare's Lightning callback's validation scores) only where the site's
scores are released (no DP, or ``--dp-release-site-scores``); under ``--secure-aggregation secagg`` the training
result is the masked update and the key and unmask stages' answers are declared too. `add_egress_gates` puts one
`aggregators.contracts.egress_gate.EgressGate` per task last in the sites' result filters.
"""

from __future__ import annotations

from typing import Any

from aggregators.contracts.egress import METRICS_KIND, NVFLARE_RESULT_META, Release
from jobs.secure_aggregation import secagg_releases, sum_result_kind, sum_result_meta

#: The tasks a training job's sites answer: NVFlare's default training task and the final site evaluation.
TRAIN_TASK, VALIDATE_TASK = "train", "validate"
WEIGHTS_KIND = "WEIGHTS"


def job_weight_keys(spec: Any) -> tuple[str, ...]:
    """The state_dict entries a site of ``spec`` sends: every entry of the job's model but its local ones; for a
    ``--script`` job, any name (the user's script builds the model)."""
    if spec.script is not None:
        return ("*",)
    from jobs.spec import job_model

    local = set(spec.local_keys.split(",")) if spec.local_keys else set()
    return tuple(name for name in job_model(spec).state_dict() if name not in local)


def job_releases(spec: Any) -> tuple[Release, ...]:
    """The declared release of each task of ``spec``'s sites (module docstring)."""
    from lightning_modules.privacy.job_checks import is_private
    from lightning_modules.privacy.release import declared_meta

    private = is_private(spec)
    meta = (*declared_meta(spec.client, private, spec.dp_release_site_scores), *NVFLARE_RESULT_META)
    meta += sum_result_meta(spec)
    metrics = ("*",) if not private or spec.dp_release_site_scores else ()
    releases = (
        Release(TRAIN_TASK, (sum_result_kind(spec),), job_weight_keys(spec), meta, metrics),
        Release(VALIDATE_TASK, (METRICS_KIND,), (), meta, metrics),
    )
    return releases + cross_site_releases(spec) + secagg_releases(spec)


def cross_site_releases(spec: Any) -> tuple[Release, ...]:
    """With ``cross_site_eval`` (aggregators/contracts/cross_site.py; refused under DP and for --script jobs): a site
    sends its kept model (a mixture: both states and the weight) and its local-only model, every entry of the job's
    model (local ones included: these are the site's whole models), and for the other sites' models counts only."""
    if not getattr(spec, "cross_site_eval", False):
        return ()
    from aggregators.contracts import cross_site
    from jobs.spec import job_model

    entries = tuple(job_model(spec).state_dict())
    return (
        Release(
            cross_site.SUBMIT_TASK,
            (WEIGHTS_KIND,),
            cross_site.submitted_data_patterns(entries),
            (cross_site.KEPT_WEIGHT,),
        ),
        Release(
            cross_site.VALIDATE_TASK,
            (METRICS_KIND,),
            (),
            (),
            tuple(f"*/{count}" for count in cross_site.COUNTS),
        ),
    )


def add_egress_gates(job: Any, spec: Any) -> None:
    """One gate per task, appended to the sites' result filters: after every filter the job adds before it (call
    it last), so under secure aggregation it sees the encrypted result as it leaves."""
    from nvflare.job_config.defs import FilterType

    from aggregators.contracts.egress_gate import EgressGate

    for release in job_releases(spec):
        job.to_clients(EgressGate(**release.to_config()), tasks=[release.task], filter_type=FilterType.TASK_RESULT)
