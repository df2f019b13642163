"""One step of a recurrence on the GPU as one kernel launch (`api.Step`'s path on the cuda backend).

The full-sequence call picks its strategy for long sequences: a matrix-linear program (linear attention,
RetNet, Mamba-2) in chunks of matrix products, a product of a state-free value with a param (minGRU's
``x W``) hoisted out of the time loop as one torch matrix product. For a single step both are the wrong
trade: a chunk of one step is some thirty torch ops, and the hoisted product of one row of x is a launch
of its own. Here a step runs the whole program, lowered as one kernel (`runner_for`), at L = 1: for a
matrix-linear state ``S = a S + k v^T; o = sum_k S q`` one thread (or a few lanes) per (head, v) updates
its column of S in registers and sums its output from the new values; a product ``x W`` is a loop over the
row of x in the thread that needs its result.

    step = CudaStep(backend, program, layout, dtype)
    done = step(given, initial, out, in_place)     # None: not this path (`api.Step` takes its general one)
    ys, finals = done

The arrays the kernel writes are the caller's where given: the outputs into ``out=``, and with
``in_place=True`` the new states into the state arrays read as the initial ones (the kernel's ``init_s``
and ``final_s`` are one array; every strategy taking it loads a thread's own part of each state before the
first barrier and stores it after the last, and each thread reads only the part it stores, so a thread's
old values are read before anyone writes them). Both given: the step allocates nothing. A call like an
earlier one (same shapes, strides, dtypes, device, the same arrays given) is one key lookup, an overlap
check of the written arrays and the launch. A plan's scratch arrays (`product_form`'s products, the states
written aside) are its own: one `Step` serves one stream at a time.

A recurrence reading its states through a recurrent product (an LSTM's ``h U``) lowers whole to a thread per
batch row walking the product alone; over one step, though, the old state is an input like x. A step is then
its `product_form`: x W and h U as two matrix products (cuBLAS, into arrays of the step's own), then one kernel
of the rest (gates, norms, cell), the new states written in place. (The full call's persistent kernel loads all
of U on chip before its first step: for one step about ten times slower at decode sizes.) With
``SSMC_CUDA_STEP_PRODUCTS=1`` it is `step_program`, one kernel of a thread per [b k], each summing its own
products (a new state other threads read, h, written aside and copied over the caller's after the kernel: a
second launch, still no allocation; each thread waits for its sums' loads one by one, so it is not the
default). A product batched over an axis both factors keep (lstm_heads' ``h U`` per head: U block-diagonal) is one
batched matrix product (`torch.bmm`), as is a factor whose kept axes lie in no one dimension (lstm_heads' W
[n i g k]: batched over the heads, x read by each at batch stride 0): `matrices`. Where `product_form` does not
take a program (16-bit operands), the general path runs it: the hoisted x W, then the full call's kernels.

A product the full call hoists out of the time loop with a value per index that is no parallel index of the whole
kernel (a thread would compute many of its values, each a loop over its sum: LRU's ``B u`` over n in a thread per
batch row, where minGRU's ``x W`` [b d] is one value a thread of [b d]) makes a step its `split_form`: two kernels,
a thread per state element computing its own sums and writing its new state (in place: no other thread reads it),
then the outputs from the new states (LRU's readout ``sum_n C[d, n] h[b, n]`` in a thread of [b d]). A complex
array is read and written as its real and imaginary parts where they lie (`complex_io.ComplexStep`: views of
every other element, which `StepPlan._apart` takes as apart).

Not this path (None), where the general one runs: a program whose whole kernel is no single launch of one
kernel at L = 1 and no `split_form`; the recurrent products the persistent kernel takes (above); arrays that
are not torch tensors of a float dtype on the current device, given arrays that the kernel cannot write as they
lie (another dtype than the result's), written arrays that share memory with any other array of the call (the
general path raises its error or copies); a product whose operands are 16-bit or no matrix as they lie.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from ...ir.axes import TIME
from ...runtime.binding import layout_of, to_time_first
from ...runtime.prologue import bind_call
from . import launch
from .arrays import TORCH_DTYPES
from .devices import current_device, device_name, emulating, on_backend_device
from .options import options
from .printer import ArraySpec
from .runner import output_dtype, runner_for

_UNPLANNED = object()
MAX_STEP_PLANS = 64  # call signatures a step keeps (ever new shapes: start over)
# the strategies whose kernel is one launch that reads each state part in the thread that stores it
ONE_KERNEL = ("fused", "lanes", "rows")


class CudaStep:
    """`api.Step` on the cuda backend as one launch a step (module docstring)."""

    def __init__(self, target, program, layout, dtype=None):
        self.target = target  # the `CudaBackend`
        self.program = program
        self.layout = layout
        self.dtype = dtype
        # where time sits in each sequence's and output's array in the layout (`api.time_positions`)
        self.seq_time = {d.name: layout_of(layout, d.name, d.axes).index(TIME) for d in program.seqs}
        self.out_time = {n: layout_of(layout, n, y.axes).index(TIME) for n, y in program.outputs}
        self.state_names = tuple(s.name for s in program.states)
        self.output_names = tuple(n for n, _ in program.outputs)
        self.plans: dict = {}

    def __call__(self, given: dict, initial: dict, out, in_place: bool):
        """(outputs, new states) as `api.Step` returns them, or None where this path does not apply.
        `given`: every input by name (sequences without their time axis); `initial`: the states given."""
        key = _key(given, initial, out, in_place)
        if key is None:
            return None
        plan = self.plans.get(key, _UNPLANNED)
        if plan is _UNPLANNED:
            if len(self.plans) >= MAX_STEP_PLANS:
                self.plans.clear()
            plan = self.plans[key] = self._plan(given, initial, out, in_place)
        if plan is None:
            return None
        return plan(given, initial, out)

    def _plan(self, given: dict, initial: dict, out, in_place: bool):
        """The launch for calls like this one (`StepPlan`), or None."""
        import torch

        p = self.program
        if (in_place and set(initial) != set(self.state_names)) or (out is not None and not self.output_names):
            return None
        first = next(iter(given.values()), None)
        if first is None or (not emulating() and first.get_device() != current_device()):
            return None
        floats = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
        for x in (*given.values(), *initial.values(), *(_as_tuple(out) if out is not None else ())):
            if x.dtype not in floats or not on_backend_device(x):
                return None
        timed = {n: (x.unsqueeze(self.seq_time[n]) if n in self.seq_time else x) for n, x in given.items()}
        try:
            bound, dtype = bind_call(self.target, p, (), {**timed, **initial}, self.layout, self.dtype,
                                     read_only_zeros=True)
        except ValueError:
            return None  # the general path raises it
        seqs, params, init, opts = self.target.run_inputs(p, bound, dtype)
        # every array the kernel reads is the caller's own memory (no copy or cast made by the binding)
        for n, t in {**seqs, **params}.items():
            if t.data_ptr() != given[n].data_ptr() or t.dtype != given[n].dtype:
                return None
        for n, t in initial.items():
            if init[n].data_ptr() != t.data_ptr() or init[n].dtype != t.dtype:
                return None
        sizes = tuple(sorted(bound.sizes.items()))
        products = _reads_states_through_products(p)
        if products:  # a step program: the states read as sequences, their new values written as outputs
            if options().step_products:  # one kernel, each thread summing its own products
                form = step_program(p)
                parallel = tuple(a for st in p.states for a in st.axes)
            else:  # the products by cuBLAS, then one kernel (module docstring: not the persistent kernel)
                form, parallel = product_form(p), ()
            if form is None:
                return None
            program = form.program
            launch = one_launch(program, dtype.name, sizes, parallel)
        else:
            form, program = None, p
            launch = one_launch(p, dtype.name, sizes)
            if launch is None and split_form(p) is not None:  # a product a thread per batch row would walk
                return self._split_plan(split_form(p), given, initial, out, in_place, bound, dtype, seqs, params,
                                        init, opts)
        if launch is None:
            return None
        k, runner = launch.kernel, runner_for(program, dtype.name, map_reduce=form is None)
        wired = self._wired(out, initial, in_place, bound, dtype, seqs, params, opts)
        if wired is None:
            return None
        # per kernel array: where its pointer comes from (kind, key) and the array as the kernel sees it
        state_dtype, outs, source, made = wired
        keep, copies, shared = [], [], []
        for j, st in enumerate(p.states):
            s, t = st.name, init[st.name]
            old = ("state", s) if s in initial else ("fixed", t.data_ptr())
            keep.append(t)  # a shared zero state, read only
            shape = tuple(bound.sizes[a] for a in st.axes)
            if form is None:
                source[f"init_{s}"] = old, t
                read, written = f"init_{s}", f"final_{s}"
                lead = ()
            else:
                source[s] = old, t.unsqueeze(0)
                for alias in form.aliases[j]:  # the state read at renamed axes: the same memory
                    source[alias] = old, t.unsqueeze(0)
                read, written = s, f"out_{form.next_names[j]}"
                lead = (0,)
            if in_place and (form is None or not form.aliases[j]):
                source[written] = old, source[read][1]
                shared += [read, written]
            elif in_place:  # other threads read the old values: written aside, then copied over
                scratch = torch.empty(shape, dtype=state_dtype, device=t.device)
                keep.append(scratch)
                copies.append((scratch, s))
                source[written] = ("fixed", scratch.data_ptr()), scratch.unsqueeze(0)
            else:
                made[f"final_{s}"] = (shape, state_dtype)
                meta = torch.empty(shape, dtype=state_dtype, device="meta")
                source[written] = ("made", f"final_{s}"), meta.unsqueeze(0) if lead else meta
        matmuls = []  # the products the kernel reads (`product_form`), computed before it
        alias_state = {a: st.name for st, names in zip(p.states, step_program(p).aliases) for a in names} \
            if products else {}
        for q in getattr(form, "products", ()):
            operands = []
            for name in (q.a, q.b):
                state = alias_state.get(name, name if name in self.state_names else None)
                if state is not None:  # the old state (read at renamed axes: the same memory)
                    t = init[state]
                    where = ("state", state) if state in initial else ("fixed", t.data_ptr())
                else:  # a sequence (its step, time dropped) or a param
                    t = seqs[name][0] if name in seqs else params[name]
                    where = ("given", name)
                if t.dtype != state_dtype:
                    return None  # 16-bit operands: the general path's products
                operands.append((where, t))
            mats = matrices(q, operands[0][1], operands[1][1], bound.sizes)
            if mats is None:
                return None  # not matrices as they lie: the general path
            batch, rows, cols, a_mat, b_mat = mats
            shape = (a_mat[0][0], a_mat[0][1], b_mat[0][2])
            if not batch:  # one matrix product
                a_mat, b_mat, shape = (a_mat[0][1:], a_mat[1][1:]), (b_mat[0][1:], b_mat[1][1:]), shape[1:]
            scratch = torch.empty(shape, dtype=state_dtype, device=first.device)
            keep.append(scratch)
            matmuls.append(((operands[0][0], *a_mat), (operands[1][0], *b_mat), scratch))
            order = [*batch, *rows, *cols]
            laid = scratch.view(*[bound.sizes[a] for a in order])
            source[q.name] = ("fixed", scratch.data_ptr()), laid.permute(*[order.index(a) for a in q.axes]).unsqueeze(0)
        for a in k.arrays:
            if a.name not in source or a.role not in ("seq", "param", "init", "final", "out"):
                return None
        specs = {a.name: ArraySpec(TORCH_DTYPES[str(source[a.name][1].dtype)],
                                   tuple(source[a.name][1].stride()) or (1,)) for a in k.arrays}
        text = runner.source_for(k, specs, bound.sizes, launch.mapping, 1, launch.strategy)
        if shared:
            text = aliased(text, k.name, [a.name for a in k.arrays], shared)
        function = runner.function(text, k.name)
        reads, writes = _reads_writes(given, initial, outs, in_place)
        return StepPlan([(function, launch.grid, [source[a.name][0] for a in k.arrays])], made, self.output_names,
                        self.state_names, in_place, reads, writes, launch.strategy, keep, copies, matmuls)

    def _wired(self, out, initial: dict, in_place: bool, bound, dtype, seqs: dict, params: dict, opts: dict):
        """What `_plan` and `_split_plan` wire alike: (the new states' dtype, the ``out=`` arrays or None, per kernel
        array of an input or an output where its pointer comes from (kind, key) and the array as the kernel sees
        it, the outputs the step allocates {name: (shape, dtype)}), or None where the arrays given do not fit (an
        ``out=`` of another count, shape or dtype; in place, a state given in another dtype)."""
        import torch

        state_dtype = torch.float64 if dtype.name == "float64" else torch.float32
        outs = _as_tuple(out) if out is not None else None
        if (outs is not None and len(outs) != len(self.output_names)) or \
                (in_place and any(initial[s].dtype != state_dtype for s in self.state_names)):
            return None
        source, made = {}, {}
        for n, t in {**seqs, **params}.items():
            source[n] = ("given", n), t
        for i, name in enumerate(self.output_names):
            y = self.program.outputs[i][1]
            wanted = output_dtype(opts["out_dtype"], name) or state_dtype
            shape = _layout_shape(self.layout, name, y.axes, bound.sizes, self.out_time[name])
            if outs is not None:
                o, where = outs[i], ("out", i)
                if tuple(o.shape) != shape or o.dtype != wanted:
                    return None
            else:
                made[f"out_{name}"] = (shape, wanted)  # (a meta array laid out as the step allocates it)
                o, where = torch.empty(shape, dtype=wanted, device="meta"), ("made", f"out_{name}")
            source[f"out_{name}"] = where, o.unsqueeze(self.out_time[name]).permute(
                *to_time_first(self.layout, name, y.axes))
        return state_dtype, outs, source, made

    def _split_plan(self, split, given, initial, out, in_place, bound, dtype, seqs, params, init, opts):
        """`_plan` of a `split_form`: its states kernel, then its outputs kernel (each one launch), or None."""
        import torch

        p = self.program
        sizes = tuple(sorted(bound.sizes.items()))
        state_axes = tuple(dict.fromkeys(a for st in p.states for a in st.axes))
        launches = (one_launch(split.states, dtype.name, sizes, state_axes), one_launch(split.outputs, dtype.name,
                                                                                         sizes, ()))
        if None in launches or any(set(st.axes) != set(launches[0].kernel.parallel) for st in p.states):
            return None  # a thread per state element, each writing its own (in place: no other reads it)
        wired = self._wired(out, initial, in_place, bound, dtype, seqs, params, opts)
        if wired is None:
            return None
        state_dtype, outs, as_is, made = wired
        # per kernel array: (where its pointer comes from, the array, its axes: None where it lies as the kernel
        # reads it), laid to the kernel's axes below
        source, keep = {n: (where, t, None) for n, (where, t) in as_is.items()}, []
        for st, new in zip(p.states, split.next_names):
            s, t = st.name, init[st.name]
            old = ("state", s) if s in initial else ("fixed", t.data_ptr())
            keep.append(t)  # a shared zero state, read only
            source[s] = old, t.unsqueeze(0), (TIME, *st.axes)
            if in_place:
                source[f"out_{new}"] = source[s]
            else:
                shape = tuple(bound.sizes[a] for a in st.axes)
                made[f"final_{s}"] = (shape, state_dtype)
                meta = torch.empty(shape, dtype=state_dtype, device="meta")
                source[f"out_{new}"] = ("made", f"final_{s}"), meta.unsqueeze(0), (TIME, *st.axes)
            source[new] = source[f"out_{new}"]  # the outputs kernel reads the new state its first kernel wrote
        kernels = []
        for program, planned in zip((split.states, split.outputs), launches):
            k, runner = planned.kernel, runner_for(program, dtype.name, map_reduce=False)
            laid = {}
            for a in k.arrays:
                if a.name not in source or a.role not in ("seq", "param", "out"):
                    return None
                _, t, axes = source[a.name]
                laid[a.name] = t if axes is None else t.permute(*[axes.index(x) for x in a.axes])
            specs = {n: ArraySpec(TORCH_DTYPES[str(t.dtype)], tuple(t.stride()) or (1,)) for n, t in laid.items()}
            text = runner.source_for(k, specs, bound.sizes, planned.mapping, 1, planned.strategy)
            shared = [n for st, new in zip(p.states, split.next_names) for n in (st.name, f"out_{new}")
                      if in_place and n in laid]
            if shared:
                text = aliased(text, k.name, [a.name for a in k.arrays], shared)
            kernels.append((runner.function(text, k.name), planned.grid, [source[a.name][0] for a in k.arrays]))
        reads, writes = _reads_writes(given, initial, outs, in_place)
        return StepPlan(kernels, made, self.output_names, self.state_names, in_place, reads, writes,
                        launches[0].strategy, keep, [], [])


class StepPlan:
    """One call signature's launches: its products (cuBLAS), then each kernel (one; a `split_form`'s two) with its
    grid and per kernel array where its pointer comes from (an input given, a state given, a shared zero state or
    scratch array of its own, an array the step allocates, an ``out=`` array)."""

    def __init__(self, kernels: list, made, output_names, state_names, in_place, reads, writes,
                 strategy: str, keep: list, copies: list, matmuls: list):
        self.kernels, self.made = kernels, made  # (function, grid, items) per kernel, launched in order
        # products before the kernel: ((kind, key) of a, its 2-d or 3-d (batched) shape, strides), the same of b,
        # the result
        self.matmuls = matmuls
        self.keep = keep      # arrays of its own it launches on (shared zero states, scratch new states)
        self.copies = copies  # (scratch, state): a new state written aside, copied over the caller's after
        self.strategy = strategy  # the strategy whose kernel it launches ("fused", "lanes", "rows")
        self.device = current_device()  # where its function is loaded, and its arrays are (the key's devices)
        self.output_names, self.state_names, self.in_place = output_names, state_names, in_place
        # (kind, name or index, bytes spanned) of the arrays read, and of the caller's arrays written
        self.reads, self.writes = reads, writes

    def __call__(self, given: dict, initial: dict, out):
        outs = _as_tuple(out) if out is not None else ()
        if current_device() != self.device or not self._apart(given, initial, outs):
            return None  # another device current than the arrays' (the general path switches), or overlaps
        if self.made:
            import torch

            device = device_name()
            made = {n: torch.empty(shape, dtype=dtype, device=device) for n, (shape, dtype) in self.made.items()}
        else:
            made = {}
        launches = []
        for function, grid, items in self.kernels:
            pointers = []
            for kind, key in items:
                if kind == "given":
                    pointers.append(given[key].data_ptr())
                elif kind == "state":
                    pointers.append(initial[key].data_ptr())
                elif kind == "fixed":
                    pointers.append(key)
                elif kind == "made":
                    pointers.append(made[key].data_ptr())
                else:
                    pointers.append(outs[key].data_ptr())
            launches.append((function, grid, pointers))
        if self.matmuls:
            import torch

            where = {"given": given, "state": initial}
            for (ka, sa, ta), (kb, sb, tb), result in self.matmuls:
                a = where[ka[0]][ka[1]].as_strided(sa, ta) if ka[0] != "fixed" else self._fixed(ka[1], sa, ta)
                b = where[kb[0]][kb[1]].as_strided(sb, tb) if kb[0] != "fixed" else self._fixed(kb[1], sb, tb)
                (torch.bmm if result.dim() == 3 else torch.mm)(a, b, out=result)
        for function, grid, pointers in launches:
            launch.launch_kernel(function, grid, 1, 1, pointers)
        for scratch, s in self.copies:
            initial[s].copy_(scratch)
        if out is not None:
            ys = tuple(out) if isinstance(out, list) else out  # as `api.Step.written` returns them
        elif self.output_names:
            ys = tuple(made[f"out_{n}"] for n in self.output_names)
            ys = ys[0] if len(ys) == 1 else ys
        else:
            ys = None
        finals = tuple(initial[s] if self.in_place else made[f"final_{s}"] for s in self.state_names)
        return ys, finals[0] if len(finals) == 1 else finals

    def _fixed(self, pointer: int, size, stride):
        """A matrix view of the array of its own at `pointer` (a shared zero state)."""
        return next(t for t in self.keep if t.data_ptr() == pointer).as_strided(size, stride)

    def _apart(self, given: dict, initial: dict, outs: tuple) -> bool:
        """Whether every array of the caller's the kernel writes (the outputs given, the states written in
        place) shares no memory with any other array of the call (a state written in place is read as
        itself)."""
        if not self.writes:
            return True
        where = {"given": given, "state": initial, "out": outs}
        spans = [(kind, key, where[kind][key].data_ptr(), e) for kind, key, e in (*self.reads, *self.writes)]
        for kind, key, (n, step, size) in self.writes:
            w0 = where[kind][key].data_ptr()
            for other, okey, a0, (an, astep, asize) in spans:
                if (other, okey) != (kind, key) and n and an and w0 < a0 + an and a0 < w0 + n:
                    # within one span, apart where every element of each lies between two of the other's (a
                    # complex array's real and imaginary parts: `_extents`)
                    g = math.gcd(step, astep)
                    if not g or not asize <= (w0 - a0) % g <= g - size:
                        return False
        return True


def _extents(arrays: dict) -> dict:
    """Per array, (the bytes its elements span from its first (0 for an empty one), the greatest common divisor
    of its strides in bytes (0 for one element): its elements start a multiple of it apart, its element's
    bytes)."""
    out = {}
    for n, t in arrays.items():
        size = t.element_size()
        span = 0 if t.numel() == 0 else (sum((d - 1) * abs(st) for d, st in zip(t.shape, t.stride())) + 1) * size
        out[n] = span, math.gcd(*(abs(st) * size for d, st in zip(t.shape, t.stride()) if d > 1)), size
    return out


def _reads_writes(given: dict, initial: dict, outs, in_place: bool) -> tuple[list, list]:
    """(the arrays a step reads, the caller's arrays it writes) as `StepPlan` checks them: (kind, name or index,
    `_extents`)."""
    reads = [("given", n, e) for n, e in _extents(given).items()]
    reads += [("state", n, e) for n, e in _extents(initial).items()]
    writes = [("out", i, e) for i, e in _extents(dict(enumerate(outs or ()))).items()]
    if in_place:
        writes += [r for r in reads if r[0] == "state"]
    return reads, writes


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _layout_shape(layout, name: str, axes: tuple[str, ...], sizes: dict[str, int], time_at: int) -> tuple:
    """The shape of output `name` in the layout's order less time."""
    order = list(layout_of(layout, name, axes))
    del order[time_at]
    return tuple(sizes[a] for a in order)


