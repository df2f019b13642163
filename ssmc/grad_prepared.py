"""A training step on the GPU worked out once per call signature.

`Grad` (grad.py) binds, checks and plans every call: at a small shape that host time costs more
than the kernels (Mamba-1 B32 D512 L180 on an H100: kernels 0.35 ms, host 1.5 ms a step,
bench/host_profile.py). Where the call's arguments are torch CUDA tensors, the first call of a
signature (`registry.call_key`: shapes, strides, dtypes and devices of the arguments, the keywords
given, the overrides) does all that and leaves a step; later calls like it take its path, which per
call only

    forward:   views of the arguments with time first, casts where the compute dtype differs,
               the forward's launch
    backward:  views of the output cotangents with time first, the backward's launches, views of
               the gradients in the inputs' layouts

`PreparedStep` is the step where the CUDA fused backward applies (its two kernels:
`FusedBackwardRunner.prepare_forward` / `prepare_backward`); `PreparedChunk` where it does not and one
chunk covers the sequence (a scan, HGRN, a minGRU): the recording forward (none for `Grad`'s one
call, whose outputs are not wanted), then the carries where the forward did not record them, and
the adjoint, each worked out at its first call: allocations and one launch (`CudaRunner.prepare`)
where the run is one launch, else the general run at the call's sizes. The checks `bind_arrays` and
`grad.cotangents` made for the first call hold for every call of the same signature, so nothing is
checked again.
"""

from __future__ import annotations

import numpy as np

from .backends.registry import preparer, runner
from .grad import Tape, array_ops, cotangents
from .ir.axes import TIME
from .passes.autodiff import GRAD
from .runtime.binding import Bound, layout_of


class _Signature:
    """What steps of one call signature share: `bound`, the first call's binding; `dtype`, its compute
    dtype (the inputs', or the one `ssmc.grad` was given); `given`, the keywords of its call;
    `initial`, its initial states in that dtype."""

    def __init__(self, grad, layout, bound: Bound, dtype, given: set[str], initial: dict, chunk: int):
        import torch

        fwd = grad.backward_program.forward
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
        self.outputs_to_time_first = {n: [layout_of(layout, n, y.axes).index(a) for a in (TIME, *y.axes)]
                                      for n, y in fwd.outputs}
        self.params = [d.name for d in fwd.params]
        self.given_states = [s.name for s in fwd.states if s.name in given]
        self.zeros = {s.name: initial[s.name] for s in fwd.states if s.name not in given}  # only read
        self.backwards: dict = {}  # signature of the output cotangents -> what its backward launches

    def _cast(self, t):
        t = t.detach()
        return t if t.dtype == self.compute else t.to(self.compute)

    def _arrays(self, args: tuple, kwargs: dict):
        """The call's sequences (time first), params and initial states, in the compute dtype, and its tape."""
        arrays = dict(zip(self.names, args))
        arrays.update(kwargs)
        cast = self._cast
        seqs = {n: cast(arrays[n].permute(*perm)) for n, perm in self.to_time_first.items()}
        params = {n: cast(arrays[n]) for n in self.params}
        initial = {**self.zeros, **{s: cast(arrays[s]) for s in self.given_states}}
        tape = Tape(seqs, params, self.sizes, self.length, self.dtype, self.layout, self.chunk, [initial], step=self)
        return seqs, params, initial, tape

    def _cotangents(self, tape: Tape, grad_outputs, grad_final_states):
        """(what the backward of these cotangents launches, their time-first views by GRAD + name), where
        they are torch CUDA tensors of the outputs only (by name, or one tensor for the one output);
        else None (the general path). The first cotangents of a signature are checked as the general
        path checks them (`grad.cotangents`) and prepared by `_prepare_backward(tape, checked)`."""
        import torch

        from .backends.cuda.devices import on_backend_device

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
            cot, lam = cotangents(self.program, array_ops("cuda"), tape, given, None)
            checked = ({GRAD + k: v for k, v in cot.items()}, {GRAD + k: v for k, v in lam.items()})
            prepared = self.backwards[tuple(key)] = self._prepare_backward(tape, given, *checked) or False
        if not prepared:
            return None
        zero_cot = prepared[0]
        cot = dict(zero_cot)
        cot.update((GRAD + n, self._cast(t.permute(*self.outputs_to_time_first[n]))) for n, t in given.items())
        return prepared, cot

    def _prepare_backward(self, tape: Tape, given: dict, cot: dict, lam: dict):
        raise NotImplementedError

    def _in_layouts(self, seq_grads: dict, finals: dict) -> dict:
        """Gradients by input name: the sequences' (time first in `seq_grads`) in their layouts, the
        params' and initial states' from `finals` (by GRAD + name)."""
        grads = {}
        for d in self.program.inputs:
            perm = self.to_layout.get(d.name)
            grads[d.name] = (finals[GRAD + d.name] if perm is None
                             else seq_grads[GRAD + d.name].permute(*perm)).contiguous()
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

    def forward(self, args: tuple, kwargs: dict, outputs: bool):
        """What `Grad._forward` returns for a call of this signature."""
        seqs, params, initial, tape = self._arrays(args, kwargs)
        if outputs:
            run = self.run_forward
        else:
            if self.run_summary is None:
                self.run_summary = self.fused.prepare_forward(seqs, params, initial, self.sizes, self.length, False)
            run = self.run_summary
        outs, finals, tape.rounds = run(seqs, params, initial)
        return (outs if outputs else {}), finals, tape

    def backward(self, tape: Tape, grad_outputs, grad_final_states) -> dict | None:
        """What `Grad.backward` returns, where the cotangents suit this path (`_cotangents`); else None."""
        found = self._cotangents(tape, grad_outputs, grad_final_states)
        if found is None:
            return None
        (_, launch, lam), cot = found
        outs, finals = launch(tape.seqs, tape.params, tape.rounds, cot, lam, {})
        return self._in_layouts(outs, finals)

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
            run = self.runs[name] = planned_run(program, self.dtype, seqs, params, initial, self.sizes, self.length)
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
        return self._in_layouts(outs, finals)

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
        zeros = array_ops("cuda").zeros
        init = dict(lam)
        init.update((GRAD + p, zeros(tuple(tape.params[p].shape), self.dtype)) for p in self.params)
        adjoint = planned_run(self.grad.backward_program.adjoint, self.dtype, self._adjoint_seqs(tape, cot),
                              tape.params, init, self.sizes, self.length)
        return {k: v for k, v in cot.items() if k[len(GRAD):] not in given}, adjoint, init


