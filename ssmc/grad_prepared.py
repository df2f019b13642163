"""A training step on the GPU worked out once per call signature.

`Grad` (grad.py) binds, checks and plans every call: at a small shape that host time costs more
than the kernels (Mamba-1 B32 D512 L180 on an H100: kernels 0.35 ms, host 1.5 ms a step,
bench/host_profile.py). Where the forward runs the CUDA fused backward's kernels and the call's
arguments are torch CUDA tensors, the first call of a signature (`registry.call_key`: shapes,
strides, dtypes and devices of the arguments, the keywords given, the overrides) does all that
and leaves a `PreparedStep`; later calls like it take its path, which per call only

    forward:   views of the arguments with time first, casts where the compute dtype differs,
               the forward kernel's launch (`FusedBackwardRunner.prepare_forward`)
    backward:  views of the output cotangents with time first, the backward kernel's launch
               (`prepare_backward`), views of the gradients in the inputs' layouts

The checks `bind_arrays` and `grad.cotangents` made for the first call hold for every call of the
same signature, so nothing is checked again.
"""

from __future__ import annotations

import numpy as np

from .grad import Tape, array_ops, cotangents
from .ir.axes import TIME
from .passes.autodiff import GRAD
from .runtime.binding import Bound, layout_of


class PreparedStep:
    """`Grad.forward` / `Grad.backward` for calls like a first one (module docstring). `bound`: that
    call's binding; `dtype`: its compute dtype (the inputs', or the one `ssmc.grad` was given);
    `seqs`, `params`, `initial`: its arrays in that dtype, time first."""

    def __init__(self, grad, layout, bound: Bound, dtype, given: set[str], fused, seqs, params, initial,
                 chunk: int):
        import torch

        fwd = grad.backward_program.forward
        self.program, self.fused, self.layout, self.chunk = fwd, fused, layout, chunk
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
        self.states = [s.name for s in fwd.states if s.name in given]
        self.zeros = {s.name: initial[s.name] for s in fwd.states if s.name not in given}  # only read
        self.run_forward = fused.prepare_forward(seqs, params, initial, bound.sizes, bound.length)
        self.backwards: dict = {}  # signature of the output cotangents -> (launch, zero cotangents, ...)

    def _cast(self, t):
        t = t.detach()
        return t if t.dtype == self.compute else t.to(self.compute)

    def forward(self, args: tuple, kwargs: dict, outputs: bool):
        """What `Grad._forward` returns for a call of this signature."""
        arrays = dict(zip(self.names, args))
        arrays.update(kwargs)
        cast = self._cast
        seqs = {n: cast(arrays[n].permute(*perm)) for n, perm in self.to_time_first.items()}
        params = {n: cast(arrays[n]) for n in self.params}
        initial = {**self.zeros, **{s: cast(arrays[s]) for s in self.states}}
        tape = Tape(seqs, params, self.sizes, self.length, self.dtype, self.layout, self.chunk, [initial], step=self)
        outs, finals, tape.rounds = self.run_forward(seqs, params, initial)
        return (outs if outputs else {}), finals, tape

    def backward(self, tape: Tape, grad_outputs, grad_final_states) -> dict | None:
        """What `Grad.backward` returns, where the cotangents are torch CUDA tensors of the outputs
        only (by name, or one tensor for the one output); else None (the general path)."""
        import torch

        if grad_final_states is not None and not (isinstance(grad_final_states, dict) and not grad_final_states):
            return None  # cotangents of the final states: the general path
        names = [n for n, _ in self.program.outputs]
        given = {names[0]: grad_outputs} if isinstance(grad_outputs, torch.Tensor) and len(names) == 1 else grad_outputs
        if not isinstance(given, dict) or not given:
            return None
        key = []
        for name, t in given.items():
            if not isinstance(t, torch.Tensor) or not t.is_cuda:
                return None
            key.append((name, t.shape, t.stride(), t.dtype, t.device))
        prepared = self.backwards.get(tuple(key))
        if prepared is None:
            prepared = self.backwards[tuple(key)] = self._prepare_backward(tape, given)
        launch, zero_cot, lam = prepared
        cot = dict(zero_cot)
        cot.update((GRAD + n, self._cast(t.permute(*self.outputs_to_time_first[n]))) for n, t in given.items())
        outs, finals = launch(tape.seqs, tape.params, tape.rounds, cot, lam, {})
        grads = {}
        for d in self.program.inputs:
            perm = self.to_layout.get(d.name)
            grads[d.name] = (finals[GRAD + d.name] if perm is None else outs[GRAD + d.name].permute(*perm)).contiguous()
        grads.update((s.name, finals[GRAD + s.name]) for s in self.program.states)
        return grads

    def _prepare_backward(self, tape: Tape, given: dict):
        """The backward's launch for cotangents like `given`, checked as the general path checks them
        (`grad.cotangents`), and the zero cotangents of the outputs not given and of the final states."""
        cot, lam = cotangents(self.program, array_ops("cuda"), tape, given, None)
        cot = {GRAD + k: v for k, v in cot.items()}
        lam = {GRAD + k: v for k, v in lam.items()}  # zeros, only read
        launch = self.fused.prepare_backward(tape.seqs, tape.params, tape.rounds, cot, lam, {}, self.sizes,
                                             self.length)
        zero_cot = {k: v for k, v in cot.items() if k[len(GRAD):] not in given}  # only read
        return launch, zero_cot, lam
