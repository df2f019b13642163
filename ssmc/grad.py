"""``ssmc.grad``: gradients of every input, param and initial state, through the derived backward.

    g = ssmc.grad(spec, layout="b t ...")
    grads = g(x, f, h=h0, grad_outputs=dy, grad_final_states=dh_last)
    grads["x"], grads["f"], grads["h"]          # same shapes and layout as the inputs

    outs, finals, tape = g.forward(x, f, h=h0)   # a training step: the forward once ...
    grads = g.backward(tape, grad_outputs=dy)    # ... and the backward from what it kept

The forward saves the carry at chunk boundaries only; each chunk's carries are recomputed from its
boundary when the backward reaches it (`autodiff.MemoryPlan`). The chunk (`default_chunk`) is, on
the CPU, as long as keeps one chunk's carries within `CPU_CARRIES_BUDGET` (64 MiB), and at least
`DEFAULT_CHUNK` steps; when one chunk covers the sequence, `Grad.forward` runs the recording
forward (outputs and every carry) and the backward recomputes nothing. On the GPU every chunk
costs a few kernel launches, so the chunk is as long as keeps the recomputed carries no bigger
than the sequences given: one chunk for a scan whose state is as big as its input, about L / 5
steps for Mamba-1 (state N = 16 per channel). The GPU recomputes the carries, except that a
training step (`Grad.forward`, which `ssmc.torch` runs) whose one chunk covers the sequence runs the
recording forward there too, as its outputs are wanted anyway. Where the CUDA fused backward
applies (backends/cuda/fused_backward.py), its round of 32 steps is the chunk and a given `chunk`
is not used. A CUDA training step of torch tensors is worked out once per call signature
(grad_prepared.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .backends import interpreter
from .backends.cuda.devices import check_one_device, current_device, on_arrays_device
from .backends.registry import array_support, call_key, check_backend, compute_dtype, default_backend, runner
from .frontend.attention import AttentionSpec
from .ir.axes import TIME
from .ir.node import Node, toposort
from .ir.ops import Op
from .ir.program import Recurrence
from .passes.attention_grad import derive_attention_backward
from .passes.autodiff import DEFAULT_CHUNK, GRAD, Backward, derive_backward
from .runtime.binding import (
    DEFAULT_LAYOUT,
    MAX_PREPARED_CALLS,
    bind_arrays,
    check_layout,
    hashable_layout,
    layout_of,
    to_array,
    to_float64,
)

CPU_CARRIES_BUDGET = 64 << 20  # bytes of carries one chunk may recompute (or keep) on the CPU


def default_chunk(backend: str, length: int, program, sizes: dict[str, int], itemsize: int = 4) -> int:
    """Steps per recomputed chunk when the caller gives none (module docstring)."""
    per_step_state = sum(math.prod(sizes[a] for a in s.axes) for s in program.states)
    if backend != "cuda":
        return max(DEFAULT_CHUNK, min(length, CPU_CARRIES_BUDGET // max(per_step_state * itemsize, 1)))
    per_step_seqs = sum(math.prod(sizes[a] for a in d.axes) for d in program.seqs)
    return max(DEFAULT_CHUNK, min(length, length * per_step_seqs // max(per_step_state, 1)))


class _HostArrays:
    """The few array operations the driver needs, on NumPy arrays (interpreter, numba)."""

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


class _DeviceArrays:
    """The same on torch CUDA tensors (the cuda backend)."""

    @staticmethod
    def convert(x, name):
        from .backends.cuda.runner import to_device

        return to_device(x, name)

    @staticmethod
    def zeros(shape, dtype):
        import torch

        from .backends.cuda.devices import device_name

        return torch.zeros(tuple(shape), device=device_name(),
                           dtype=torch.float64 if dtype == np.float64 else torch.float32)

    @staticmethod
    def cast(x, dtype):
        import torch

        return x.to(torch.float64 if dtype == np.float64 else torch.float32)

    @staticmethod
    def cat(parts):
        import torch

        return torch.cat(parts, dim=0)

    @staticmethod
    def permute(x, perm):
        return x.permute(*perm)

    @staticmethod
    def contiguous(x):
        return x.contiguous()


def array_ops(backend: str):
    """The array operations of a backend's arrays: torch CUDA tensors for cuda, else NumPy."""
    return _DeviceArrays if backend == "cuda" else _HostArrays


