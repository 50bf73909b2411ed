"""The PSI job's site component, shipped in the job's custom/ folder as the QC job ships ``qc_site.py``: a job with
code of its own passes NVFlare's component allow-list, which names NVFlare's PSI classes but not the bundle's. The
fingerprints and the shared-people file are `data_prep.genotypes.psi`'s, from the bundle installed at the site."""

from data_prep.genotypes.psi import GenotypeFingerprintPSI


class FingerprintPSI(GenotypeFingerprintPSI):
    """`data_prep.genotypes.psi.GenotypeFingerprintPSI` under a name the job's custom/ folder holds."""
