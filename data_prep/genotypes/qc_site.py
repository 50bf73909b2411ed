"""The federated QC job's client script (``python -m data_prep.genotypes qc-job`` copies it into the job): a thin
launcher for `data_prep.genotypes.federated_qc.site_main`, which the bundle installed at the site provides."""

import sys

try:
    from data_prep.genotypes.federated_qc import site_main
except ImportError as missing:  # a site without the bundle: say what it lacks
    sys.exit(f"error: the federated QC job needs the nvflare-noniid bundle installed at the site: {missing}")

if __name__ == "__main__":
    site_main()
