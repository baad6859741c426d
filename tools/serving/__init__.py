"""Measurements of the served path users run: gateway overhead, smg against the gateway, the soak; child-process helpers."""