def _key(given: dict, initial: dict, out, in_place: bool):
    """What a plan depends on besides the arrays' addresses, or None where an argument is no torch tensor
    (a tensor of another dtype or device gets a key; its plan is None: `CudaStep._plan`)."""
    tensor = _TORCH.get("Tensor")
    if tensor is None:
        import torch

        tensor = _TORCH["Tensor"] = torch.Tensor
    parts = [in_place]
    for part in (given, initial):
        for n, x in part.items():
            if not isinstance(x, tensor):
                return None
            parts.append((n, x.shape, x.stride(), x.dtype, x.device))
    if out is not None:
        for x in _as_tuple(out):
            if not isinstance(x, tensor):
                return None
            parts.append((x.shape, x.stride(), x.dtype, x.device))
        parts.append(isinstance(out, (tuple, list)))
    return (*parts, *options().key)


_TORCH: dict = {}  # torch.Tensor, once torch is imported (this module imports it only where a step runs)


def one_launch(program, compute: str, sizes: tuple, parallel: tuple | None = None):
    """The one launch of `program` lowered whole at these sizes (``((axis, size), ...)``) for one step,
    where a step runs so (module docstring), else None; worked out once per setting of the overrides.
    `parallel`: `program` is a `step_program`, lowered as one kernel of all its roots, whose thread
    indices must include these axes (its states': a thread then writes its own new state values)."""
    return _one_launch(program, compute, sizes, parallel, options().key)


