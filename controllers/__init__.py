"""NVFlare server side: one ModelController-based workflow plus thin adapters around the pure rules."""
