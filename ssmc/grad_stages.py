"""Gradients of a staged layer (lowering/stages.py) as the chain of its stages' gradients.

A layer the fusion stage cuts into programs (pre, core, post) is, as a function, their
composition: each stage reads the layer's inputs and the intermediates earlier stages wrote
(``row<k>``, ``cut<k>``). Its gradient is the stages' gradients in reverse order, as a plain loop:

    cot = cotangents of the layer's outputs
    for stage in reversed(stages):
        grads = grad(stage)(cot[outputs of stage])          # each stage's own best backward
        cot[intermediate] += grads[intermediate]            # for the stage that wrote it
        total[input]      += grads[input]                   # the layer's own inputs

So each stage runs the backward that suits it alone: the core of a Mamba-1 block (scan, skip,
gate) is Mamba-1 itself, whose adjoint the CUDA fused backward runs in one kernel, where the
block's whole adjoint would be staged again and recomputed chunk by chunk. The interpreter, the
ground truth, keeps the whole program's adjoint (`grad.Grad`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .backends.cuda.devices import check_one_device, on_arrays_device
from .backends.registry import array_support, check_backend, compute_dtype
from .grad import Grad, Tape, array_ops, cotangents, in_layout, tape_arrays
from .lowering.stages import fuse
from .runtime.binding import DEFAULT_LAYOUT, bind_arrays, check_layout


@dataclass
class StagedTape:
    """What `StagedGrad.forward` keeps: each stage's `Tape`, in stage order, and the layer's
    sizes, length, compute dtype and layout (for the cotangents `backward` is given)."""

    tapes: list[Tape]
    sizes: dict[str, int]
    length: int
    dtype: np.dtype
    layout: object


class StagedGrad:
    """`grad.Grad`'s interface (call, `forward`, `backward`) for a program the fusion stage cuts
    into several programs: a `Grad` per stage, chained (module docstring)."""

    def __init__(self, program, backend: str, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
        self.program = program
        self.backend = check_backend(backend)
        self.stages = fuse(program).stages
        self.xp = array_ops(self.backend)
        self.layout = layout
        self.dtype = dtype
        self.chunk = chunk
        self._grads: dict[str, list[Grad]] = {}

    def _stage_grads(self, dtype: np.dtype) -> list[Grad]:
        """A `Grad` per stage, all in the layer's compute dtype (intermediates stay in it)."""
        key = np.dtype(dtype).name
        if key not in self._grads:
            self._grads[key] = [Grad(st.program, self.backend, DEFAULT_LAYOUT, self.chunk, dtype)
                                for st in self.stages]
        return self._grads[key]

    def __call__(self, *args, grad_outputs=None, grad_final_states=None, layout=None, **kwargs):
        """Returns {input name: gradient} for every sequence, param and state (initial value)."""
        tape = self.forward(*args, layout=layout, **kwargs)[2]
        return self.backward(tape, grad_outputs=grad_outputs, grad_final_states=grad_final_states)

    @on_arrays_device(lambda args, kwargs: (*args, kwargs))
    def forward(self, *args, layout=None, **kwargs):
        """(outputs, final states, tape) as `Grad.forward`: outputs time first, compute dtype."""
        p, layout = self.program, layout or self.layout
        check_layout(layout, p)
        convert, zeros = array_support(self.backend)
        bound = bind_arrays(p.inputs, p.states, args, kwargs, layout, p.static_sizes, p.name, p.roots,
                            convert, zeros)
        if self.backend == "cuda":
            check_one_device({**bound.arrays, **bound.initial})
        dtype = compute_dtype(self.backend, bound.dtype, self.dtype)
        values = dict(bound.arrays)      # the layer's inputs (sequences time first), then intermediates
        given_states = {s.name: bound.initial[s.name] for s in p.states if s.name in kwargs}
        results, finals, tapes = {}, {}, []
        for stage, g in zip(self.stages, self._stage_grads(dtype)):
            sp = stage.program
            inputs = {d.name: values[d.name] for d in sp.inputs}
            inputs.update((s.name, given_states[s.name]) for s in sp.states if s.name in given_states)
            outs, fin, tape = g.forward(**inputs)
            tapes.append(tape)
            finals.update(fin)
            for name, value in outs.items():
                (values if name in stage.writes else results)[name] = value
        results = {n: results[n] for n, _ in p.outputs}
        finals = {s.name: finals[s.name] for s in p.states}
        return results, finals, StagedTape(tapes, bound.sizes, bound.length, dtype, layout)

    @on_arrays_device(lambda a, kw: tape_arrays((a[0] if a else kw["tape"]).tapes[0]))
    def backward(self, tape: StagedTape, grad_outputs=None, grad_final_states=None) -> dict:
        """Gradients {input name: array} (inputs' layouts), as `Grad.backward`."""
        p, xp = self.program, self.xp
        cot, lam = cotangents(p, xp, tape, grad_outputs, grad_final_states)
        totals: dict = {}
        for stage, g, t in reversed(list(zip(self.stages, self._stage_grads(tape.dtype), tape.tapes))):
            sp = stage.program
            stage_cot = {n: cot.pop(n) if n in cot else xp.zeros((t.length, *(t.sizes[a] for a in y.axes)), t.dtype)
                         for n, y in sp.outputs}
            grads = g.adjoint(t, stage_cot, {s.name: lam[s.name] for s in sp.states})
            for name, value in grads.items():
                into = cot if name not in {d.name for d in p.inputs} and name not in lam else totals
                into[name] = into[name] + value if name in into else value
        for d in p.inputs:  # declared but read by no stage
            if d.name not in totals:
                shape = ((tape.length,) if d in p.seqs else ()) + tuple(tape.sizes[a] for a in d.axes)
                totals[d.name] = xp.zeros(shape, tape.dtype)
        return in_layout(p, totals, tape.layout, xp)


def make_grad(program, backend: str, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
    """`StagedGrad` where a compiled backend runs `program` in stages, else `Grad`; ValueError for
    a `chunk` that is not a whole number of steps >= 1."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1):
        raise ValueError(f"chunk must be a whole number of steps >= 1, got {chunk!r}")
    if backend != "interpreter" and fuse(program).staged:
        return StagedGrad(program, backend, layout, chunk, dtype)
    return Grad(program, backend, layout, chunk, dtype)