@lru_cache(maxsize=256)
def _one_launch(program, compute: str, sizes: tuple, parallel: tuple | None, overrides: tuple):
    from .hoisted import hoisted_runner

    runner = runner_for(program, compute, map_reduce=parallel is None)
    low = runner.lowered
    if low.strategy != "fused" or len(low.kernels) != 1 or low.core_states or low.accumulators:
        return None
    kernel = low.kernels[0]
    if parallel is not None:
        if not set(parallel) <= set(kernel.parallel):
            return None  # a thread per batch row walking whole rows (a norm over the hidden axis)
    else:
        hoisted = hoisted_runner(program, compute)
        for _, node in (*hoisted.hoisted.pre, *hoisted.hoisted.post_outputs,
                        *hoisted.hoisted.post_accumulators) if hoisted is not None else ():
            if not set(node.axes) - {TIME} <= set(kernel.parallel):
                return None  # a thread would compute many of the product's values, each a loop over its sum
    launches = runner.launches(dict(sizes), 1, False)
    if len(launches) != 1:
        return None
    launch = launches[0]
    if launch.kernel is not kernel or launch.nblk != 1 or launch.strategy not in ONE_KERNEL:
        return None
    if launch.mapping.groups > 1 and not launch.mapping.row:
        return None  # split-K partials, summed by torch after
    return launch


