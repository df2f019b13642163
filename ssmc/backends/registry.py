"""Which backends exist: one `Backend` object each (base.py says what callers ask of it).

    get_backend("numba").runner(program, np.dtype("float32"))(seqs, params, initial, sizes, length)

`interpreter` runs a program as written in float64 NumPy (the ground truth), `numba` compiles it for
the CPU, `cuda` for a GPU (CuPy and PyTorch). The CUDA backend's modules are imported only when it is
asked something only it can answer, so that the others run where CuPy or torch are missing.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from ..ir.node import toposort
from ..ir.ops import Op
from . import interpreter
from .base import Backend, Runner, run_stages
from .cuda.backend import CudaBackend

__all__ = ["BACKENDS", "Backend", "Runner", "array_support", "call_key", "check_backend",
           "compute_dtype", "default_backend", "for_tensor", "get_backend", "preparer", "run_stages", "runner"]


class InterpreterBackend(Backend):
    """The float64 reference interpreter: a program as written, never in stages."""

    runs_stages = False

    def runner(self, program, dtype: np.dtype, products: dict | None = None) -> Runner:
        return partial(interpreter.run_recurrence, program)

    def compute_dtype(self, given: np.dtype, requested=None) -> np.dtype:
        """float64 whatever is given or requested: the ground truth."""
        return np.dtype(np.float64)

    def attention(self, program):
        """None: attention runs on the interpreter (`interpreter.run_attention`), the ground truth."""
        return None


class NumbaBackend(Backend):
    """Programs compiled for the CPU by Numba."""

    def compiled(self, program, dtype: np.dtype, products: dict | None = None) -> Runner:
        from .numba import runner_for

        run = runner_for(program, dtype.name).run
        return run if products is None else partial(run, products=products)

    def recording(self, backward):
        """The recording forward, saving besides the carries the products the adjoint would hoist out
        of its loop and recompute from the carries (an LSTM's ``h U``), which the forward's loop
        computes anyway; written per step, they reach the adjoint through `Tape.products`."""
        rec = backward.recording
        if rec is None:
            return rec, ()
        from ..lowering.hoist import hoist

        states = {s.name for s in backward.forward.states}
        known = {d.name for d in backward.forward.decls}
        taken = {n for n, _ in rec.outputs}
        saved = []
        for _, node in hoist(backward.adjoint).pre:
            leaves = {n.arg for n in toposort([node]) if n.op is Op.INPUT}
            if leaves & states and leaves <= known:
                name = f"saved_{len(saved)}"
                while name in taken:
                    name += "_"
                saved.append((name, node))
        if not saved:
            return rec, ()
        return rec.with_roots(rec.updates, rec.outputs + tuple(saved)), tuple(saved)


_BACKENDS: dict[str, Backend] = {b.name: b for b in (InterpreterBackend("interpreter"), NumbaBackend("numba"),
                                                      CudaBackend("cuda"))}
BACKENDS = tuple(_BACKENDS)


def default_backend() -> str:
    """The fastest backend this machine can run: CUDA when a GPU, CuPy and PyTorch are there, else Numba
    (the CUDA backend emulated on the CPU, ``SSMC_CUDA_EMULATE=1``, is for tests: never the default)."""
    from .cuda.arrays import available
    from .cuda.devices import emulating

    return "cuda" if not emulating() and available() else "numba"


def check_backend(name: str) -> str:
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")
    return name


def get_backend(name: str | Backend) -> Backend:
    """The backend object of a name (ValueError for an unknown one); a backend object as it is."""
    if isinstance(name, Backend):
        return name
    return _BACKENDS[check_backend(name)]


def for_tensor(tensor) -> str:
    """The backend a torch tensor runs on by default: cuda for CUDA tensors, else numba."""
    return "cuda" if tensor.is_cuda else "numba"


# The questions of `Backend` as functions of a backend's name (or object)

def compute_dtype(name: str | Backend, given: np.dtype, requested=None) -> np.dtype:
    return get_backend(name).compute_dtype(given, requested)


def runner(name: str | Backend, program, dtype: np.dtype, products: dict | None = None) -> Runner:
    return get_backend(name).runner(program, dtype, products)


def preparer(name: str | Backend, program, dtype: np.dtype):
    return get_backend(name).preparer(program, dtype)


def call_key(name: str | Backend, args: tuple, kwargs: dict):
    return get_backend(name).call_key(args, kwargs)


def array_support(name: str | Backend, read_only_zeros: bool = False):
    return get_backend(name).array_support(read_only_zeros)
