"""The noisy federated QC job's client script (``qc-job --dp-target-epsilon`` copies it into the job): it runs
`lightning_modules.privacy.qc_release.site_main` from the bundle installed at the site."""

from lightning_modules.privacy.qc_release import site_main

if __name__ == "__main__":
    site_main()