@lru_cache(maxsize=256)
def _reads_states_through_products(program) -> bool:
    """`backend.sequential_recompute` (the step loop takes what is left after hoisting), asked here: the backend
    module imports this one."""
    from ...lowering.hoist import hoist
    from .kernels.step_loop import applies

    return applies(hoist(program, transpose=False).program) is not None


@dataclass(frozen=True)
class StepProgram:
    """A recurrence's single step as a program without states (`step_program`)."""

    program: object                        # the states as sequences (their names), new values as outputs
    next_names: tuple[str, ...]            # per state, the output of its new value
    aliases: tuple[tuple[str, ...], ...]   # per state, the sequences that read it at renamed axes


@lru_cache(maxsize=64)
def step_program(program) -> StepProgram | None:
    """`program`'s single step with its states read as sequences, for a recurrent product (an LSTM's
    ``sum_j h[b, j] U[j, g, k]``): over one step the old state is an input like x, so the product is a sum
    each thread of [b k] computes itself. Each read of a state at renamed axes (``h.rename(k="j")``) becomes a
    sequence of its own (the same memory, other axis names), so that the state's axes stay the kernel's
    thread indices; the new states are outputs after the program's own."""
    from ...ir.node import Node
    from ...ir.ops import Op
    from ...ir.program import Decl, Recurrence, Role

    states = {st.name for st in program.states}
    taken = {d.name for d in program.decls} | {n for n, _ in program.outputs}

    def fresh(name: str) -> str:
        while name in taken:
            name += "_"
        taken.add(name)
        return name

    aliases: dict[str, list[tuple[str, tuple[str, ...]]]] = {s: [] for s in states}
    memo: dict = {}

    def sub(node):
        if node in memo:
            return memo[node]
        x = node.args[0] if node.args else None
        if node.op is Op.RENAME and x.op is Op.INPUT and x.arg in states:
            name = fresh(f"{x.arg}_{'_'.join(node.axes)}")
            aliases[x.arg].append((name, node.axes))
            new = Node.make(Op.INPUT, (), name, node.axes)
        else:
            args = tuple(sub(a) for a in node.args)
            new = node if args == node.args else Node.make(node.op, args, node.arg, node.axes if node.op in
                                                           (Op.INPUT, Op.CONST, Op.IOTA, Op.SIZE) else None)
        memo[node] = new
        return new

    outputs = [(n, sub(y)) for n, y in program.outputs]
    next_names = tuple(fresh(f"next_{st.name}") for st in program.states)
    outputs += [(n, sub(u)) for n, u in zip(next_names, program.updates)]
    decls = [Decl(d.name, Role.SEQ, d.axes, d.loc) if d.role is Role.STATE else d for d in program.decls]
    decls += [Decl(n, Role.SEQ, axes) for s in aliases for n, axes in aliases[s]]
    step = Recurrence(f"{program.name}_step", tuple(decls), (), tuple(outputs), program.sizes, program.reverse,
                      program.loc, program.doc)
    return StepProgram(step, next_names, tuple(tuple(n for n, _ in aliases[st.name]) for st in program.states))


