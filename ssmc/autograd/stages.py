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
ground truth, keeps the whole program's adjoint (`driver.Grad`: `Backend.runs_stages`).
"""

from __future__ import annotations

import numpy as np

from ..backends.cuda.devices import on_arrays_device
from ..backends.registry import check_backend, get_backend
from ..runtime.binding import DEFAULT_LAYOUT
from ..runtime.prologue import bind_call
from .driver import Driver, Grad
from .tape import Tape


class StagedGrad(Driver):
    """`Driver` of a program the fusion stage cuts into several programs: a `Grad` per stage,
    chained (module docstring). Its tape holds a tape per stage (`Tape.tapes`)."""

    def __init__(self, program, backend: str, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
        self.program = program
        self.backend = check_backend(backend)
        self.target = get_backend(backend)
        self.stages = self.target.stages(program).stages
        self.xp = self.target.arrays
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

    @on_arrays_device(lambda a, kw: (*a[0], a[1]))  # (args, kwargs, layout, outputs)
    def _forward(self, args: tuple, kwargs: dict, layout, outputs: bool):
        """(outputs, final states, tape) as `Grad.forward`: outputs time first, compute dtype; each
        stage's forward runs with its outputs (the next stage reads them), so `outputs` changes nothing."""
        p, layout = self.program, layout or self.layout
        bound, dtype = bind_call(self.target, p, args, kwargs, layout, self.dtype)
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
        return results, finals, Tape(bound.sizes, bound.length, dtype, layout, tapes=tapes)

    def adjoint(self, tape: Tape, cot: dict, lam: dict) -> dict:
        """The stages' adjoints, last to first: each stage's cotangents are those of its outputs
        (zeros where none came), its gradients of intermediates the cotangents of the stage that
        wrote them, its gradients of the layer's inputs summed (zeros for inputs no stage reads)."""
        p, xp = self.program, self.xp
        cot = dict(cot)
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
        return totals
