"""Tidal scaling: silent standby instances, the warm pool, scheduled and metric-driven scaling."""
