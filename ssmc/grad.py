"""``ssmc.grad``: gradients of every input, param and initial state, through the derived backward.

    g = ssmc.grad(spec, layout="b t ...")
    grads = g(x, f, h=h0, grad_outputs=dy, grad_final_states=dh_last)
    grads["x"], grads["f"], grads["h"]          # same shapes and layout as the inputs

The forward saves the carry at chunk boundaries only; each chunk's carries are recomputed from its
boundary when the backward reaches it (`autodiff.MemoryPlan`). The chunk is `DEFAULT_CHUNK` steps
on the CPU. On the GPU every chunk costs a few kernel launches, so the chunk is as long as keeps
the recomputed carries no bigger than the sequences given (`default_chunk`): one chunk for a
scan whose state is as big as its input, about L / 5 steps for Mamba-1 (state N = 16 per channel).
"""

from __future__ import annotations

import math

import numpy as np

from .backends import interpreter
from .backends.registry import array_support, check_backend, compute_dtype, default_backend, runner
from .frontend.attention import AttentionSpec
from .ir.axes import TIME
from .passes.attention_grad import derive_attention_backward
from .passes.autodiff import DEFAULT_CHUNK, GRAD, Backward, derive_backward
from .runtime.binding import DEFAULT_LAYOUT, bind_arrays, layout_of, to_float64


