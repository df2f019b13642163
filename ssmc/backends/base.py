"""The backend protocol: what the rest of ssmc asks of a backend, instead of comparing its name.

`registry.get_backend(name)` hands out one frozen `Backend` object per backend. Callers (`ssmc.compile`,
the gradient drivers of `ssmc.autograd`, the torch function, the benchmark) ask it:

    runner(program, dtype)        the run function of a program (the runner contract below)
    preparer(program, dtype)      where runs can be worked out once for many calls alike, else None
    call_key(args, kwargs)        what such a prepared call depends on, else None (no shortcut)
    array_support(...)            how arguments become the backend's arrays (binding)
    check_arrays(arrays)          checks of a bound call's arrays together (one device)
    compute_dtype(given, ...)     the dtype a call computes in
    attention(program)            how `ssmc.attention` runs: the tiled torch path, or None (interpreter)
    arrays                        the array operations of the gradient drivers (`ArrayOps`)
    default_chunk(...)            the memory plan of a gradient: steps per recomputed chunk
    recording(backward)           the recording forward a gradient runs, and what it saves
    fused_backward(...)           a backward run as a whole (CUDA's fused backward), else None

A runner is ``run(seqs, params, initial, sizes, length) -> (outputs, final states)`` with time-first
arrays and name -> array dicts: the contract of `interpreter.run_recurrence`.

The base class is a backend computing on the host in NumPy; `registry.py` holds the three there are.
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Protocol

import numpy as np

from ..lowering.stages import Fused, fuse
from ..passes.autodiff import DEFAULT_CHUNK
from ..runtime.binding import to_array

Runner = Callable[..., tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]

CPU_CARRIES_BUDGET = 64 << 20  # bytes of carries one chunk may recompute (or keep) on the host


class ArrayOps(Protocol):
    """The few array operations the gradient drivers need, on a backend's own arrays."""

    def convert(self, x, name: str): ...
    def zeros(self, shape, dtype): ...
    def cast(self, x, dtype): ...
    def cat(self, parts): ...
    def permute(self, x, perm): ...
    def contiguous(self, x): ...


class HostArrays:
    """`ArrayOps` on NumPy arrays (interpreter, numba)."""

    convert = staticmethod(to_array)  # cast to the compute dtype afterwards (no float64 detour)

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype=dtype)

    @staticmethod
    def cast(x, dtype):
        return x.astype(dtype, copy=False)

    @staticmethod
    def cat(parts):
        return np.concatenate(parts, axis=0)

    @staticmethod
    def permute(x, perm):
        return x.transpose(perm)

    @staticmethod
    def contiguous(x):
        return np.require(x, requirements="C")


