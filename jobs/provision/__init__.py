"""Provisioning a real deployment of this bundle and running jobs on it (see docs/deployment.md)."""
