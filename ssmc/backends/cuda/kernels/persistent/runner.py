"""The persistent kernel (a forward, or an adjoint: reverse time, the operand dz) as a runner (the
runner contract of `StepLoop.run`), with the step loop as its fallback for every shape, dtype or
device it does not take.

    loop = persistent_loop(program, compute, StepLoop(program, compute))   # in step_loop.step_loop
    outs, finals = loop.run(seqs, params, initial, sizes, length, out_dtype)

A call converts its arrays to contiguous fp32 (in the tensor-core form, 16-bit sequences are read as
they are), allocates the outputs (fp32; in the tensor-core form the values only the post products read,
an adjoint's dz, and the recorded product h U in 16 bits: `half_outputs`), the exchange buffer
xo [2][rows][xcols] (the operand of a step by its parity; split, also the fp32 partial products
pb [2][ksplit][rows][units]; streamed, the blocks' U slices ug) and zeroed barrier words, and makes one
cooperative launch (`cuLaunchCooperativeKernel`: the driver refuses a grid that cannot be co-resident
rather than letting its barrier deadlock). Emulated (SSMC_CUDA_EMULATE=1) it launches one block.
A barrier that waits past its limit flags the barrier words and goes on (no hang); the runner copies
them to the host behind the launch and raises `BarrierTimeout` at its next call (no call syncs).
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import replace

from ...options import emulating, options
from ...runner import batch_outer
from . import analysis, forward
from .analysis import Cell, analyse, plan
from .forward import kernel_name, kernel_source

TIME = "~t"  # the time axis among an output's axes while allocating it
# emulated (SSMC_CUDA_EMULATE=1): the blocks a launch takes (None: one, or a block a head). The emulator runs a
# launch's blocks one after another, without grid barriers between them; with more than one, a call runs step
# by step, each step launched until every exchange among the blocks is complete (`_emulate_steps`): the tests'
# way to check the split of the units over blocks at any length
EMULATED_BLOCKS: int | None = None


class BarrierTimeout(RuntimeError):
    """A persistent kernel's grid barrier waited past its limit: the launch went on with wrong values."""


