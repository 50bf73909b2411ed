"""A model in the genomics consortium's architecture, written here from its published description (not its code).

    nvflare simulator jobs/snp_consortium -w /tmp/ws_consortium -n 3   # the committed job: FedAvg, AdamW, 1000 Genomes

``model.py``: ``HaploblockClassifier``, a cnn_transformer over haploblocks (per-block embeddings, Conv1d +
BatchNorm1d, a transformer encoder, focal loss, AdamW with cosine warm restarts, seeded construction). The data
comes from the sibling example package ``genomics`` (``genomics.data:SnpSites``); the bundle installs both
(pyproject.toml), so the committed job carries neither, and a job that ships this folder ships ``genomics`` too.
See docs/genomics.md, "The consortium's architecture".
"""
