"""Sample-level differential privacy at every site: DP-SGD (Opacus's per-sample gradients and DP step) wired into the
client-algorithm callback, an RDP accountant, the per-site privacy ledger in the state store, and the table of what
leaves a site (docs/privacy.md).

Opacus is an optional extra (``pip install '.[privacy]'``): only `lightning_modules.privacy.dp_sgd` and the
accountant import it, and only when a job turns DP on.
"""

from lightning_modules.privacy.config import PrivacyConfig, privacy_config_problem

__all__ = ["PrivacyConfig", "privacy_config_problem"]
