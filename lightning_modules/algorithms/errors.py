"""The client algorithms' error type, in a module of its own so that ``base.py`` and ``hparams.py`` (which ``base.py``
imports) can both raise it; import it from `lightning_modules.algorithms` or ``.base`` as before."""

from __future__ import annotations


class ClientAlgorithmError(RuntimeError):
    """A client algorithm cannot run with this trainer, optimizer, precision or server meta."""
