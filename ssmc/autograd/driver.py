"""The gradient driver: a training step's forward, its tape, and the backward from it.

`Driver` is the interface every recurrence gradient has (``g(...)``, ``g.forward``, ``g.backward``,
``g.adjoint``); `Grad` drives one program on any backend, `stages.StagedGrad` chains the gradients
of a layer's fusion stages.

The forward saves the carry at chunk boundaries only; each chunk's carries are recomputed from its
boundary when the backward reaches it (`autodiff.MemoryPlan`). The chunk, where the caller gives
none, is the backend's (`Backend.default_chunk`): on the host as long as keeps one chunk's carries
within a budget, on a device as long as keeps the recomputed carries no bigger than the sequences
given. `Grad._path` picks, in one place, how a call's forward runs, and with it its backward:

    fused           the backend's fused backward applies (`Backend.fused_backward`): its forward
                    saves the carry every round, its backward is one kernel; its round is the
                    chunk (a `chunk` given is not used)
    prepared chunk  a backend that prepares calls (`Backend.call_key`), one chunk: a step worked
                    out once for calls alike (prepared.py)
    recording       one chunk: the recording forward keeps every carry, the backward recomputes
                    nothing (on a device only where the outputs are wanted:
                    `Backend.records_without_outputs`)
    chunked         the forward keeps the chunk boundaries

Calls like an earlier one skip the prologue where the backend prepares calls: the prepared step of
the fused path or a prepared chunk (prepared.py), and for ``g(...)`` a `LeanStep` (lean.py).
"""

from __future__ import annotations

import numpy as np

from ..backends.cuda.devices import on_arrays_device
from ..backends.registry import check_backend, get_backend
from ..passes.autodiff import DEFAULT_CHUNK, GRAD, Backward, derive_backward
from ..runtime.binding import DEFAULT_LAYOUT
from ..runtime.precision import given_half, half_of
from ..runtime.prologue import PreparedCalls, bind_call
from .lean import LeanStep
from .prepared import PreparedChunk, PreparedStep
from .tape import Tape, cotangents, in_layout, tape_arrays

FUSED, PREPARED_CHUNK, RECORDING, CHUNKED = "fused", "prepared chunk", "recording", "chunked"


def default_chunk(backend, length: int, program, sizes: dict[str, int], itemsize: int = 4) -> int:
    """Steps per recomputed chunk when the caller gives none (`Backend.default_chunk`); `backend`
    a name or a backend object."""
    return get_backend(backend).default_chunk(length, program, sizes, itemsize)


class Driver:
    """Gradients of a recurrence's inputs given cotangents of its outputs and final states.

    ``g(*inputs, grad_outputs=..., grad_final_states=...)`` runs the forward and the backward.
    ``g.forward(*inputs)`` returns the outputs and final states and a `Tape`, and
    ``g.backward(tape, ...)`` the gradients: a training step runs the forward once (`ssmc.torch`
    does this). A driver implements `_forward` and `adjoint`; `program` is the recurrence it
    differentiates, `backend` its backend's name (`on_arrays_device` reads it), `target` the backend."""

    program = None
    backend: str
    xp = None  # the backend's `ArrayOps`

    def __call__(self, *args, grad_outputs=None, grad_final_states=None, layout=None, **kwargs):
        """Returns {input name: gradient} for every sequence, param and state (initial value)."""
        tape = self._forward(args, kwargs, layout, False)[2]
        return self.backward(tape, grad_outputs=grad_outputs, grad_final_states=grad_final_states)

    def forward(self, *args, layout=None, **kwargs):
        """(outputs, final states, tape): outputs as name -> array [L, *axes] (time first) and final
        states by name, in the compute dtype; the tape for `backward`."""
        return self._forward(args, kwargs, layout, True)

    def _forward(self, args: tuple, kwargs: dict, layout, outputs: bool):
        raise NotImplementedError

    @on_arrays_device(lambda a, kw: tape_arrays(a[0] if a else kw["tape"]))
    def backward(self, tape: Tape, grad_outputs=None, grad_final_states=None) -> dict:
        """Gradients {input name: array} (inputs' layouts) from a `forward`'s tape and the cotangents
        of its outputs and final states (given in the forward's layout; missing ones are zero)."""
        with given_half(tape.half):  # 16-bit inputs: runners with a 16-bit form take it (runtime/precision.py)
            if tape.step is not None:  # a prepared step's tape: its path, where the cotangents suit it
                grads = tape.step.backward(tape, grad_outputs, grad_final_states)
                if grads is not None:
                    return grads
            cot, lam = cotangents(self.program, self.xp, tape, grad_outputs, grad_final_states)
            return in_layout(self.program, self.adjoint(tape, cot, lam), tape.layout, self.xp)

    def adjoint(self, tape: Tape, cot: dict, lam: dict) -> dict:
        """Gradients {input name: array}, sequences time first, from time-first cotangents of every
        output (`cot`) and final state (`lam`)."""
        raise NotImplementedError