@dataclass(frozen=True)
class SplitForm:
    """A recurrence's single step as two programs without states (`split_form`)."""

    states: object                         # the states as sequences; outputs: their new values (`next_names`)
    outputs: object                        # the new values as sequences (`next_names`); outputs: the program's
    next_names: tuple[str, ...]


@lru_cache(maxsize=64)
def split_form(program) -> SplitForm | None:
    """`program`'s `step_program` as two kernels: the new states (a thread per state element, summing its own
    hoisted products: LRU's ``sum_d B[n, d] x[b, d]`` in the thread of [b n]), then the outputs from them (LRU's
    readout ``sum_n C[d, n] h[b, n]`` in a thread of [b d]). For a program whose one kernel is a thread per
    batch row walking such a product for every n (the full call hoists it as a matrix product). None where a
    new state reads a state other than at its own element (renamed, or summed over one of its axes: written
    in place, it would read what another thread wrote), a new state is another state's old value as it is
    (read where it is stored, after the other's store), or an output reads an old state."""
    from ...ir.node import Node, toposort
    from ...ir.ops import REDUCTIONS, Op
    from ...ir.program import Decl, Recurrence, Role

    form = step_program(program)
    if form is None or any(form.aliases) or not program.outputs:
        return None
    p = form.program
    outs = dict(p.outputs)
    updates = tuple(outs[n] for n in form.next_names)
    states = {st.name for st in program.states}
    for node in toposort(updates):
        if node.op in REDUCTIONS and any(n.op is Op.INPUT and n.arg in states and node.arg in n.axes
                                         for n in toposort(node.args)):
            return None
    for st, u in zip(program.states, updates):
        while u.op is Op.EXPAND:
            u = u.args[0]
        if u.op is Op.INPUT and u.arg in states and u.arg != st.name:
            # a new state that is another's old one as it is (a shift register of a state, ``h.shift(1)``): the
            # kernel loads it where it stores it, after the other's new value was stored over it in place
            return None
    new_of = dict(zip(updates, form.next_names))
    memo: dict = {}

    def sub(node):  # the outputs reading the new states where they read the updates' values
        if node in new_of:
            return Node.make(Op.INPUT, (), new_of[node], node.axes)
        if node not in memo:
            args = tuple(sub(a) for a in node.args)
            memo[node] = node if args == node.args else Node.make(node.op, args, node.arg)
        return memo[node]

    outputs = tuple((n, sub(outs[n])) for n, _ in program.outputs)
    if any(n.op is Op.INPUT and n.arg in states for n in toposort(tuple(y for _, y in outputs))):
        return None  # an output reads an old state: written in place by the first kernel, it is gone
    parts = []
    for name, returned, extra in ((f"{p.name}_states", tuple(zip(form.next_names, updates)), ()),
                                  (f"{p.name}_outputs", outputs,
                                   tuple(Decl(n, Role.SEQ, u.axes) for n, u in zip(form.next_names, updates)))):
        read = {n.arg for n in toposort(tuple(y for _, y in returned)) if n.op is Op.INPUT}
        decls = tuple(d for d in (*p.decls, *extra) if d.name in read)
        parts.append(Recurrence(name, decls, (), returned, p.sizes, p.reverse, p.loc, p.doc))
    return SplitForm(parts[0], parts[1], form.next_names)


