"""The PSI job's site components, shipped in the job's custom/ folder as the QC job ships ``qc_site.py``: a job with
code of its own passes NVFlare's component allow-list, which names NVFlare's PSI classes but not the bundle's. The
fingerprints and the shared-people file are `data_prep.genotypes.psi`'s, from the bundle installed at the site.

**An exact intersection.** NVFlare's ``PSIServer`` sends its items to the other site in a Bloom filter
(``openmined.psi``'s ``DataStructure.BLOOM_FILTER``), which should err once in 10^11 queries at NVFlare's default
rate. Measured here (openmined.psi 2.0.6, 240 hashed items a side, 6 shared): the client's intersection held an item
the server did not have in 3-12 of 300 runs, at requested rates 1e-11 to 1e-6 (NVFlare's own docstring cites a known
openmined bug at small rates). A false item is never a false match (``min_panels`` fingerprints must match), but
only the site that learns the intersection first holds it, so the workflow's final check that both sites hold the
same intersection would end such a run (read from NVFlare's code). `ExactPSIServer` sends its (blinded) items as a
plain list (``DataStructure.RAW``) instead: 0 of 300 runs wrong; for 240 items the setup message grows from 1,932
bytes (the Bloom filter at 1e-11) to 8,403 (about 35 bytes an item), measured with openmined.psi 2.0.6.
"""

from nvflare.apis.shareable import Shareable
from nvflare.app_common.app_constant import PSIConst
from nvflare.app_opt.psi.dh_psi.dh_psi_client import PSIClient
from nvflare.app_opt.psi.dh_psi.dh_psi_server import PSIServer
from nvflare.app_opt.psi.dh_psi.dh_psi_task_handler import DhPSITaskHandler

from data_prep.genotypes.psi import GenotypeFingerprintPSI


class FingerprintPSI(GenotypeFingerprintPSI):
    """`data_prep.genotypes.psi.GenotypeFingerprintPSI` under a name the job's custom/ folder holds."""


class ExactPSIServer(PSIServer):
    """NVFlare's DH-PSI server whose setup message is the raw list of its blinded items (module docstring)."""

    def setup(self, client_items_size: int) -> bytes:
        import private_set_intersection.python as psi

        message = self.psi_server.CreateSetupMessage(self.fpr, client_items_size, self.items, psi.DataStructure.RAW)
        return message.SerializeToString()


class ExactDhPSITaskHandler(DhPSITaskHandler):
    """NVFlare's DH-PSI task handler with `ExactPSIServer`: the setup stage makes fresh keys for each interaction, as
    NVFlare's does, and answers one setup message per requested size (the backward pass asks for several)."""

    def setup(self, shareable: Shareable, client_name: str) -> Shareable:
        items = self.get_items()
        if not items:
            raise RuntimeError(f"site {client_name} has no items for the private set intersection")
        self.psi_client, self.psi_server = PSIClient(items), ExactPSIServer(items, self.bloom_filter_fpr)
        result = Shareable()
        if PSIConst.ITEMS_SIZE in shareable:
            result[PSIConst.SETUP_MSG] = self.psi_server.setup(shareable.get(PSIConst.ITEMS_SIZE))
        else:
            sizes = shareable.get(PSIConst.ITEMS_SIZE_SET)
            result[PSIConst.SETUP_MSG] = {str(size): self.psi_server.setup(size) for size in sizes}
        return result