class Grad(Driver):
    """`Driver` of one program on any backend (module docstring)."""

    def __init__(self, program, backend: str = "interpreter", layout=DEFAULT_LAYOUT, chunk: int | None = None,
                 dtype=None):
        if chunk is not None and chunk < 1:
            raise ValueError("chunk must be at least 1")
        self.backward_program: Backward = derive_backward(program, chunk or DEFAULT_CHUNK)
        self.program = self.backward_program.forward
        self.backend = check_backend(backend)
        self.target = get_backend(backend)
        self.recording, self.saved = self.target.recording(self.backward_program)
        self.xp = self.target.arrays
        self.dtype = dtype
        self.layout = layout
        self.chunk = chunk
        self._fused_runners: dict[str, object] = {}  # compute dtype -> the backend's fused backward runner
        self._steps = PreparedCalls()  # call key -> its prepared step (prepared.py)
        self._leans = PreparedCalls()  # the same keys -> the `LeanStep` of `__call__`, or False (none applies)

    @on_arrays_device(lambda args, kwargs: (*args, kwargs))
    def __call__(self, *args, grad_outputs=None, grad_final_states=None, layout=None, **kwargs):
        """Returns {input name: gradient} for every sequence, param and state (initial value)."""
        key = self._steps.key(self.target, args, kwargs, layout or self.layout)
        if key is not None and grad_final_states is None:
            grads = self._lean_call(key, args, kwargs, grad_outputs)
            if grads is not None:
                return grads
        half = half_of([*args, *kwargs.values()])
        with given_half(half):
            tape = self._forward(args, kwargs, layout, False, key)[2]
        if half is not None and tape is not None:
            tape.half = half
        return self.backward(tape, grad_outputs=grad_outputs, grad_final_states=grad_final_states)

    def _lean_call(self, key, args: tuple, kwargs: dict, grad_outputs) -> dict | None:
        """`__call__` through the `LeanStep` of calls like this one (lean.py: a launch and a few views
        each way, where the prepared step's path binds, permutes and casts), once a prepared step has
        served such a call without outputs, on the current device, the cotangents one tensor per
        output; None where it does not apply (the caller takes the general path). `key`: the call's
        `PreparedCalls.key`."""
        if not (args or kwargs):
            return None
        lean = self._leans.get(key)
        if lean is None:
            lean = self._lean_step(key, args, kwargs)
            if lean is None:
                return None
            self._leans.remember(key, lean)
        if not lean:
            return None
        outputs = lean.output_names
        if len(outputs) == 1 and hasattr(grad_outputs, "data_ptr"):
            cotangents = (grad_outputs,)
        elif isinstance(grad_outputs, dict) and set(grad_outputs) == set(outputs):
            cotangents = tuple(grad_outputs[n] for n in outputs)
        else:
            return None
        tensors = [*args, *kwargs.values()]
        _, buffer = lean.forward(tensors)
        grads = lean.backward(tensors, buffer, cotangents)
        if not lean.lean_backward:  # its gradients' views would not be contiguous: the prepared path from now on
            self._leans[key] = False
        if grads is None:  # cotangents unlike the first ones: the general backward from this forward's tape
            return self.backward(lean.tape(tensors, buffer), grad_outputs=dict(zip(outputs, cotangents)))
        return {n: grads[i] for n, i in lean.order}

    def _lean_step(self, key, args: tuple, kwargs: dict):
        """The `LeanStep` of `_lean_call` for calls of `key`, False where none applies, None where the
        prepared step it starts from is not there yet (the general path makes it)."""
        fwd = self.program
        step = self._steps.get(key)
        if not isinstance(step, PreparedStep) or step.run_summary is None:
            return None
        tensors = [*args, *kwargs.values()]
        if len(args) > len(fwd.inputs) or not self.target.on_current_device(tensors[0]):
            return False  # states by position; another device (the general path switches to it)
        names = [d.name for d in fwd.inputs[:len(args)]] + list(kwargs)
        lean = LeanStep.build(step, names, [(n, []) for n, _ in fwd.outputs], tensors, gradients_only=True)
        return False if lean is None else lean

    def forward(self, *args, layout=None, **kwargs):
        """(outputs, final states, tape): outputs as name -> array [L, *axes] (time first) and final
        states by name, in the compute dtype; the tape for `backward`."""
        half = half_of([*args, *kwargs.values()])
        with given_half(half):  # the runners see 16-bit inputs only cast (runtime/precision.py)
            found = self._forward(args, kwargs, layout, True, self._steps.key(self.target, args, kwargs,
                                                                               layout or self.layout))
        if half is not None and found[2] is not None:
            found[2].half = half
        return found

    @on_arrays_device(lambda a, kw: (*a[0], a[1]))  # (args, kwargs, layout, outputs, key)
    def _forward(self, args, kwargs, layout, outputs: bool, key=None):
        """`forward`'s work; `key`: the call's `PreparedCalls.key` (None: the backend prepares no call
        like it)."""
        layout = layout or self.layout
        if key is not None:  # a call like an earlier one: its step was worked out then (prepared.py)
            step = self._steps.get(key)
            if step is not None:
                return step.forward(args, kwargs, outputs)
        fwd, xp = self.program, self.xp
        bound, dtype = bind_call(self.target, fwd, args, kwargs, layout, self.dtype)
        sizes, length = bound.sizes, bound.length
        chunk = self.chunk or self.target.default_chunk(length, fwd, sizes, np.dtype(dtype).itemsize)
        seqs = {d.name: xp.cast(bound.arrays[d.name], dtype) for d in fwd.seqs}
        params = {d.name: xp.cast(bound.arrays[d.name], dtype) for d in fwd.params}
        initial = {k: xp.cast(v, dtype) for k, v in bound.initial.items()}
        tape = Tape(sizes, length, dtype, layout, seqs, params, chunk, [initial])
        if fwd.reverse:
            raise NotImplementedError("gradients of a reverse-time spec")  # not produced by the frontend
        path, fused = self._path(tape, outputs, key)
        if path == FUSED and hasattr(fused, "half_inputs"):  # a runner that reads some 16-bit sequences as given
            seqs = tape.seqs = fused.half_inputs(seqs, {n: bound.arrays[n] for n in seqs}, sizes)
        if path == FUSED:  # one kernel saving the carry every round; the backward is one kernel too
            if key is not None:
                tape.step = self._steps.remember(key, PreparedStep(self, layout, bound, dtype, set(kwargs), fused,
                                                                   seqs, params, initial, chunk))
            outs, finals, tape.rounds = fused.forward(seqs, params, initial, sizes, length, outputs)
            return (outs if outputs else {}), finals, tape
        if path == PREPARED_CHUNK:  # runs worked out once (prepared.py)
            step = self._steps.remember(key, PreparedChunk(self, layout, bound, dtype, set(kwargs), initial, chunk))
            return step.forward(args, kwargs, outputs)
        if path == RECORDING:
            return self._recording_forward(tape)
        return self._chunked_forward(tape, outputs)

    def _path(self, tape: Tape, outputs: bool, key) -> tuple[str, object]:
        """How a call's forward runs, and with it its backward (module docstring): (the path, the
        fused backward's runner where the path is "fused"). `outputs`: whether the caller wants the
        outputs; `key`: the call's key where the backend prepares calls like it."""
        fused = self._fused_backward(tape.seqs, tape.sizes, tape.length, tape.dtype)
        if fused is not None:
            return FUSED, fused
        one_chunk = tape.chunk >= tape.length
        if key is not None and one_chunk:
            return PREPARED_CHUNK, None
        if one_chunk and self.recording is not None and (outputs or self.target.records_without_outputs):
            return RECORDING, None
        return CHUNKED, None

    def _recording_forward(self, tape: Tape):
        """One chunk: the forward keeps every carry (and the products `saved`), the backward
        recomputes nothing."""
        run = self.target.runner(self.recording, tape.dtype, tape.products)
        outs, finals = run(tape.seqs, tape.params, tape.boundaries[0], tape.sizes, tape.length)
        tape.carries = {f"prev_{s.name}": outs.pop(f"prev_{s.name}") for s in self.program.states}
        tape.products.update((node, outs.pop(name)) for name, node in self.saved)
        return outs, finals, tape

    def _chunked_forward(self, tape: Tape, outputs: bool):
        """The forward chunk by chunk, keeping the carry at each chunk's end; without `outputs`, the
        last chunk is left to the backward (which recomputes its carries anyway)."""
        fwd, length, chunk = self.program, tape.length, tape.chunk
        run_forward = self.target.runner(fwd, tape.dtype)
        bounds = list(range(0, length, chunk))
        parts: dict[str, list] = {n: [] for n, _ in fwd.outputs}
        finals = tape.boundaries[0]
        for i, start in enumerate(bounds):
            if i == len(bounds) - 1 and not outputs:
                break
            part = {k: v[start:start + chunk] for k, v in tape.seqs.items()}
            outs, finals = run_forward(part, tape.params, finals, tape.sizes, min(chunk, length - start))
            for n in parts:
                parts[n].append(outs[n])
            if i < len(bounds) - 1:
                tape.boundaries.append(finals)
        outs = {n: (v[0] if len(v) == 1 else self.xp.cat(v)) for n, v in parts.items()} if outputs else {}
        return outs, finals, tape

    def _fused_backward(self, seqs: dict, sizes: dict[str, int], length: int, dtype):
        """The backend's fused backward runner where it applies at these sizes and layouts, else None."""
        fused = self._fused_runner(dtype)
        return fused if fused is not None and fused.applies(seqs, sizes, length) else None

    def _fused_runner(self, dtype):
        """The fused backward runner of this gradient (None where the backend has none or it cannot
        fuse), looked up once per dtype: the lookup hashes the forward and adjoint programs, which
        walks their graphs."""
        name = np.dtype(dtype).name
        if name not in self._fused_runners:
            self._fused_runners[name] = self.target.fused_backward(self.backward_program, name)
        return self._fused_runners[name]

    def adjoint(self, tape: Tape, cot: dict, lam: dict) -> dict:
        """Gradients {input name: array}, sequences time first, from time-first cotangents of every
        output (`cot`) and final state (`lam`): the adjoint over the chunks, last to first, each
        chunk's carries recomputed from its boundary (or taken from the tape)."""
        if tape.rounds is not None:
            return self._fused_adjoint(tape, cot, lam)
        bw, target = self.backward_program, self.target
        fwd, xp, dtype, sizes, length, chunk = bw.forward, self.xp, tape.dtype, tape.sizes, tape.length, tape.chunk
        seqs, params = tape.seqs, tape.params
        acc = {GRAD + p.name: xp.zeros(tuple(params[p.name].shape), dtype) for p in fwd.params}
        run_adjoint = target.runner(bw.adjoint, dtype, tape.products if tape.carries is not None else None)
        carry = {GRAD + k: v for k, v in lam.items()} | acc
        seq_grads: dict[str, list] = {d.name: [] for d in fwd.seqs}
        for start, init in zip(reversed(range(0, length, chunk)), reversed(tape.boundaries)):
            n = min(chunk, length - start)
            part = {k: v[start:start + n] for k, v in seqs.items()}
            if tape.carries is not None:
                prev = tape.carries
            else:
                prev, _ = target.runner(bw.carries, dtype)(part, params, init, sizes, n)
            adj_seqs = dict(part)
            adj_seqs.update({s.name: prev[f"prev_{s.name}"] for s in fwd.states})
            adj_seqs.update({GRAD + k: v[start:start + n] for k, v in cot.items()})
            outs, carry = run_adjoint(adj_seqs, params, carry, sizes, n)
            for d in fwd.seqs:
                seq_grads[d.name].append(outs[GRAD + d.name])
        grads = {name: (parts[0] if len(parts) == 1 else xp.cat(parts[::-1])) for name, parts in seq_grads.items()}
        grads.update({p.name: carry[GRAD + p.name] for p in fwd.params})
        grads.update({s.name: carry[GRAD + s.name] for s in fwd.states})
        return grads

    def _fused_adjoint(self, tape: Tape, cot: dict, lam: dict) -> dict:
        """The adjoint as the fused backward's one kernel (`tape.rounds` from its forward; the param
        gradients start from zeros it allocates)."""
        fwd = self.program
        fused = self._fused_runner(tape.dtype)
        outs, finals = fused.backward(tape.seqs, tape.params, tape.rounds, {GRAD + k: v for k, v in cot.items()},
                                      {GRAD + k: v for k, v in lam.items()}, {}, tape.sizes, tape.length)
        grads = {d.name: outs[GRAD + d.name] for d in fwd.seqs}
        grads.update({p.name: finals[GRAD + p.name] for p in fwd.params})
        grads.update({s.name: finals[GRAD + s.name] for s in fwd.states})
        return grads