def _as_dict(values, names: list[str], what: str) -> dict:
    if values is None:
        return {}
    if isinstance(values, dict):
        unknown = set(values) - set(names)
        if unknown:
            raise ValueError(f"{what}: unknown names {sorted(unknown)}; expected {names}")
        return dict(values)
    if len(names) == 1 and not isinstance(values, (tuple, list)):
        return {names[0]: values}
    if len(values) != len(names):
        raise ValueError(f"{what}: expected {len(names)} arrays for {names}, got {len(values)}")
    return dict(zip(names, values))



def cotangents(program, xp, tape, grad_outputs, grad_final_states) -> tuple[dict, dict]:
    """The cotangents of `program`'s outputs (time first) and final states, in the tape's compute
    dtype, from arrays given in the forward's layout; zeros for those not given."""
    sizes, length, dtype = tape.sizes, tape.length, tape.dtype
    gy = _as_dict(grad_outputs, [n for n, _ in program.outputs], "grad_outputs")
    gh = _as_dict(grad_final_states, [s.name for s in program.states], "grad_final_states")
    cot = {}
    for name, y in program.outputs:
        order = layout_of(tape.layout, name, y.axes)
        if name in gy:
            arr = xp.convert(gy[name], f"grad_outputs[{name!r}]")
            want = tuple(length if a == TIME else sizes[a] for a in order)
            if tuple(arr.shape) != want:
                raise ValueError(f"grad_outputs[{name!r}] has shape {arr.shape}, expected {want} "
                                 f"for axes {' '.join(order)}")
            cot[name] = xp.cast(xp.permute(arr, [order.index(a) for a in (TIME, *y.axes)]), dtype)
        else:
            cot[name] = xp.zeros((length, *(sizes[a] for a in y.axes)), dtype)
    lam = {}
    for s in program.states:
        shape = tuple(sizes[a] for a in s.axes)
        arr = xp.convert(gh[s.name], f"grad_final_states[{s.name!r}]") if s.name in gh else xp.zeros(shape, dtype)
        if tuple(arr.shape) != shape:
            raise ValueError(f"grad_final_states[{s.name!r}] has shape {arr.shape}, expected {shape}")
        lam[s.name] = xp.cast(arr, dtype)
    return cot, lam


def in_layout(program, grads: dict, layout, xp) -> dict:
    """`grads` (sequences time first) with each sequence's gradient in its input's layout, contiguous."""
    out = {}
    for d in program.inputs:
        g = grads[d.name]
        if d in program.seqs:
            order = layout_of(layout, d.name, d.axes)
            canonical = (TIME, *d.axes)
            g = xp.permute(g, [canonical.index(a) for a in order])
        out[d.name] = xp.contiguous(g)
    for s in program.states:
        out[s.name] = grads[s.name]
    return out

@dataclass
class Tape:
    """What `Grad.forward` keeps for `Grad.backward`: arrays in the compute dtype, time first.

    `boundaries[c]` is the carry before chunk c; `carries` holds ``prev_<state>`` of every step
    when one chunk covers the sequence and the backend ran the recording forward (then the
    backward recomputes nothing, and takes from `products` the matrix products its Numba adjoint
    would recompute: an LSTM's ``x W``, hoisted by the forward, and ``h U``, saved per step).
    `rounds` holds the carry into every round of the CUDA fused backward's kernel, written by the
    forward's warp or lanes kernel (backends/cuda/fused_backward.py; `boundaries` is then the
    initial state alone)."""

    seqs: dict
    params: dict
    sizes: dict[str, int]
    length: int
    dtype: np.dtype
    layout: object
    chunk: int
    boundaries: list[dict]
    carries: dict | None = None
    products: dict = field(default_factory=dict)
    rounds: dict | None = None
    step: object = None  # the `grad_prepared` step whose forward made it (its backward's path)


