"""The CPU backend: loop nests printed as Python and compiled by Numba (parallel over prange)."""

from .runner import NumbaRunner, runner_for

__all__ = ["NumbaRunner", "runner_for"]
