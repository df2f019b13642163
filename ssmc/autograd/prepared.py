"""A training step worked out once per call signature, where the backend prepares calls (CUDA).

`Grad` (driver.py) binds, checks and plans every call: at a small shape that host time costs more
than the kernels (bench/results/ has the measurements). Where the call's arguments are the backend's
own arrays (torch CUDA tensors), the first call of a signature (`Backend.call_key`: shapes, strides,
dtypes and devices of the arguments, the keywords given, the overrides) does all that and leaves a
step; later calls like it take its path, which per call only

    forward:   views of the arguments with time first, casts where the compute dtype differs,
               the forward's launch
    backward:  views of the output cotangents with time first, the backward's launches, views of
               the gradients in the inputs' layouts

`PreparedStep` is the step where the backend's fused backward applies (its two kernels:
`FusedBackwardRunner.prepare_forward` / `prepare_backward`); `PreparedChunk` where it does not and one
chunk covers the sequence (a scan, HGRN, a minGRU): the recording forward (none for `Grad`'s one
call, whose outputs are not wanted), then the carries where the forward did not record them, and
the adjoint, each worked out at its first call: allocations and one launch (`Backend.preparer`)
where the run is one launch, else the general run at the call's sizes. The checks `bind_arrays` and
`tape.cotangents` made for the first call hold for every call of the same signature, so nothing is
checked again. `lean.LeanStep` goes further for the calls a `PreparedStep` serves.
"""

from __future__ import annotations

import numpy as np

from ..ir.axes import TIME
from ..passes.autodiff import GRAD
from ..runtime.binding import Bound, layout_of, to_time_first
from .tape import Tape, cotangents