class Grad:
    """Gradients of a recurrence's inputs given cotangents of its outputs and final states.

    ``g(*inputs, grad_outputs=..., grad_final_states=...)`` runs the forward (keeping chunk
    boundaries) and the backward. ``g.forward(*inputs)`` returns the outputs and final states and
    a `Tape`, and ``g.backward(tape, ...)`` the gradients: a training step runs the forward once
    (`ssmc.torch` does this)."""

    def __init__(self, program, backend: str = "interpreter", layout=DEFAULT_LAYOUT, chunk: int | None = None,
                 dtype=None):
        if chunk is not None and chunk < 1:
            raise ValueError("chunk must be at least 1")
        self.backward_program: Backward = derive_backward(program, chunk or DEFAULT_CHUNK)
        self.backend = check_backend(backend)
        self.recording, self.saved = _recording(self.backward_program, self.backend)
        self.xp = array_ops(self.backend)
        self.dtype = dtype
        self.layout = layout
        self.chunk = chunk
        self._fused_runners: dict[str, object] = {}  # compute dtype -> the CUDA fused backward's runner
        self._steps: dict = {}  # call key (registry.call_key) and layout -> its step (CUDA, grad_prepared.py)
        self._leans: dict = {}  # the same keys -> the `LeanStep` of `__call__`, or False (none applies)

    @on_arrays_device(lambda args, kwargs: (*args, kwargs))
    def __call__(self, *args, grad_outputs=None, grad_final_states=None, layout=None, **kwargs):
        """Returns {input name: gradient} for every sequence, param and state (initial value)."""
        key = None
        if self.backend == "cuda" and grad_final_states is None:
            key = call_key(self.backend, args, kwargs)
            grads = self._lean_call(key, args, kwargs, layout, grad_outputs)
            if grads is not None:
                return grads
        tape = self._forward(args, kwargs, layout, outputs=False, key=key)[2]
        return self.backward(tape, grad_outputs=grad_outputs, grad_final_states=grad_final_states)

    def _lean_call(self, key, args: tuple, kwargs: dict, layout, grad_outputs) -> dict | None:
        """`__call__` through the `LeanStep` of calls like this one (grad_prepared.py: a launch and a
        few views each way, where the prepared step's path binds, permutes and casts; Mamba-1 B32 D512
        L180 on an H200's host: 242 µs a step for 178 of kernels before), once a prepared step has
        served such a call without outputs, on the current device, the cotangents one torch tensor
        per output; None where it does not apply (the caller takes the general path). `key`: the
        call's `registry.call_key`."""
        if key is None or not (args or kwargs):
            return None
        key = (hashable_layout(layout or self.layout), *key)
        lean = self._leans.get(key)
        if lean is None:
            lean = self._lean_step(key, args, kwargs)
            if lean is None:
                return None
            self._leans[key] = lean
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
        from .grad_prepared import LeanStep, PreparedStep

        fwd = self.backward_program.forward
        step = self._steps.get(key)
        if not isinstance(step, PreparedStep) or step.run_summary is None:
            return None
        tensors = [*args, *kwargs.values()]
        if len(args) > len(fwd.inputs) or tensors[0].get_device() != current_device():
            return False  # states by position; another device (the general path switches to it)
        names = [d.name for d in fwd.inputs[:len(args)]] + list(kwargs)
        lean = LeanStep.build(step, names, [(n, []) for n, _ in fwd.outputs], tensors, gradients_only=True)
        return False if lean is None else lean

    def forward(self, *args, layout=None, **kwargs):
        """(outputs, final states, tape): outputs as name -> array [L, *axes] (time first) and final
        states by name, in the compute dtype; the tape for `backward`."""
        return self._forward(args, kwargs, layout, outputs=True)

    @on_arrays_device(lambda a, kw: (*a[0], a[1]))  # (args, kwargs, layout, outputs)
    def _forward(self, args, kwargs, layout, outputs: bool, key=None):
        """`forward`'s work; `key`: the call's `registry.call_key` where the caller has it."""
        fwd = self.backward_program.forward
        layout = layout or self.layout
        key = call_key(self.backend, args, kwargs) if key is None else key
        if key is not None:  # a call like an earlier one: its step was worked out then (grad_prepared.py)
            key = (hashable_layout(layout), *key)
            step = self._steps.get(key)
            if step is not None:
                return step.forward(args, kwargs, outputs)
        xp = self.xp
        check_layout(layout, fwd)
        convert, zeros = array_support(self.backend)
        bound = bind_arrays(fwd.inputs, fwd.states, args, kwargs, layout, fwd.static_sizes, fwd.name, fwd.roots,
                            convert, zeros)
        if self.backend == "cuda":
            check_one_device({**bound.arrays, **bound.initial})
        sizes, length = bound.sizes, bound.length
        dtype = compute_dtype(self.backend, bound.dtype, self.dtype)
        chunk = self.chunk or default_chunk(self.backend, length, fwd, sizes, np.dtype(dtype).itemsize)
        seqs = {d.name: xp.cast(bound.arrays[d.name], dtype) for d in fwd.seqs}
        params = {d.name: xp.cast(bound.arrays[d.name], dtype) for d in fwd.params}
        initial = {k: xp.cast(v, dtype) for k, v in bound.initial.items()}
        tape = Tape(seqs, params, sizes, length, dtype, layout, chunk, [initial])
        recording = self.recording
        if fwd.reverse:
            raise NotImplementedError("gradients of a reverse-time spec")  # not produced by the frontend
        fused = self._fused_backward(seqs, sizes, length, dtype)
        if fused is not None:  # one kernel saving the carry every round; the backward is one kernel too
            if key is not None:
                from .grad_prepared import PreparedStep

                tape.step = self._remember(key, PreparedStep(self, layout, bound, dtype, set(kwargs), fused, seqs,
                                                             params, initial, chunk))
            outs, finals, tape.rounds = fused.forward(seqs, params, initial, sizes, length, outputs)
            return (outs if outputs else {}), finals, tape
        if key is not None and chunk >= length:  # CUDA, one chunk: runs worked out once (grad_prepared.py)
            from .grad_prepared import PreparedChunk

            step = self._remember(key, PreparedChunk(self, layout, bound, dtype, set(kwargs), initial, chunk))
            return step.forward(args, kwargs, outputs)
        if chunk >= length and recording is not None and (outputs or self.backend != "cuda"):
            # one chunk: the forward keeps every carry, the backward recomputes nothing. On the GPU
            # only where the outputs are wanted (a training step: `forward`, ssmc.torch): writing the
            # carries costs less than the pass that would recompute them (the scan B8 D2048 L4096:
            # about 0.09 ms more a forward, 0.27 ms less a backward); `__call__` skips the forward.
            outs, finals = runner(self.backend, recording, dtype, tape.products)(seqs, params, initial, sizes, length)
            tape.carries = {f"prev_{s.name}": outs.pop(f"prev_{s.name}") for s in fwd.states}
            tape.products.update((node, outs.pop(name)) for name, node in self.saved)
            return outs, finals, tape
        run_forward = runner(self.backend, fwd, dtype)
        bounds = list(range(0, length, chunk))
        parts: dict[str, list] = {n: [] for n, _ in fwd.outputs}
        finals = initial
        for i, start in enumerate(bounds):
            if i == len(bounds) - 1 and not outputs:
                break  # the last chunk's carries are recomputed by the backward anyway
            part = {k: v[start:start + chunk] for k, v in seqs.items()}
            outs, finals = run_forward(part, params, finals, sizes, min(chunk, length - start))
            for n in parts:
                parts[n].append(outs[n])
            if i < len(bounds) - 1:
                tape.boundaries.append(finals)
        outs = {n: (v[0] if len(v) == 1 else xp.cat(v)) for n, v in parts.items()} if outputs else {}
        return outs, finals, tape

    def _remember(self, key, step):
        """Keep `step` for calls of `key`: at most MAX_PREPARED_CALLS (calls of ever new shapes: start over)."""
        if len(self._steps) >= MAX_PREPARED_CALLS:
            self._steps.clear()
        self._steps[key] = step
        return step

    def _fused_backward(self, seqs: dict, sizes: dict[str, int], length: int, dtype):
        """The CUDA fused backward's runner where it applies at these sizes and layouts, else None."""
        if self.backend != "cuda":
            return None
        fused = self._fused_runner(dtype)
        return fused if fused is not None and fused.applies(seqs, sizes, length) else None

    def _fused_runner(self, dtype):
        """The CUDA fused backward's runner of this gradient (None where it cannot fuse), looked up
        once per dtype: the lookup hashes the forward and adjoint programs, which walks their graphs."""
        name = np.dtype(dtype).name
        if name not in self._fused_runners:
            from .backends.cuda.fused_backward import fused_backward_runner

            self._fused_runners[name] = fused_backward_runner(self.backward_program, name)
        return self._fused_runners[name]

    @on_arrays_device(lambda a, kw: tape_arrays(a[0] if a else kw["tape"]))
    def backward(self, tape: Tape, grad_outputs=None, grad_final_states=None) -> dict:
        """Gradients {input name: array} (inputs' layouts) from a `forward`'s tape and the cotangents
        of its outputs and final states (given in the forward's layout; missing ones are zero)."""
        if tape.step is not None:  # a prepared step's tape: its path, where the cotangents suit it
            grads = tape.step.backward(tape, grad_outputs, grad_final_states)
            if grads is not None:
                return grads
        fwd = self.backward_program.forward
        cot, lam = cotangents(fwd, self.xp, tape, grad_outputs, grad_final_states)
        return in_layout(fwd, self.adjoint(tape, cot, lam), tape.layout, self.xp)

    def adjoint(self, tape: Tape, cot: dict, lam: dict) -> dict:
        """Gradients {input name: array}, sequences time first, from time-first cotangents of every
        output (`cot`) and final state (`lam`): the adjoint over the chunks, last to first, each
        chunk's carries recomputed from its boundary (or taken from the tape)."""
        bw = self.backward_program
        fwd, xp, dtype, sizes, length, chunk = bw.forward, self.xp, tape.dtype, tape.sizes, tape.length, tape.chunk
        seqs, params = tape.seqs, tape.params
        if tape.rounds is not None:
            return self._fused_adjoint(tape, cot, lam)
        acc = {GRAD + p.name: xp.zeros(tuple(params[p.name].shape), dtype) for p in fwd.params}
        run_adjoint = runner(self.backend, bw.adjoint, dtype, tape.products if tape.carries is not None else None)
        carry = {GRAD + k: v for k, v in lam.items()} | acc
        seq_grads: dict[str, list] = {d.name: [] for d in fwd.seqs}
        for start, init in zip(reversed(range(0, length, chunk)), reversed(tape.boundaries)):
            n = min(chunk, length - start)
            part = {k: v[start:start + n] for k, v in seqs.items()}
            if tape.carries is not None:
                prev = tape.carries
            else:
                prev, _ = runner(self.backend, bw.carries, dtype)(part, params, init, sizes, n)
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
        """The adjoint as the CUDA fused backward's one kernel (`tape.rounds` from its forward; the
        param gradients start from zeros it allocates)."""
        fwd = self.backward_program.forward
        fused = self._fused_runner(tape.dtype)
        outs, finals = fused.backward(tape.seqs, tape.params, tape.rounds, {GRAD + k: v for k, v in cot.items()},
                                      {GRAD + k: v for k, v in lam.items()}, {}, tape.sizes, tape.length)
        grads = {d.name: outs[GRAD + d.name] for d in fwd.seqs}
        grads.update({p.name: finals[GRAD + p.name] for p in fwd.params})
        grads.update({s.name: finals[GRAD + s.name] for s in fwd.states})
        return grads


