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
from ..runtime.binding import DEFAULT_LAYOUT, from_time_first, to_time_first
from ..runtime.precision import cast_gradients, casting_gradients, given_half
from ..runtime.prologue import PreparedCalls, bind_call
from .driver import Driver, Grad
from .prepared import PreparedChunk, PreparedStep, contiguous_in, takes_half_cotangents
from .tape import Tape, cotangents


class StagedGrad(Driver):
    """`Driver` of a program the fusion stage cuts into several programs: a `Grad` per stage,
    chained (module docstring). Its tape holds a tape per stage (`Tape.tapes`)."""

    def __init__(self, program, backend: str, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
        self.program = program
        self.backend = check_backend(backend)
        self.target = get_backend(backend)
        self.stages = self.target.stages(program).stages
        self.xp = self.target.arrays
        # per stage, the names it reads that no other stage reads: of those, a gradient the caller only casts
        # (`cast_gradients`) is that stage's alone, so its runner may write it in the input's 16 bits; another
        # stage's part is added into the rest
        reads = [{d.name for d in st.program.inputs} for st in self.stages]
        self.read_alone = [frozenset(n for n in r if sum(n in o for o in reads) == 1) for r in reads]
        self.layout = layout
        self.dtype = dtype
        self.chunk = chunk
        self._grads: dict[str, list[Grad]] = {}
        self._steps = PreparedCalls()  # call key -> its `PreparedStages`, or False (none applies)

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
        key = self._steps.key(self.target, args, kwargs, layout)
        if key is not None:  # a call like an earlier one: its stages' steps were found then
            step = self._steps.get(key)
            if step:
                return step.forward(args, kwargs)
        bound, dtype = bind_call(self.target, p, args, kwargs, layout, self.dtype)
        values = dict(bound.arrays)      # the layer's inputs (sequences time first), then intermediates
        given_states = {s.name: bound.initial[s.name] for s in p.states if s.name in kwargs}
        results, finals, tapes, steps = {}, {}, [], []
        for stage, g in zip(self.stages, self._stage_grads(dtype)):
            sp = stage.program
            inputs = {d.name: values[d.name] for d in sp.inputs}
            inputs.update((s.name, given_states[s.name]) for s in sp.states if s.name in given_states)
            if key is not None:  # the stage's own call key: its prepared step after this call
                steps.append(g._steps.key(g.target, (), inputs, g.layout))
            outs, fin, tape = g.forward(**inputs)
            tapes.append(tape)
            finals.update(fin)
            for name, value in outs.items():
                (values if name in stage.writes else results)[name] = value
        results = {n: results[n] for n, _ in p.outputs}
        finals = {s.name: finals[s.name] for s in p.states}
        tape = Tape(bound.sizes, bound.length, dtype, layout, tapes=tapes)
        if key is not None and key not in self._steps:
            grads = self._stage_grads(dtype)
            found = [g._steps.get(k) if k is not None else None for g, k in zip(grads, steps)]
            prepared = all(isinstance(f, (PreparedStep, PreparedChunk)) for f in found)
            self._steps.remember(key, prepared and PreparedStages(self, layout, bound, dtype, set(kwargs), found,
                                                                 [t.half for t in tapes]))
        return results, finals, tape

    def adjoint(self, tape: Tape, cot: dict, lam: dict) -> dict:
        """The stages' adjoints, last to first: each stage's cotangents are those of its outputs
        (zeros where none came), its gradients of intermediates the cotangents of the stage that
        wrote them, its gradients of the layer's inputs summed (zeros for inputs no stage reads)."""
        p, xp = self.program, self.xp
        cot = dict(cot)
        totals: dict = {}
        cast = cast_gradients()
        for stage, g, t, alone in reversed(list(zip(self.stages, self._stage_grads(tape.dtype), tape.tapes,
                                                    self.read_alone))):
            sp = stage.program
            stage_cot = {n: cot.pop(n) if n in cot else xp.zeros((t.length, *(t.sizes[a] for a in y.axes)), t.dtype)
                         for n, y in sp.outputs}
            with casting_gradients(cast & alone):
                grads = g.adjoint(t, stage_cot, {s.name: lam[s.name] for s in sp.states})
            for name, value in grads.items():
                into = cot if name not in {d.name for d in p.inputs} and name not in lam else totals
                into[name] = into[name] + value if name in into else value
        for d in p.inputs:  # declared but read by no stage
            if d.name not in totals:
                shape = ((tape.length,) if d in p.seqs else ()) + tuple(tape.sizes[a] for a in d.axes)
                totals[d.name] = xp.zeros(shape, tape.dtype)
        return totals


class PreparedStages:
    """`StagedGrad`'s forward and backward for calls like a first one (the same `Backend.call_key`: shapes,
    strides, dtypes, devices, keywords, overrides), where every stage's `Grad` served that call through a
    prepared step (prepared.py). The first call bound and checked the arguments, and each stage's
    arguments (the layer's sequences time first, the intermediates the stages before wrote) are laid out
    alike in every such call, so each stage's prepared step serves them: a call here permutes the
    sequences to time first and calls the steps in order, without binding the layer's call or looking each
    stage's step up. The backward checks the first cotangents of a signature as `tape.cotangents` does,
    then chains the steps' backwards last to first, as `StagedGrad.adjoint` chains the stages' adjoints."""

    def __init__(self, grad: StagedGrad, layout, bound, dtype, given: set[str], steps: list, halves: list):
        p = grad.program
        self.grad, self.program, self.layout = grad, p, layout
        self.sizes, self.length, self.dtype = bound.sizes, bound.length, dtype
        self.names = [d.name for d in p.inputs]
        self.to_time_first = [(d.name, to_time_first(layout, d.name, d.axes))
                              for d in p.seqs]
        self.params = [d.name for d in p.params]
        self.given_states = [s.name for s in p.states if s.name in given]
        inputs = set(self.names) | {s.name for s in p.states}
        # per stage: its step, the names it reads, the names it writes for later stages, its outputs, the
        # 16-bit dtype its own inputs came in at the first call (`Grad.forward`'s `half_of` of them, or None)
        self.stages = [(step, [d.name for d in st.program.inputs],
                        [s.name for s in st.program.states if s.name in given], set(st.writes),
                        [n for n, _ in st.program.outputs], half)
                       for st, step, half in zip(grad.stages, steps, halves)]
        self.outputs = [n for n, _ in p.outputs]
        self.states = [s.name for s in p.states]
        self.inputs = inputs
        self.outputs_to_time_first = {n: to_time_first(layout, n, y.axes)
                                      for n, y in p.outputs}
        self.backwards: dict = {}  # signature of the output cotangents -> True once checked
        self.stage_grads = grad._stage_grads(dtype)
        seqs = {d.name for d in p.seqs}
        # per input: its name, the permutation from time first to its layout (None: not a sequence), its
        # shape as a gradient of zeros has it where no stage reads it (`StagedGrad.adjoint`, `tape.in_layout`)
        self.gradients = [(d.name, from_time_first(layout, d.name, d.axes)
                           if d.name in seqs else None,
                           ((self.length,) if d.name in seqs else ()) + tuple(self.sizes[a] for a in d.axes))
                          for d in p.inputs]

    def forward(self, args: tuple, kwargs: dict, outputs: bool = True):
        """What `StagedGrad._forward` returns for a call of this signature (each stage's forward runs with
        its outputs, so `outputs` changes nothing)."""
        arrays = dict(zip(self.names, args))
        arrays.update(kwargs)
        values = {n: arrays[n].detach().permute(*perm) for n, perm in self.to_time_first}
        values.update((n, arrays[n]) for n in self.params)
        results, finals, tapes = {}, {}, []
        for step, reads, states, writes, _, half in self.stages:
            inputs = {n: values[n] for n in reads}
            inputs.update((s, arrays[s]) for s in states)
            if half is None:
                outs, fin, tape = step.forward((), inputs, True)
            else:  # as `Grad.forward`: the runners see the 16-bit inputs only cast (runtime/precision.py)
                with given_half(half):
                    outs, fin, tape = step.forward((), inputs, True)
                tape.half = half
            tapes.append(tape)
            finals.update(fin)
            for name, value in outs.items():
                (values if name in writes else results)[name] = value
        tape = Tape(self.sizes, self.length, self.dtype, self.layout, tapes=tapes, step=self)
        return {n: results[n] for n in self.outputs}, {s: finals[s] for s in self.states}, tape

    def backward(self, tape: Tape, grad_outputs, grad_final_states) -> dict | None:
        """What `Driver.backward` returns, where the cotangents are torch tensors of the outputs only (by
        name, or one tensor for the one output); else None (the general path)."""
        import torch

        from ..backends.cuda.devices import on_backend_device

        if grad_final_states is not None and not (isinstance(grad_final_states, dict) and not grad_final_states):
            return None  # cotangents of the final states: the general path
        names = self.outputs
        given = {names[0]: grad_outputs} if isinstance(grad_outputs, torch.Tensor) and len(names) == 1 else grad_outputs
        if not isinstance(given, dict) or not given:
            return None
        key = []
        for name, t in given.items():
            if not isinstance(t, torch.Tensor) or not on_backend_device(t):
                return None
            key.append((name, t.shape, t.stride(), t.dtype, t.device))
        key = tuple(key)
        if key not in self.backwards:  # checked as the general path checks them (ValueError before any work)
            cotangents(self.program, self.grad.xp, tape, given, None)
            self.backwards[key] = True
        compute = torch.float64 if np.dtype(self.dtype) == np.float64 else torch.float32
        cot = {}  # in the compute dtype as a stage gets them, or 16-bit as given where it takes them so
        for n, t in given.items():
            cot[n] = t.detach().permute(*self.outputs_to_time_first[n])
        totals: dict = {}
        inputs = self.inputs
        cast = cast_gradients()
        for (_, _, _, _, outputs, _), g, t, alone in reversed(list(zip(self.stages, self.stage_grads, tape.tapes,
                                                                      self.grad.read_alone))):
            stage_cot = {n: cot.pop(n) for n in outputs if n in cot}  # the others: zeros (the step's own)
            if not takes_half_cotangents(t.step):
                stage_cot = {n: c if c.dtype == compute else c.to(compute) for n, c in stage_cot.items()}
            grads = None
            with casting_gradients(cast & alone):
                if stage_cot:
                    if t.half is None:
                        grads = t.step.backward(t, stage_cot, None)
                    else:
                        with given_half(t.half):
                            grads = t.step.backward(t, stage_cot, None)
                if grads is None:
                    grads = g.backward(t, grad_outputs=stage_cot, grad_final_states=None)
            for name, value in grads.items():
                into = totals if name in inputs else cot
                into[name] = into[name] + value if name in into else value
        xp = self.grad.xp
        out = {}
        dtypes = tape.gradient_dtypes or {}  # the caller's (the torch op's): cast as made contiguous, one copy
        for name, perm, shape in self.gradients:  # as `tape.in_layout` (zeros where no stage reads the input)
            g = totals[name] if name in totals else xp.zeros(shape, self.dtype)
            out[name] = contiguous_in(g if perm is None else g.permute(*perm), dtypes.get(name))
        out.update((s, totals[s]) for s in self.states)
        return out