class _Signature:
    """What steps of one call signature share: `bound`, the first call's binding; `dtype`, its compute
    dtype (the inputs', or the one `ssmc.grad` was given); `given`, the keywords of its call;
    `initial`, its initial states in that dtype."""

    def __init__(self, grad, layout, bound: Bound, dtype, given: set[str], initial: dict, chunk: int):
        import torch

        fwd = grad.program
        self.grad, self.program, self.layout, self.chunk = grad, fwd, layout, chunk
        self.sizes, self.length, self.dtype = bound.sizes, bound.length, np.dtype(dtype)
        self.compute = torch.float64 if self.dtype == np.float64 else torch.float32
        self.names = [d.name for d in fwd.inputs]
        # time-first views of the sequences, and back to their layouts for their gradients
        self.to_time_first, self.to_layout = {}, {}
        for d in fwd.seqs:
            order, canonical = layout_of(layout, d.name, d.axes), (TIME, *d.axes)
            self.to_time_first[d.name] = [order.index(a) for a in canonical]
            self.to_layout[d.name] = [canonical.index(a) for a in order]
        self.outputs_to_time_first = {n: to_time_first(layout, n, y.axes)
                                      for n, y in fwd.outputs}
        self.params = [d.name for d in fwd.params]
        self.given_states = [s.name for s in fwd.states if s.name in given]
        self.zeros = {s.name: initial[s.name] for s in fwd.states if s.name not in given}  # only read
        self.backwards: dict = {}  # signature of the output cotangents -> what its backward launches

    def _cast(self, t):
        t = t.detach()
        return t if t.dtype == self.compute else t.to(self.compute)

    def _cast_cotangent(self, t):
        """An output's cotangent as the backward takes it: in the compute dtype, or 16-bit as given where
        the fused runner takes it so (`takes_half_cotangents`: a chunked core rounds it to q's 16 bits for
        its kernels, so a cast to fp32 here would only be undone there)."""
        import torch

        if t.dtype in (torch.bfloat16, torch.float16) and takes_half_cotangents(self):
            return t.detach()
        return self._cast(t)

    def _arrays(self, args: tuple, kwargs: dict):
        """The call's sequences (time first), params and initial states, in the compute dtype, and its tape."""
        arrays = dict(zip(self.names, args))
        arrays.update(kwargs)
        cast = self._cast
        seqs = {n: cast(arrays[n].permute(*perm)) for n, perm in self.to_time_first.items()}
        params = {n: cast(arrays[n]) for n in self.params}
        initial = {**self.zeros, **{s: cast(arrays[s]) for s in self.given_states}}
        tape = Tape(self.sizes, self.length, self.dtype, self.layout, seqs, params, self.chunk, [initial], step=self)
        return seqs, params, initial, tape

    def _cotangents(self, tape: Tape, grad_outputs, grad_final_states):
        """(what the backward of these cotangents launches, their time-first views by GRAD + name), where
        they are torch CUDA tensors of the outputs only (by name, or one tensor for the one output);
        else None (the general path). The first cotangents of a signature are checked as the general
        path checks them (`tape.cotangents`) and prepared by `_prepare_backward(tape, checked)`."""
        import torch

        from ..backends.cuda.devices import on_backend_device

        if grad_final_states is not None and not (isinstance(grad_final_states, dict) and not grad_final_states):
            return None  # cotangents of the final states: the general path
        names = [n for n, _ in self.program.outputs]
        given = {names[0]: grad_outputs} if isinstance(grad_outputs, torch.Tensor) and len(names) == 1 else grad_outputs
        if not isinstance(given, dict) or not given:
            return None
        key = [tape.carries is None]  # a recording forward's carries and recomputed ones: two layouts
        for name, t in given.items():
            if not isinstance(t, torch.Tensor) or not on_backend_device(t):
                return None
            key.append((name, t.shape, t.stride(), t.dtype, t.device))
        prepared = self.backwards.get(tuple(key))
        if prepared is None:
            cot, lam = cotangents(self.program, self.grad.xp, tape, given, None)
            checked = ({GRAD + k: v for k, v in cot.items()}, {GRAD + k: v for k, v in lam.items()})
            prepared = self.backwards[tuple(key)] = self._prepare_backward(tape, given, *checked) or False
        if not prepared:
            return None
        zero_cot = prepared[0]
        cot = dict(zero_cot)
        cot.update((GRAD + n, self._cast_cotangent(t.permute(*self.outputs_to_time_first[n])))
                   for n, t in given.items())
        return prepared, cot

    def _prepare_backward(self, tape: Tape, given: dict, cot: dict, lam: dict):
        raise NotImplementedError

    def _in_layouts(self, seq_grads: dict, finals: dict, dtypes: dict | None = None) -> dict:
        """Gradients by input name: the sequences' (time first in `seq_grads`) in their layouts, the
        params' and initial states' from `finals` (by GRAD + name); contiguous, in `dtypes`' dtype where it
        has the name (`Tape.gradient_dtypes`: made contiguous and cast in one copy)."""
        grads = {}
        for d in self.program.inputs:
            perm = self.to_layout.get(d.name)
            g = finals[GRAD + d.name] if perm is None else seq_grads[GRAD + d.name].permute(*perm)
            grads[d.name] = contiguous_in(g, (dtypes or {}).get(d.name))
        grads.update((s.name, finals[GRAD + s.name]) for s in self.program.states)
        return grads