def default_chunk(backend: str, length: int, program, sizes: dict[str, int]) -> int:
    """Steps per recomputed chunk when the caller gives none (module docstring)."""
    if backend != "cuda":
        return DEFAULT_CHUNK
    per_step_state = sum(math.prod(sizes[a] for a in s.axes) for s in program.states)
    per_step_seqs = sum(math.prod(sizes[a] for a in d.axes) for d in program.seqs)
    return max(DEFAULT_CHUNK, min(length, length * per_step_seqs // max(per_step_state, 1)))


class _HostArrays:
    """The few array operations the driver needs, on NumPy arrays (interpreter, numba)."""

    convert = staticmethod(to_float64)

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

        return torch.zeros(tuple(shape), device="cuda", dtype=torch.float64 if dtype == np.float64 else torch.float32)

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


class Grad:
    """Gradients of a recurrence's inputs given cotangents of its outputs and final states."""

    def __init__(self, program, backend: str = "interpreter", layout=DEFAULT_LAYOUT, chunk: int | None = None,
                 dtype=None):
        if chunk is not None and chunk < 1:
            raise ValueError("chunk must be at least 1")
        self.backward: Backward = derive_backward(program, chunk or DEFAULT_CHUNK)
        self.backend = check_backend(backend)
        self.xp = _DeviceArrays if self.backend == "cuda" else _HostArrays
        self.dtype = dtype
        self.layout = layout
        self.chunk = chunk

    def __call__(self, *args, grad_outputs=None, grad_final_states=None, layout=None, **kwargs):
        """Returns {input name: gradient} for every sequence, param and state (initial value)."""
        fwd = self.backward.forward
        layout = layout or self.layout
        xp = self.xp
        convert, zeros = array_support(self.backend)
        bound = bind_arrays(fwd.inputs, fwd.states, args, kwargs, layout, fwd.static_sizes, fwd.name, fwd.roots,
                            convert, zeros)
        sizes, length = bound.sizes, bound.length
        dtype = compute_dtype(self.backend, bound.dtype, self.dtype)
        out_names = [n for n, _ in fwd.outputs]
        gy = _as_dict(grad_outputs, out_names, "grad_outputs")
        gh = _as_dict(grad_final_states, [s.name for s in fwd.states], "grad_final_states")
        cot = {}
        for name, y in fwd.outputs:
            order = layout_of(layout, name, y.axes)
            if name in gy:
                arr = xp.convert(gy[name], f"grad_outputs[{name!r}]")
                want = tuple(length if a == TIME else sizes[a] for a in order)
                if tuple(arr.shape) != want:
                    raise ValueError(f"grad_outputs[{name!r}] has shape {arr.shape}, expected {want} "
                                     f"for axes {' '.join(order)}")
                cot[name] = xp.permute(arr, [order.index(a) for a in (TIME, *y.axes)])
            else:
                cot[name] = xp.zeros((length, *(sizes[a] for a in y.axes)), dtype)
        lam = {}
        for s in fwd.states:
            shape = tuple(sizes[a] for a in s.axes)
            arr = xp.convert(gh[s.name], f"grad_final_states[{s.name!r}]") if s.name in gh else xp.zeros(shape, dtype)
            if tuple(arr.shape) != shape:
                raise ValueError(f"grad_final_states[{s.name!r}] has shape {arr.shape}, expected {shape}")
            lam[s.name] = arr
        grads = self._run(bound, cot, lam, dtype)
        out = {}
        for d in fwd.inputs:
            g = grads[d.name]
            if d in fwd.seqs:
                order = layout_of(layout, d.name, d.axes)
                canonical = (TIME, *d.axes)
                g = xp.permute(g, [canonical.index(a) for a in order])
            out[d.name] = xp.contiguous(g)
        for s in fwd.states:
            out[s.name] = grads[s.name]
        return out

    def _run(self, bound, cot: dict[str, np.ndarray], lam: dict[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
        bw = self.backward
        fwd, sizes, length = bw.forward, bound.sizes, bound.length
        chunk = self.chunk or default_chunk(self.backend, length, fwd, sizes)
        xp = self.xp
        seqs = {d.name: xp.cast(bound.arrays[d.name], dtype) for d in fwd.seqs}
        params = {d.name: xp.cast(bound.arrays[d.name], dtype) for d in fwd.params}
        cot = {k: xp.cast(v, dtype) for k, v in cot.items()}
        lam = {k: xp.cast(v, dtype) for k, v in lam.items()}
        run_forward = runner(self.backend, fwd, dtype)
        run_carries = runner(self.backend, bw.carries, dtype)
        run_adjoint = runner(self.backend, bw.adjoint, dtype)
        bounds = list(range(0, length, chunk))
        if fwd.reverse:
            raise NotImplementedError("gradients of a reverse-time spec")  # not produced by the frontend
        # forward: keep the carry at each chunk boundary only
        saved = [{k: xp.cast(v, dtype) for k, v in bound.initial.items()}]
        for start in bounds[:-1]:
            part = {k: v[start:start + chunk] for k, v in seqs.items()}
            _, finals = run_forward(part, params, saved[-1], sizes, chunk)
            saved.append(finals)
        # backward: chunks last to first, recomputing each chunk's carries from its boundary
        acc = {GRAD + p.name: xp.zeros(tuple(params[p.name].shape), dtype) for p in fwd.params}
        carry = {GRAD + k: v for k, v in lam.items()} | acc
        seq_grads: dict[str, list[np.ndarray]] = {d.name: [] for d in fwd.seqs}
        for start, init in zip(reversed(bounds), reversed(saved)):
            n = min(chunk, length - start)
            part = {k: v[start:start + n] for k, v in seqs.items()}
            prev, _ = run_carries(part, params, init, sizes, n)
            adj_seqs = dict(part)
            adj_seqs.update({s.name: prev[f"prev_{s.name}"] for s in fwd.states})
            adj_seqs.update({GRAD + k: v[start:start + n] for k, v in cot.items()})
            outs, carry = run_adjoint(adj_seqs, params, carry, sizes, n)
            for d in fwd.seqs:
                seq_grads[d.name].append(outs[GRAD + d.name])
        grads = {name: xp.cat(parts[::-1]) for name, parts in seq_grads.items()}
        grads.update({p.name: carry[GRAD + p.name] for p in fwd.params})
        grads.update({s.name: carry[GRAD + s.name] for s in fwd.states})
        return grads


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

    if isinstance(spec, AttentionSpec):
        return AttentionGrad(spec, layout)
    return Grad(_program(spec), backend or default_backend(), layout, chunk, dtype)
