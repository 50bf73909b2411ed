"""The genomics consortium's own model and data, written as a user's package that jobs import by path.

The bundle installs this folder as the top-level package ``genomics`` (pyproject.toml), so the committed jobs
import it from every site's install of the bundle and carry no copy of it; a job of yours may still ``--ship``
it. A site with a regular install imports the installed copy before a shipped one of the same name (NVFlare
appends the job's folder to the path, after site-packages): a changed version needs a package name of its own.

    python -m jobs.build --presets                     # regenerates the committed jobs, jobs/snp_scaffold among them
    nvflare simulator jobs/snp_scaffold -w /tmp/ws_snp -n 3

``model.py``: genotype models (``cnn_transformer`` and an MLP baseline) as LightningModules with an adaptive
optimizer; ``data.py``: a LightningDataModule that gives each site its share of the 1000 Genomes panel or of a
simulated cohort, or reads the site's own genotype file. See docs/genomics.md.
"""