class PreparedStep(_Signature):
    """`Grad.forward` / `Grad.backward` for calls like a first one, where the CUDA fused backward
    applies (module docstring). `seqs`, `params`, `initial`: the first call's arrays in the compute
    dtype, time first."""

    def __init__(self, grad, layout, bound: Bound, dtype, given: set[str], fused, seqs, params, initial,
                 chunk: int):
        super().__init__(grad, layout, bound, dtype, given, initial, chunk)
        self.fused = fused
        self.run_forward = fused.prepare_forward(seqs, params, initial, bound.sizes, bound.length)
        self.run_summary = None  # the forward without outputs, prepared at the first call that wants none
        # the sequences the runner reads as given (`half_inputs`), found at the first call: not cast after
        self.half_keep: frozenset | None = None

    def forward(self, args: tuple, kwargs: dict, outputs: bool):
        """What `Grad._forward` returns for a call of this signature."""
        if self.half_keep is not None:
            seqs, params, initial, tape = self._half_arrays(args, kwargs)
        else:
            seqs, params, initial, tape = self._arrays(args, kwargs)
            if hasattr(self.fused, "half_inputs"):  # as `Grad._forward`: 16-bit sequences the runner reads as given
                arrays = dict(zip(self.names, args))
                arrays.update(kwargs)
                given = {n: arrays[n].detach().permute(*perm) for n, perm in self.to_time_first.items()}
                seqs = tape.seqs = self.fused.half_inputs(seqs, given, self.sizes)
                self.half_keep = frozenset(n for n, v in seqs.items() if v is given[n])
        if outputs:
            run = self.run_forward
        else:
            if self.run_summary is None:
                self.run_summary = self.fused.prepare_forward(seqs, params, initial, self.sizes, self.length, False)
            run = self.run_summary
        outs, finals, tape.rounds = run(seqs, params, initial)
        return (outs if outputs else {}), finals, tape

    def _half_arrays(self, args: tuple, kwargs: dict):
        """`_arrays` where the runner reads the sequences `half_keep` as given (16-bit q, k, v of a chunked
        core: `half_inputs`): those time first as they are, the others cast (none cast only to be dropped)."""
        arrays = dict(zip(self.names, args))
        arrays.update(kwargs)
        cast, keep = self._cast, self.half_keep
        seqs = {}
        for n, perm in self.to_time_first.items():
            t = arrays[n].detach().permute(*perm)
            seqs[n] = t if n in keep else cast(t)
        params = {n: cast(arrays[n]) for n in self.params}
        initial = {**self.zeros, **{s: cast(arrays[s]) for s in self.given_states}}
        tape = Tape(self.sizes, self.length, self.dtype, self.layout, seqs, params, self.chunk, [initial], step=self)
        return seqs, params, initial, tape

    def backward(self, tape: Tape, grad_outputs, grad_final_states) -> dict | None:
        """What `Grad.backward` returns, where the cotangents suit this path (`_cotangents`); else None."""
        found = self._cotangents(tape, grad_outputs, grad_final_states)
        if found is None:
            return None
        (_, launch, lam), cot = found
        outs, finals = launch(tape.seqs, tape.params, tape.rounds, cot, lam, {})
        return self._in_layouts(outs, finals, tape.gradient_dtypes)

    def _prepare_backward(self, tape: Tape, given: dict, cot: dict, lam: dict):
        """The backward's launch for cotangents like `given`, and the zero cotangents of the outputs
        not given and of the final states (only read)."""
        launch = self.fused.prepare_backward(tape.seqs, tape.params, tape.rounds, cot, lam, {}, self.sizes,
                                             self.length)
        zero_cot = {k: v for k, v in cot.items() if k[len(GRAD):] not in given}
        return zero_cot, launch, lam


