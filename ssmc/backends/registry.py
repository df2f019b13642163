"""Which backends exist, and the one function each offers: run a recurrence over arrays.

A runner is ``run(seqs, params, initial, sizes, length) -> (outputs, final states)`` with
time-first arrays and name -> array dicts: the contract of `interpreter.run_recurrence`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np

from ..lowering.stages import Fused, fuse
from . import interpreter

BACKENDS = ("interpreter", "numba", "cuda")

Runner = Callable[..., tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]


def default_backend() -> str:
    """The fastest backend this machine can run: CUDA when a GPU, CuPy and PyTorch are there, else Numba
    (the CUDA backend emulated on the CPU, ``SSMC_CUDA_EMULATE=1``, is for tests: never the default)."""
    from .cuda.devices import emulating
    from .cuda.runner import available

    return "cuda" if not emulating() and available() else "numba"


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


def runner(backend: str, program, dtype: np.dtype, products: dict | None = None) -> Runner:
    """The run function for `program`: the interpreter runs it as written (the ground truth);
    compiled backends run its fusion stages (`lowering/stages.py`), each a program of its own.

    `products`: where the Numba and CUDA backends keep the matrix products they hoist out of the
    time loop (`hoist.compute_pre`) for a later run over the same sequences and params to reuse;
    the interpreter, and programs run in stages, ignore it."""
    if backend == "interpreter":
        return partial(interpreter.run_recurrence, program)
    fused = fuse(program)
    if not fused.staged:
        return _compiled(backend, program, dtype, products)
    staged = partial(run_stages, fused, [_compiled(backend, st.program, dtype) for st in fused.stages])
    if backend == "cuda":  # or where one block of threads owns each row: the layer in one kernel
        from .cuda.runner import layer_runner

        return layer_runner(fused, dtype.name, staged)
    return staged


def preparer(backend: str, program, dtype: np.dtype):
    """Where a backend can work a run out once for many calls alike (CUDA, a program run as one
    kernel): ``prepare(seqs, params, initial, sizes, length, out_dtype) -> call or None``
    (`CudaRunner.prepare`); else None."""
    if backend != "cuda" or fuse(program).staged:
        return None
    from .cuda.hoisted import hoisted_runner
    from .cuda.runner import runner_for

    if hoisted_runner(program, dtype.name) is not None:  # matrix products around the kernels
        return None
    return runner_for(program, dtype.name).prepare


def call_key(backend: str, args: tuple, kwargs: dict):
    """What binding and running a call depend on besides its layout, where the backend prepares
    runs (`preparer`) and every argument is an array it takes as it is; else None (no shortcut)."""
    if backend != "cuda":
        return None
    from .cuda.runner import call_key as cuda_call_key

    return cuda_call_key(args, kwargs)


def _compiled(backend: str, program, dtype: np.dtype, products: dict | None = None) -> Runner:
    if backend == "cuda":
        from .cuda.hoisted import hoisted_runner
        from .cuda.runner import runner_for as cuda_runner

        hoisted = hoisted_runner(program, dtype.name)
        if hoisted is not None:  # contractions out of the time loop, as matrix products (cuda/hoisted.py)
            return hoisted.run if products is None else partial(hoisted.run, products=products)
        return cuda_runner(program, dtype.name).run
    from .numba import runner_for

    run = runner_for(program, dtype.name).run
    return run if products is None else partial(run, products=products)


def run_stages(fused: Fused, runs: list[Runner], seqs, params, initial, sizes, length, out_dtype=None):
    """Run the stages in order, each stage's intermediates (``row<k>``, ``cut<k>``) becoming the
    sequences of the next; the runner contract. Intermediates stay in the compute dtype (norm
    statistics in fp32 whatever the inputs); results are cast to `out_dtype` at the end."""
    seqs = dict(seqs)
    outs, finals = {}, {}
    for stage, run in zip(fused.stages, runs):
        p = stage.program
        got, fin = run({d.name: seqs[d.name] for d in p.seqs}, {d.name: params[d.name] for d in p.params},
                       {s.name: initial[s.name] for s in p.states}, sizes, length)
        finals.update(fin)
        for name, value in got.items():
            if name in stage.writes:
                seqs[name] = value
            else:
                outs[name] = value if out_dtype is None else value.to(out_dtype)
    program = fused.program
    return {n: outs[n] for n, _ in program.outputs}, {s.name: finals[s.name] for s in program.states}


def array_support(backend: str, read_only_zeros: bool = False):
    """(convert, zeros) for binding arguments: NumPy on the host, torch CUDA tensors for cuda (a
    ValueError where this machine cannot run cuda).
    `read_only_zeros`: the caller never writes nor returns the zero initial states (a forward), so
    cuda may share one tensor per shape between calls (`shared_device_zeros`)."""
    if backend == "cuda":
        from .cuda.runner import device_zeros, require_gpu, shared_device_zeros, to_device

        require_gpu()
        return to_device, shared_device_zeros if read_only_zeros else device_zeros
    return None, None