def planned_run(program, dtype, seqs, params, initial, sizes: dict[str, int], length: int):
    """``run(seqs, params, initial, products=None) -> (outputs, finals)`` of `program` on CUDA for
    arrays like these: prepared (`CudaRunner.prepare`: allocations and one launch) where it is one
    launch, else the general run at these sizes, which takes the matrix products hoisted out of the
    loop from `products` where a run over the same sequences and params put them there (a
    recording forward's ``x W`` for its adjoint: `registry.runner`)."""
    prepare = preparer("cuda", program, dtype)
    run = prepare and prepare(seqs, params, initial, sizes, length)
    if run:
        return lambda seqs, params, initial, products=None: run(seqs, params, initial)
    return lambda seqs, params, initial, products=None: runner("cuda", program, dtype, products)(
        seqs, params, initial, sizes, length)


# Where each of a kernel's arrays comes from, per call (`LeanStep`): an argument, an offset of the
# call's buffer, an array the step keeps (its address), a cotangent, an offset of the forward's buffer
ARGUMENT, BUFFER, KEPT, COTANGENT, FORWARD_BUFFER = range(5)


class LeanStep:
    """The torch op's training step (ssmc/torch.py) for calls like one a `PreparedStep` served, at the
    least host time a call: a forward is one allocation, one launch and the outputs' views, made in
    their layouts; a backward one allocation and memset, one launch and the gradients' views. Where
    each of the kernels' arrays comes from is worked out once (`_sources`). At a small shape every
    torch call of the host counts: Mamba-1 B32 D512 L180 spends about as long on the host as in its
    kernels (bench/host_profile.py).

    `names`: the op's arguments (the inputs, then the initial states given), as it passes them to
    `Grad.forward`; `output_perms`: per output, its name and permutation from time first to its
    layout. `forward(tensors)` returns (outputs + final states, the forward's buffer);
    `backward(tensors, buffer, cotangents)` the gradients in the order of `names`, then (with
    `gradients_only`, for `Grad.__call__`, which returns them too) of the initial states not among
    them (`returned`), or None where the cotangents do not suit (one of the final states, or one of
    other shape, strides or dtype than the first backward's): the caller then takes the general path
    with `tape(tensors, buffer)`.
    `gradients_only`: the forward a call that wants no outputs runs (`PreparedStep.run_summary`,
    which a call through `PreparedStep.forward` prepared), its outputs not returned."""

    def __init__(self, step: PreparedStep, names: list[str], output_perms: list[tuple[str, list[int]]],
                 gradients_only: bool = False):
        self.step, self.names = step, names
        self.returned = names + ([s.name for s in step.program.states if s.name not in names] if gradients_only
                                 else [])
        if gradients_only:  # `Grad.__call__`'s gradients in the general path's order (inputs, then states):
            order = [*(d.name for d in step.program.inputs), *(s.name for s in step.program.states)]
            self.order = [(n, self.returned.index(n)) for n in order]  # each name and its place in `returned`
        self.output_names = [n for n, _ in output_perms]
        prepared = step.run_summary if gradients_only else step.run_forward
        self.forward_launch, self.length = prepared.launch, prepared.length
        self.arguments = {name: i for i, name in enumerate(names)}
        self.arguments.update((f"init_{s}", self.arguments[s]) for s in step.given_states if s in self.arguments)
        self.kept = {f"init_{s}": t for s, t in step.zeros.items()}  # zero initial states: only read
        self.forward_sources = self._sources(self.forward_launch, {}, {})
        allocated = {a.name: a for a in self.forward_launch.allocations}
        self.outputs = [] if gradients_only else [_view(allocated[f"out_{n}"], perm) for n, perm in output_perms]
        self.outputs += [_view(allocated[f"final_{s.name}"], None, [step.sizes[a] for a in s.axes])
                         for s in step.program.states]
        self.rounds = {s.name: allocated[f"rounds_{s.name}"] for s in step.program.states}
        self.backward = self._first_backward

    @classmethod
    def build(cls, step, names: list[str], output_perms: list[tuple[str, list[int]]], tensors: list,
              gradients_only: bool = False):
        """The lean step of calls like one with `tensors` that `step` served, or None: where the
        tensors are not of the compute dtype (the general path casts them) or the outputs in their
        layouts are not contiguous (the op returns them contiguous: the general path copies them)."""
        from .backends.cuda.fused_backward import PreparedLaunch

        forward = getattr(step, "run_summary" if gradients_only else "run_forward", None)
        if not isinstance(step, PreparedStep) or not isinstance(forward, PreparedLaunch):
            return None
        if any(t.dtype != step.compute for t in tensors):
            return None
        try:
            lean = cls(step, names, output_perms, gradients_only)
        except KeyError:  # a kernel array it does not know where from: the general path
            return None
        return lean if all(_contiguous(shape, strides) for shape, strides, _ in lean.outputs) else None

    def _sources(self, launch, cotangents: dict, forward_buffer: dict) -> tuple:
        """Per kernel array of `launch` (in order): (kind, value) as the kinds above say; `cotangents`
        and `forward_buffer` (byte offsets) by kernel array name."""
        offsets = {a.name: a.offset * launch.dtype.itemsize for a in launch.allocations}
        out = []
        for name in launch.names:
            if name in self.arguments:
                out.append((ARGUMENT, self.arguments[name]))
            elif name in cotangents:
                out.append((COTANGENT, cotangents[name]))
            elif name in forward_buffer:
                out.append((FORWARD_BUFFER, forward_buffer[name]))
            elif name in offsets:
                out.append((BUFFER, offsets[name]))
            else:
                out.append((KEPT, self.kept[name].data_ptr()))
        return tuple(out)

    def forward(self, tensors: tuple):
        import torch

        launch = self.forward_launch
        buffer = launch.buffer()
        base = buffer.data_ptr()
        launch.launch_pointers([tensors[v].data_ptr() if k == ARGUMENT else base + v if k == BUFFER else v
                                for k, v in self.forward_sources], self.length)
        return tuple(torch.as_strided(buffer, *view) for view in self.outputs), buffer

    @property
    def lean_backward(self) -> bool:
        """Whether a backward is (still, or from the second one on) one launch and views: where the first
        one found the gradients' views not contiguous, or a kernel array it did not know, none is."""
        return self.backward in (self._first_backward, self._lean_backward)

    def tape(self, tensors: tuple, buffer) -> Tape:
        """The tape `Grad.backward` takes for this call (the general path)."""
        import torch

        tape = self.step._arrays((), dict(zip(self.names, tensors)))[3]
        tape.rounds = {s: torch.as_strided(buffer, a.shape, a.strides, a.offset) for s, a in self.rounds.items()}
        return tape

    def _first_backward(self, tensors: tuple, buffer, cotangents: tuple):
        """The first backward: through `PreparedStep.backward`, whose launch it then keeps for the
        later ones (`_lean_backward`), where the cotangents are the outputs' and torch CUDA tensors."""
        n_out = len(self.output_names)
        if any(c is None for c in cotangents[:n_out]) or any(c is not None for c in cotangents[n_out:]):
            return None
        tape = self.tape(tensors, buffer)
        given = dict(zip(self.output_names, cotangents))
        found = self.step._cotangents(tape, given, None)
        if found is None:
            return None
        (_, launch, lam), cot = found
        outs, finals = launch(tape.seqs, tape.params, tape.rounds, cot, lam, {})
        grads = self.step._in_layouts(outs, finals)
        # the later backwards: cotangents like these, the other kernel arrays as this one had them
        self.cotangent_like = [(c.shape, c.stride(), c.dtype) for c in cotangents[:n_out]]
        self.kept.update((f"init_{n}", v) for n, v in lam.items())
        try:
            self._plan_backward(launch.launch, tensors)
        except KeyError:  # a kernel array it does not know where from: the general path from now on
            self.backward = lambda *args: None
        return tuple(grads[n] for n in self.returned)

    def _plan_backward(self, launch, tensors: tuple) -> None:
        """Where the backward's arrays come from, and its gradients' views in the arguments' layouts;
        the later backwards lean where those are contiguous (the general path copies them else)."""
        rounds = {f"rounds_{s}": a.offset * self.forward_launch.dtype.itemsize for s, a in self.rounds.items()}
        self.backward_sources = self._sources(launch, {GRAD + n: i for i, n in enumerate(self.output_names)}, rounds)
        allocated = {a.name: a for a in launch.allocations}
        self.gradients = []
        shapes = [list(t.shape) for t in tensors]
        shapes += [[self.step.sizes[a] for a in self.step.program.decl(n).axes] for n in self.returned[len(tensors):]]
        for name, shape in zip(self.returned, shapes):
            a = allocated.get(f"out_{GRAD}{name}") or allocated[f"final_{GRAD}{name}"]
            perm = self.step.to_layout.get(name)
            self.gradients.append(_view(a, perm, None if perm else shape))
        self.backward_launch = launch
        # the kernel reads the cotangents as they are: in the compute dtype only
        lean = all(_contiguous(shape, strides) for shape, strides, _ in self.gradients) and \
            all(dtype == self.step.compute for _, _, dtype in self.cotangent_like)
        self.backward = self._lean_backward if lean else (lambda *args: None)

    def _lean_backward(self, tensors: tuple, buffer, cotangents: tuple):
        import torch

        n_out = len(self.output_names)
        cot = list(cotangents[:n_out])
        if len(cotangents) > n_out and any(c is not None for c in cotangents[n_out:]):
            return None
        for i, (c, (shape, strides, dtype)) in enumerate(zip(cot, self.cotangent_like)):
            if c is None or c.dtype != dtype or c.shape != shape:
                return None
            if c.stride() != strides:
                c = cot[i] = c.contiguous()
                if c.stride() != strides:
                    return None
        launch = self.backward_launch
        grads = launch.buffer()
        base, forward = grads.data_ptr(), buffer.data_ptr()
        pointers = []
        for k, v in self.backward_sources:
            pointers.append(tensors[v].data_ptr() if k == ARGUMENT else base + v if k == BUFFER else
                            cot[v].data_ptr() if k == COTANGENT else forward + v if k == FORWARD_BUFFER else v)
        launch.launch_pointers(pointers, self.length)
        return tuple(torch.as_strided(grads, *view) for view in self.gradients)


def _contiguous(shape, strides) -> bool:
    """Whether a view of `shape` and `strides` is contiguous (as torch's `is_contiguous` says)."""
    expected = 1
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


def _view(a, perm: list[int] | None, shape: list[int] | None = None) -> tuple:
    """(shape, strides, offset) of allocation `a` in another layout: its axes permuted by `perm`, or
    (contiguous as it is) reshaped to `shape`."""
    if perm is not None:
        return [a.shape[i] for i in perm], [a.strides[i] for i in perm], a.offset
    if shape is None or list(a.shape) == list(shape):
        return list(a.shape), list(a.strides), a.offset
    from .backends.cuda.codegen import contiguous_strides

    return list(shape), list(contiguous_strides(shape)) if shape else [], a.offset


