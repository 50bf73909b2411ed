"""Run this job with NVFlare's recipe API: ``python job.py`` (SimEnv), ``--env poc`` (PocEnv),
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