@dataclass(frozen=True)
class Product:
    """A sum over one axis of the product of two inputs (``sum_i x[b, i] W[i, g, k]``), computed before the
    kernel as one matrix product [rows, summed] x [summed, cols], or a batch of them (`matrices`), into a
    sequence of the kernel's."""

    name: str                    # the sequence the kernel reads it as, axes `axes`
    axes: tuple[str, ...]
    a: str                       # the two inputs (a step program's names) and their axes
    a_axes: tuple[str, ...]
    b: str
    b_axes: tuple[str, ...]
    summed: str


@dataclass(frozen=True)
class ProductForm:
    """A `step_program` with its products of two inputs taken out (`product_form`)."""

    program: object                        # the step program reading each product as a sequence
    next_names: tuple[str, ...]
    aliases: tuple[tuple[str, ...], ...]   # per state, the renamed reads the kernel still makes
    products: tuple[Product, ...]


@lru_cache(maxsize=64)
def product_form(program) -> ProductForm | None:
    """`program`'s `step_program` with every sum over one axis of the product of two inputs (an LSTM's x W
    and h U: over one step the old state is an input) read as a sequence the step computes before its kernel
    as a matrix product (cuBLAS), the kernel left the rest: its gates, norms and cell, element by element or
    by row; a product whose factors share an axis they keep (lstm_heads' ``sum_j h[b, n, j] U[n, j, g, k]``, per
    head n) is a batch of matrix products (`matrices`). None where it has no such product."""
    from ...ir.node import Node, toposort
    from ...ir.ops import Op
    from ...ir.program import Decl, Recurrence, Role

    form = step_program(program)
    if form is None:
        return None
    p = form.program
    taken = {d.name for d in p.decls} | {n for n, _ in p.outputs}
    products, memo = [], {}

    def sub(node):
        if node in memo:
            return memo[node]
        x = node.args[0] if node.args else None
        if node.op is Op.SUM and x.op is Op.MUL and len(x.args) == 2 and all(a.op is Op.INPUT for a in x.args):
            a, b = x.args
            if node.arg in a.axes and node.arg in b.axes:
                name = f"product{len(products)}"
                while name in taken:
                    name += "_"
                taken.add(name)
                products.append(Product(name, node.axes, a.arg, a.axes, b.arg, b.axes, node.arg))
                memo[node] = Node.make(Op.INPUT, (), name, node.axes)
                return memo[node]
        args = tuple(sub(a) for a in node.args)
        new = node if args == node.args else Node.make(node.op, args, node.arg)
        memo[node] = new
        return new

    outputs = tuple((n, sub(y)) for n, y in p.outputs)
    if not products:
        return None
    read = {n.arg for n in toposort(tuple(y for _, y in outputs)) if n.op is Op.INPUT}
    decls = [d for d in p.decls if d.name in read] + [Decl(q.name, Role.SEQ, q.axes) for q in products]
    step = Recurrence(p.name, tuple(decls), (), outputs, p.sizes, p.reverse, p.loc, p.doc)
    aliases = tuple(tuple(a for a in names if a in read) for names in form.aliases)
    return ProductForm(step, form.next_names, aliases, tuple(products))