class PersistentLoop:
    """Runs `cell`'s program as one persistent kernel a call where its shape fits (`analysis.plan`),
    else as `fallback` (the StepLoop). `refusals`: sizes key -> why a shape ran as the fallback."""

    def __init__(self, program, compute: str, fallback, cell: Cell):
        self.program, self.compute, self.fallback, self.cell = program, compute, fallback, cell
        self.refusals: dict[tuple, str] = {}
        self._plans: dict[tuple, object] = {}
        self._sources: dict[tuple, str] = {}   # `_launch`'s kernel source by everything that prints it
        self._functions: dict[tuple, object] = {}
        self._last_bar = None
        self._phase_at = None  # where the last launch keeps its clocks by phase in its barrier words (`phases`)
        self._pending = None  # (event or None, host copy of the barrier words) of the last launch, unread

    @property
    def describe(self) -> str:
        return (f"{self.fallback.describe}; where the shape fits, one persistent kernel a call "
                f"({self.cell.describe()}: U resident in shared memory, or streamed from L2 each step where it "
                "does not fit, a grid barrier a step"
                f"{' and one a level of reductions' if self.cell.reductions else ''}; "
                "SSMC_CUDA_PERSISTENT=0: the loop)")

    def plan_for(self, sizes: dict[str, int], half: bool = False):
        """The `analysis.Plan` of `sizes` for the current options (one block where emulated), or a refusal;
        `half`: the tensor-core form (16-bit U and operand on chip); else, fp32 inputs, its fp32 form
        (`Plan.tf32`: 3xTF32, or TF32 where allowed: `tf32_passes`) unless SSMC_CUDA_PERSISTENT_MMA=0;
        either falling back to the FMA form (fp32 U and operand) where that does not fit, and then, U on chip not
        fitting in either, to the tensor-core form with U streamed from L2 each step (`Plan.streamed`);
        SSMC_CUDA_PERSISTENT=streamed: the streamed form only. A refusal names each form's reason."""
        emulate = emulating()
        sm, cap = options().sm_count, options().persistent_blocks
        passes = 0 if half else tf32_passes()
        opts = options()
        ring = (opts.persistent_forward_chunk, opts.persistent_forward_stages)
        deep_ring = (opts.persistent_adjoint_chunk, opts.persistent_adjoint_stages)
        forced = opts.persistent == "streamed"
        key = (tuple(sorted(sizes.items())), emulate, sm, half, passes, cap, ring, deep_ring, forced,
               analysis.MIN_BLOCK_PAIRS,
               analysis.SPLIT_BYTES, analysis.SPLITS, analysis.SPLIT_ACCUMULATORS,
               analysis.DEEP_STAGES, EMULATED_BLOCKS)  # (tests, bench/ change them)
        if key not in self._plans:
            # emulated: a block a head (the blocks run one after another: no grid barrier between them)
            blocks = (EMULATED_BLOCKS or math.prod(sizes[a] for a in self.cell.heads)) if emulate else None
            tensor_cores = bool(half or passes)

            def streamed():
                if not tensor_cores:
                    return "the streamed form needs the tensor-core form (SSMC_CUDA_PERSISTENT_MMA=0)"
                return plan(self.cell, sizes, sm, blocks=blocks, mma=True, max_blocks=cap, tf32=passes, ring=ring,
                            deep_ring=deep_ring, streamed=True)

            if forced:
                chosen = streamed()
                chosen = (f"streamed (SSMC_CUDA_PERSISTENT=streamed): {chosen}" if isinstance(chosen, str)
                          else replace(chosen, reason="streamed as SSMC_CUDA_PERSISTENT=streamed asks"))
            else:
                chosen = (plan(self.cell, sizes, sm, blocks=blocks, mma=True, max_blocks=cap, tf32=passes, ring=ring,
                               deep_ring=deep_ring)
                          if tensor_cores else None)
                if chosen is None or isinstance(chosen, str):
                    resident = chosen
                    chosen = plan(self.cell, sizes, sm, blocks=blocks, max_blocks=cap)
                    if isinstance(chosen, str):  # U fits on chip in no form: streamed from L2 each step
                        second = streamed()
                        why = [f"tensor cores, U resident: {resident}"] if resident else []
                        chosen = (replace(second, reason=f"streamed: U fits on chip in no form ({resident or chosen})")
                                  if not isinstance(second, str)
                                  else "; ".join([*why, f"FMA form: {chosen}", f"streamed: {second}"]))
            self._plans[key] = chosen
        return self._plans[key]

    def half_dtype(self, params):
        """The 16-bit dtype of the recurrent weight as given (bfloat16 / float16: the tensor-core form), or
        that of the call's inputs where a gradient's path cast them to fp32 (runtime/precision.py), or None
        (the fp32 form)."""
        import torch

        from .....runtime.precision import half_inputs

        w = params.get(self.cell.weight)
        return w.dtype if w is not None and w.dtype in (torch.bfloat16, torch.float16) else half_inputs()


    # `hoisted.HoistedRunner` passes `orders` and `products` to `run`, and computes the hoisted products of
    # 16-bit inputs in 16 bits (this runner reads them so, in its tensor-core form)
    writes_in_order = True
    reads_half = True

    def run(self, seqs, params, initial, sizes, length, out_dtype=None, orders=None, products=None):
        """The runner contract (time-first torch tensors in and out, as `StepLoop.run`). The outputs are
        allocated as the sequences lie (batch outer where they are: `runner.batch_outer`), each with its
        axes in the order `orders` gives (output name -> axes: the post products' order, so that they
        read it as a matrix without a copy; the returned views have the program's order). `products`
        (a forward's, as in `hoist.compute_pre`): where given, the kernel also writes its recurrent
        product of every step there, keyed by its node (the adjoint's ``h U`` is that very node)."""
        arrays = [*seqs.values(), *params.values(), *initial.values()]
        device = arrays[0].device if arrays else None
        emulate = emulating()
        on_device = device is not None and (device.type == "cpu" if emulate else device.type == "cuda")
        self._check()
        half = self.half_dtype(params)
        chosen = self.plan_for(sizes, half is not None)
        key = tuple(sorted(sizes.items()))
        if length < 1 or not on_device or isinstance(chosen, str):
            if isinstance(chosen, str):
                self.refusals[key] = chosen
            return self.fallback.run(seqs, params, initial, sizes, length, out_dtype)
        record = products is not None and not self.program.reverse and self.cell.product not in products
        result = self._launch(chosen, seqs, params, initial, sizes, length, device, emulate, orders or {}, record,
                              half if chosen.mma else None)
        if isinstance(result, str):  # the driver refused the cooperative launch
            self.refusals[key] = result
            return self.fallback.run(seqs, params, initial, sizes, length, out_dtype)
        outs, finals, recorded = result
        if recorded is not None:
            products[self.cell.product] = recorded
        dtype = out_dtype or torch_float32()
        p = self.program
        kept = self.half_outputs(chosen, orders, half)  # the post products' operands: read in 16 bits anyway
        outs = {name: o if o.dtype == dtype or name in kept else o.to(dtype) for (name, _), o in zip(p.outputs, outs)}
        finals = {s.name: f if f.dtype == dtype else f.to(dtype) for s, f in zip(p.states, finals)}
        return outs, finals

    def half_outputs(self, chosen, orders, half) -> frozenset:
        """The outputs a launch writes in 16 bits: in the tensor-core form, the per-step values only the
        hoisted post products read (`orders`' names: an adjoint's dz at every gate, which they multiply in
        16 bits, `TorchArrays`; the bias gradient, a sum of it, accumulates in fp32). Every other output
        fp32 (the carries a recording forward keeps for its adjoint's cell, the outputs returned)."""
        if half is None or isinstance(chosen, str) or not chosen.mma or not orders:
            return frozenset()
        return frozenset(name for name, _ in self.program.outputs if name in orders)

    def _watch(self, bar) -> None:
        """Keep the launch's barrier words for `_check`: on a GPU a copy to pinned host memory and an event
        behind the launch (no sync now); nothing new while a CUDA graph is being captured."""
        import torch

        if bar.device.type != "cuda":
            self._pending = (None, bar)
        elif torch.cuda.is_current_stream_capturing():
            pass  # a replay's barrier words are not read (the launch before the capture's still are)
        else:
            host = torch.empty(3, dtype=torch.int32, pin_memory=True)
            host.copy_(bar[:3], non_blocking=True)  # then the tiles' counters
            event = torch.cuda.Event()
            event.record()
            self._pending = (event, host)

    def _check(self, wait: bool = False) -> None:
        """Raise `BarrierTimeout` where an earlier launch's grid barrier timed out (its results are wrong).
        Read at the next call, once that launch has finished (`wait`: wait for it), so no call syncs."""
        if self._pending is None:
            return
        event, host = self._pending
        if event is not None:
            import torch

            # an event is neither queried nor waited for while a CUDA graph is captured: read it later
            if torch.cuda.is_current_stream_capturing() or (not wait and not event.query()):
                return
            event.synchronize()
        self._pending = None
        words = host.tolist()
        if words[1]:
            raise BarrierTimeout(f"{self.program.name}: the persistent kernel's grid barrier timed out at step "
                                 f"{words[2]} of an earlier call, so that call's outputs and states are wrong (the "
                                 "GPU shared with another process, or a bug); SSMC_CUDA_PERSISTENT=0 runs the "
                                 "step loop instead")

    def status(self) -> tuple[bool, int]:
        """(whether a barrier of the last launch timed out, the step it did): reads the device (a sync)."""
        if self._last_bar is None:
            return False, 0
        bar = self._last_bar.cpu().tolist()
        return bool(bar[1]), int(bar[2])

    def phases(self) -> list[float] | None:
        """The last launch's clocks by phase of a step, summed over the steps, a block's mean (persistent_phases:
        sequences and publish, the barrier, the product, its result to the pairs, the cell, all of the loop),
        or None where it did not count them; reads the device (a sync)."""
        if self._last_bar is None or self._phase_at is None:
            return None
        words = self._last_bar[self._phase_at:].cpu().view(-1, 8).long() & 0xFFFFFFFF
        return [float(v) for v in words[:, :6].double().mean(0)]

    def _launch(self, chosen, seqs, params, initial, sizes, length, device, emulate, orders, record, half=None):
        import torch

        p, cell = self.program, self.cell
        f32 = torch.float32

        def dense(t, shape):
            t = t if t.dtype == f32 else t.to(f32)
            return t.expand(*shape).contiguous()

        def full(axes):
            return [sizes[a] for a in axes]

        # sequences read in place (their strides printed into the source; 0 along a broadcast axis)
        # (in the tensor-core form, those in its 16-bit dtype as they are: the kernel converts them)
        seq_t = [(seqs[d.name] if half is not None and seqs[d.name].dtype == half else _as_f32(seqs[d.name]))
                 .expand(length, *full(d.axes)) for d in p.seqs]
        half_seqs = frozenset(d.name for d, t in zip(p.seqs, seq_t) if t.dtype != f32)
        seq_strides = {d.name: tuple(t.stride()) for d, t in zip(p.seqs, seq_t)}
        par_t = [dense(params[d.name], full(d.axes)) for d in p.params]
        ini_t = [dense(initial[s.name], full(s.axes)) for s in p.states]
        outer = batch_outer(seq_t)

        def allocated(axes, order, dtype=f32):
            """[L, *axes] as a view of memory [L, *order] ([order[0], L, *order[1:]] where `outer`)."""
            memory = ((order[0], TIME, *order[1:]) if outer and order else (TIME, *order))
            t = torch.empty([length if a == TIME else sizes[a] for a in memory], dtype=dtype, device=device)
            return t.permute(*[memory.index(a) for a in (TIME, *axes)])

        # in the tensor-core form the post products' operands (an adjoint's dz) and the recorded product (the
        # adjoint's h U, read as a 16-bit sequence: as x W is) in 16 bits: half the bytes written and read
        half_outs = self.half_outputs(chosen, orders, half)
        outs = [allocated(y.axes, tuple(orders.get(name, y.axes)), half if name in half_outs else f32)
                for name, y in p.outputs]
        out_strides = {name: tuple(o.stride()) for (name, _), o in zip(p.outputs, outs)}
        axes = cell.product.axes  # recorded rows first, as the adjoint's h U would lie
        rows_first = tuple(a for a in axes if a in cell.rows) + tuple(a for a in axes if a not in cell.rows)
        recorded = allocated(axes, rows_first, half or f32) if record else None
        finals = [torch.empty(full(s.axes), dtype=f32, device=device) for s in p.states]
        # the exchange buffer, each step's operand [rows][xcols] by step parity (the kernel writes it, and
        # zeroes its pad columns once; split, the pad columns lie in every K group's slice: zeroed here)
        split = chosen.ksplit > 1
        xo = (torch.zeros if split else torch.empty)(2 * chosen.xrows * chosen.xcols, dtype=half or f32, device=device)
        # (unused, a barrier timed out, the step it did), then a counter a batch tile (split: a counter a K
        # group, then one a J group, of every tile)
        groups = chosen.ksplit + chosen.jsplit if split else 1
        opts = options()
        phases = bool(opts.persistent_phases)
        # (persistent_phases: 8 words a block after the counters, its clocks by phase: `phases`)
        bar = torch.zeros(3 + chosen.tiles * groups + (8 * chosen.blocks if phases else 0), dtype=torch.int32,
                          device=device)
        self._phase_at = 3 + chosen.tiles * groups if phases else None
        self._last_bar = bar
        tensors = [*seq_t, *par_t, *ini_t, *outs, *finals, *([recorded] if record else []), xo, bar]
        if split:  # the K groups' fp32 partial products [2][ksplit][rows][units], by step parity
            tensors.append(torch.empty(2 * chosen.ksplit * chosen.xrows * chosen.jsplit * chosen.nunits * chosen.cols,
                                       dtype=f32, device=device))
        if cell.reductions:  # the reductions' block sums [levels][blocks][tile rows][values] (`Plan.rvals`)
            tensors.append(torch.empty(max(1, chosen.rlevels * chosen.blocks * chosen.trows * chosen.rvals), dtype=f32,
                                       device=device))
        if chosen.streamed:  # the blocks' U slices [slices][npad][jpad] in the on-chip type (each block writes its
            # own, every tile's alike: the kernel's prologue), read through L2 each step
            tensors.append(torch.empty(chosen.slices * chosen.slice_elems, dtype=half or f32, device=device))
        pointers = [t.data_ptr() for t in tensors]
        late = bool(opts.persistent_late_stores)
        form = dict(bf16=half != torch.float16, half_seqs=half_seqs, half_outs=half_outs,
                    half_record=record and half is not None, late=late, prefetch=bool(opts.persistent_prefetch),
                    phases=phases, reload=bool(opts.persistent_reload_index) or late,
                    early_loads=late and bool(opts.persistent_early_loads))
        rp_strides = tuple(recorded.stride()) if record else None
        # printing the kernel from the IR costs milliseconds of host time: once per source's inputs
        key = (chosen, tuple(sorted(sizes.items())), tuple(sorted(seq_strides.items())),
               tuple(sorted(out_strides.items())), rp_strides, tuple(sorted(form.items())),
               analysis.SPLIT_ACCUMULATORS, forward.BARRIER_TIMEOUT)  # (module globals kernel_source reads)
        source = self._sources.get(key)
        if source is None:
            source = self._sources[key] = kernel_source(cell, chosen, sizes, seq_strides, out_strides, rp_strides,
                                                        **form)
        name = kernel_name(cell)
        if emulate:
            from ...emulator import emulated

            fn = self._functions.get(("emulated", source))
            if fn is None:
                fn = self._functions[("emulated", source)] = emulated(source, name)
            if chosen.blocks > math.prod(sizes[a] for a in cell.heads):
                _emulate_steps(fn, chosen, length, p.reverse, tensors, seq_t, outs, recorded, ini_t, finals)
            else:
                fn((chosen.blocks, chosen.threads), length, 0, pointers)
            self._watch(bar)
            return outs, finals, recorded
        refused = _cooperative_launch(self._function(source, name, device), chosen, length, pointers)
        if refused:
            return refused
        self._watch(bar)
        return outs, finals, recorded

    def _function(self, source: str, name: str, device):
        key = (device.index, source)
        fn = self._functions.get(key)
        if fn is None:
            import cupy

            from ...source import compile_options

            module = cupy.RawModule(code=source, options=compile_options(source))
            fn = self._functions[key] = module.get_function(name)
        return fn


