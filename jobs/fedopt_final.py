"""The FedOpt model after an HE job's last round, at a site: ``python -m jobs.fedopt_final``.

Under ``--secure-aggregation he --server fedadam|fedyogi|fedadagrad|fedavgm`` the sites take the server optimizer's
step (controllers/he_fedopt.py), so the model the server saves, ``app_server/FL_global_model.pt``, is the last
round's encrypted weighted mean ybar_{T-1}, not FedOpt's x_T. A site turns it into x_T: it decrypts the mean with its
own context (`jobs.secure_aggregation.decrypt_global_model`) and takes one more step from the state it stored
in the last round::

    python -m jobs.fedopt_final <downloaded result>/app_server/FL_global_model.pt --job jobs/my_fedadam_he \\
        --context <site kit>/startup/client_context.tenseal \\
        --state <site workspace>/client_state/<job id> --site site-1 --out /tmp/fedadam_final.pt

``--state`` is the folder of the job's state at the site (``$FLALGO_STATE_DIR/<job id>`` when the site sets it).
For a ``--secure-aggregation plain`` job the saved model is in clear and ``--context`` is left out. The rule and its
arguments are read from the job folder, so the step is the one the sites took.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

STEP_FILTER = "controllers.he_fedopt.SiteOptimizerStep"


def job_rule(job_dir: Path) -> tuple[str, dict[str, Any], int]:
    """(rule, rule_args, last round) of an exported job that steps at the sites."""
    config = Path(job_dir) / "app" / "config"
    client = json.loads((config / "config_fed_client.json").read_text())
    steps = [f for e in client.get("task_data_filters", []) for f in e["filters"] if f["path"] == STEP_FILTER]
    if not steps:
        raise ValueError(f"{job_dir} does not take FedOpt's step at the sites (no {STEP_FILTER} in its client config)")
    server = json.loads((config / "config_fed_server.json").read_text())
    rounds = server["workflows"][0]["args"]["num_rounds"]
    return steps[0]["args"]["server"], dict(steps[0]["args"].get("server_args") or {}), int(rounds) - 1


def saved_mean(model_file: Path, context: Path | None, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The server's saved mean: decrypted with a site's context, or as saved (a plain job)."""
    if context is not None:
        from jobs.secure_aggregation import decrypt_global_model

        return decrypt_global_model(model_file, context, shapes)
    import torch

    saved = torch.load(model_file, map_location="cpu", weights_only=False)
    weights = saved.get("model", saved) if isinstance(saved, dict) else saved
    if any(isinstance(weights[name], bytes) for name in shapes):
        raise ValueError(f"{model_file} holds ciphertexts: give a site's --context")
    return {name: weights[name].numpy() if hasattr(weights[name], "numpy") else weights[name] for name in shapes}


def final_model(job_dir: Path, model_file: Path, context: Path | None, state_dir: Path, site: str) -> dict[str, Any]:
    """x_T as numpy arrays (module docstring)."""
    from jobs.secure_aggregation import job_model_shapes
    from lightning_modules.site_optimizer import SiteOptimizer
    from lightning_modules.state_store import ClientStateStore

    rule, rule_args, last_round = job_rule(job_dir)
    mean = saved_mean(model_file, context, job_model_shapes(job_dir))
    optimizer = SiteOptimizer(rule, rule_args, ClientStateStore(state_dir, site))
    return optimizer.final_model(mean, last_round)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from lightning_modules.site_optimizer import SiteOptimizerError

    parser = argparse.ArgumentParser(prog="python -m jobs.fedopt_final", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="the downloaded app_server/FL_global_model.pt")
    parser.add_argument("--job", type=Path, required=True, help="the job folder (rule, its arguments, shapes)")
    parser.add_argument("--context", type=Path, help="<site kit>/startup/client_context.tenseal (HE jobs)")
    parser.add_argument("--state", type=Path, required=True, help="the site's state folder of the job")
    parser.add_argument("--site", required=True, help="the site whose state it is (e.g. site-1)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the state_dict (.pt)")
    args = parser.parse_args(argv)
    try:
        model = final_model(args.job, args.model, args.context, args.state, args.site)
    except (OSError, ValueError, KeyError, SiteOptimizerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    torch.save({name: torch.from_numpy(value) for name, value in model.items()}, args.out)
    print(f"FedOpt's final model ({len(model)} entries) from {args.site}'s state: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
