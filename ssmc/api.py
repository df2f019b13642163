"""``ssmc.compile``: a program plus a backend gives a callable.

    fn = ssmc.compile(spec, backend="interpreter", layout="b t ...")
    y = fn(u, delta, A, B, C, D)                               # per-step outputs
    y, h_last = fn(u, delta, A, B, C, D, h=h0, return_final_states=True)

Outputs come back in the call's layout; with several outputs (or states) as a tuple in spec order.
"""

from __future__ import annotations

import numpy as np

from . import autograd
from .backends import interpreter
from .backends.cuda.devices import on_arrays_device
from .backends.registry import BACKENDS, check_backend, default_backend, get_backend
from .frontend import spec as frontend_spec
from .frontend.attention import AttentionSpec
from .ir.axes import TIME
from .ir.program import Attention, Recurrence
from .runtime.binding import DEFAULT_LAYOUT, from_time_first, hashable_layout, layout_of, to_time_first
from .runtime.prologue import PreparedCalls, attention_params, bind_attention, bind_call, program_of

__all__ = ["BACKENDS", "Compiled", "CompiledAttention", "Step", "compile", "default_backend", "grad", "step"]


def _permute(arr, perm):
    return arr.permute(*perm) if hasattr(arr, "permute") else arr.transpose(perm)


def _single(values: tuple):
    return values[0] if len(values) == 1 else values