def tape_arrays(tape: Tape) -> tuple[dict, dict]:
    """The arrays a tape holds (the device its backward runs on: `on_arrays_device`)."""
    return tape.seqs, tape.params


def _recording(bw: Backward, backend: str) -> tuple[Recurrence | None, tuple[tuple[str, Node], ...]]:
    """The recording forward a backend runs, and the (output name, node) pairs it saves for the
    adjoint. On Numba: the products the adjoint would hoist out of its loop and recompute from
    the carries (an LSTM's ``h U``), which the forward's loop computes anyway; written per step,
    they reach the adjoint through `Tape.products`."""
    rec = bw.recording
    if rec is None or backend != "numba":
        return rec, ()
    from .lowering.hoist import hoist

    states = {s.name for s in bw.forward.states}
    known = {d.name for d in bw.forward.decls}
    taken = {n for n, _ in rec.outputs}
    saved = []
    for _, node in hoist(bw.adjoint).pre:
        leaves = {n.arg for n in toposort([node]) if n.op is Op.INPUT}
        if leaves & states and leaves <= known:
            name = f"saved_{len(saved)}"
            while name in taken:
                name += "_"
            saved.append((name, node))
    if not saved:
        return rec, ()
    return rec.with_roots(rec.updates, rec.outputs + tuple(saved)), tuple(saved)


