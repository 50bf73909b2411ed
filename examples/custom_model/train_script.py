"""A user's own Lightning training script, made federated with a few lines (the rest is plain Lightning).

Ship it in a job with ``python -m jobs.build ... --model custom_model.model:DigitsClassifier --script
examples/custom_model/train_script.py --ship examples/custom_model``: every site runs this file instead of the
bundle's site loop; the server side (rule, validation, metrics) is the bundle's, built from the same command.
"""

import nvflare.client.lightning as flare
import pytorch_lightning as pl

from custom_model.data import DigitsSites
from custom_model.model import DigitsClassifier
from lightning_modules.federated import job_algorithm

flare.init()
site = flare.get_site_name()
model = DigitsClassifier()
data = DigitsSites(site=site)
algorithm = job_algorithm()  # the job's client algorithm (--client/--client-args), its state kept per site
while flare.is_running():
    received = flare.receive()
    if received is None:
        break
    trainer = pl.Trainer(max_epochs=1, callbacks=[algorithm], logger=False, enable_checkpointing=False)
    flare.patch(trainer, restore_state=False)  # NVFlare's callback goes after ours; a fresh optimizer each round
    trainer.validate(model, datamodule=data, verbose=False)  # the sites' evaluation of the received global model
    trainer.fit(model, datamodule=data)