class Compiled:
    """A recurrence bound to a backend; call it on arrays."""

    def __init__(self, program: Recurrence, backend: str, layout, dtype=None):
        self.program = program
        self.backend = backend  # its name (`on_arrays_device` reads it)
        self.target = get_backend(backend)
        self.layout = layout
        self.dtype = dtype
        self._runs: dict = {}  # compute dtype -> run function (finding it hashes the program: host time)
        self._calls = PreparedCalls()  # call key -> a prepared run taking (args, kwargs), or False
        self._output_perms: dict = {}  # layout -> (output, its axes' order from time-first)
        self._reset_compiled = None  # packed calls in one (packed.reset_program), made at the first such call

    def __repr__(self) -> str:
        return f"<ssmc.Compiled {self.program.name} backend={self.backend}>"

    @on_arrays_device(lambda args, kwargs: (*args, kwargs))
    def run(self, *args, layout=None, **kwargs) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Outputs in canonical layout (L, *axes) and final states, as name -> array dicts (on a
        device backend, on the device of the arguments)."""
        p, target = self.program, self.target
        layout = layout or self.layout
        key = self._calls.key(target, args, kwargs, layout)
        if key is not None:  # a call like an earlier one: bound and planned then (host time: small shapes)
            call = self._calls.get(key)
            if call:
                return call(args, kwargs)
        bound, dtype = bind_call(target, p, args, kwargs, layout, self.dtype, read_only_zeros=True)
        run = self._runs.get(dtype)
        if run is None:
            run = self._runs[dtype] = target.runner(p, dtype)
        seqs, params, initial, options = target.run_inputs(p, bound, dtype)
        prepare = target.preparer(p, dtype) if key is not None and key not in self._calls else None
        if prepare is not None:
            prepared = prepare(seqs, params, initial, bound.sizes, bound.length, **options)
            # False: runs of more than one launch take the full path (the key says so quickly)
            self._calls.remember(key, prepared and _bound_call(p, initial, prepared, set(kwargs), layout))
            if prepared:
                return prepared(seqs, params, initial)
        return run(seqs, params, initial, bound.sizes, bound.length, **options)

    def __call__(self, *args, return_final_states: bool = False, layout=None, cu_seqlens=None, **kwargs):
        if cu_seqlens is not None:  # packed sequences: ssmc/packed.py
            return self._packed(args, kwargs, return_final_states, layout, cu_seqlens)
        outs, finals = self.run(*args, layout=layout, **kwargs)
        layout = layout or self.layout
        perms = self._output_perms.get(hashable_layout(layout))
        if perms is None:
            perms = self._output_perms[hashable_layout(layout)] = [
                (name, from_time_first(layout, name, y.axes))
                for name, y in self.program.outputs]
        ys = [_permute(outs[name], perm) for name, perm in perms]
        ys = _single(tuple(ys)) if ys else None
        if not return_final_states:
            return ys
        return ys, _single(tuple(finals[s.name] for s in self.program.states))

    def _packed(self, args, kwargs, return_final_states, layout, cu_seqlens):
        """`cu_seqlens` (packed.py): one call restarting the states at the boundaries where no initial states
        are given and no final states wanted, else a call per sequence over its time slice."""
        from . import packed

        p = self.program
        states = {s.name: kwargs.pop(s.name) for s in p.states if s.name in kwargs}
        inputs = {**dict(zip([d.name for d in p.inputs], args)), **kwargs}  # unknown names: the call's error
        missing = [d.name for d in p.seqs if d.name not in inputs]
        if missing:
            raise ValueError(f"{p.name}: missing the sequences {missing}")
        inputs = {k: x if hasattr(x, "shape") else np.asarray(x) for k, x in inputs.items()}
        states = {k: h if hasattr(h, "shape") else np.asarray(h) for k, h in states.items()}

        def run(one: dict, h0: dict) -> tuple:
            ys, finals = self(**one, **h0, layout=layout, return_final_states=True)
            ys = () if ys is None else ys if isinstance(ys, tuple) else (ys,)
            return ys, finals if isinstance(finals, tuple) else (finals,)

        reset = None if states or return_final_states else packed.reset_program(p)
        if reset is not None:  # one call that restarts the states at the boundaries (packed.py)
            layout = layout or self.layout
            cu, _ = packed.checked(p, layout, inputs, states, cu_seqlens)
            if self._reset_compiled is None:
                self._reset_compiled = Compiled(reset, self.backend, self.layout, self.dtype)
            marks = packed.reset_sequence(p, layout, cu, inputs[p.seqs[0].name])
            return self._reset_compiled(**inputs, **{packed.RESET: marks}, layout=layout)
        ys, finals = packed.call(run, p, layout or self.layout, inputs, states, cu_seqlens)
        ys = _single(ys) if ys else None
        return (ys, _single(finals)) if return_final_states else ys


def _bound_call(p: Recurrence, initial: dict, prepared, given: set[str], layout):
    """`prepared` (a backend's run worked out for one call) as a function of a call's (args, kwargs)
    alike (same `Backend.call_key`, so the same keywords `given`): binding them is matching names, the
    checks `bind_arrays` made for the first such call holding for them all. A prepared run of launches
    alone reads only the arrays' addresses (`CudaRunner.prepare`: their layouts are in the key), so the
    arrays go as given, not as time-first views (a permute costs host time); one that says
    `time_first` (stages around a chunked core, whose core permutes its operands: cuda/staged.py)
    takes the sequences time first, as binding gives them."""
    names = [d.name for d in p.inputs]
    seqs, params = [d.name for d in p.seqs], [d.name for d in p.params]
    zeros = {s.name: initial[s.name] for s in p.states if s.name not in given}  # shared, read only
    states = [s.name for s in p.states if s.name in given]
    if getattr(prepared, "time_first", False):
        perms = [(d.name, to_time_first(layout, d.name, d.axes)) for d in p.seqs]

        def call(args, kwargs):
            arrays = dict(zip(names, args))
            arrays.update(kwargs)
            # detached as binding detaches them (the core's torch ops would record a graph)
            return prepared({n: arrays[n].detach().permute(*perm) for n, perm in perms},
                            {n: arrays[n].detach() for n in params},
                            {**zeros, **{s: arrays[s].detach() for s in states}})
        return call

    def call(args, kwargs):
        arrays = dict(zip(names, args))
        arrays.update(kwargs)
        return prepared({n: arrays[n] for n in seqs}, {n: arrays[n] for n in params},
                        {**zeros, **{s: arrays[s] for s in states}})
    return call


class CompiledAttention:
    """`ssmc.attention` bound to a layout and a backend. It runs as the backend's `Backend.attention`
    says: the tiled torch path (backends/tiled_attention.py: NumPy in, NumPy out on the CPU; torch
    tensors on their device) where torch imports, else the interpreter. `path` says which."""

    def __init__(self, program: Attention, layout, backend: str = "interpreter"):
        self.program = program
        self.layout = layout
        self.backend = backend
        self.tiled = get_backend(backend).attention(program)
        self.path = "interpreter" if self.tiled is None else "torch tiled"

    def bind(self, q, k, v, layout, params):
        """(q and the params bound, k / v bound, the GQA group): `prologue.bind_attention`."""
        return bind_attention(self.program, q, k, v, layout, params)

    def __call__(self, q, k, v, *args, layout=None, return_lse=False, cu_seqlens=None, cu_seqlens_k=None,
                 **params):
        """`args`: the modifiers' params in their order after q, k, v (or by name in `params`).
        `cu_seqlens` [N+1]: N sequences packed along time in a batch of 1, each attending within itself,
        positions counted from its start; `cu_seqlens_k` the keys' offsets where they differ (packed.py)."""
        p = self.program
        layout = layout or self.layout
        params = attention_params(p, args, params)
        if cu_seqlens is not None or cu_seqlens_k is not None:
            from . import packed

            q, k, v = (x if hasattr(x, "shape") else np.asarray(x) for x in (q, k, v))
            return packed.attention_call(lambda *one: self(*one, layout=layout, return_lse=return_lse, **params),
                                         p, layout, q, k, v, cu_seqlens, cu_seqlens_k, return_lse)
        if self.tiled is not None:
            return self.tiled(q, k, v, layout, params, return_lse)
        qb, kv, _ = self.bind(q, k, v, layout, params)
        sizes = {**kv.sizes, **qb.sizes}
        out, lse = interpreter.run_attention(p, qb.arrays["q"], kv.arrays["k"], kv.arrays["v"],
                                             {d.name: qb.arrays[d.name] for d in p.inputs}, sizes)
        order = layout_of(layout, "out", p.v_axes)
        canonical = (TIME, *p.v_axes)
        out = out.transpose([canonical.index(a) for a in order])
        if not return_lse:
            return out
        lse_order = layout_of(layout, "lse", p.batch_axes)
        canonical = (TIME, *p.batch_axes)
        return out, np.require(lse.transpose([canonical.index(a) for a in lse_order]), requirements="C")


def compile(spec, backend: str | None = None, *, layout=DEFAULT_LAYOUT, dtype=None):
    """Compile a spec for a backend: "numba" (CPU, the default here) or "interpreter" (float64).

    `layout` places the time axis in sequence arrays: a template like ``"b t ..."`` (one for all)
    or a dict from input/output name to template; the default ``"t ..."`` puts time first.
    `dtype` (float32 / float64) fixes the compute type; by default it follows the inputs (float32
    when all are float32). The interpreter always computes in float64.

    A spec with complex inputs, states or outputs (``ssmc.State["b n", complex]``) is called on
    complex arrays there (complex128, or complex64 for float32 compute) and returns complex arrays
    for its complex outputs and states (complex_io.py: its program computes on real pairs).
    """
    if isinstance(spec, AttentionSpec):
        return CompiledAttention(spec.program, layout, check_backend(backend or default_backend()))
    backend = check_backend(backend or default_backend())
    signature = getattr(spec, "complex_signature", None)
    if signature is not None:
        from .complex_io import ComplexCall, ComplexCompiled

        layout = ComplexCall(signature).layout(layout)
        return ComplexCompiled(signature, Compiled(program_of(spec), backend, layout, dtype))
    return Compiled(program_of(spec), backend, layout, dtype)


def grad(spec, backend: str | None = None, *, layout=DEFAULT_LAYOUT, chunk: int | None = None, dtype=None):
    """`autograd.grad` (gradients of every input, param and initial state), and for a spec with complex
    values its `complex_io.ComplexGrad`: complex gradients of complex inputs, by torch's convention
    (for a real loss L, dL/d(re) + i dL/d(im)), from complex cotangents of complex outputs."""
    signature = getattr(spec, "complex_signature", None)
    if signature is None:
        return autograd.grad(spec, backend, layout=layout, chunk=chunk, dtype=dtype)
    from .complex_io import ComplexCall, ComplexGrad

    layout = ComplexCall(signature).layout(layout)
    return ComplexGrad(signature, autograd.grad(program_of(spec), backend, layout=layout, chunk=chunk, dtype=dtype))


def time_positions(program: Recurrence, layout) -> tuple[dict[str, int], dict[str, int]]:
    """Where the time axis sits in the call's layout: (sequence name -> its position in that
    sequence's array, output name -> its position in that output's array)."""
    seqs = {d.name: layout_of(layout, d.name, d.axes).index(TIME) for d in program.seqs}
    outs = {name: layout_of(layout, name, y.axes).index(TIME) for name, y in program.outputs}
    return seqs, outs


def state_dict_of(program: Recurrence, states, argument: str = "states") -> dict:
    """`states` (None, one array for a program of one state, a tuple in state order, or a dict by
    name) as a dict by name; a ValueError naming `argument` where it does not fit."""
    names = [s.name for s in program.states]
    if states is None:
        return {}
    if isinstance(states, dict):
        unknown = sorted(set(states) - set(names))
        if unknown:
            raise ValueError(f"{argument}: {program.name} has the states {names}, not {unknown}")
        return dict(states)
    if isinstance(states, (tuple, list)):
        if len(states) > len(names):
            raise ValueError(f"{argument}: {program.name} has {len(names)} states {names}; got {len(states)}")
        return dict(zip(names, states))
    if len(names) != 1:
        raise ValueError(f"{argument}: {program.name} has the states {names}: give a tuple or a dict")
    return {names[0]: states}


def _add_time(x, position: int):
    if hasattr(x, "unsqueeze"):  # torch
        return x.unsqueeze(position)
    return np.expand_dims(np.asarray(x), position)


class Step:
    """A recurrence's single-step form (`step`): call it on one step of each sequence (its time
    axis left out), the params, and the states; it returns (the outputs at that step, the new states).

        y_t, new = s(*inputs_t, states=None, out=None, in_place=False, **named)

    As a plain loop, for a forward-time program, with the full-sequence call's arrays:

        y[..., t, ...], h = s(x[..., t, ...], ..., params, states=h)     for t in 0..L-1

    gives the outputs `y` and final states `h` of one call over the L steps (a reverse-time program steps
    from t = L-1 down). Each sequence is given with the shape it has in the layout less its time axis
    (``x_t``: [b d] for ``x: Seq["b d"]`` under "b t ..."); params and states as the full call takes them.
    The outputs come in the layout's order less time (one array, or a tuple in spec order, None where
    the spec has none); the new states as `Compiled` returns final states (one array, or a tuple in state
    order), so they go back in as ``states=`` (None: zero initial states).

    ``out=``: arrays to write the outputs into (one array for one output, or a tuple in spec order),
    each of the output's shape in the layout's order less time and of its dtype (NumPy arrays, or torch tensors on
    the arrays' device); the call returns `out` itself in place of new arrays.
    ``in_place=True``: the new states are written into the state arrays given (every state must be given,
    as ``states=`` or by name; each of the state's own shape and dtype, no two in one memory), which come back as
    the new states: a decoder keeps one buffer a state across steps.

    On the cuda backend (`Backend.step_runner`: backends/cuda/step.py), a step whose program lowers whole to one
    kernel (every recurrence that reads no state through a recurrent product) is one launch of that kernel: it
    writes the outputs into the ``out=`` tensors and, with ``in_place=True``, the new states over the old ones
    (each thread reads its part of the state before writing it), so with both given a step allocates nothing;
    a recurrent product no persistent kernel takes (a LayerNorm LSTM) is two matrix products, then one kernel.
    Elsewhere (other backends, NumPy arrays, an LSTM's or GRU's persistent kernel, written arrays sharing memory
    with others of the call) it runs the compiled full-sequence path on a sequence of length one (time axis added,
    final states returned, time axis removed), and ``out=`` / ``in_place=True`` are written by a copy after
    that run (``dst.copy_(src)`` for torch, ``dst[...] = src`` for NumPy). Either way it takes what `Compiled`
    takes and the values equal the allocating call's.
    """

    def __init__(self, program: Recurrence, backend: str, layout, dtype=None):
        self.program = program
        self.compiled = Compiled(program, backend, layout, dtype)
        self.backend = backend
        self.layout = layout
        self._seq_time, self._out_time = time_positions(program, layout)
        # what every call reads (a decoder calls once a token: host time)
        self._names = [d.name for d in program.inputs]
        self._state_names = {s.name for s in program.states}
        self._one_state = program.states[0].name if len(program.states) == 1 else None
        # the backend's own path for a step (cuda: one kernel launch writing the arrays given), or None
        self._own = self.compiled.target.step_runner(program, layout, dtype)

    def __repr__(self) -> str:
        return f"<ssmc.Step {self.program.name} backend={self.backend}>"

    def __call__(self, *args, states=None, out=None, in_place: bool = False, **kwargs):
        p, names = self.program, self._names
        if len(args) > len(names):
            raise ValueError(f"{p.name} takes the inputs {names}; got {len(args)} positional arguments")
        given = dict(zip(names, args))
        state_names = self._state_names
        if states is not None and self._one_state is not None and hasattr(states, "shape"):
            initial = {self._one_state: states}  # the common case of `state_dict_of`
        else:
            initial = state_dict_of(p, states)
        for name in list(kwargs):
            if name in given or name in initial:
                raise ValueError(f"argument {name!r} given twice")
            if name in state_names:
                initial[name] = kwargs.pop(name)
            elif name in names:
                given[name] = kwargs.pop(name)
        missing = [n for n in names if n not in given]
        if missing:
            raise ValueError(f"{p.name} takes the inputs {names}; missing {missing}")
        if in_place:
            absent = [s.name for s in p.states if s.name not in initial]
            if absent:
                raise ValueError(f"{p.name} step: in_place=True writes the new states into the arrays given; "
                                 f"missing the states {absent}")
        if self._own is not None and not kwargs:
            done = self._own(given, initial, out, in_place)
            if done is not None:
                return done
        for name, position in self._seq_time.items():
            given[name] = _add_time(given[name], position)
        ys, finals = self.compiled(**given, **initial, **kwargs, return_final_states=True)
        positions = list(self._out_time.values())
        if isinstance(ys, tuple):
            ys = tuple(y.squeeze(pos) for y, pos in zip(ys, positions))
        elif ys is not None:
            ys = ys.squeeze(positions[0])
        if out is not None:
            if ys is None:
                raise ValueError(f"out: {p.name} has no outputs")
            ys = self.written(out, ys, [name for name, _ in p.outputs], "out")
        if in_place:
            finals = self.written(tuple(initial[s.name] for s in p.states), finals, [s.name for s in p.states],
                                  "states")
        return ys, finals

    @staticmethod
    def written(targets, values, names: list[str], argument: str):
        """`values` (one array or a tuple, as a call returns them) copied into `targets` (alike: one array
        or a tuple of as many, the same shapes), which are returned in their place; a ValueError naming
        `argument` and the array where they do not fit (checked all before any is written: their shapes and dtypes
        the results', no two of them the same memory)."""
        if values is None:
            raise ValueError(f"{argument}: the spec has no outputs to write")
        many = isinstance(values, tuple)
        got = targets if isinstance(targets, (tuple, list)) else (targets,)
        vals = values if many else (values,)
        if len(got) != len(vals) or len(names) != len(vals):
            raise ValueError(f"{argument}: {len(vals)} arrays {names} to write; got {len(got)}")
        for name, dst, src in zip(names, got, vals):
            if not hasattr(dst, "shape") or tuple(dst.shape) != tuple(src.shape):
                shape = tuple(dst.shape) if hasattr(dst, "shape") else type(dst).__name__
                raise ValueError(f"{argument}: {name!r} must be an array of shape {tuple(src.shape)}; got {shape}")
            if str(dst.dtype).replace("torch.", "") != str(src.dtype).replace("torch.", ""):
                raise ValueError(f"{argument}: {name!r} must be of dtype {src.dtype} (the result's); got {dst.dtype}")
        for i, a in enumerate(got):
            for j in range(i):
                if _overlap(a, got[j]):
                    raise ValueError(f"{argument}: {names[i]!r} and {names[j]!r} share memory; each needs its own")
        for dst, src in zip(got, vals):
            if hasattr(dst, "copy_"):  # torch: the kernel's result is on the arrays' device
                dst.copy_(src if hasattr(src, "copy_") else dst.new_tensor(np.asarray(src)))
            else:
                dst[...] = src.detach().cpu().numpy() if hasattr(src, "detach") else src
        return tuple(got) if many else got[0]


def _overlap(a, b) -> bool:
    """Whether arrays `a` and `b` (NumPy or torch) may share memory: torch's by the byte ranges their strides span
    (views of one buffer that do not meet are apart), NumPy's by `np.shares_memory`."""
    if hasattr(a, "data_ptr") and hasattr(b, "data_ptr"):
        if a.device != b.device or a.numel() == 0 or b.numel() == 0:
            return False

        def span(t):
            start = t.data_ptr()
            return start, start + (sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        (a0, a1), (b0, b1) = span(a), span(b)
        return a0 < b1 and b0 < a1
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.shares_memory(a, b)
    return a is b


def step(spec, backend: str | None = None, *, layout=DEFAULT_LAYOUT, dtype=None) -> Step:
    """The single-step form of a recurrence spec (`Step`): for decoding one step at a time.

        s = ssmc.step(hgrn.SPEC, layout="b t ...")
        y, h = s(x_t, f_t)                 # x_t, f_t: [b d], no time axis; zero initial state
        y, h = s(x_t, f_t, states=h)       # the next step
        s(x_t, f_t, states=h, out=y, in_place=True)   # the next, into y and h (`Step`: shapes)

    `layout` is the full-sequence layout (where time would sit); the arrays given leave time out.

    An attention spec gives an `attention_step.AttentionStep`, which decodes against a KV cache:

        s = ssmc.step(attention_spec, layout="b h t ...")
        cache = s.cache({"b": 2, "h": 16, "d": 128}, max_len=4096, dtype=torch.bfloat16, device="cuda")
        out_t = s(q_t, k_t, v_t, cache, *params)   # [b h d] each; appends k_t, v_t at cache.length, attends
    """
    if isinstance(spec, AttentionSpec):
        from .attention_step import AttentionStep

        return AttentionStep(spec.program, check_backend(backend or default_backend()), layout)
    backend = check_backend(backend or default_backend())
    signature = getattr(spec, "complex_signature", None)
    if signature is not None:  # complex arrays in and out (complex_io.py)
        from .complex_io import ComplexCall, ComplexStep

        layout = ComplexCall(signature).layout(layout)
        return ComplexStep(signature, Step(program_of(spec), backend, layout, dtype))
    return Step(program_of(spec), backend, layout, dtype)


frontend_spec.set_compiler(compile)  # what calling a spec runs (the front end imports no backend)
