"""``ssmc.grad``: gradients of every input, param and initial state, through the derived backward.

    g = ssmc.grad(spec, layout="b t ...")
    grads = g(x, f, h=h0, grad_outputs=dy, grad_final_states=dh_last)
    grads["x"], grads["f"], grads["h"]          # same shapes and layout as the inputs

    outs, finals, tape = g.forward(x, f, h=h0)   # a training step: the forward once ...
    grads = g.backward(tape, grad_outputs=dy)    # ... and the backward from what it kept

The package, in import order (no module imports one below it):

    tape.py       `Tape`, the one record a forward leaves its backward (every driver, every path);
                  the cotangents a backward reads, and gradients back in the inputs' layouts
    prepared.py   steps worked out once per call signature where the backend prepares calls
                  (`PreparedStep` for the fused backward, `PreparedChunk` for one chunk)
    lean.py       `LeanStep`: a `PreparedStep`'s calls at the least host time (pointers and views)
    driver.py     `Driver`, the interface of a recurrence's gradient, and `Grad`, the driver of one
                  program on any backend; `Grad._path` is the one place that picks a call's path
    stages.py     `StagedGrad`: the driver of a layer cut into fusion stages, chaining `Grad`s (and
                  `PreparedStages`, its calls alike after a first one, chaining the stages' steps)
    attention.py  `AttentionGrad`: `ssmc.attention`'s gradients (the tiled torch path, or the interpreter)

Everything a backend decides is asked of its `Backend` object (backends/base.py): its arrays, its
chunk, its recording forward, its fused backward, whether it prepares calls. No module here
compares backend names.

What is not one driver yet, and why:

- `StagedGrad` is a `Driver` of its own: its tape is its stages' tapes and its adjoint their chain.
  Folding it into `Grad` would make `Grad` know about fusion stages for one case.
- `PreparedStep`, `PreparedChunk` and `LeanStep` are the CUDA backend's per-signature fast paths.
  They replay launches the CUDA runner prepared (`CudaRunner.prepare`, `PreparedLaunch`), so they
  use its objects directly; `Grad._path` picks them, and their tapes are `Tape`s whose `step`
  routes the backward back to them. Moving them behind `Backend` needs a hook on the CUDA side
  that returns a prepared training step (forward and backward launches) for a bound call.
- `AttentionGrad` differentiates an `Attention` program, not a recurrence: it has no tape and no
  chunks; it runs the tiled torch path (backends/tiled_attention.py) until attention's kernels are
  built, the interpreter where torch is missing.
"""

from __future__ import annotations

import numpy as np

from ..backends.registry import default_backend, get_backend
from ..frontend.attention import AttentionSpec
from ..runtime.binding import DEFAULT_LAYOUT
from ..runtime.prologue import program_of
from .attention import AttentionGrad
from .driver import Driver, Grad, default_chunk
from .stages import StagedGrad
from .tape import Tape

__all__ = ["AttentionGrad", "Driver", "Grad", "StagedGrad", "Tape", "default_chunk", "grad", "make_grad"]


def make_grad(program, backend: str, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
    """`StagedGrad` where the backend runs `program` in stages, else `Grad`; ValueError for a `chunk`
    that is not a whole number of steps >= 1."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1):
        raise ValueError(f"chunk must be a whole number of steps >= 1, got {chunk!r}")
    target = get_backend(backend)
    if target.runs_stages and target.stages(program).staged:
        return StagedGrad(program, backend, layout, chunk, dtype)
    return Grad(program, backend, layout, chunk, dtype)


def grad(spec, backend: str | None = None, *, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
    """Gradients of a spec (see the module docstring) on a backend (default: as `ssmc.compile`).

    `chunk` sets a recurrence's memory plan (default: `Backend.default_chunk`); `dtype` as in
    `ssmc.compile`.
    """
    if isinstance(spec, AttentionSpec):
        return AttentionGrad(spec, layout, backend or default_backend())
    return make_grad(program_of(spec), backend or default_backend(), layout, chunk, dtype)