@dataclass(frozen=True)
class Backend:
    """A backend computing on the host in NumPy arrays (the defaults of every question)."""

    name: str

    # arrays live on an accelerator: its kernels read any float dtype and strides in place, a call's
    # arrays must share one device, and results come back there
    on_device: ClassVar[bool] = False
    # a layer the fusion stage cuts into programs runs as its stages (`lowering/stages.py`), and its
    # gradient chains the stages' gradients (`autograd/stages.py`)
    runs_stages: ClassVar[bool] = True
    # a gradient that wants no outputs runs the recording forward where one chunk covers the sequence
    # (keeping every carry costs less than recomputing them); else only where outputs are wanted
    records_without_outputs: ClassVar[bool] = True
    arrays: ClassVar[ArrayOps] = HostArrays()

    def __str__(self) -> str:
        return self.name

    # running

    def runner(self, program, dtype: np.dtype, products: dict | None = None) -> Runner:
        """The run function for `program`: its fusion stages (`lowering/stages.py`), each a program
        compiled on its own (`compiled`), chained by `run_stages` (or run whole by `layer_runner`).

        `products`: where the backend keeps the matrix products it hoists out of the time loop
        (`hoist.compute_pre`) for a later run over the same sequences and params to reuse; programs
        run in stages ignore it."""
        fused = self.stages(program)
        if not fused.staged:
            return self.compiled(program, dtype, products)
        staged = partial(run_stages, fused, [self.compiled(st.program, dtype) for st in fused.stages],
                         dtypes=self.stage_dtypes(fused, dtype))
        return self.layer_runner(fused, dtype, staged)

    def takes_products(self, program, dtype: np.dtype) -> bool:
        """Whether `runner(program, dtype, products)` reads or fills `products` (else the runner is the
        same for any products, and a caller may keep it)."""
        return True

    def stages(self, program) -> Fused:
        """The programs `program` runs as, in order (`lowering/stages.py`, `fuse`)."""
        return fuse(program)

    def compiled(self, program, dtype: np.dtype, products: dict | None = None) -> Runner:
        """The run function of one program (no stages): the backend's compiled kernels."""
        raise NotImplementedError(f"backend {self.name!r} compiles nothing")

    def step_runner(self, program, layout, dtype=None):
        """A backend's own path for `api.Step`'s calls (``run(given, initial, out, in_place)`` -> (outputs,
        new states), or None for a call it does not take), or None: every step runs the full-sequence call
        on a sequence of one step."""
        return None

    def layer_runner(self, fused: Fused, dtype: np.dtype, staged: Runner) -> Runner:
        """The run function of a layer cut into stages, given `staged` (the stages in order)."""
        return staged

    def stage_dtypes(self, fused: Fused, dtype: np.dtype):
        """``dtypes(index, seqs, sizes, out_dtype) -> the out_dtype argument of stage `index`'s run``
        (`run_stages`; seqs: the call's and the earlier stages' sequences), where the backend's runners
        write some stage's outputs in other dtypes than the compute dtype; else None (intermediates in
        the compute dtype, the results cast to the call's dtype at the end)."""
        return None

    def preparer(self, program, dtype: np.dtype):
        """``prepare(seqs, params, initial, sizes, length, out_dtype) -> call or None`` where the
        backend can work a run out once for many calls alike; else None."""
        return None

    def call_key(self, args: tuple, kwargs: dict):
        """What binding and running a call depend on besides its layout, where the backend prepares
        runs (`preparer`) and every argument is an array it takes as it is; else None (no shortcut)."""
        return None

    def on_current_device(self, tensor) -> bool:
        """Whether `tensor` is one of the backend's arrays on its current device (where prepared
        training steps of the torch function apply)."""
        return False

    # binding

    def array_support(self, read_only_zeros: bool = False):
        """(convert, zeros) for binding arguments (`bind_arrays`); (None, None): NumPy.
        `read_only_zeros`: the caller never writes nor returns the zero initial states (a forward),
        so a backend may share one array per shape between calls."""
        return None, None

    def check_arrays(self, arrays: dict) -> None:
        """Checks of a bound call's arrays (name -> array) together: ValueError naming one."""

    def compute_dtype(self, given: np.dtype, requested=None) -> np.dtype:
        """As requested, or as the inputs are (`Bound.dtype`: float32 when all are float32, float16 and
        bfloat16 included); float32 or float64."""
        dtype = np.dtype(requested) if requested is not None else np.dtype(given)
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"dtype {dtype} is not supported by the {self.name} backend (float32, float64)")
        return dtype

    def run_inputs(self, program, bound, dtype: np.dtype) -> tuple[dict, dict, dict, dict]:
        """(seqs, params, initial states, the run's extra keywords) of a bound call for a forward run:
        on the host the arrays in the compute dtype."""
        seqs = {d.name: bound.arrays[d.name].astype(dtype, copy=False) for d in program.seqs}
        params = {d.name: bound.arrays[d.name].astype(dtype, copy=False) for d in program.params}
        initial = {k: v.astype(dtype, copy=False) for k, v in bound.initial.items()}
        return seqs, params, initial, {}

    def from_host(self, values: dict, dtype: str) -> dict:
        """NumPy arrays as the backend takes them, in `dtype` (the benchmark's inputs)."""
        return {k: v.astype(dtype) for k, v in values.items()}

    def synchronize(self) -> None:
        """Until the backend has done what was asked of it (the benchmark's clock stops after)."""

    def attention(self, program):
        """The run of an `Attention` program: its tiled torch path (`tiled_attention.TiledAttention`), or
        None where attention runs on the interpreter (torch not importable)."""
        try:
            from .tiled_attention import TiledAttention
        except ImportError:
            return None
        return TiledAttention(program)

    def device_description(self) -> str:
        """Where the backend runs, in words (a ValueError where it cannot run here)."""
        return f"CPU ({platform.processor() or platform.machine()})"

    # gradients

    def default_chunk(self, length: int, program, sizes: dict[str, int], itemsize: int = 4) -> int:
        """Steps per recomputed chunk of a gradient when the caller gives none: as long as keeps one
        chunk's carries within `CPU_CARRIES_BUDGET`, and at least `DEFAULT_CHUNK` steps."""
        per_step_state = sum(math.prod(sizes[a] for a in s.axes) for s in program.states)
        return max(DEFAULT_CHUNK, min(length, CPU_CARRIES_BUDGET // max(per_step_state * itemsize, 1)))

    def recording(self, backward):
        """(the recording forward this backend runs, the (output name, node) pairs it saves for the
        adjoint): `backward.recording` as derived, nothing saved."""
        return backward.recording, ()

    def fused_backward(self, backward, dtype: str):
        """A runner of the forward and the adjoint of `backward` as a whole (CUDA's fused backward:
        `applies`, `forward`, `backward`, `prepare_forward`, `prepare_backward`), or None."""
        return None


def run_stages(fused: Fused, runs: list[Runner], seqs, params, initial, sizes, length, out_dtype=None,
               dtypes=None):
    """Run the stages in order, each stage's intermediates (``row<k>``, ``cut<k>``) becoming the
    sequences of the next; the runner contract. Intermediates stay in the compute dtype (norm
    statistics in fp32 whatever the inputs); results are cast to `out_dtype` at the end. `dtypes`
    (`Backend.stage_dtypes`), where given, says what each stage's run writes its outputs in instead."""
    seqs = dict(seqs)
    outs, finals = {}, {}
    for index, (stage, run) in enumerate(zip(fused.stages, runs)):
        p = stage.program
        own = dtypes(index, seqs, sizes, out_dtype) if dtypes is not None else None
        got, fin = run({d.name: seqs[d.name] for d in p.seqs}, {d.name: params[d.name] for d in p.params},
                       {s.name: initial[s.name] for s in p.states}, sizes, length,
                       **({} if own is None else {"out_dtype": own}))
        finals.update(fin)
        for name, value in got.items():
            if name in stage.writes:
                seqs[name] = value
            else:
                outs[name] = value if out_dtype is None else value.to(out_dtype)  # no copy where so already
    program = fused.program
    return {n: outs[n] for n, _ in program.outputs}, {s.name: finals[s.name] for s in program.states}