def _emulate_steps(fn, chosen, length, reverse, tensors, seqs, outs, recorded, initial, finals) -> None:
    """An emulated launch of several blocks (`EMULATED_BLOCKS`), a step at a time: the kernel at length 1 on the
    step's slices of the sequences and outputs (their pointers moved to step t), from the carries the step before
    left, launched 2 + `Plan.rlevels` times (the emulator runs the blocks one after another, its grid barriers
    compiled out: a launch reads what the blocks after it wrote in the launch before, so each launch completes one
    more exchange among them: the operand, the reductions' levels; the values recomputed are the same)."""
    carries = list(initial)
    for s in range(length):
        t = length - 1 - s if reverse else s
        moved = {id(x): x.data_ptr() + t * x.stride(0) * x.element_size()
                 for x in [*seqs, *outs, *([recorded] if recorded is not None else [])]}
        pointers = [moved.get(id(x), x.data_ptr()) for x in tensors]
        at = {id(f): i for i, f in enumerate(initial)}
        pointers = [carries[at[id(x)]].data_ptr() if id(x) in at else ptr for x, ptr in zip(tensors, pointers)]
        for _ in range(2 + chosen.rlevels):
            fn((chosen.blocks, chosen.threads), 1, 0, pointers)
        carries = [f.clone() for f in finals]