def matrices(q: Product, a, b, sizes: dict):
    """Product `q` of the tensors `a` (axes ``q.a_axes``) and `b` (``q.b_axes``) as they lie, as one matrix
    product or a batch of them (cuBLAS: `torch.mm` / `torch.bmm` into the step's own array):

        out[p, r, c] = sum_s A[p, r, s] B[p, s, c]      p: the batch axes, r: a's other axes, c: b's

    The batch axes are the axes both factors keep (lstm_heads' heads n in ``sum_j h[b, n, j] U[n, j, g, k]``),
    and where a factor's kept axes merge into no one dimension as it lies, one of them besides (W [n i g k] of
    ``sum_i x[b, i] W[n, i, g, k]``: batched over n, x read by every head at batch stride 0). Returns
    (batch axes, row axes, column axes, (A's shape, strides), (B's shape, strides)), each 3-d, or None."""
    rows = [x for x in q.a_axes if x != q.summed and x not in q.b_axes]
    cols = [x for x in q.b_axes if x != q.summed and x not in q.a_axes]
    shared = [x for x in q.a_axes if x != q.summed and x in q.b_axes]
    for extra in (None, *rows, *cols):
        batch = [*shared, extra] if extra is not None else shared
        r, c = [x for x in rows if x != extra], [x for x in cols if x != extra]
        a_mat = _merged(a, q.a_axes, (batch, r, [q.summed]), sizes)
        b_mat = _merged(b, q.b_axes, (batch, [q.summed], c), sizes)
        if a_mat is not None and b_mat is not None:
            return batch, r, c, a_mat, b_mat
    return None


