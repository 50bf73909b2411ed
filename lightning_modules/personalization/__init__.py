"""Personalization: what a site keeps for itself (partial sharing, FedRep's head). See docs/personalization.md."""

from lightning_modules.personalization.local_keys import (
    BATCHNORM,
    LocalKeysError,
    declared_head_keys,
    leaked_local_keys,
    local_keys_problem,
    parse_local_keys,
    resolve_local_keys,
    shared_entries,
)

__all__ = [
    "BATCHNORM",
    "LocalKeysError",
    "declared_head_keys",
    "leaked_local_keys",
    "local_keys_problem",
    "parse_local_keys",
    "resolve_local_keys",
    "shared_entries",
]
