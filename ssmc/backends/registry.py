"""Which backends exist, and the one function each offers: run a recurrence over arrays.

A runner is ``run(seqs, params, initial, sizes, length) -> (outputs, final states)`` with
time-first arrays and name -> array dicts: the contract of `interpreter.run_recurrence`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from . import interpreter

BACKENDS = ("interpreter", "numba", "cuda")

Runner = Callable[..., tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]


def default_backend() -> str:
    """The fastest backend this machine can run: CUDA when a GPU, CuPy and PyTorch are there, else Numba."""
    from .cuda.runner import available

    return "cuda" if available() else "numba"


def check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return name


def compute_dtype(backend: str, given: np.dtype, requested=None) -> np.dtype:
    """float64 for the interpreter (the ground truth); else as requested, or as the inputs are.

    On CUDA, float16 / bfloat16 inputs compute in float32.
    """
    if backend == "interpreter":
        return np.dtype(np.float64)
    dtype = np.dtype(requested) if requested is not None else np.dtype(given)
    if dtype not in (np.float32, np.float64):
        raise ValueError(f"dtype {dtype} is not supported by the {backend} backend (float32, float64)")
    return dtype


def runner(backend: str, program, dtype: np.dtype) -> Runner:
    if backend == "interpreter":
        return partial(interpreter.run_recurrence, program)
    if backend == "cuda":
        from .cuda.runner import runner_for as cuda_runner

        return cuda_runner(program, dtype.name).run
    from .numba import runner_for

    return runner_for(program, dtype.name).run


def array_support(backend: str):
    """(convert, zeros) for binding arguments: NumPy on the host, torch CUDA tensors for cuda."""
    if backend == "cuda":
        from .cuda.runner import device_zeros, to_device

        return to_device, device_zeros
    return None, None
