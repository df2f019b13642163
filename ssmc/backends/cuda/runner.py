"""Running lowered programs on the GPU: NVRTC through CuPy, memory as PyTorch CUDA tensors.

Inside the backend every device array is a torch tensor (CuPy arrays come in zero-copy through
``__cuda_array_interface__``), because torch has bf16 and the slicing / zeros / concatenation the
gradient driver needs; CuPy compiles (`RawModule`, NVRTC, with CuPy's on-disk cache under
``$SSMC_CACHE_DIR/cupy``) and launches on torch's current stream. `CudaRunner.run` has the
interpreter's contract: time-first arrays (any strides; nothing is copied), name -> array dicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...lowering.kernel import Kernel, Lowered
from ...lowering.plan import lower, sum_of_output
from ...lowering.split_sum import row_axis
from ...lowering.stages import Fused, fuse
from ...lowering.summary import summary_names
from ...lowering.time_blocks import TimeBlocks, summary_inits, time_blocks
from ...runtime.cache import cache_dir
from ...runtime.progress import progress
from .arrays import TORCH_DTYPES
from .devices import current_device, device_name, emulating
from .hardware import WARP
from .kernels.base import Launch, Shape
from .kernels.lanes.analysis import state_lanes
from .kernels.lanes.forward import lane_blocks, lane_groups, lanes_block
from .kernels.time_blocks import FILL_THREADS, THREAD
from .kernels.warp import lane_steps, ragged, steps_per_lane
from .launch import launch_kernel
from .options import environment_default, options
from .printer import ONE_GROUP, ROW_THREADS, ArraySpec, Threads, contiguous_strides, split_groups
from .select import Selection, select
from .select import strategy as strategy_named
from .source import compile_options

# A thread's local memory on sm_80 / sm_90 (CUDA's limit): a kernel whose per-thread arrays need
# more fails to launch (an LSTM's adjoint epilogue at B32 I256 H256 with its products in the kernels
# asked for 4 MB a thread), so `CudaRunner.function` refuses it with a ValueError
MAX_LOCAL_BYTES = 512 << 10
def accumulator_blocks(total: int, length: int) -> int:
    """Blocks of time for an epilogue kernel summing over time (partial sums added afterwards)."""
    return max(1, min(length, -(-FILL_THREADS // max(total, 1))))


MAX_THREADS = (1 << 31) - 1  # time-fastest kernels divide the thread index in 32 bits

# Row kernels (lowering/split_sum.py, cooperative rows): a map kernel reducing over a long axis r
# (a norm over d, once per (b, t)) gives each row G threads of one block, G a power of two doubled
# while the rows give fewer than ROW_FILL threads and every thread keeps at least ROW_TERMS indices
# of r, at most MAX_ROW_GROUPS. Mamba-1's block at B 8, L 2048, D 1536: 16384 rows, G = 16.
ROW_FILL = FILL_THREADS
ROW_TERMS = 32
MAX_ROW_GROUPS = 32


def row_groups(k: Kernel, sizes: dict[str, int], rows: int) -> tuple[str | None, int]:
    """The axis `rows` rows of map kernel `k` are shared along and by how many threads each (1: a
    thread per row). `SSMC_CUDA_ROW_GROUPS` overrides the count (a power of two; 1: off)."""
    axis = row_axis(k, sizes)
    if axis is None:
        return None, 1
    forced = options().row_groups
    if forced is not None:
        groups = forced
        if groups > ROW_THREADS:
            raise ValueError(f"SSMC_CUDA_ROW_GROUPS={forced!r}: expected a power of two up to {ROW_THREADS}")
    else:
        groups = 1
        while (groups < MAX_ROW_GROUPS and rows * groups < ROW_FILL
               and sizes[axis] >= 2 * groups * ROW_TERMS):
            groups *= 2
    if groups == 1 or rows * groups > MAX_THREADS:
        return None, 1
    return axis, groups


# Rows of a recurrence (lowering/split_sum.py, `recurrence_row_axis`): a recurrence whose step takes
# a row statistic (a norm over d) runs a block of G threads per row (b), G about the axis' size (in
# whole warps, at most MAX_ROW_RECURRENCE_GROUPS: `row_recurrence_groups`); a thread owns every G-th
# index for the whole sequence. One block then *owns the normalised axis* when each thread holds at most
# MAX_ROW_INDICES of it: a staged layer (scan kernel, then the norm's row kernel) runs as this one
# kernel there, where its scan would run a thread per recurrence anyway (`layer_runner`).
# `SSMC_CUDA_ROW_RECURRENCE` = 0 / 1 turns it off / on wherever the loops allow it.
MAX_ROW_RECURRENCE_GROUPS = 512
MAX_ROW_INDICES = 2


def row_recurrence_groups(size: int) -> int:
    """Threads per row for a row axis of `size`: up to a warp a power of two (shuffles within it);
    above, the fewest whole warps, at most MAX_ROW_RECURRENCE_GROUPS, that give each thread as many
    indices as the most loaded one (300: 320 threads, one each; 1536: 512, three each)."""
    if size <= WARP:
        return 1 << max(0, size - 1).bit_length()
    per_thread = -(-size // MAX_ROW_RECURRENCE_GROUPS)
    threads = -(-size // per_thread)
    return -(-threads // WARP) * WARP


class CudaRunner:
    """A lowered program whose kernels are built per shape (sizes, strides, dtypes) and cached."""

    def __init__(self, program, compute: str = "float32", map_reduce: bool = True):
        self.program = program
        self.compute = compute                          # float32 | float64
        self.ctype = "double" if compute == "float64" else "float"  # the kernels' compute type in C
        # map_reduce=False: a program without states as one kernel of all its roots (a step's, cuda/step.py)
        self.lowered: Lowered = lower(program, map_reduce=map_reduce)
        self.time_blocks: TimeBlocks | None = time_blocks(program) if self.lowered.strategy == "fused" else None
        self.lane_steps = lane_steps(self.time_blocks)  # the warp kernel's steps per lane
        self.modules: dict[tuple, object] = {}          # (device, source) -> its module, loaded there
        self.functions: dict[tuple, object] = {}        # (kernel, array layouts, sizes, device) -> function
        # plans, decisions, prepared launches and runs, by shape, layouts and overrides (`planned`)
        self.plans: dict[tuple, object] = {}
        # the axis a recurrence's row statistics reduce, if a block of threads may share each row
        # along it (lowering/split_sum.py): a norm inside the update, or a whole layer (`layer_runner`)
        self.row_axis = fuse(program).shared_row_axis()
        # a fused kernel whose states' own axis can be split among lanes (kernels/lanes/analysis.py)
        self.state_lanes = state_lanes(self.lowered.kernels[0]) if self.lowered.strategy == "fused" else None
        environment_default("CUPY_CACHE_DIR", str(cache_dir("cupy")))

    # -- building ----------------------------------------------------------------------------
    def source_for(self, k: Kernel, specs: dict[str, ArraySpec], sizes: dict[str, int],
                   mapping: Threads = ONE_GROUP, length: int | None = None, strategy: str = "") -> str:
        """`k`'s module source for these layouts, as the strategy named `strategy` prints it (""):
        a thread per parallel index); `length` (None: any) where its source depends on it."""
        return (strategy_named(strategy) if strategy else THREAD).source(self, k, specs, sizes, mapping, length)

    def function(self, source: str, name: str):
        """Kernel `name` of `source`, compiled (NVRTC, CuPy's disk cache) and loaded on the current
        device: one module per device, since a function launches only in its own device's context."""
        key = (current_device(), source)
        if emulating():  # compiled for the CPU (backends/cuda/emulator.py)
            from .emulator import emulated

            named = (*key, name)  # a launcher per kernel of the source
            if named not in self.modules:
                with progress(f"compiling {self.lowered.program.name} for the CUDA emulator (C++)"):
                    self.modules[named] = emulated(source, name)
            return self.modules[named]
        module = self.modules.get(key)
        if module is None:
            import cupy

            with progress(f"compiling {self.lowered.program.name} for CUDA (NVRTC)"):
                module = cupy.RawModule(code=source, options=compile_options(source))
                module.compile()
            self.modules[key] = module
        function = module.get_function(name)
        local = function.local_size_bytes
        if local > MAX_LOCAL_BYTES:  # the driver's launch would fail with CUDA_ERROR_INVALID_VALUE
            raise ValueError(
                f"{name}: each thread of this kernel needs {local} bytes of local memory for its arrays "
                f"at these sizes, more than the {MAX_LOCAL_BYTES} CUDA allows, so it cannot run on the GPU "
                "(the numba backend runs it; a state or accumulator along large axes held by one thread, "
                "as an LSTM's grad_W with its products in the kernels, SSMC_CUDA_HOIST=0)")
        return function

    # -- planning ----------------------------------------------------------------------------
    def _threads(self, k: Kernel, sizes: dict[str, int]) -> int:
        return math.prod(sizes[a] for a in k.parallel)

    def row_threads(self, sizes: dict[str, int]) -> Threads | None:
        """The thread mapping of the "rows" strategy at `sizes` (None where it cannot run)."""
        if self.row_axis is None or options().row_recurrence is False:
            return None
        return Threads(groups=row_recurrence_groups(sizes[self.row_axis]), split=self.row_axis, row=True,
                       recurrence=True)

    def owns_rows(self, sizes: dict[str, int]) -> bool:
        """Whether a block of the "rows" strategy holds a whole row with few indices per thread."""
        threads = self.row_threads(sizes)
        return threads is not None and sizes[self.row_axis] <= MAX_ROW_INDICES * threads.groups

    def lane_threads(self, sizes: dict[str, int]) -> Threads | None:
        """The thread mapping of the "lanes" strategy at `sizes` (None where it cannot run)."""
        if self.state_lanes is None:
            return None
        groups = lane_groups(sizes[self.state_lanes.axis])
        block = lanes_block(self.state_lanes, sizes, groups, 8 if self.compute == "float64" else 4)
        return None if block is None else Threads(lanes=groups, block=block)

    def strategy(self, sizes: dict[str, int], length: int, time_contiguous: bool = False, lanes: bool = True) -> str:
        """How a run goes (`decide`, without its reason)."""
        return self.decide(sizes, length, time_contiguous, lanes)[0]

    def decide(self, sizes: dict[str, int], length: int, time_contiguous: bool = False,
               lanes: bool = True) -> tuple[str, str]:
        """How a run goes, and why: the strategy table's choice (select.py). With `lanes` false, the
        choice without the lanes kernel (the fused backward asks so whether it applies)."""
        selection = self.selection(sizes, length, time_contiguous, lanes)
        return selection.strategy, selection.reason

    def selection(self, sizes: dict[str, int], length: int, time_contiguous: bool = False,
                  lanes: bool = True) -> Selection:
        """The strategy table's full answer (select.py): the choice and every verdict before it."""
        return select(self, Shape(sizes, length, time_contiguous, lanes))

    def planned(self, what: str, make, *key):
        """`make()`, once per `key` and setting of the overrides (a plan is a pure function of
        them; planning walks the kernels' IR, which costs more than a small launch): the launches
        and strategy, each launch worked out (`_launch`), each run prepared (`run`), and the
        decisions of other runners built on this one (the fused backward's, a staged layer's)."""
        full = (what, *key, *options().key)
        plan = self.plans.get(full)
        if plan is None:
            if len(self.plans) >= MAX_PLANS:  # ever new lengths or shapes: start over
                self.plans.clear()
            plan = self.plans[full] = make()
        return plan

    def launches(self, sizes: dict[str, int], length: int, time_contiguous: bool = False) -> list[Launch]:
        """The launches `run` makes for these sizes, in order (what `ssmc inspect` reports)."""
        return list(self.planned("launches", lambda: tuple(self._uncached_launches(sizes, length, time_contiguous)),
                                  _sizes_key(sizes), length, time_contiguous))

    def _uncached_launches(self, sizes: dict[str, int], length: int, time_contiguous: bool) -> list[Launch]:
        chosen = strategy_named(self.strategy(sizes, length, time_contiguous))
        return [replace(launch, strategy=chosen.name)
                for launch in chosen.launches(self, Shape(sizes, length, time_contiguous))]

    def epilogue_launch(self, k: Kernel, sizes: dict[str, int], length: int, time_contiguous: bool) -> Launch:
        """A map/reduce epilogue kernel's launch: an output one step per block of time, an accumulator
        in as many blocks as fill the GPU (a multiple of a warp when threads run along time); a long
        sum split into groups of threads (split-K, printer.split_groups), or else a map kernel's long
        rows shared by groups of threads (`row_groups`)."""
        return self.planned("epilogue", lambda: self._uncached_epilogue_launch(k, sizes, length, time_contiguous),
                             k.name, _sizes_key(sizes), length, time_contiguous)

    def _uncached_epilogue_launch(self, k: Kernel, sizes: dict[str, int], length: int,
                                  time_contiguous: bool) -> Launch:
        total = self._threads(k, sizes)
        if k.program.states:
            nblk = accumulator_blocks(total, length)
            if time_contiguous:  # lanes of a warp on neighbouring steps
                nblk = min(length, -(-nblk // WARP) * WARP)
        else:
            nblk = max(1, length)
        split, groups = split_groups(k, sizes)
        row = False
        if groups == 1 and not k.program.states:
            split, groups = row_groups(k, sizes, total * nblk)
            row = groups > 1
        fastest = time_contiguous and total * nblk * groups <= MAX_THREADS
        return Launch(k, length, nblk, total * nblk * groups, Threads(fastest, groups, split, row))

    # -- running -----------------------------------------------------------------------------
    def _launch(self, k: Kernel, arrays: dict, sizes: dict[str, int], length: int, nblk: int = 1,
                out_dtype=None, time_contiguous: bool = False, mapping: Threads = ONE_GROUP,
                grid: tuple[int, int] | None = None) -> dict:
        """Launch `k`; returns the arrays it wrote (`_prepare_launch`, `_execute`). The launch is worked
        out once per layout of its inputs, shape and overrides (working it out costs host time on every
        launch, six of them a training step of HGRN at B32 D512 L180, run as time blocks; see
        bench/results/2026-11-27-from-code-comments.md)."""
        return self._execute(self._planned_launch(k, arrays, sizes, length, nblk, out_dtype, time_contiguous,
                                                  mapping, grid), arrays)

    def _planned_launch(self, k: Kernel, arrays: dict, sizes: dict[str, int], length: int, nblk: int = 1,
                        out_dtype=None, time_contiguous: bool = False, mapping: Threads = ONE_GROUP,
                        grid: tuple[int, int] | None = None) -> Prepared:
        """`_prepare_launch`, kept per layout of `arrays`, shape and overrides (`_launch`)."""
        return self.planned(
            "launch", lambda: self._prepare_launch(k, arrays, sizes, length, nblk, out_dtype, time_contiguous,
                                                   mapping, grid),
            k.name, _sizes_key(sizes), length, nblk, out_dtype, time_contiguous, mapping, grid, current_device(),
            *((arrays[a.name].dtype, arrays[a.name].stride()) for a in k.arrays if a.role in ("seq", "param", "init")))

    def _prepare_launch(self, k: Kernel, arrays: dict, sizes: dict[str, int], length: int, nblk: int = 1,
                        out_dtype=None, time_contiguous: bool = False, mapping: Threads = ONE_GROUP,
                        grid: tuple[int, int] | None = None, strategy: str = "") -> Prepared:
        """`k`'s launch over `arrays` (the inputs) worked out: the function for these layouts, the
        grid, the arrays it writes. With `time_contiguous` its per-step outputs (and carries `prev_*`)
        are allocated with time contiguous, as their readers take them; with `mapping.groups` > 1 its
        outputs and finals are partials, one copy per group (they then have the groups first).
        `grid`: the planned launch's (else worked out here)."""
        import torch

        layouts, items = [], []  # per kernel array: (dtype, strides as the kernel sees it, group stride)
        warp = self.time_blocks is not None and k is self.time_blocks.lane_rescan
        outer = batch_outer([arrays[a.name] for a in k.arrays if a.role == "seq"])
        groups = mapping.groups
        state_dtype = torch.float64 if self.compute == "float64" else torch.float32
        for a in k.arrays:
            if a.role in ("seq", "param", "init"):
                t = arrays[a.name]
                layouts.append((t.dtype, tuple(t.stride()) or (1,), 0))
                items.append(a.name)
                continue
            shape = [length if ax == "t" else nblk if ax == "block" else sizes[ax] for ax in a.axes]
            partial = groups > 1 and not mapping.row and a.role in ("out", "final")
            wanted = output_dtype(out_dtype, a.name[len("out_"):]) if a.role == "out" else None
            dtype = wanted if wanted is not None and not partial else state_dtype
            lead = [groups] if partial else []
            if (warp or time_contiguous) and a.role in ("out", "prev") and len(shape) > 1:
                # time contiguous: lanes write (warp kernel) or read (epilogue) neighbouring steps
                item = Allocation(a.name, (*lead, *shape[1:], shape[0]), dtype, len(shape) - 1 + len(lead), len(lead))
            elif outer and a.role in ("out", "prev") and len(shape) > 2 and not lead:
                # as the sequences ("b t ..."): a caller's view in that layout is contiguous, no copy
                item = Allocation(a.name, (shape[1], shape[0], *shape[2:]), dtype, 1, 0)
            else:
                item = Allocation(a.name, (*lead, *shape), dtype)
            strides = item.strides()
            layouts.append((dtype, (strides[1:] if partial else strides) or (1,), strides[0] if partial else 0))
            items.append(item)
        steps = warp and steps_per_lane(self.lane_steps)
        key = (k.name, tuple(layouts), _sizes_key(sizes), steps, mapping, warp and ragged(length, steps),
               current_device(), strategy)
        fn = self.functions.get(key)
        if fn is None:  # rendering the source costs more than a launch: once per shape
            specs = {a.name: ArraySpec(TORCH_DTYPES[str(dtype)], strides, g)
                     for a, (dtype, strides, g) in zip(k.arrays, layouts)}
            source = self.source_for(k, specs, sizes, mapping, length, strategy)
            fn = self.functions[key] = self.function(source, k.name)
        if grid is None:  # a launch without a planned grid
            grid = Launch(k, length, nblk, self._threads(k, sizes) * nblk * groups, mapping).grid
        return Prepared(fn, grid, length, nblk, tuple(items))

    def _execute(self, prepared: Prepared, arrays: dict) -> dict:
        """Launch a prepared kernel over `arrays` (its inputs by name) into arrays it allocates;
        returns those by name."""
        made = {item.name: item.allocate() for item in prepared.items if type(item) is Allocation}
        launch_kernel(prepared.function, prepared.grid, prepared.length, prepared.nblk,
                      [(arrays[item] if type(item) is str else made[item.name]).data_ptr() for item in prepared.items])
        return made

    def run(self, seqs, params, initial, sizes, length, out_dtype=None):
        """Same contract as `interpreter.run_recurrence` (torch CUDA tensors in and out)."""

        low, p = self.lowered, self.program
        contiguous = time_contiguous(seqs)
        strategy = self.planned("strategy", lambda: self.strategy(sizes, length, contiguous),
                                 _sizes_key(sizes), length, contiguous)
        if strategy_named(strategy).prepared:  # prepared once per layout, shape, overrides
            call = self.planned(
                "run", lambda: self.prepare(seqs, params, initial, sizes, length, out_dtype),
                _sizes_key(sizes), length, out_dtype, current_device(),
                *((n, v.dtype, v.stride()) for part in (seqs, params, initial) for n, v in part.items()))
            return call(seqs, params, initial)
        plan = self.launches(sizes, length, contiguous)
        finals, prev = {}, {}
        if low.core_states:
            core = plan.pop(0)
            made = self._launch(core.kernel, {**seqs, **params, **{f"init_{s}": initial[s] for s in low.core_states}},
                                sizes, length, time_contiguous=contiguous, grid=core.grid)
            for s in low.core_states:
                prev[s] = made[f"prev_{s}"]
                finals[s] = made[f"final_{s}"].reshape([sizes[a] for a in p.decl(s).axes])
        inputs = {**seqs, **params, **prev, **{f"init_{s}": initial[s] for s in low.accumulators}}
        steps, sums = self._map_plan(plan, inputs, sizes, length, out_dtype, self._planned_launch)
        return self._run_maps(steps, sums, inputs, initial, finals)

    def _map_plan(self, launches, inputs: dict, sizes, length, out_dtype, prepare_launch) -> tuple[list, list]:
        """The epilogue, one kernel per root (map/reduce): outputs one step per block of time, accumulators
        in as many blocks as fill the GPU, their partial sums added afterwards. Per launch of `launches`
        (`prepare_launch`'s, over `inputs`): (it prepared, [(state, its partials' shape)], [(output, array,
        split-K dtype or False)]); then per accumulator summed from an output after them: (state, output,
        dims, perm, the output's dtype). `run` and `prepare_maps` execute it (`_run_maps`)."""
        low, p = self.lowered, self.program
        summed = {name for _, name, _ in low.from_outputs}
        steps = []
        for launch in launches:
            if launch.kernel.time_blocks:  # threads along time where its own sequences mostly have it contiguous
                launch = self.epilogue_launch(launch.kernel, sizes, length, _along_time(launch.kernel, inputs))
            epi, nblk, groups = launch.kernel, launch.nblk, launch.mapping.groups
            # an output an accumulator is summed from stays in the compute dtype until then
            own_dtype = None if summed.intersection(n for n, _ in epi.program.outputs) else out_dtype
            prepared = prepare_launch(epi, inputs, sizes, length, nblk, own_dtype, launch.mapping.time_fastest,
                                      launch.mapping, launch.grid)
            states = [(st.name, [groups * nblk, *(sizes[a] for a in st.axes)]) for st in epi.program.states]
            split = groups > 1 and not launch.mapping.row  # split-K partials, summed after
            outputs = [(n, f"out_{n}", output_dtype(own_dtype, n) if split else False) for n, _ in epi.program.outputs]
            steps.append((prepared, states, outputs))
        sums = [(st, name, *sum_of_output(p, st, name, axes), output_dtype(out_dtype, name))
                for st, name, axes in low.from_outputs]
        return steps, sums

    def _run_maps(self, steps: list, sums: list, arrays: dict, initial: dict, finals: dict) -> tuple[dict, dict]:
        """(outputs, finals) of the program from `_map_plan`'s launches over `arrays`; `finals` holds the
        core's final states, if any."""
        outs = {}
        for prepared, states, outputs in steps:
            made = self._execute(prepared, arrays)
            for name, shape in states:
                part = made[f"final_{name}"].reshape(shape).sum(0)
                finals[name] = initial[name].to(part.dtype) + part
            for name, array, split in outputs:
                out = made[array]
                if split is not False:
                    out = out.sum(0)
                    out = out.to(split) if split is not None else out
                outs[name] = out
        for st, name, dims, perm, wanted in sums:
            out = outs[name]
            part = out.sum(dims).permute(perm)  # in the compute dtype
            finals[st] = initial[st].to(part.dtype) + part
            if wanted is not None:
                outs[name] = out.to(wanted)
        p = self.program
        return {n: outs[n] for n, _ in p.outputs}, {s.name: finals[s.name] for s in p.states}

    def prepare(self, seqs, params, initial, sizes, length, out_dtype=None):
        """A run for calls like this one (every array of the same dtype, shape and strides, the same
        overrides): ``call(seqs, params, initial) -> (outputs, finals)`` that only allocates the outputs
        and launches (`run` plans, checks and looks the kernel up on every call: host time that bounds
        small shapes): one launch, or the three of time blocks (`prepare_time_blocks`); None for a
        split program's core and epilogues. The call reads only its arrays' addresses (their dtypes
        and strides are this call's), so any view that starts where this call's arrays start will do:
        `api.Compiled` passes the arrays in the caller's layout."""
        contiguous = time_contiguous(seqs)
        strategy = self.planned("strategy", lambda: self.strategy(sizes, length, contiguous),
                                 _sizes_key(sizes), length, contiguous)
        return strategy_named(strategy).prepare(self, seqs, params, initial, sizes, length, out_dtype, contiguous)

    def prepare_one_launch(self, seqs, params, initial, sizes, length, out_dtype, contiguous: bool,
                           outputs_along_time: bool = False):
        """`prepare` for a strategy whose run is one launch of one kernel; `outputs_along_time`: its
        outputs are written with time contiguous where the sequences have it so."""
        launch, = self.launches(sizes, length, contiguous)
        prepared = self._prepare_launch(launch.kernel, {**seqs, **params, **_init(initial)}, sizes, length,
                                        out_dtype=out_dtype, time_contiguous=contiguous and outputs_along_time,
                                        mapping=launch.mapping, grid=launch.grid, strategy=launch.strategy)
        p = self.program
        outputs = [(n, f"out_{n}") for n, _ in p.outputs]
        finals = [(s.name, f"final_{s.name}", [sizes[a] for a in s.axes]) for s in p.states]

        def call(seqs, params, initial):
            made = self._execute(prepared, {**seqs, **params, **_init(initial)})
            return {n: made[a] for n, a in outputs}, {n: made[a].reshape(shape) for n, a, shape in finals}
        return call

    def prepare_maps(self, seqs, params, initial, sizes, length, out_dtype=None, contiguous=False):
        """`prepare` for a program of map/reduce kernels without a core (no state carried from step to
        step: the stages around a chunked core, `passes/matrix_linear.chunk_stages`, and their adjoints,
        whose param gradients are sums over time): the launches `run` makes, each worked out once, and
        the sums after them as `run` adds them. None where the program has a core (`run` launches it
        first)."""
        low = self.lowered
        if low.core_states:
            return None
        inputs = {**seqs, **params, **{f"init_{s}": initial[s] for s in low.accumulators}}
        steps, sums = self._map_plan(self.launches(sizes, length, contiguous), inputs, sizes, length, out_dtype,
                                     self._prepare_launch)
        accumulators = low.accumulators

        def call(seqs, params, initial):
            arrays = {**seqs, **params, **{f"init_{s}": initial[s] for s in accumulators}}
            return self._run_maps(steps, sums, arrays, initial, {})
        return call

    def prepare_time_blocks(self, seqs, params, initial, sizes, length, out_dtype=None, contiguous=False):
        """`prepare` for time blocks: the summary, combine and rescan launches of `run_time_blocks`
        worked out once. The combine and rescan read arrays the launches before them allocate, whose
        layouts the plan knows: they are planned over meta tensors of those layouts. (Through the
        general path, HGRN's op step at "b t d" B32 D512 L1024 took more host time than its kernels
        took; see bench/results/2026-11-27-from-code-comments.md.)"""
        tb, p = self.time_blocks, self.program
        summary, combine, rescan = self.launches(sizes, length, contiguous)
        nblk = summary.nblk
        init = summary_inits(p, sizes, nblk, _full)

        def laid_out(prepared: Prepared) -> dict:  # meta tensors laid out as the launch allocates
            return {a.name: a.allocate("meta") for a in prepared.items if type(a) is Allocation}

        first = self._prepare_launch(tb.summary, {**seqs, **params, **init}, sizes, length, nblk, grid=summary.grid)
        names = summary_names(p)
        made = laid_out(first)
        given = {**{n: made[f"final_{n}"] for n in names}, **{f"init_{n}": v for n, v in initial.items()}}
        second = self._prepare_launch(tb.combine, given, sizes, nblk, 1, grid=combine.grid)
        made = laid_out(second)
        carries = {f"init_{st.name}": made[f"prev_{st.name}"] for st in p.states}
        third = self._prepare_launch(tb.rescan, {**seqs, **params, **carries}, sizes, length, nblk,
                                     out_dtype=out_dtype if p.outputs else None, grid=rescan.grid)
        outputs = [(n, f"out_{n}") for n, _ in p.outputs]
        finals = [(st.name, f"final_{st.name}", [sizes[a] for a in st.axes]) for st in p.states]

        def call(seqs, params, initial):
            made = self._execute(first, {**seqs, **params, **init})
            carried = self._execute(second, {**{n: made[f"final_{n}"] for n in names},
                                             **{f"init_{n}": v for n, v in initial.items()}})
            done = self._execute(third, {**seqs, **params,
                                         **{f"init_{st.name}": carried[f"prev_{st.name}"] for st in p.states}})
            return ({n: done[a] for n, a in outputs},
                    {n: carried[a].reshape(shape) for n, a, shape in finals})
        return call


# plans and decisions a runner keeps (by shape, length and overrides), before it starts over
MAX_PLANS = 4096


def output_dtype(out_dtype, name: str):
    """The dtype output `name` is written in: `out_dtype` as a run takes it, one torch dtype for every
    output, None (the compute dtype) or pairs ((output name, dtype), ...) for some outputs
    (`run_stages` hands a stage's outputs that a chunked core reads in 16 bits so: no cast between)."""
    if isinstance(out_dtype, tuple):
        return dict(out_dtype).get(name)
    return out_dtype


@dataclass(frozen=True)
class Allocation:
    """An array a launch writes: allocated C-contiguous with `shape`, in which the time axis is at
    `time_at` (-1: the caller's time-first order as it is); the view returned has it moved to
    `time_index` (the caller's time-first view, after any leading group axis). Time innermost
    (layouts like "b d t") or second (after the batch, "b t ..."), as the sequences have it."""

    name: str
    shape: tuple[int, ...]
    dtype: object         # a torch dtype
    time_at: int = -1
    time_index: int = 0

    def allocate(self, device: str | None = None):
        import torch

        t = torch.empty(self.shape, device=device or device_name(), dtype=self.dtype)
        return t if self.time_at < 0 else t.movedim(self.time_at, self.time_index)

    def strides(self) -> tuple[int, ...]:
        """The strides of the array `allocate` returns (without allocating it)."""
        strides = list(contiguous_strides(list(self.shape))) if self.shape else []
        if self.time_at >= 0:
            strides.insert(self.time_index, strides.pop(self.time_at))
        return tuple(strides)


@dataclass(frozen=True)
class Prepared:
    """A kernel launch worked out but for its arrays: per kernel array (in order) an input's name or
    the `Allocation` of an array it writes."""

    function: object
    grid: tuple[int, int]
    length: int
    nblk: int
    items: tuple[str | Allocation, ...]


def _init(initial: dict) -> dict:
    return {f"init_{s}": v for s, v in initial.items()}


def lane_block_count(k: Kernel, sizes: dict[str, int], mapping: Threads) -> int:
    """Blocks of the lanes kernel launched with `mapping` (`lanes.lane_blocks`)."""
    return lane_blocks(k, sizes, mapping.lanes, mapping.block)


def time_contiguous(seqs: dict) -> bool:
    """Whether every sequence has time contiguous (layouts like "b d t")."""
    return bool(seqs) and all(v.dim() > 1 and v.stride(0) == 1 for v in seqs.values())


def _sizes_key(sizes: dict[str, int]) -> tuple:
    return tuple(sorted(sizes.items()))


def _along_time(k: Kernel, arrays: dict) -> bool:
    """Should consecutive threads of a time-blocked kernel (map/reduce epilogue, map) take
    consecutive steps? When most of its sequences have time contiguous (layouts like "b d t"): then
    its loads and stores coalesce, where threads along the last parallel axis would stride over
    whole sequences."""
    seqs = [arrays[a.name] for a in k.arrays if a.role == "seq" and arrays[a.name].dim() > 1]
    return 2 * sum(t.stride(0) == 1 for t in seqs) > len(seqs)


_FILLED: dict[tuple, object] = {}


def _full(shape, value: float):
    """A read-only array of `shape` holding `value` (time blocks' initial summaries): a broadcast view
    of one element kept per value, rank and device (a fill kernel and an allocation per call each cost
    host time, four of them a training step of HGRN at B32 D512 L180; see
    bench/results/2026-11-27-from-code-comments.md)."""
    key = (len(shape), value, current_device())
    one = _FILLED.get(key)
    if one is None:
        import torch

        one = _FILLED[key] = torch.full((1,) * len(shape), value, device=device_name(), dtype=torch.float32)
    return one.expand(*shape)


def batch_outer(seqs: list) -> bool:
    """Whether the time-first sequences (some at least 3-d) all lie with their second axis outermost
    and time next (layouts like "b t ..."): the order a kernel's per-step outputs are then allocated in."""
    deep = [v for v in seqs if v.dim() > 2]
    return bool(deep) and all(v.dim() < 3 or (v.stride(1) >= v.stride(0) >= max(v.stride()[2:]) and v.shape[1] > 1
                                                and v.shape[0] > 1) for v in seqs)


def one_kernel(fused: Fused, compute: str, sizes: dict[str, int], length: int, time_contiguous: bool) -> bool:
    """Whether the staged layer `fused` runs as one "rows" kernel at these sizes (see
    MAX_ROW_RECURRENCE_GROUPS): where a block owns each row and its core would run a thread per
    recurrence anyway (time-parallel scans want more threads than one block per row gives);
    `SSMC_CUDA_ROW_RECURRENCE=1` wherever the loops allow it."""
    if not fused.staged:
        return False
    whole = runner_for(fused.program, compute)
    if whole.row_threads(sizes) is None:
        return False
    if options().row_recurrence is True:
        return True
    core = runner_for(fused.core.program, compute)
    # it beat the thread-per-recurrence core (see bench/results/2026-11-27-from-code-comments.md); the
    # lanes core is not measured here yet
    return whole.owns_rows(sizes) and core.strategy(sizes, length, time_contiguous, lanes=False) == "fused"


def layer_runner(fused: Fused, compute: str, staged):
    """The run function of a staged layer (runner contract): its `staged` run, or where
    `one_kernel` says so the whole program as one "rows" kernel."""
    whole = runner_for(fused.program, compute)
    if whole.row_axis is None:
        return staged

    def run(seqs, params, initial, sizes, length, out_dtype=None):
        contiguous = time_contiguous(seqs)
        if whole.planned("one kernel", lambda: one_kernel(fused, compute, sizes, length, contiguous),
                          _sizes_key(sizes), length, contiguous):
            return whole.run(seqs, params, initial, sizes, length, out_dtype)
        return staged(seqs, params, initial, sizes, length, out_dtype)
    return run


_RUNNERS: dict[tuple, CudaRunner] = {}


def runner_for(program, compute: str = "float32", map_reduce: bool = True) -> CudaRunner:
    key = (program, compute) if map_reduce else (program, compute, False)
    if key not in _RUNNERS:
        _RUNNERS[key] = CudaRunner(program, compute, map_reduce)
    return _RUNNERS[key]
