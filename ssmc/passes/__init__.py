"""Passes over the IR."""