def tf32_passes() -> int:
    """The tensor-core products of an fp32 call's persistent kernel (`Plan.tf32`): 0, none (fp32 FMAs:
    SSMC_CUDA_PERSISTENT_MMA=0); 1, plain TF32 where SSMC_CUDA_TF32=1, or, unset, where torch allows TF32 for
    its fp32 matrix products (`torch.backends.cuda.matmul.allow_tf32`: the hoisted products x W, hᵀ dz, ...
    are torch's, so a call's products are all TF32 or none); else 3 (3xTF32, about fp32's accuracy)."""
    opts = options()
    if opts.persistent_mma is False:
        return 0
    allowed = opts.tf32
    if allowed is None:
        try:
            import torch
        except ImportError:  # planning without torch (`ssmc inspect`): torch's default
            return 3
        allowed = bool(torch.backends.cuda.matmul.allow_tf32)
    return 1 if allowed else 3


def _as_f32(t):
    """`t` in fp32, its strides kept (a dense permutation stays one; `torch.Tensor.to` keeps the layout)."""
    import torch

    return t if t.dtype == torch.float32 else t.to(torch.float32)


def torch_float32():
    import torch

    return torch.float32


_DRIVER = {}
_OCCUPANCY: dict[tuple, int] = {}  # (CUfunction, threads, shared bytes) -> blocks a multiprocessor