class PreparedChunk(_Signature):
    """`Grad.forward` / `Grad.backward` for calls like a first one, where no fused backward applies and
    one chunk covers the sequence (module docstring). Each run (the recording forward, or the forward
    where there is none; the carries; the adjoint per signature of cotangents) is worked out at its
    first call (`planned_run`)."""

    def __init__(self, grad, layout, bound: Bound, dtype, given: set[str], initial: dict, chunk: int):
        super().__init__(grad, layout, bound, dtype, given, initial, chunk)
        self.records = grad.recording is not None
        self.state_names = [s.name for s in self.program.states]
        self.runs: dict = {}  # "forward" / "carries" -> its planned run

    def _run(self, name: str, program, seqs, params, initial, products: dict | None = None):
        run = self.runs.get(name)
        if run is None:
            run = self.runs[name] = planned_run(self.grad.target, program, self.dtype, seqs, params, initial,
                                                self.sizes, self.length)
        return run(seqs, params, initial, products)

    def forward(self, args: tuple, kwargs: dict, outputs: bool):
        """What `Grad._forward` returns: with `outputs` the recording forward's outputs (and the carries
        on the tape); without, nothing is run (the backward recomputes the carries)."""
        seqs, params, initial, tape = self._arrays(args, kwargs)
        if not outputs:
            return {}, initial, tape
        outs, finals = self._run("forward", self.grad.recording or self.program, seqs, params, initial, tape.products)
        if self.records:
            tape.carries = {f"prev_{s}": outs.pop(f"prev_{s}") for s in self.state_names}
        return outs, finals, tape

    def backward(self, tape: Tape, grad_outputs, grad_final_states) -> dict | None:
        """What `Grad.backward` returns, where the cotangents suit this path (`_cotangents`); else None."""
        found = self._cotangents(tape, grad_outputs, grad_final_states)
        if found is None:
            return None
        (_, adjoint, init), cot = found
        outs, finals = adjoint(self._adjoint_seqs(tape, cot), tape.params, init, tape.products)
        return self._in_layouts(outs, finals, tape.gradient_dtypes)

    def _adjoint_seqs(self, tape: Tape, cot: dict) -> dict:
        """The adjoint's sequences: the forward's, the carries before each step (recorded, or recomputed
        now), the cotangents."""
        prev = tape.carries
        if prev is None:
            prev = self._run("carries", self.grad.backward_program.carries, tape.seqs, tape.params,
                             tape.boundaries[0], tape.products)[0]
        seqs = dict(tape.seqs)
        seqs.update((s, prev[f"prev_{s}"]) for s in self.state_names)
        seqs.update(cot)
        return seqs

    def _prepare_backward(self, tape: Tape, given: dict, cot: dict, lam: dict):
        """The adjoint's planned run for cotangents like `given`, the zero cotangents of the outputs not
        given, and the adjoint's initial carry: zero cotangents of the final states and zero param
        gradients (only read)."""
        zeros = self.grad.xp.zeros
        init = dict(lam)
        init.update((GRAD + p, zeros(tuple(tape.params[p].shape), self.dtype)) for p in self.params)
        adjoint = planned_run(self.grad.target, self.grad.backward_program.adjoint, self.dtype,
                              self._adjoint_seqs(tape, cot), tape.params, init, self.sizes, self.length)
        return {k: v for k, v in cot.items() if k[len(GRAD):] not in given}, adjoint, init


def contiguous_in(g, dtype=None):
    """`g` (a torch tensor) contiguous, in `dtype` where given: one copy at most."""
    import torch

    return g.contiguous() if dtype is None else g.to(dtype=dtype, memory_format=torch.contiguous_format)


def takes_half_cotangents(step) -> bool:
    """Whether `step` (a `PreparedStep`, `PreparedChunk`, or None) takes its outputs' cotangents in a 16-bit
    dtype as given (its fused runner says so: `ChunkedCore.takes_half_cotangents`)."""
    return bool(getattr(getattr(step, "fused", None), "takes_half_cotangents", False))


def planned_run(backend, program, dtype, seqs, params, initial, sizes: dict[str, int], length: int):
    """``run(seqs, params, initial, products=None) -> (outputs, finals)`` of `program` on `backend` for
    arrays like these: prepared (`Backend.preparer`: allocations and one launch) where it is one
    launch, else the general run at these sizes, which takes the matrix products hoisted out of the
    loop from `products` where a run over the same sequences and params put them there (a
    recording forward's ``x W`` for its adjoint: `Backend.runner`)."""
    prepare = backend.preparer(program, dtype)
    run = prepare and prepare(seqs, params, initial, sizes, length)
    if run:
        return lambda seqs, params, initial, products=None: run(seqs, params, initial)
    if not backend.takes_products(program, dtype):  # the run function found once (finding it hashes programs)
        general = backend.runner(program, dtype)
        return lambda seqs, params, initial, products=None: general(seqs, params, initial, sizes, length)
    return lambda seqs, params, initial, products=None: backend.runner(program, dtype, products)(
        seqs, params, initial, sizes, length)
