"""The contracts: what the layers above agree on, the bundle's bottom layer (docs/design.md, "Layers").

Build time (``jobs``), the server (``controllers``), the sites (``lightning_modules``) and the data side
(``data_prep``) each read these names, so they live below all of them and import nothing of the bundle's own but
each other: every job setting and `job_settings.JobBuildError` (``job_settings.py``), the one typed declaration of
settings and hyperparameters (``hparams.py``), the wire messages (``wire.py``) and every meta key
(``meta_keys.py``), which sites train in a round (``sampling.py``), the installed packages and HE context names
(``bundle.py``), a run's files and how it ended (``run_records.py``, ``run_outcome.py``), the cross-site
evaluation's task and count names (``cross_site.py``), and the egress declarations (``egress.py``) with the sites'
filter that enforces them (``egress_gate.py``, the one NVFlare module here: the job builder and the genotype QC job
both install it, so it sits below ``data_prep``). The rules' math (`aggregators`) sits on top of the contracts.

A setting that takes a registry's names (models, client algorithms, rules) says which registry by name
(``registry="models"``); the layer that owns the registries resolves it (``jobs.settings.registries``), so no module
here names a layer above, not even by string (tests/test_layers.py).
"""
