"""Backends: the reference interpreter (more join it)."""