def _driver_call(name: str, argtypes):
    """A libcuda function with its argument types (cached), or None."""
    if name not in _DRIVER:
        try:
            fn = getattr(ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"), name)
        except (OSError, AttributeError):
            fn = None
        else:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
        _DRIVER[name] = fn
    return _DRIVER[name]


def _cooperative_launch(function, chosen, length: int, pointers) -> str | None:
    """One cooperative launch of `function` on torch's current stream; a refusal reason, or None."""
    from ...launch import _argument_slots, _handle, current_stream

    u, vp = ctypes.c_uint, ctypes.c_void_p
    occupancy = _driver_call("cuOccupancyMaxActiveBlocksPerMultiprocessor",
                             [ctypes.POINTER(ctypes.c_int), vp, ctypes.c_int, ctypes.c_size_t])
    launch = _driver_call("cuLaunchCooperativeKernel", [vp, u, u, u, u, u, u, u, vp, vp])
    if occupancy is None or launch is None:
        return "no CUDA driver library for a cooperative launch"
    from ...launch import _DEFAULT_SHARED, _allow_shared

    if chosen.shared_bytes > _DEFAULT_SHARED:
        try:
            _allow_shared(function, chosen.shared_bytes)
        except ValueError as err:
            return str(err)
    handle = _handle(function)
    key = (handle, chosen.threads, chosen.shared_bytes)
    if key not in _OCCUPANCY:  # a driver call a launch otherwise: asked once per kernel and shape
        per_sm = ctypes.c_int(0)
        if occupancy(ctypes.byref(per_sm), handle, chosen.threads, chosen.shared_bytes) != 0:
            return "the occupancy query failed"
        _OCCUPANCY[key] = per_sm.value
    if _OCCUPANCY[key] * options().sm_count < chosen.blocks:
        return (f"{chosen.blocks} blocks cannot be co-resident ({_OCCUPANCY[key]} a multiprocessor x "
                f"{options().sm_count})")
    values, slots = _argument_slots(2 + len(pointers))
    values[:] = (length, 0, *pointers)
    code = launch(handle, chosen.blocks, 1, 1, chosen.threads, 1, 1, chosen.shared_bytes, current_stream(), slots)
    if code != 0:
        return f"cuLaunchCooperativeKernel failed ({code})"
    return None


_LOOPS: dict[tuple, PersistentLoop | None] = {}


def persistent_loop(program, compute: str, loop):
    """The persistent runner of `program` with `loop` (its StepLoop) as the fallback, where the program
    fits (`analysis.analyse`), the compute type is float32 and SSMC_CUDA_PERSISTENT is not 0; else `loop`."""
    if loop is None or options().persistent is False or compute != "float32":
        return loop
    key = (program, compute, loop)
    if key not in _LOOPS:
        cell = analyse(program)
        _LOOPS[key] = PersistentLoop(program, compute, loop, cell) if isinstance(cell, Cell) else None
    return _LOOPS[key] or loop


def refusal(program) -> str | None:
    """Why the persistent kernel does not take `program` (None: it does, shape permitting)."""
    cell = analyse(program)
    return cell if isinstance(cell, str) else None

