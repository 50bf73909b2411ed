"""The aggregation rules' math: numpy dicts in, numpy dicts out (``fedavg.py``, ``fedopt.py``, ..., ``registry.py``).

The layers' contracts, what build time, the server and the sites agree on (job settings, wire messages, meta keys,
hparams, sampling, run records, egress declarations), sit below the math in `aggregators.contracts`. This file
imports nothing, so importing the contracts loads none of the math: import a rule's names from the module that
defines them (`aggregators.registry.RULES`, `aggregators.types.ClientUpdate`).
"""
