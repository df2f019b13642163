"""``ssmc.compile``: a program plus a backend gives a callable.

    fn = ssmc.compile(spec, backend="interpreter", layout="b t ...")
    y = fn(u, delta, A, B, C, D)                               # per-step outputs
    y, h_last = fn(u, delta, A, B, C, D, h=h0, return_final_states=True)

Outputs come back in the call's layout; with several outputs (or states) as a tuple in spec order.
"""

from __future__ import annotations

import numpy as np

from .backends.cuda.devices import check_one_device, on_arrays_device
from .backends.registry import (
    BACKENDS,
    array_support,
    call_key,
    check_backend,
    compute_dtype,
    default_backend,
    preparer,
    runner,
)
from .frontend.attention import AttentionSpec
from .frontend.spec import RecurrenceSpec
from .ir.axes import TIME
from .ir.program import Recurrence
from .runtime.binding import DEFAULT_LAYOUT, MAX_PREPARED_CALLS, bind_arrays, check_layout, hashable_layout, layout_of

__all__ = ["BACKENDS", "Compiled", "compile", "default_backend"]


def _program(spec) -> Recurrence:
    if isinstance(spec, RecurrenceSpec):
        return spec.program
    if isinstance(spec, Recurrence):
        return spec
    raise TypeError(f"expected an @ssmc.recurrence spec, got {type(spec).__name__}")


def _permute(arr, perm):
    return arr.permute(*perm) if hasattr(arr, "permute") else arr.transpose(perm)


def _single(values: tuple):
    return values[0] if len(values) == 1 else values


class Compiled:
    """A recurrence bound to a backend; call it on arrays."""

    def __init__(self, program: Recurrence, backend: str, layout, dtype=None):
        self.program = program
        self.backend = backend
        self.layout = layout
        self.dtype = dtype
        self._runs: dict = {}  # compute dtype -> run function (finding it hashes the program: host time)
        self._calls: dict = {}  # call key (registry.call_key) -> a prepared run taking (args, kwargs)
        self._output_perms: dict = {}  # layout -> (output, its axes' order from time-first)

    def __repr__(self) -> str:
        return f"<ssmc.Compiled {self.program.name} backend={self.backend}>"

    @on_arrays_device(lambda args, kwargs: (*args, kwargs))
    def run(self, *args, layout=None, **kwargs) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Outputs in canonical layout (L, *axes) and final states, as name -> array dicts (on the
        CUDA backend, on the device of the arguments)."""
        p = self.program
        layout = layout or self.layout
        key = call_key(self.backend, args, kwargs)
        if key is not None:  # a call like an earlier one: bound and planned then (host time: small shapes)
            key = (hashable_layout(layout), *key)
            call = self._calls.get(key)
            if call:
                return call(args, kwargs)
        check_layout(layout, p)
        convert, zeros = array_support(self.backend, read_only_zeros=True)
        bound = bind_arrays(p.inputs, p.states, args, kwargs, layout, p.static_sizes, p.name, p.roots, convert, zeros)
        dtype = compute_dtype(self.backend, bound.dtype, self.dtype)
        run = self._runs.get(dtype)
        if run is None:
            run = self._runs[dtype] = runner(self.backend, p, dtype)
        if self.backend == "cuda":  # kernels read any float dtype and strides in place
            check_one_device({**bound.arrays, **bound.initial})
            first = next(iter(bound.arrays.values()), None)
            out_dtype = first.dtype if first is not None else None
            seqs = {d.name: bound.arrays[d.name] for d in p.seqs}
            params = {d.name: bound.arrays[d.name] for d in p.params}
            prepare = preparer(self.backend, p, dtype) if key is not None and key not in self._calls else None
            prepared = prepare and prepare(seqs, params, bound.initial, bound.sizes, bound.length, out_dtype)
            if prepare is not None:
                if len(self._calls) >= MAX_PREPARED_CALLS:  # calls of ever new shapes: start over
                    self._calls.clear()
                # False: runs of more than one launch take the full path (the key says so quickly)
                self._calls[key] = prepared and _bound_call(p, bound.initial, prepared, given=set(kwargs))
            if prepared:
                return prepared(seqs, params, bound.initial)
            return run(seqs, params, bound.initial, bound.sizes, bound.length, out_dtype=out_dtype)
        seqs = {d.name: bound.arrays[d.name].astype(dtype, copy=False) for d in p.seqs}
        params = {d.name: bound.arrays[d.name].astype(dtype, copy=False) for d in p.params}
        initial = {k: v.astype(dtype, copy=False) for k, v in bound.initial.items()}
        return run(seqs, params, initial, bound.sizes, bound.length)

    def __call__(self, *args, return_final_states: bool = False, layout=None, **kwargs):
        outs, finals = self.run(*args, layout=layout, **kwargs)
        layout = layout or self.layout
        perms = self._output_perms.get(hashable_layout(layout))
        if perms is None:
            perms = self._output_perms[hashable_layout(layout)] = [
                (name, [(TIME, *y.axes).index(a) for a in layout_of(layout, name, y.axes)])
                for name, y in self.program.outputs]
        ys = [_permute(outs[name], perm) for name, perm in perms]
        ys = _single(tuple(ys)) if ys else None
        if not return_final_states:
            return ys
        return ys, _single(tuple(finals[s.name] for s in self.program.states))


def _bound_call(p: Recurrence, initial: dict, prepared, given: set[str]):
    """`prepared` (a backend's run worked out for one call) as a function of a call's (args, kwargs)
    alike (same `registry.call_key`, so the same keywords `given`): binding them is matching names, the
    checks `bind_arrays` made for the first such call holding for them all. The prepared run reads only
    the arrays' addresses (`CudaRunner.prepare`: their layouts are in the key), so the arrays go as
    given, not as time-first views (a permute costs host time: about 5 µs on the GPU machines)."""
    names = [d.name for d in p.inputs]
    seqs, params = [d.name for d in p.seqs], [d.name for d in p.params]
    zeros = {s.name: initial[s.name] for s in p.states if s.name not in given}  # shared, read only
    states = [s.name for s in p.states if s.name in given]

    def call(args, kwargs):
        arrays = dict(zip(names, args))
        arrays.update(kwargs)
        return prepared({n: arrays[n] for n in seqs}, {n: arrays[n] for n in params},
                        {**zeros, **{s: arrays[s] for s in states}})
    return call


def compile(spec, backend: str | None = None, *, layout=DEFAULT_LAYOUT, dtype=None):
    """Compile a spec for a backend: "numba" (CPU, the default here) or "interpreter" (float64).

    `layout` places the time axis in sequence arrays: a template like ``"b t ..."`` (one for all)
    or a dict from input/output name to template; the default ``"t ..."`` puts time first.
    `dtype` (float32 / float64) fixes the compute type; by default it follows the inputs (float32
    when all are float32). The interpreter always computes in float64.
    """
    if isinstance(spec, AttentionSpec):
        return spec.compile(backend, layout=layout)
    backend = check_backend(backend or default_backend())
    return Compiled(_program(spec), backend, layout, dtype)
