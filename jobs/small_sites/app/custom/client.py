"""This job's client script: a thin launcher for the client of the nvflare-noniid bundle (``jobs.client.main``).

Every site runs it with the job's options (``task_script_args`` in ../config/config_fed_client.json), in NVFlare's
client job process or, for a job built with ``--devices N``, as the N processes that torchrun starts. The training
code is not in the job: it is the bundle's, so the bundle must be installed on every site and on the server (see
site_requirements.txt beside this file). ``python client.py --help`` lists the options. A job's own training script
(``--script``) is shipped beside this file; the bundle's client finds it here and runs it.

Written by the bundle's job builder (``python -m jobs.build``) from ``jobs/site_script/client.py``: rebuild the job
instead of editing this copy.
"""

import sys

try:
    from jobs.client import main
except ImportError as missing:  # a site without the bundle (or with a broken install): say what it lacks
    sys.exit(f"error: this job's client needs the nvflare-noniid bundle installed (site_requirements.txt): {missing}")

if __name__ == "__main__":
    main(client_script=__file__)