def _merged(t, axes: tuple, groups: tuple, sizes: dict):
    """(shape, strides) of `t` (axes `axes`) viewed with each group of axes one dimension (an axis `t` lacks: at
    stride 0), or None where a group's axes do not lie one inside the other. A matrix dimension of size 1 gets
    the stride cuBLAS takes without a copy (any stride addresses its one element)."""
    shape, strides = [], []
    for group in groups:
        size, stride = 1, None
        for x in reversed(group):  # innermost first: each axis must step over the whole of the ones inside it
            n = sizes[x]
            st = t.stride(axes.index(x)) if x in axes else 0
            if n != 1:
                if stride is not None and st != stride * size:
                    return None
                stride = st if stride is None else stride
                size *= n
        shape.append(size)
        strides.append(0 if stride is None else stride)
    if shape[1] == 1:  # rows of one element: row-major (or column-major where the columns already are)
        strides[1] = shape[2] if strides[2] == 1 or shape[2] == 1 else 1
    if shape[2] == 1:
        strides[2] = shape[1] if strides[1] == 1 and shape[1] != 1 else 1
    return tuple(shape), tuple(strides)


_SIGNATURE = r'(extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?{name}\()([^)]*)(\))'


def aliased(source: str, name: str, arrays: list[str], shared: list[str]) -> str:
    """`source` with kernel `name`'s parameters for the arrays `shared` (of its `arrays`, in order) not
    ``__restrict__``: a state's ``init_s`` and ``final_s`` are then one array (its in-place step), which a
    restrict pointer would let the compiler assume apart."""
    pattern = re.compile(_SIGNATURE.format(name=re.escape(name)))

    def plain(match):
        params = match.group(2).split(",")
        lead = len(params) - len(arrays)  # (int L, int nblk, arrays...)
        for i, a in enumerate(arrays):
            if a in shared:
                params[lead + i] = params[lead + i].replace(" __restrict__", "")
        return match.group(1) + ",".join(params) + match.group(3)

    out, count = pattern.subn(plain, source, count=1)
    if count != 1:
        raise ValueError(f"no kernel {name} in the step's source")
    return out