class AttentionGrad:
    """Gradients of `ssmc.attention`'s q, k, v and params given the output's cotangent."""

    def __init__(self, spec, layout=DEFAULT_LAYOUT):
        self.compiled = spec.compile("interpreter", layout=layout)
        self.backward = derive_attention_backward(spec.program)

    def __call__(self, q, k, v, grad_outputs=None, layout=None, **params) -> dict[str, np.ndarray]:
        p = self.backward.forward
        layout = layout or self.compiled.layout
        qb, kv = self.compiled.bind(q, k, v, layout, params)
        sizes = {**kv.sizes, **qb.sizes}
        order = layout_of(layout, "out", p.v_axes)
        canonical = (TIME, *p.v_axes)
        want = tuple(qb.arrays["q"].shape[0] if a == TIME else sizes[a] for a in order)
        d_out = np.zeros(want) if grad_outputs is None else to_float64(grad_outputs, "grad_outputs")
        if d_out.shape != want:
            raise ValueError(f"grad_outputs has shape {d_out.shape}, expected {want} for axes {' '.join(order)}")
        d_out = d_out.transpose([order.index(a) for a in canonical])
        grads = interpreter.run_attention_backward(
            self.backward, qb.arrays["q"], kv.arrays["k"], kv.arrays["v"],
            {d.name: kv.arrays[d.name] for d in p.params}, sizes, d_out)
        for name, axes in (("q", p.q_axes), ("k", p.q_axes), ("v", p.v_axes)):
            order = layout_of(layout, name, axes)
            canonical = (TIME, *axes)
            grads[name] = np.require(grads[name].transpose([canonical.index(a) for a in order]), requirements="C")
        return grads


def grad(spec, backend: str | None = None, *, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
    """Gradients of a spec (see the module docstring) on a backend (default: as `ssmc.compile`).

    `chunk` sets a recurrence's memory plan (default: `default_chunk`); `dtype` as in `ssmc.compile`.
    """
    from .api import _program
    from .grad_stages import make_grad

    if isinstance(spec, AttentionSpec):
        return AttentionGrad(spec, layout)
    return make_grad(_program(spec), backend or default_backend(), layout, chunk, dtype)
