"""The genomics consortium's own model and data, kept outside the bundle's packages: jobs import them by path.

    python -m jobs.build --preset snp_scaffold --output-dir /tmp/jobs       # or the committed jobs/snp_scaffold
    nvflare simulator jobs/snp_scaffold -w /tmp/ws -n 3

``model.py``: genotype models (``cnn_transformer`` and an MLP baseline) as LightningModules with an adaptive
optimizer; ``data.py``: a LightningDataModule that gives each site its share of the 1000 Genomes panel or of a
simulated cohort, or reads the site's own genotype file. See docs/genomics.md.
"""
