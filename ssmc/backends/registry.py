"""Which backends exist, and the one function each offers: run a recurrence over arrays.

A runner is ``run(seqs, params, initial, sizes, length) -> (outputs, final states)`` with
time-first arrays and name -> array dicts: the contract of `interpreter.run_recurrence`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from . import interpreter

BACKENDS = ("interpreter", "numba")

Runner = Callable[..., tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]


def default_backend() -> str:
    """The fastest backend this machine can run: Numba on the CPU."""
    return "numba"


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return name


def compute_dtype(backend: str, given: np.dtype, requested=None) -> np.dtype:
    """float64 for the interpreter (the ground truth); else as requested, or as the inputs are."""
    if backend == "interpreter":
        return np.dtype(np.float64)
    dtype = np.dtype(requested) if requested is not None else np.dtype(given)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype {dtype} is not supported by the {backend} backend (float32, float64)")
    return dtype


def runner(backend: str, program, dtype: np.dtype) -> Runner:
    if backend == "interpreter":
        return partial(interpreter.run_recurrence, program)
    from .numba import runner_for

    return runner_for(program, dtype.name).run
