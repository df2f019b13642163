"""Loop nests -> CUDA C (one thread per parallel index; sizes and strides baked in as constants).

A kernel is specialised to one shape: sizes become ``constexpr`` so per-thread buffers (a state
row of N values) are fixed-size arrays the compiler keeps in registers when loops over them are
unrolled; strides become constants so any layout (time contiguous or not) is read in place.
"""

from __future__ import annotations

import math
import re
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache
from importlib import resources

import jinja2

from ... import __version__
from ...ir.ops import LEAVES, Op
from ...lowering.loops import (
    ARRAY_MARK,
    Assign,
    Bin,
    Buffer,
    Call,
    InRange,
    Load,
    Loop,
    Num,
    Select,
    Var,
    free_names,
    loads,
    walk,
)
from ...lowering.plan import Kernel, Lowered, size_var
from ...lowering.reverse_warp import FusedBackward
from ...lowering.split_sum import row_accumulators, split_axis
from ...lowering.state_major import (
    STEP,
    FusedStateMajor,
    StateMajor,
    fused_state_major,
    scalar_name,
    share,
    warp_state_major,
)
from ...lowering.time_blocks import partial_name, product_name
from .kernels import environment, template

BLOCK = 128
WARP = 32
UNROLL_LIMIT = 64  # loop nests of at most this many iterations are unrolled (buffers stay in registers)
PARAM_REGISTERS = 64  # param values a warp kernel's thread may load once, before time, into registers
# A warp kernel whose states hold at most STATE_REGISTERS values per lane is built for MIN_BLOCKS blocks
# per SM (launch bounds: at most 65536 / (MIN_BLOCKS * BLOCK) = 128 registers). Left to itself ptxas gave
# the Mamba-1 forward (16 states a lane) 168 registers, 3 blocks per SM, and it ran 7% slower (H200).
STATE_REGISTERS = 16
MIN_BLOCKS = 4
SUM_UNROLL = 4     # a long loop accumulating into scalars runs this many iterations' loads at once
MAX_GROUPS = 16    # split-K (lowering/split_sum.py): at most this many groups of threads per sum...
GROUP_STEPS = 64   # ...each with at least this many terms
ROW_THREADS = 512  # a row kernel's block (lowering/split_sum.py, cooperative rows): ROW_THREADS / G rows of G threads
RECURRENCE_ROW_THREADS = 128  # a recurrence's rows (time inside): at least this many threads per block
ROW_UNROLL = 8     # a recurrence row's thread unrolls its loops over the row axis up to this many indices
STATIC_SHARED = 48 * 1024  # bytes of static shared memory a block may declare
SM_REGISTERS = 65536       # 4-byte registers an SM has for its threads (sm_80, sm_90)
SM_SHARED = 233472         # bytes of shared memory an SM has for its blocks (H100 / H200)...
SM_BLOCK_SHARED = 1024     # ...of which each block takes this many more than it declares
BOUNDED_REGISTERS = 128    # registers a thread where a kernel's `__launch_bounds__` asks for more blocks an SM...
BOUNDED_LANE_VALUES = 16   # ...in a lanes kernel whose lane holds at most this many state values x steps (S x G)

C_TYPES = {"float32": "float", "float64": "double", "float16": "__half", "bfloat16": "__nv_bfloat16"}
_FUNCS = {"exp": "exp_", "exp2": "exp2_", "log": "log_", "sqrt": "sqrt_", "rsqrt": "rsqrt_", "abs": "abs_",
          "tanh": "tanh_", "erf": "erf_", "max": "max_", "min": "min_", "pow": "pow_"}
_OPS = {"and": "&&", "or": "||"}


@dataclass(frozen=True)
class ArraySpec:
    """How one global array is laid out: element type and element strides per (kernel) axis."""

    dtype: str                     # float32 | float64 | float16 | bfloat16
    strides: tuple[int, ...]
    group_stride: int = 0          # split-K partials: the offset between groups' copies (0: one copy)


def contiguous_strides(shape) -> tuple[int, ...]:
    """Element strides of a C-contiguous array of `shape` (a 0-d one as one element)."""
    strides, acc = [], 1
    for n in reversed(list(shape) or [1]):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Threads:
    """How a time-blocked kernel maps its threads: `time_fastest` puts consecutive blocks of time on
    consecutive threads (for arrays with time contiguous; a sum over time then takes every nblk-th
    step, so that lanes read neighbouring steps), `groups` divide the sum over `split` (split-K).
    With `row`, the groups are threads of one block sharing each row of a map kernel along `split`
    (cooperative rows, lowering/split_sum.py): their partial sums are combined in shared memory and
    every group goes on with the row's total; nothing is left for the runner to add. With
    `recurrence` as well, a row is a recurrence with time inside each thread (split_sum.py,
    `recurrence_row_axis`): its G threads are consecutive and own their indices of the row axis
    for the whole sequence. `warps` > 1: the warp kernel's block of that many warps shares one
    recurrence, each round's steps split among them (`_combine_across_warps`). `lanes`: the lanes
    kernels' lanes a row, `block` their threads a block, `chunk` the lanes backward's steps a chunk."""

    time_fastest: bool = False
    groups: int = 1
    split: str | None = None
    row: bool = False
    recurrence: bool = False
    warps: int = 1
    lanes: int = 0
    block: int = 0
    chunk: int = 0

    @property
    def rows_per_block(self) -> int:
        return max(1, (RECURRENCE_ROW_THREADS if self.recurrence else ROW_THREADS) // self.groups)

    def describe(self) -> str:
        """What `ssmc inspect` adds to the kernel's strategy ("" for the default mapping)."""
        if self.warps > 1:
            return f"{self.warps} warps a recurrence"
        if self.lanes:
            return f"{self.lanes} lanes a row" + (f", chunks of {self.chunk} steps" if self.chunk else "")
        if self.groups == 1:
            return ""
        return f"{'rows' if self.row else 'split-K'} {self.split}/{self.groups}"


ONE_GROUP = Threads()  # the default mapping: the last parallel axis fastest, one group


def split_groups(k: Kernel, sizes: dict[str, int]) -> tuple[str | None, int]:
    """The axis a kernel's sum is divided along and into how many groups (1: not divided)."""
    axis = split_axis(k, sizes)
    if axis is None:
        return None, 1
    return axis, max(1, min(MAX_GROUPS, sizes[axis] // GROUP_STEPS))


class CPrinter:
    """C text for a kernel's loop nests; `staged` arrays (the warp kernel's) are read from / written
    to shared memory at the lane's slot instead of global memory."""

    def __init__(self, k: Kernel, arrays: dict[str, ArraySpec], sizes: dict[str, int], staged=frozenset(),
                 threads: Threads = ONE_GROUP, registers: dict[str, str] | None = None,
                 param_registers: dict[str, tuple[int, ...]] | None = None, vectors: dict | None = None,
                 one_value: bool = False, views: dict | None = None):
        self.k = k
        # arrays printed another way than their kind says (the lanes kernel's shared-memory stages and
        # per-lane registers): name -> function of the Load giving its C text
        self.views = views or {}
        # loads a lane made for all its steps at once (`_vector_loads`): (array, index) -> register array
        self.vectors = vectors or {}
        self.arrays = arrays
        self.sizes = sizes
        self.staged = staged
        # arrays a lane keeps in registers, one row per step of its block (the fused backward's
        # carries): name -> register array; indexed [tt][local indices], or [tt] only with `one_value`
        # (state-major: the registers hold the values of one index of the states' own axes)
        self.registers = registers or {}
        self.local_positions = {a.name: [] if one_value else
                                [i for i, ax in enumerate(a.axes) if ax != "t" and ax not in k.parallel]
                                for a in k.arrays if a.name in self.registers}
        # params loaded once into registers rp_<name> (`param_registers`): name -> its local positions
        self.param_registers = param_registers or {}
        self.split = threads.split if threads.groups > 1 else None
        self.groups = threads.groups
        self.buffers = {s.name for s in walk(k.setup + k.step + k.finish) if isinstance(s, Buffer)}
        # a row kernel: after each top-level loop over the row axis, its accumulators combined
        self.row = threads.row and self.split is not None
        self.combine = row_accumulators(k, self.split) if self.row else {}
        if self.row and self.combine is None:
            raise ValueError(f"{k.name}: rows along {self.split} cannot be shared (lowering/split_sum.py)")
        row_extent = size_var(self.split) if self.row else None
        # a recurrence row's thread: its indices of the row axis, one per unrolled iteration j
        self.per_thread = -(-sizes[self.split] // self.groups) if self.row and threads.recurrence else 0
        # a row kernel's buffer along the row axis holds its group's indices only: [i / G] (a
        # recurrence's: [j], the iteration of the loop over its own indices)
        self.compact = {s.name: tuple(d == row_extent for d in s.shape)
                        for s in walk(k.setup + k.step + k.finish) if isinstance(s, Buffer) and row_extent in s.shape}

    def index(self, e: Load) -> str:
        spec = self.arrays[e.array]
        terms = [f"({i}) * {s}LL" if s != 1 else f"({i})" for i, s in zip(e.index, spec.strides) if s != 0]
        if spec.group_stride:
            terms.append(f"(grp) * {spec.group_stride}LL")
        return " + ".join(terms) or "0"

    def expr(self, e) -> str:
        if isinstance(e, Num):
            v = e.value
            if math.isinf(v):  # by bit pattern: NVRTC without headers has no INFINITY / NAN
                return "F(__int_as_float(0x7f800000))" if v > 0 else "F(-__int_as_float(0x7f800000))"
            if math.isnan(v):
                return "F(__int_as_float(0x7fc00000))"
            return f"F({v!r})"
        if isinstance(e, Var):
            return e.name
        if isinstance(e, Load):
            if e.array in self.views:
                return self.views[e.array](e)
            if e.array in self.compact:
                own = f"[j_{self.split}]" if self.per_thread else None
                return e.array + "".join((own or f"[({i}) / {self.groups}]") if c else f"[{i}]"
                                         for i, c in zip(e.index, self.compact[e.array]))
            if e.array in self.buffers:
                return e.array + "".join(f"[{i}]" for i in e.index)
            if e.array in self.staged:
                return f"sm_{e.array}[w][slot]"
            if (e.array, e.index) in self.vectors:
                return f"{self.vectors[e.array, e.index]}[tt]"
            if e.array in self.registers:
                local = "".join(f"[{e.index[i]}]" for i in self.local_positions[e.array])
                return f"{self.registers[e.array]}[tt]{local}"
            if e.array in self.param_registers:
                return f"rp_{e.array}" + "".join(f"[{e.index[i]}]" for i in self.param_registers[e.array])
            return f"F(to_f({c_array(e.array)}[{self.index(e)}]))"
        if isinstance(e, Call):
            if e.fn == "not":
                return f"(!{self.expr(e.args[0])})"
            return f"{_FUNCS.get(e.fn, e.fn)}({', '.join(self.expr(a) for a in e.args)})"
        if isinstance(e, Bin):
            return f"({self.expr(e.a)} {_OPS.get(e.op, e.op)} {self.expr(e.b)})"
        if isinstance(e, Select):
            return f"(({self.expr(e.cond)}) ? ({self.expr(e.a)}) : ({self.expr(e.b)}))"
        if isinstance(e, InRange):
            return f"(({e.lo}) <= ({e.index}) && ({e.index}) < ({e.hi}))"
        raise TypeError(e)

    def target(self, t) -> str:
        if (isinstance(t, Var) or t.array in self.buffers or t.array in self.staged or t.array in self.registers
                or t.array in self.views):
            return self.expr(t)
        return f"{c_array(t.array)}[{self.index(t)}]"

    def stmts(self, stmts, depth: int, unrolled: int = 1, in_row: bool = False) -> list[str]:
        """C lines; `unrolled` is the trip count of the unrolled loops around these statements;
        `in_row`: inside a row kernel's loop over the row axis (each group's own indices)."""
        pad = "    " * depth
        out: list[str] = []
        for s in stmts:
            if isinstance(s, Loop):
                extent = self.sizes.get(s.extent[2:], None) if s.extent.startswith("n_") else None
                inner = unrolled
                split = self.split is not None and s.var == f"i_{self.split}"
                if split and self.per_thread:  # a recurrence row's own indices, unrolled (registers)
                    j, n = f"j_{self.split}", self.per_thread
                    out += [f"{pad}#pragma unroll{'' if n <= ROW_UNROLL else ' 1'}",
                            f"{pad}for (int {j} = 0; {j} < {n}; ++{j}) {{",
                            f"{pad}    const int {s.var} = grp + {j} * {self.groups};",
                            f"{pad}    if ({s.var} >= {s.extent}) break;"]
                    out.extend(self.stmts(s.body, depth + 1, unrolled * min(n, ROW_UNROLL), True))
                    out.append(f"{pad}}}")
                    out.extend(self._combine(s, pad))
                    continue
                if extent is not None and unrolled * extent <= UNROLL_LIMIT and not split:
                    out.append(f"{pad}#pragma unroll")
                    inner = unrolled * extent
                elif _scalar_sum(s) or (self.row and split and all(isinstance(b, Assign) for b in s.body)):
                    # independent terms (or a row kernel's independent stores): several loads in flight
                    out.append(f"{pad}#pragma unroll {SUM_UNROLL}")
                else:  # a big nest stays a loop: its buffers live in local memory instead of spilling
                    out.append(f"{pad}#pragma unroll 1")
                if split:  # this group's terms of the split sum (lowering/split_sum.py)
                    out.append(f"{pad}for (int {s.var} = grp; {s.var} < {s.extent}; {s.var} += {self.groups}) {{")
                else:
                    out.append(f"{pad}for (int {s.var} = 0; {s.var} < {s.extent}; ++{s.var}) {{")
                out.extend(self.stmts(s.body, depth + 1, inner, in_row or (self.row and split)))
                out.append(f"{pad}}}")
                out.extend(self._combine(s, pad))
            elif isinstance(s, Buffer):
                own = str(self.per_thread) if self.per_thread else None
                shape = [(own or f"(({d}) + {self.groups - 1}) / {self.groups}") if c else d
                         for d, c in zip(s.shape, self.compact.get(s.name, [False] * len(s.shape)))]
                out.append(f"{pad}F {s.name}" + "".join(f"[{d}]" for d in shape) + ";")
            elif isinstance(s, Assign):
                value = self.expr(s.value)
                target = self.target(s.target)
                global_store = (isinstance(s.target, Load) and s.target.array not in self.buffers
                                and s.target.array not in self.staged and s.target.array not in self.registers
                                and s.target.array not in self.views)
                if s.op == "atomic+=":  # many threads add into it: an array in the compute type
                    out.append(f"{pad}atomicAdd(&{target}, {value});")
                    continue
                if global_store:
                    ctype = C_TYPES[self.arrays[s.target.array].dtype]
                    value = f"from_f<{ctype}>({value})" if ctype not in ("float", "double") else f"({ctype})({value})"
                if global_store and self.row:  # past the rows: no store; a value the row shares: one
                    pad_if = f"{pad}if ({'valid' if in_row else 'lead'}) "
                else:
                    pad_if = pad
                if s.op == "=":
                    out.append(f"{pad_if}{target} = {value};")
                elif s.op == "+=":
                    out.append(f"{pad_if}{target} += {value};")
                else:
                    out.append(f"{pad_if}{target} = max_({target}, {value});")
            else:
                raise TypeError(s)
        return out

    def _combine(self, loop: Loop, pad: str) -> list[str]:
        """After a top-level loop over the row axis: the groups' partials of what it accumulates,
        combined into the row's total (every thread of the block reaches this line)."""
        out = []
        for name, op in self.combine.get(id(loop), ()):
            if self.per_thread:  # consecutive threads: shuffles in a warp, then across its warps
                fn = "group_sum" if op == "+=" else "group_max"
                out.append(f"{pad}{name} = {fn}<{self.groups}>({name}, ssmc_part);")
            else:
                fn = "row_sum" if op == "+=" else "row_max"
                out.append(f"{pad}{name} = {fn}<{self.groups}>({name}, ssmc_part, ssmc_first, ssmc_stride);")
        return out

    def scalars(self) -> list[str]:
        names = []
        for s in walk(self.k.setup + self.k.step + self.k.finish):
            if isinstance(s, Assign) and isinstance(s.target, Var) and s.target.name not in names:
                names.append(s.target.name)
        return [f"F {n} = F(0);" for n in names]


def _scalar_sum(loop: Loop) -> bool:
    """An innermost loop that accumulates (its iterations' terms are independent until added)."""
    body = loop.body
    return all(isinstance(s, Assign) for s in body) and any(s.op == "+=" for s in body)


def _staged_prev(k: Kernel, arrays: dict[str, ArraySpec]) -> list[str]:
    """Carries `prev_*` a thread-per-recurrence kernel writes one value of per step, into an array
    with time contiguous: written through shared memory, 32 steps at a time, so that a warp's
    writes are coalesced (a thread writing its own steps would touch a line per lane and step). As
    many as the block's static shared memory holds (the others are written directly)."""
    if k.time_blocks:
        return []
    parallel = set(k.parallel)
    staged, room = [], STATIC_SHARED
    for a in k.arrays:
        if (a.role == "prev" and set(a.axes[1:]) <= parallel and arrays[a.name].strides[0] == 1
                and len(a.axes) > 1):
            need = BLOCK * (WARP + 1) * (8 if arrays[a.name].dtype == "float64" else 4)
            if need <= room:
                staged.append(a.name)
                room -= need
    return staged


def _flush_prev(k: Kernel, pr: CPrinter, staged: list[str]) -> list[str]:
    """C lines writing row `r`'s staged steps (`count` from `base`) of every staged carry, the warp's
    active lanes taking consecutive steps."""
    step = "t1 - 1 - (base + s)" if k.reverse else "t0 + base + s"
    index = {a.name: a for a in k.arrays}
    out = []
    for name in staged:
        a = index[name]
        at_zero = pr.index(Load(name, ("0", *(f"p_{ax}" for ax in a.axes[1:]))))
        value = _store(pr.arrays[name].dtype, f"sm_{name}[ssmc_row0 + r][s]")
        out += [f"const long long o_{name} = __shfl_sync(lanes, (long long)({at_zero}), r);",
                f"for (int s = lane; s < count; s += nact) {c_array(name)}[o_{name} + ({step})] = {value};"]
    return out


def _unflatten(parallel) -> list[str]:
    """C lines splitting the flat index `p` into one index `p_<axis>` per parallel axis (the last fastest)."""
    lines, rest = [], "p"
    for a in reversed(parallel):
        lines += [f"const int p_{a} = (int)({rest} % {size_var(a)});",
                  f"const long long rest_{a} = {rest} / {size_var(a)};"]
        rest = f"rest_{a}"
    return lines


def kernel_context(k: Kernel, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                   threads: Threads = ONE_GROUP) -> dict:
    staged = _staged_prev(k, arrays)
    pr = CPrinter(k, arrays, sizes, frozenset(staged), threads=threads)
    params = []
    for a in k.arrays:
        ctype = C_TYPES[arrays[a.name].dtype]
        const = "const " if a.role in ("seq", "param", "init") else ""
        params.append(f"{const}{ctype}* __restrict__ {c_array(a.name)}")
    constants = [f"constexpr int {size_var(a)} = {sizes[a]};" for a in k.sizes]
    total = " * ".join(str(sizes[a]) for a in k.parallel) or "1"
    constants.append(f"constexpr long long total = {total};")
    unflatten = _unflatten(k.parallel)
    par = " ".join(k.parallel) or "-"
    comment = f"{k.program.name}: one thread per [{par}]" + (" and block of time" if k.time_blocks else "")
    row = threads.row and threads.groups > 1
    if row and threads.recurrence:
        comment = (f"{k.program.name}: a recurrence per [{par}], time inside, {threads.groups} threads per "
                   f"recurrence, each owning every {threads.groups}-th {threads.split}; "
                   f"{threads.rows_per_block} per block")
    elif row:
        comment = (f"{k.program.name}: a row per [{par}] and step, {threads.groups} threads per row, each taking "
                   f"every {threads.groups}-th {threads.split}; {threads.rows_per_block} rows per block")
    elif threads.groups > 1:
        comment += f" and group of {threads.split} ({threads.groups} groups, partial sums)"
    if threads.time_fastest:
        comment += ", consecutive threads along time"
    return {
        "template": template("rows.cu.j2" if row and threads.recurrence else "map_rows.cu.j2" if row
                             else "thread.cu.j2"),
        "name": k.name,
        "comment": comment,
        "time_fastest": threads.time_fastest,
        "interleaved": threads.time_fastest and k.sum_over_time,
        "groups": threads.groups,
        "row": row and not threads.recurrence,
        "row_recurrence": row and threads.recurrence,
        "rows_per_block": threads.rows_per_block,
        "params": params,
        "constants": constants,
        "unflatten": unflatten,
        "declarations": pr.scalars(),
        "reverse": k.reverse,
        "setup": "\n".join(pr.stmts(k.setup, 1)),
        "step": "\n".join(pr.stmts(k.step, 2)),
        "finish": "\n".join(pr.stmts(k.finish, 1)),
        "stage_prev": [f"__shared__ F sm_{a}[{BLOCK}][{WARP + 1}];" for a in staged],
        "flush_prev": _flush_prev(k, pr, staged),
    }


def warp_kernel_context(k: Kernel, summary: Kernel, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                        steps_per_lane: int, round_steps: int = 0, ragged: bool = True, warps: int = 1) -> dict:
    """The warp kernel (lowering/time_blocks.py) of the program step `k`: the `summary` step and
    `k`'s spliced around a scan of the (product, partial) pairs across the warp's lanes. Where `k`
    has arrays ``rounds_<state>`` (lowering/reverse_warp.py), the lane whose steps start a round of
    `round_steps` (the fused backward's) writes its carry there. `warps` > 1 (`shares_recurrence`):
    a block of that many warps per recurrence, a round of warps x 32 x K steps."""
    program = k.program
    if warps > 1 and not shares_recurrence(k, summary):
        raise ValueError(f"{k.name}: only a warp kernel with scalar states, without rounds, can share a "
                         "recurrence among warps")
    stage_len = WARP * (steps_per_lane + 1)  # a slot skipped after each lane's steps: no bank conflicts
    block_warps = warps if warps > 1 else BLOCK // WARP
    value_bytes = 8 if any(a.dtype == "float64" for a in arrays.values()) else 4  # F: double where any is
    room = STATIC_SHARED - 4 * warps * len(program.states) * value_bytes  # less the warps' aggregates
    staged = _within(_stageable(k.arrays, (summary, k), set(k.parallel)), block_warps * stage_len * value_bytes, room)
    ctx = kernel_context(k, arrays, sizes)
    ctx["template"] = template("warp.cu.j2")
    in_registers = param_registers((summary, k), set(k.parallel), sizes)
    major = warp_state_major(summary, k)
    unrolled = major is not None and _state_loop_unrolled(program.states, set(k.parallel), sizes, steps_per_lane)
    # Params stay in registers only in the state-major kernel that saves the backward's rounds: the
    # plain forward then fits 128 registers, 4 blocks per SM (Mamba-1 B8 D1536 L2048 on an H200: 0.62
    # against 0.96 ms), where the rounds kernel ran faster with them (0.66 against ~0.9 ms). Indexed by
    # a rolled loop, a register array would be local memory.
    if major is not None and not round_steps:
        in_registers = {}
    elif major is not None and not unrolled:
        in_registers = {name: local for name, local in in_registers.items() if not local}
    ps = CPrinter(summary, arrays, sizes, staged, param_registers=in_registers)
    pr = CPrinter(k, arrays, sizes, staged, param_registers=in_registers)
    ctx["shared"] = [f"__shared__ F sm_{a}[{block_warps}][{stage_len}];" for a in sorted(staged)]
    ctx["shared"] += [f"__shared__ F sm_agg_{s.name}[2][{warps}][2];  // the warps' (product, partial), two rounds"
                      for s in program.states if warps > 1]
    ctx["warps"] = warps
    index = {a.name: a for a in k.arrays}
    ctx["stage_in"] = [(a, f"F(to_f({c_array(a)}[{pr.index(_at_t(index[a]))}]))")
                       for a in sorted(staged) if index[a].role == "seq"]
    ctx["stage_out"] = [f"if (valid) {c_array(a)}[{pr.index(_at_t(index[a]))}] = "
                        f"{_store(arrays[a].dtype, f'sm_{a}[w][slot]')};"
                        for a in sorted(staged) if index[a].role == "out"]
    ctx["vector_stage"] = major is None and _vector_stage(k, staged, arrays, steps_per_lane)
    if ctx["vector_stage"]:
        at = {a: f"{c_array(a)} + ({pr.index(_at_t(index[a]))})" for a in staged}
        ctx["stage_in_at"] = [(a, at[a]) for a in sorted(staged) if index[a].role == "seq"]
        ctx["stage_out_at"] = [(a, at[a]) for a in sorted(staged) if index[a].role == "out"]
        width = 4 * _vector_width(steps_per_lane)
        ctx["aligned"] = " && ".join(f"(unsigned long long){c_array(a)} % {width} == 0" for a in sorted(staged))
    declared = set(ctx["declarations"])
    ctx["declarations"] += [d for d in ps.scalars() if d not in declared]
    per = f"a block of {warps} warps" if warps > 1 else "one warp"
    ctx["comment"] = (f"{program.name}: {per} per [{' '.join(k.parallel) or '-'}], its lanes over blocks "
                      f"of {steps_per_lane} steps")
    ctx["steps_per_lane"] = steps_per_lane
    small = _state_values(program.states, set(k.parallel), sizes) <= STATE_REGISTERS
    ctx["bounds"] = f"__launch_bounds__({BLOCK}, {MIN_BLOCKS}) " if small and major is None else ""
    if warps > 1:
        ctx["bounds"] = f"__launch_bounds__({warps * WARP}) "
    loads = _load_param_registers(in_registers, (summary, k), pr)
    ctx["summary_setup"] = "\n".join(["    " + line for line in loads] + ps.stmts(summary.setup, 1))
    ctx["summary_step"] = "\n".join(ps.stmts(summary.step, 3))
    ctx["step"] = "\n".join(pr.stmts(k.step, 3))
    ctx["finish"] = "\n".join(CPrinter(k, arrays, sizes).stmts(k.finish, 2))
    scan = _lane_scan(program.states, set(k.parallel), sizes, warps=warps)
    save = [f"{head}{c_array(name)}[{pr.index(Load(name, (f't0 / {round_steps}', *env)))}]"
            f" = {_store(arrays[name].dtype, f'st_{s}{idx}')};"
            for s, head, idx, env, name in _round_arrays(k)]
    if save:  # after the combine: st_<s> is the carry into this lane's steps
        save = [f"if (t0 < L && t0 % {round_steps} == 0) {{  // this lane's steps start a round of the backward",
                *(f"    {line}" for line in save), "}"]
    pad = "    "
    ctx["carry"] = "\n".join(pad + line for line in scan.carry)
    ctx["reset"] = "\n".join(2 * pad + line for line in scan.reset)
    ctx["combine"] = "\n".join(2 * pad + line for line in scan.combine + save)
    ctx["final_carry"] = "\n".join(pad + line for line in scan.final)
    ctx["state_major"] = ""
    if major is not None:
        first, second = share(*major)
        per_step = list(dict.fromkeys(second.per_step + first.per_step))
        seqs = {a.name for a in k.arrays if a.role == "seq"}
        vectors = _vector_loads(first.body + second.body, seqs, k.reverse, arrays, steps_per_lane)
        pm = CPrinter(k, arrays, sizes, staged, param_registers=in_registers)
        pv = CPrinter(k, arrays, sizes, staged, param_registers=in_registers, vectors=vectors)
        for printer in (pm, pv):  # the summary's buffers (values hoisted before time) are arrays here too
            printer.buffers |= set(per_step) | {s.name for s in summary.setup if isinstance(s, Buffer)}
        names = _scalar_names(summary.setup + k.setup + k.finish + second.pre + first.pre + second.post)
        names += [n for n in first.scalars + second.scalars if n not in names]
        ctx["declarations"] = ([f"F {n} = F(0);" for n in names if n not in per_step]
                               + [f"F {n}[{steps_per_lane}];  // one per step of the lane" for n in per_step])
        ctx["declarations"] += [f"F sv_{s.name}" + "".join(f"[{size_var(a)}]" for a in s.axes if a not in k.parallel)
                                + ";  // the carries into this lane's steps, for the backward"
                                for s in program.states if s.name in {n for n, *_ in _round_arrays(k)}]
        ctx["state_major"] = "\n".join(_state_major_lines(first, second, k, (pv, pm), steps_per_lane,
                                                          round_steps, unrolled, ragged))
        ctx["comment"] += ", the states' own axes outside the steps"
    return ctx


# The state-major warp kernel (lowering/state_major.py) unrolls its loop over the states' own axes
# (their values in registers) while that loop times the lane's steps is at most this.
STATE_MAJOR_UNROLL = 128


def _state_loop_unrolled(states, parallel: set[str], sizes: dict[str, int], steps_per_lane: int) -> bool:
    own = [a for a in states[0].axes if a not in parallel]
    return math.prod(sizes[a] for a in own) * steps_per_lane <= STATE_MAJOR_UNROLL


def _scalar_names(stmts) -> list[str]:
    """The scalars `stmts` assign, in order of first assignment."""
    names = []
    for s in walk(stmts):
        if isinstance(s, Assign) and isinstance(s.target, Var) and s.target.name not in names:
            names.append(s.target.name)
    return names


def _lane_steps_loop(depth: int, k: Kernel, steps_per_lane: int, body: list[str], mode: str) -> list[str]:
    """C lines of a loop over this lane's steps (unrolled; `t` and `slot` bound) around `body`.
    `mode` "full": every lane has all its steps (straight-line code); "exit": the loop ends after
    the lane's last step; "live": straight-line too, steps past L read the last step (`t` clamped)
    and `live` is false for them (their results are dropped: `_predicated`)."""
    pad = "    " * depth
    at = "min(t0 + tt, L - 1)" if mode == "live" else "t0 + tt"
    t = f"L - 1 - ({at})" if k.reverse else at
    head = {"full": [], "exit": [f"{pad}    if (tt >= t1 - t0) break;"],
            "live": [f"{pad}    const bool live = tt < t1 - t0;"]}[mode]
    return [f"{pad}#pragma unroll",
            f"{pad}for (int tt = 0; tt < {steps_per_lane}; ++tt) {{",
            *head,
            f"{pad}    const int t = {t};",
            f"{pad}    const int slot = lane * {steps_per_lane + 1} + tt;",
            *body,
            f"{pad}}}"]


def _predicated(body: list, carried: set[str]) -> list:
    """`body` with its assignments to the `carried` scalars kept only for live steps."""
    return [Assign(s.target, Select(Var("live"), s.value, s.target), s.op)
            if isinstance(s.target, Var) and s.target.name in carried and s.op == "=" else s for s in body]


def _vector_loads(body: list, seqs: set[str], reverse: bool, arrays: dict[str, ArraySpec],
                  steps_per_lane: int) -> dict:
    """Loads of `body` (state-major: inside the loop over the states' own axes) that a lane can make
    for its K steps at once, as K // 4 (K // 2) vector loads: float32 sequences (names in `seqs`)
    with time contiguous whose other strides keep a lane's first step aligned (multiples of K), in
    a program not `reverse` in time, K even. (array, index) -> the register array ``ld<j>``
    (indexed by the step)."""
    if reverse or steps_per_lane % 2:
        return {}
    out = {}
    for s in body:
        for e in loads(s.value):
            spec = arrays.get(e.array)
            if (e.array in seqs and spec.dtype == "float32" and spec.strides[0] == 1 and e.index[0] == "t"
                    and all(st % steps_per_lane == 0 for st in spec.strides[1:])
                    and not any("t" in _words(i) for i in e.index[1:]) and (e.array, e.index) not in out):
                out[e.array, e.index] = f"ld{len(out)}"
    return out


def _words(index: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", index))


def _state_major_lines(first: StateMajor, second: StateMajor, k: Kernel, printers: tuple[CPrinter, CPrinter],
                       steps_per_lane: int, round_steps: int, unrolled: bool, ragged: bool) -> list[str]:
    """A round of the state-major warp kernel (lowering/state_major.py), twice: for a round whose
    lanes all have their K steps, straight-line code, in which the scheduler overlaps one state
    value's scan across the lanes with the next one's chains (with an exit per step in between, the
    rounds were latency-bound: Mamba-1 B8 D1536 L2048 on an H200 1.57 against 0.96 ms), loads along
    the states' axes made as vectors (`_vector_loads`) where the arrays are aligned; and for the
    last, partial, round (and unaligned arrays)."""
    vector, scalar = printers
    full = _state_major_round(first, second, k, vector, steps_per_lane, round_steps, unrolled, "full")
    # A partial last round (`ragged`: the length is no multiple of the round) runs straight-line too,
    # unless a step stores along the states' axes (a step past L would). Where every round is full,
    # the other branch only takes unaligned arrays, with exits: straight-line, its registers slowed
    # the full rounds' code (Mamba-1 B8 D1536 L2048 on an H200: 0.80 against 0.62 ms).
    stores = any(isinstance(s.target, Load) and s.target.array not in scalar.buffers
                 for s in first.body + second.body)
    partial = _state_major_round(first, second, k, scalar, steps_per_lane, round_steps, unrolled,
                                 "live" if ragged and not stores else "exit")
    return _full_or_partial(full, partial, steps_per_lane, {a for a, _ in vector.vectors})


def _full_or_partial(full: list[str], partial: list[str], steps_per_lane: int, vectors: set[str]) -> list[str]:
    """C lines running the round's `full` code where every lane has all its steps and the arrays
    accessed as vectors (`vectors`) are aligned, its `partial` code otherwise."""
    align = 4 * _vector_width(steps_per_lane)
    aligned = "".join(f" && (unsigned long long){c_array(a)} % {align} == 0" for a in sorted(vectors))
    return [f"        if (base + {WARP * steps_per_lane} <= L{aligned}) {{  // every lane has all its steps",
            *("    " + line for line in full),
            "        } else {",
            *("    " + line for line in partial),
            "        }"]


def _state_major_round(first: StateMajor, second: StateMajor, k: Kernel, pm: CPrinter, steps_per_lane: int,
                       round_steps: int, unrolled: bool, mode: str) -> list[str]:
    """One round: the steps' values, then per index of the states' own axes the summary's chain
    over the lane's steps, the scan across the lanes and the step's chain, then what reads the sums
    over those axes. `mode`: of the chains' loops (`_lane_steps_loop`); the loops before and after
    the chains exit after the lane's last step unless the round is full."""
    parallel = set(k.parallel)
    states = k.program.states
    own = [a for a in states[0].axes if a not in parallel]
    depth = 2 + len(own)
    outer = "full" if mode == "full" else "exit"
    summary = first.body
    if mode == "live":  # a step past L leaves the summary as it was
        summary = _predicated(summary, {scalar_name(f"st_{f(s.name)}") for s in states
                                        for f in (product_name, partial_name)})
    lines = _lane_steps_loop(2, k, steps_per_lane, pm.stmts(second.pre + first.pre, 3), outer)
    for i, a in enumerate(own):
        pad = "    " * (2 + i)
        lines += [f"{pad}#pragma unroll" if unrolled else f"{pad}#pragma unroll 1",
                  f"{pad}for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a}) {{  // one state value at a time"]
    pad = "    " * depth
    for (array, index), reg in pm.vectors.items():  # this lane's K steps of each, at once
        first_step = pm.index(Load(array, ("t0", *index[1:])))
        lines += [f"{pad}F {reg}[{steps_per_lane}];",
                  f"{pad}load_steps<{steps_per_lane}>({reg}, {c_array(array)} + {first_step});"]
    lines += _summary_identity(states, pad)
    lines += _lane_steps_loop(depth, k, steps_per_lane, pm.stmts(summary, depth + 1), mode)
    rounds = {name for name, *_ in _round_arrays(k)}
    for s in states:
        _, idx, env = _state_loops(s, parallel)
        lines += _combine_state_value(s.name, f"cr_{s.name}{idx}", pad)
        if s.name in rounds:  # kept for the store after the loop (a branch here would split the round)
            lines.append(f"{pad}sv_{s.name}{idx} = {scalar_name(f'st_{s.name}')};")
    lines += _lane_steps_loop(depth, k, steps_per_lane, pm.stmts(second.body, depth + 1), mode)
    lines += ["    " * (depth - 1 - i) + "}" for i in range(len(own))]
    for s in states:
        if s.name in rounds:  # this lane's steps start a round of the backward: its carries are saved
            head, idx, env = _state_loops(s, parallel)
            at = pm.index(Load(f"rounds_{s.name}", (f"t0 / {round_steps}", *env)))
            store = _store(pm.arrays[f"rounds_{s.name}"].dtype, f"sv_{s.name}{idx}")
            lines += [f"        if (t0 < L && t0 % {round_steps} == 0) {{",
                      f"            {head}{c_array(f'rounds_{s.name}')}[{at}] = {store};", "        }"]
    lines += _lane_steps_loop(2, k, steps_per_lane, pm.stmts(second.post, 3), outer)
    return lines


def _summary_identity(states, pad: str) -> list[str]:
    """C lines starting the state-major summaries (scalars, one state index) of `states` at (1, 0)."""
    names = [(scalar_name(f"st_{product_name(s.name)}"), scalar_name(f"st_{partial_name(s.name)}")) for s in states]
    return [f"{pad}{prod} = F(1); {part} = F(0);" for prod, part in names]


def _combine_state_value(state: str, carry: str, pad: str, reverse: bool = False) -> list[str]:
    """C lines scanning one state value's summary across the lanes (`_combine_one`, state-major
    scalars): the carry into this lane's steps becomes ``v_st_<state>``, `carry` the one past the round."""
    prod, part = (scalar_name(f"st_{name(state)}") for name in (product_name, partial_name))
    return [f"{pad}{{", *(pad + line for line in _combine_one(prod, part, carry, scalar_name(f"st_{state}"), reverse)),
            f"{pad}}}"]


@dataclass
class _LaneScan:
    """C lines of the scan of (product, partial) pairs across a warp's lanes, per state:
    `carry` (cr_<s> from st_<s>, after the setup), `reset` (a round's summaries to identity),
    `combine` (each lane's carry into its steps, st_<s>, and the carry past the round, cr_<s>),
    `final` (st_<s> = cr_<s>)."""

    carry: list[str]
    reset: list[str]
    combine: list[str]
    final: list[str]


def _state_loops(s, parallel: set[str]) -> tuple[str, str, list[str]]:
    """(loop heads over the state's local axes, its local index, the index of each of its axes)."""
    local = [a for a in s.axes if a not in parallel]
    head = "".join(f"for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a}) " for a in local)
    return head, "".join(f"[i_{a}]" for a in local), [f"p_{a}" if a in parallel else f"i_{a}" for a in s.axes]


def _lane_scan(states, parallel: set[str], sizes: dict[str, int], reverse: bool = False,
               warps: int = 1) -> _LaneScan:
    """`_LaneScan` for `states`; `reverse`: lane 0 holds the latest steps of the round, the carry
    comes from the later side (a suffix scan, lanes after compose first); `warps` > 1: the block's
    warps share the recurrence (scalar states only: `_combine_across_warps`)."""
    carry, reset, combine, final = [], [], [], []
    for s in states:
        head, idx, _ = _state_loops(s, parallel)
        local = [a for a in s.axes if a not in parallel]
        if math.prod(sizes[a] for a in local) > UNROLL_LIMIT:  # unrolled, ptxas would try registers and spill
            head = "#pragma unroll 1\n" + head
        carry.append(f"F cr_{s.name}{''.join(f'[{size_var(a)}]' for a in local)};")
        carry += f"{head}cr_{s.name}{idx} = st_{s.name}{idx};".split("\n")
        prod, part = f"st_{product_name(s.name)}{idx}", f"st_{partial_name(s.name)}{idx}"
        reset += f"{head}{{ {prod} = F(1); {part} = F(0); }}".split("\n")
        lines = (_combine_across_warps(prod, part, f"cr_{s.name}", f"st_{s.name}", f"sm_agg_{s.name}", warps)
                 if warps > 1 else _combine_one(prod, part, f"cr_{s.name}{idx}", f"st_{s.name}{idx}", reverse))
        combine += [*f"{head}{{".split("\n"), *lines, "}"]
        final += f"{head}st_{s.name}{idx} = cr_{s.name}{idx};".split("\n")
    return _LaneScan(carry, reset, combine, final)


def _combine_one(prod: str, part: str, carry: str, into: str, reverse: bool = False) -> list[str]:
    """C lines (indented one level) scanning one state value's (product, partial) pairs across the
    lanes: `into` becomes the carry into this lane's steps, `carry` the carry past the round."""
    shfl, first, last = ("__shfl_down_sync", WARP - 1, 0) if reverse else ("__shfl_up_sync", 0, WARP - 1)
    return [
        f"    F P = {prod}, H = {part};",
        f"    if (lane == {first}) H = P * {carry} + H;  // the carry enters: H becomes the state past",
        *_inclusive_lane_scan(reverse, "inclusive: the lanes nearer the carry first", total_product=False),
        f"    const F into = {shfl}(0xffffffffu, H, 1);  // the state past the previous lane's steps",
        f"    {into} = lane == {first} ? {carry} : into;  // the carry into this lane's steps",
        f"    {carry} = __shfl_sync(0xffffffffu, H, {last});",
    ]


def _inclusive_lane_scan(reverse: bool, comment: str, total_product: bool) -> list[str]:
    """C lines (indented one level) of the shuffle scan of the (P, H) pairs across a warp's lanes
    (from lane 0 up, or `reverse` from lane 31 down): each lane's H becomes the state past its own
    and the earlier lanes' steps. `total_product`: P too becomes the whole prefix's product (the
    warp's total is used); else its last shuffle is skipped."""
    shfl = "__shfl_down_sync" if reverse else "__shfl_up_sync"
    before = f"lane + off < {WARP}" if reverse else "lane >= off"
    pb = (f"{shfl}(0xffffffffu, P, off);" if total_product
          else f"off < {WARP // 2} ? {shfl}(0xffffffffu, P, off) : F(1);  // the last P is unused")
    return [
        "    #pragma unroll",
        f"    for (int off = 1; off < {WARP}; off <<= 1) {{  // {comment}",
        f"        const F Hb = {shfl}(0xffffffffu, H, off);",
        f"        const F Pb = {pb}",
        f"        if ({before}) {{ H = P * Hb + H; P = P * Pb; }}",
        "    }",
    ]


def _combine_across_warps(prod: str, part: str, carry: str, into: str, totals: str, warps: int) -> list[str]:
    """C lines (indented one level) scanning one scalar state's (product, partial) pairs across the
    `warps` warps of a block that share its recurrence, the earlier steps on the lower warps: each
    warp's inclusive scan over its lanes, the warps' totals through shared memory (`totals`, two
    rounds' worth, so one barrier a round suffices), then the carry folded through the warps before
    this one. `into` becomes the carry into this lane's steps, `carry` the carry past the round (the
    same in every warp)."""
    return [
        f"    F P = {prod}, H = {part};",
        *_inclusive_lane_scan(False, "inclusive, within the warp", total_product=True),
        f"    if (lane == {WARP - 1}) {{ {totals}[par][wr][0] = P; {totals}[par][wr][1] = H; }}  // the warp's",
        "    const F Pe = __shfl_up_sync(0xffffffffu, P, 1), He = __shfl_up_sync(0xffffffffu, H, 1);  // exclusive",
        "    __syncthreads();",
        f"    F c = {carry};",
        "    #pragma unroll",
        f"    for (int j = 0; j < {warps}; ++j) {{  // c: the state past warps 0 .. j - 1",
        f"        if (j == wr) {into} = lane == 0 ? c : Pe * c + He;",
        f"        c = {totals}[par][j][0] * c + {totals}[par][j][1];",
        "    }",
        f"    {carry} = c;",
    ]


def _vector_stage(k: Kernel, staged, arrays: dict[str, ArraySpec], steps_per_lane: int) -> bool:
    """Whether the warp kernel moves its `staged` arrays a lane's own K steps at a time, as vectors
    (K // 4 float4 or K // 2 float2 per array), instead of K coalesced scalars: all float32, time
    contiguous, their other strides multiples of K (each lane's first step aligned; the pointers are
    checked when the kernel starts), K even, forward in time, and not state-major (which loads its
    own vectors, `_vector_loads`). The scan B8 D2048 L4096 on an H200 (hand-edited kernels,
    2026-11-25): 8 warps a channel 0.198 ms with scalars, 0.192 with vectors in."""
    if k.reverse or steps_per_lane % 2 or not staged:
        return False
    specs = [arrays[a] for a in staged]
    return all(s.dtype == "float32" and s.strides[0] == 1 and all(st % steps_per_lane == 0 for st in s.strides[1:])
               for s in specs)


def shares_recurrence(k: Kernel, summary: Kernel) -> bool:
    """Whether the warp kernel of `k` can spread one recurrence over several warps of a block
    (`_combine_across_warps`): its states scalar per recurrence (no own axes), not state-major, no
    carries saved for the fused backward's rounds."""
    parallel = set(k.parallel)
    return (warp_state_major(summary, k) is None and not any(a.role == "rounds" for a in k.arrays)
            and all(a in parallel for s in k.program.states for a in s.axes))


def recurrence_warps_fit(k: Kernel, summary: Kernel, steps_per_lane: int, value_bytes: int) -> int:
    """How many warps sharing one recurrence fit the static shared memory of a block: each stages a
    round of its sequences and outputs (`_stageable`) and keeps its states' totals."""
    staged = len(_stageable(k.arrays, (summary, k), set(k.parallel)))
    per_warp = (staged * WARP * (steps_per_lane + 1) + 4 * len(k.program.states)) * value_bytes
    return max(1, STATIC_SHARED // max(1, per_warp))


def _state_values(states, parallel: set[str], sizes: dict[str, int]) -> int:
    """How many state values one thread of a warp kernel holds (the sizes of the states' local axes)."""
    return sum(math.prod(sizes[a] for a in s.axes if a not in parallel) for s in states)


def _round_arrays(k: Kernel):
    """(state, loop heads, local index, array index, array name) of each ``rounds_<state>`` of `k`."""
    parallel = set(k.parallel)
    names = {a.name for a in k.arrays if a.role == "rounds"}
    for s in k.program.states:
        if f"rounds_{s.name}" in names:
            head, idx, env = _state_loops(s, parallel)
            yield s.name, head, idx, env, f"rounds_{s.name}"


def fused_backward_context(fb: FusedBackward, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                           steps_per_lane: int, state_major: bool = False) -> dict:
    """The fused backward kernel (lowering/reverse_warp.py): the forward's summary and carries and
    the adjoint's summary and step spliced around two lane scans, a round at a time, last first;
    with `state_major`, where `fused_state_major` applies, the states' own axes outside those."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    parallel = set(fb.parallel)
    registers = {f"prev_{s}": f"rg_{s}" for s in fb.carried} | {s: f"rg_{s}" for s in fb.carried}
    registers |= {f"out_{v}": f"rg_{v}" for v in fb.shared} | {v: f"rg_{v}" for v in fb.shared}
    staged = _stageable(fb.arrays, kernels, parallel)
    printers = [CPrinter(k, arrays, sizes, staged, registers=registers) for k in kernels]
    fs, fc, as_, ad = printers
    index = {a.name: a for a in fb.arrays}
    params = []
    for a in fb.arrays:
        const = "const " if a.role in ("seq", "param", "init", "rounds") else ""
        params.append(f"{const}{C_TYPES[arrays[a.name].dtype]}* __restrict__ {c_array(a.name)}")
    axes = sorted({a for k in kernels for a in k.sizes})
    constants = [f"constexpr int {size_var(a)} = {sizes[a]};" for a in axes]
    constants.append(f"constexpr long long total = {' * '.join(str(sizes[a]) for a in fb.parallel)};")
    unflatten = _unflatten(fb.parallel)
    declarations = []
    for pr in printers:
        declarations += [d for d in pr.scalars() if d not in declarations]
    stage_len = WARP * (steps_per_lane + 1)
    fwd_states = fb.backward.forward.states
    core_states = [s for s in fb.adjoint.program.states if s.name in fb.core]
    forward_scan = _lane_scan(fwd_states, parallel, sizes)
    adjoint_scan = _lane_scan(core_states, parallel, sizes, reverse=True)
    registers_decl = []
    load_round = []
    for s in fwd_states:
        head, idx, env = _state_loops(s, parallel)
        local = [size_var(a) for a in s.axes if a not in parallel]
        registers_decl.append(f"F rg_{s.name}[{steps_per_lane}]" + "".join(f"[{d}]" for d in local) + ";"
                              "  // the carry before each of this lane's steps")
        registers_decl.append(f"F cr_{s.name}" + "".join(f"[{d}]" for d in local) + ";")
        at = fc.index(Load(f"rounds_{s.name}", ("r", *env)))
        load_round.append(f"{head}cr_{s.name}{idx} = F(to_f({c_array(f'rounds_{s.name}')}[{at}]));")
    for a in fb.forward_summary.arrays:  # values the forward's summary keeps for the later steps
        if a.role == "out" and a.name[len("out_"):] in fb.shared:
            local = "".join(f"[{size_var(x)}]" for x in a.axes[1:] if x not in parallel)
            registers_decl.append(f"F rg_{a.name[len('out_'):]}[{steps_per_lane}]{local};"
                                  "  // a value of each of this lane's steps, computed once")
    accumulate = []
    for name, axes_ in fb.partials.accumulators.items():
        s = fb.adjoint.program.decl(name)
        head, idx, _ = _state_loops(s, parallel)
        at = {a: (f"p_{a}" if a in parallel else f"i_{a}") for a in s.axes}
        target = f"{c_array(f'final_{name}')}[{ad.index(Load(f'final_{name}', tuple(at[a] for a in axes_) or ('0',)))}]"
        accumulate += [f"{head}{{  // this warp's sum of its threads' terms, added into the result",
                       f"    F v = st_{name}{idx};",
                       "    #pragma unroll",
                       f"    for (int off = {WARP // 2}; off > 0; off >>= 1)",
                       "        v += __shfl_xor_sync(0xffffffffu, v, off);",
                       f"    if (lane == 0) atomicAdd(&{target}, v);",
                       "}"]
    pad = "    "
    ctx = {
        "template": template("warp_backward.cu.j2"),
        "fused_backward": True,
        "name": fb.name,
        "comment": (f"{fb.backward.adjoint.name}: one warp per [{' '.join(fb.parallel)}], its lanes over blocks of "
                    f"{steps_per_lane} steps, rounds last first; the forward's carries recomputed in registers"),
        "params": params,
        "constants": constants,
        "unflatten": unflatten,
        "declarations": declarations,
        "steps_per_lane": steps_per_lane,
        "vector_stage": False,
        "shared": [f"__shared__ F sm_{a}[{BLOCK // WARP}][{stage_len}];" for a in sorted(staged)],
        "stage_in": [(a, f"F(to_f({c_array(a)}[{ad.index(_at_t(index[a]))}]))")
                     for a in sorted(staged) if index[a].role == "seq"],
        "stage_out": [f"if (valid) {c_array(a)}[{ad.index(_at_t(index[a]))}] = "
                      f"{_store(arrays[a].dtype, f'sm_{a}[w][slot]')};"
                      for a in sorted(staged) if index[a].role == "out"],
        "setup": "\n".join(line for pr, k in zip(printers, kernels) for line in pr.stmts(k.setup, 1)),
        "carry": "\n".join(pad + line for line in adjoint_scan.carry + registers_decl),
        "load_round": "\n".join(2 * pad + line for line in load_round),
        "forward_reset": "\n".join(2 * pad + line for line in forward_scan.reset),
        "forward_summary": "\n".join(fs.stmts(fb.forward_summary.step, 3)),
        "forward_combine": "\n".join(2 * pad + line for line in forward_scan.combine),
        "forward_step": "\n".join(fc.stmts(fb.forward_carries.step, 3)),
        "adjoint_reset": "\n".join(2 * pad + line for line in adjoint_scan.reset),
        "adjoint_summary": "\n".join(as_.stmts(fb.adjoint_summary.step, 3)),
        "adjoint_combine": "\n".join(2 * pad + line for line in adjoint_scan.combine),
        "adjoint_step": "\n".join(ad.stmts(fb.adjoint.step, 3)),
        "final_carry": "\n".join(pad + line for line in adjoint_scan.final),
        "finish": "\n".join(CPrinter(fb.adjoint, arrays, sizes).stmts(fb.adjoint.finish, 2)),
        "accumulate": "\n".join(pad + line for line in accumulate),
        "state_major": "",
        "spread": 0,
        "spread_blocks": 0,
    }
    major = fused_state_major(fb) if state_major else None
    if major is not None:
        extra = _fused_state_major(fb, major, arrays, sizes, steps_per_lane, staged, registers)
        ctx["shared"] += extra.pop("shared")
        ctx.update(extra)
        ctx["comment"] += "; the states' own axes outside the steps"
        # no launch bounds: bounded to 4 blocks per SM (128 registers) it spilled at N = 16 and 256 and
        # ran about as fast (Mamba-1 B8 D1536 L2048 N16 on an H200: 1.92 against 1.98 ms in 134)
    return ctx


def _fused_state_major(fb: FusedBackward, major: FusedStateMajor, arrays: dict[str, ArraySpec],
                       sizes: dict[str, int], steps_per_lane: int, staged, registers: dict[str, str]) -> dict:
    """The fused backward's context entries for its state-major round (lowering/state_major.py,
    `FusedStateMajor`): declarations (a register per step for the per-step values and the forward's
    carries and shared values, of one state index at a time) and the round, twice: straight-line
    code with a lane's steps of B[:, n] loaded and its terms of grad_B[:, n] added as vectors,
    for rounds whose lanes all have their steps and aligned arrays; and with exits after the
    lane's last step for the others (a partial last round, which runs first)."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    steps = major.steps()
    K = steps_per_lane
    per_step = list(dict.fromkeys(n for sm in steps for n in sm.per_step))
    seqs = {a.name for a in fb.arrays if a.role == "seq"}
    vectors = _vector_loads([x for sm in steps for x in sm.body], seqs, False, arrays, K)
    atomics = _vector_atomics(major.adjoint.body, arrays, K)
    hoisted = {b.name for k in kernels for b in k.setup if isinstance(b, Buffer)}

    def printers(vec: dict) -> list[CPrinter]:
        out = []
        for k in kernels:
            pr = CPrinter(k, arrays, sizes, staged, registers=registers, vectors=vec, one_value=True)
            pr.buffers |= set(per_step) | hoisted | set(atomics.values())
            out.append(pr)
        return out

    summed = BLOCK_SUMS and _block_sums(fb, atomics, sizes)
    full = _fused_state_major_round(fb, major, printers(vectors), sizes, K, atomics, False, summed)
    partial = _fused_state_major_round(fb, major, printers({}), sizes, K, atomics, True, summed)
    declarations = []
    for k, sm in zip(kernels, steps):
        for n in _scalar_names(k.setup + k.finish + sm.pre + sm.post) + list(sm.scalars):
            line = f"F {n} = F(0);"
            if n not in per_step and line not in declarations:
                declarations.append(line)
    declarations += [f"F {n}[{K}];  // one per step of the lane" for n in per_step + sorted(set(atomics.values()))]
    carried = [f"F rg_{s}[{K}];  // the carry before each of this lane's steps, of one state index"
               for s in fb.carried]
    carried += [f"F rg_{v}[{K}];  // a value of each of this lane's steps, computed once" for v in fb.shared]
    pad = "    "
    core = [s for s in fb.adjoint.program.states if s.name in fb.core]
    shared = [f"__shared__ F sm_sums[2][{len(atomics)}][{BLOCK // WARP}][{WARP * K}];  // the warps' atomic terms"
              f" of one state index, twice: a barrier per index"] if summed else []
    return {
        "spread": _spread(fb, sizes, summed),
        "spread_blocks": sizes[fb.parallel[-1]] // (BLOCK // WARP),
        "shared": shared,
        "declarations": declarations + (["int sums_at = 0;  // which copy of sm_sums"] if summed else []),
        "carry": "\n".join(pad + line for line in _lane_scan(core, set(fb.parallel), sizes, reverse=True).carry
                           + carried),
        "state_major": "\n".join(_full_or_partial(full, partial, K, {a for a, _ in vectors} | {a for a, _ in atomics})),
    }


# Where the warps of a block take neighbouring indices of the axis an atomic add sums over (Mamba-1's
# d, for grad_B[b, n, t]), they add their terms up in shared memory first and one reduction per
# block and vector goes to memory (`_block_sums`).
BLOCK_SUMS = True


def _block_sums(fb: FusedBackward, atomics: dict, sizes: dict[str, int]) -> bool:
    """Whether the warps of a block may add their atomic terms (`_vector_atomics`) up before the
    reductions: they differ only in the last parallel axis (its size a multiple of the warps per
    block, so that no warp leaves early and a block's warps share the other indices), which every
    such array sums over."""
    last = fb.parallel[-1]
    axes = {a.name: a.axes for a in fb.arrays}
    return bool(atomics) and sizes[last] % (BLOCK // WARP) == 0 and all(last not in axes[a] for a, _ in atomics)


def _block_sum_lines(depth: int, atomics: dict, printer: CPrinter, steps_per_lane: int) -> list[str]:
    """C lines adding the block's warps' terms of each atomic array (`at<j>`, a lane's K steps) up in
    shared memory, then one vector reduction (`add_steps`) per block and vector of the round, by the
    first threads; steps past L are not added (their rows are padded to whole vectors only)."""
    pad = "    " * depth
    K, width = steps_per_lane, _vector_width(steps_per_lane)
    per_array = WARP * K // width  # vectors of one array in a round
    lines = [f"{pad}{{  // the block's warps add their terms up: one reduction per vector of the round"]
    for j, reg in enumerate(atomics.values()):
        lines += [f"{pad}    #pragma unroll", f"{pad}    for (int tt = 0; tt < {K}; ++tt) "
                  f"sm_sums[sums_at][{j}][w][lane * {K} + tt] = {reg}[tt];"]
    warps = " + ".join(f"sm_sums[sums_at][j][{x}][s + e]" for x in range(BLOCK // WARP))
    targets = [f"({c_array(array)} + {printer.index(Load(array, ('base + s', *at[1:])))})" for array, at in atomics]
    target = targets[-1]
    for j in reversed(range(len(targets) - 1)):
        target = f"j == {j} ? {targets[j]} : {target}"
    vectors = len(atomics) * per_array
    if vectors <= BLOCK:  # a vector a thread
        head = [f"{pad}    const int j = threadIdx.x / {per_array}, s = threadIdx.x % {per_array} * {width};",
                f"{pad}    if (j < {len(atomics)} && base + s < L) {{"]
    else:  # BLOCK at a time (one a thread lost the rest: Mamba-1 at K = 6 lost grad_C's later steps,
        # five summed arrays the fifth; found 2026-11-26). Not everywhere: the loop took Mamba-1's
        # backward at K = 2 from 80 to 95 registers
        head = [f"{pad}    for (int i = threadIdx.x; i < {vectors}; i += {BLOCK}) {{",
                f"{pad}        const int j = i / {per_array}, s = i % {per_array} * {width};",
                f"{pad}        if (base + s >= L) continue;"]
    lines += [f"{pad}    __syncthreads();",
              *head,
              f"{pad}        F v[{width}];",
              f"{pad}        #pragma unroll",
              f"{pad}        for (int e = 0; e < {width}; ++e) v[e] = {warps};",
              f"{pad}        F* to = {target};",
              f"{pad}        if ((unsigned long long)to % {4 * width} == 0) add_steps<{width}>(to, v);",
              f"{pad}        else for (int e = 0; e < {width} && base + s + e < L; ++e) atomicAdd(to + e, v[e]);",
              f"{pad}    }}",
              f"{pad}    sums_at ^= 1;  // the next index writes the other copy: no second barrier",
              f"{pad}}}"]
    return lines


def _vector_width(steps_per_lane: int) -> int:
    """Values per vector load or reduction of a lane's steps (`load_steps`, `add_steps`)."""
    return 4 if steps_per_lane % 4 == 0 else 2


def _vector_atomics(body: list, arrays: dict[str, ArraySpec], steps_per_lane: int) -> dict:
    """Atomic adds of `body` (state-major, a lane's steps inside) that a lane can make for its K
    steps at once (`add_steps`): into float32 arrays with time contiguous at step t whose other
    strides keep a lane's first step aligned, K even. (array, index) -> the register array ``at<j>``
    collecting the lane's K terms."""
    if steps_per_lane % 2:
        return {}
    out = {}
    for s in body:
        e = s.target
        if s.op == "atomic+=" and isinstance(e, Load) and (e.array, e.index) in out:
            return {}  # two terms into one register a step: the second would replace the first
        if s.op == "atomic+=" and isinstance(e, Load):
            spec = arrays[e.array]
            if (spec.dtype == "float32" and spec.strides[0] == 1 and e.index[0] == "t"
                    and all(st % steps_per_lane == 0 for st in spec.strides[1:])
                    and not any("t" in _words(i) for i in e.index[1:])):
                out[e.array, e.index] = f"at{len(out)}"
    return out


def _fused_steps_loop(depth: int, steps_per_lane: int, body: list[str], exits: bool, backwards: bool) -> list[str]:
    """C lines of a loop over this lane's steps (unrolled; `t` and `slot` bound) around `body`, the
    last step first if `backwards`; with `exits`, steps past the lane's last are skipped."""
    pad = "    " * depth
    head = f"for (int tt = {steps_per_lane - 1}; tt >= 0; --tt)" if backwards else \
        f"for (int tt = 0; tt < {steps_per_lane}; ++tt)"
    skip = [f"{pad}    if (tt >= nt) {'continue' if backwards else 'break'};"] if exits else []
    return [f"{pad}#pragma unroll", f"{pad}{head} {{", *skip,
            f"{pad}    const int t = t0 + tt;",
            f"{pad}    const int slot = lane * {steps_per_lane + 1} + tt;",
            *body, f"{pad}}}"]


# The state-major fused backward's loop over the states' own axes is unrolled this many times. Each
# index's chains and scans depend on loads (B[:, n], the round's carry): rolled, with the next index's
# loaded while one computes (`_next_index_loads`), the kernel keeps fewer registers and more warps in
# flight. Mamba-1 B8 D1536 L2048 N16 on an H200: 1.94 ms rolled (without those loads ahead) against
# 3.69 unrolled (185 registers, loads stalled) and 2.34 step-major.
FUSED_STATE_UNROLL = 1


def _fused_state_major_round(fb: FusedBackward, major: FusedStateMajor, printers: list[CPrinter],
                             sizes: dict[str, int], steps_per_lane: int, atomics: dict, exits: bool,
                             summed: bool) -> list[str]:
    """One round of the state-major fused backward (`_fused_state_major`); `atomics`: the adjoint's
    atomic adds made per lane as vectors (`_vector_atomics`); `exits`: a round whose lanes may have
    fewer steps (their vectors' other terms are zeros, added into the rows' padding past L: the
    arrays are allocated with rows of whole vectors, `fused_backward._row`) or unaligned arrays;
    `summed`: the block's warps add those terms up first (`_block_sums`)."""
    fs, fc, as_, ad = major.steps()
    pfs, pfc, pas, pad_ = printers
    K = steps_per_lane
    parallel = set(fb.parallel)
    forward_states = fb.backward.forward.states
    core = [s for s in fb.adjoint.program.states if s.name in fb.core]
    lines = _fused_steps_loop(2, K, pfs.stmts(fs.pre, 3) + pfc.stmts(fc.pre, 3), exits, False)
    lines += _fused_steps_loop(2, K, pas.stmts(as_.pre, 3) + pad_.stmts(ad.pre, 3), exits, True)
    # what each index of the state loop reads before its chains: (register, steps (0: a scalar), load)
    index = "".join(f"[{v}]" for v in major.local)
    reads = [(reg, K, f"{c_array(array)} + {pfs.index(Load(array, ('t0', *at[1:])))}")
             for (array, at), reg in pfs.vectors.items()]
    for s in forward_states:  # the carry into the round, as the forward saved it
        at = pfc.index(Load(f"rounds_{s.name}", ("r", *_state_loops(s, parallel)[2])))
        reads.append((f"cf_{s.name}", 0, f"F(to_f({c_array(f'rounds_{s.name}')}[{at}]))"))
    reads += [(f"ca_{s.name}", 0, f"cr_{s.name}{index}") for s in core]
    reads += [(scalar_name(f"st_{n}"), 0, f"st_{n}{index}") for n in major.accumulators]
    own = [v[len("i_"):] for v in major.local]
    ahead = len(own) == 1  # the next index's reads made while this one computes
    if ahead:
        lines += _next_index_loads(2, reads, major.local[0], "0")
    for i, a in enumerate(own):
        pad = "    " * (2 + i)
        lines += [f"{pad}#pragma unroll {FUSED_STATE_UNROLL}",
                  f"{pad}for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a}) {{  // one state value at a time"]
    depth = 2 + len(own)
    pad = "    " * depth
    for reg, steps, load in reads:
        if steps:
            lines.append(f"{pad}F {reg}[{steps}];")
            lines += ([f"{pad}#pragma unroll", f"{pad}for (int tt = 0; tt < {steps}; ++tt) {reg}[tt] = next_{reg}[tt];"]
                      if ahead else [f"{pad}load_steps<{steps}>({reg}, {load});"])
        else:
            lines.append(f"{pad}{'' if reg.startswith('v_') else 'F '}{reg} = {f'next_{reg}' if ahead else load};")
    if ahead:
        var = major.local[0]
        lines += [f"{pad}{{",
                  f"{pad}    const int {_next(var)} = min({var} + 1, {size_var(own[0])} - 1);",
                  *_next_index_loads(depth + 1, reads, var, _next(var), declare=False), f"{pad}}}"]
    lines += _summary_identity(forward_states, pad)
    lines += _fused_steps_loop(depth, K, pfs.stmts(fs.body, depth + 1), exits, False)
    for s in forward_states:
        lines += _combine_state_value(s.name, f"cf_{s.name}", pad)
    lines += _fused_steps_loop(depth, K, pfc.stmts(fc.body, depth + 1), exits, False)
    lines += _summary_identity(core, pad)
    lines += _fused_steps_loop(depth, K, pas.stmts(as_.body, depth + 1), exits, True)
    for s in core:
        lines += _combine_state_value(s.name, f"ca_{s.name}", pad, reverse=True)
    lines += [f"{pad}cr_{s.name}{index} = ca_{s.name};  // the carry past the round" for s in core]
    body = [Assign(Load(atomics[s.target.array, s.target.index], (STEP,)), s.value)
            if s.op == "atomic+=" and (s.target.array, s.target.index) in atomics else s for s in ad.body]
    if exits:
        lines += [f"{pad}for (int tt = 0; tt < {K}; ++tt) {reg}[tt] = F(0);" for reg in atomics.values()]
    lines += _fused_steps_loop(depth, K, pad_.stmts(body, depth + 1), exits, True)
    if summed:
        lines += _block_sum_lines(depth, atomics, pad_, K)
    for (array, at), reg in ({} if summed else atomics).items():  # this lane's K terms of each, at once
        target = f"{c_array(array)} + {pad_.index(Load(array, ('t0', *at[1:])))}"
        if exits:
            lines += [f"{pad}if (t0 < L) {{",
                      f"{pad}    if ((unsigned long long)({target}) % {4 * _vector_width(K)} == 0) "
                      f"add_steps<{K}>({target}, {reg});",
                      f"{pad}    else for (int tt = 0; tt < nt; ++tt) atomicAdd({target} + tt, {reg}[tt]);",
                      f"{pad}}}"]
        else:
            lines.append(f"{pad}add_steps<{K}>({target}, {reg});")
    lines += [f"{pad}st_{n}{index} = {scalar_name(f'st_{n}')};" for n in major.accumulators]
    lines += ["    " * (depth - 1 - i) + "}" for i in range(len(own))]
    lines += _fused_steps_loop(2, K, pad_.stmts(ad.post, 3), exits, True)
    return lines


def _spread(fb: FusedBackward, sizes: dict[str, int], summed: bool) -> int:
    """How many indices of the parallel axes but the last the fused backward's blocks take in turn
    (0: blocks in order). Where the block sums (`_block_sums`) add into arrays over the last axis
    (Mamba-1's grad_B[b, n, t], summed over d), a grid in order has the blocks running at once take
    neighbouring d of one b and add into the same addresses; in turns over b they spread over the
    batch, fewer of them adding into one address at once. Mamba-1 backward on an H100, in order ->
    spread (bench/backward_variants.py, 2026-11-26): B8 D1536 L2048 1.318 -> 1.284 ms, B32 D512 L180
    0.2473 -> 0.2414, B4 D2048 L2048 0.810 -> 0.808, B16 D1024 L1024 0.803 -> 0.811. (Each block
    starting its loop over n at its own index as well took 5% off B8 D1536 L2048 on an H100, 2.4% on
    an H200, but added 0.3-7% at five other shapes, B1 to B32, on an H200: not kept.)"""
    spread = math.prod(sizes[a] for a in fb.parallel[:-1]) if summed else 0
    return spread if spread > 1 else 0


def _next(var: str) -> str:
    return f"next_{var}"


def _next_index_loads(depth: int, reads: list, var: str, at: str, declare: bool = True) -> list[str]:
    """C lines loading `reads` (register, steps, load) at index `at` of the state loop variable `var`
    into ``next_<register>``."""
    pad = "    " * depth
    lines = []
    for reg, steps, load in reads:
        load = re.sub(rf"\b{var}\b", at, load)
        if steps:
            lines += [f"{pad}F next_{reg}[{steps}];"] if declare else []
            lines.append(f"{pad}load_steps<{steps}>(next_{reg}, {load});")
        else:
            lines.append(f"{pad}{'F ' if declare else ''}next_{reg} = {load};")
    return lines


def _loads(stmts):
    """Every global or buffer access in `stmts` (reads and write targets)."""
    for s in walk(stmts):
        if isinstance(s, Assign):
            yield from loads(s.target)
            yield from loads(s.value)


def param_registers(kernels, parallel: set[str], sizes: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Params the threads of `kernels` read at their own parallel indices only (Mamba-1's A[d, n] at
    d = p_d), at most `PARAM_REGISTERS` values in all: name -> the positions of their other axes,
    by which the register copy ``rp_<name>`` is indexed. Loaded once before the time loop, they
    leave the steps' loads, of which a warp kernel's L1 traffic is made."""
    axes = {a.name: a.axes for k in kernels for a in k.arrays if a.role == "param"}
    uniform = dict.fromkeys(axes, True)
    for k in kernels:
        for load in _loads(k.setup + k.step + k.finish):
            if load.array in axes:
                uniform[load.array] &= all(i == f"p_{ax}" for i, ax in zip(load.index, axes[load.array])
                                           if ax in parallel)
    chosen, budget = {}, PARAM_REGISTERS
    for name in sorted(axes):
        count = math.prod(sizes[ax] for ax in axes[name] if ax not in parallel)
        if uniform[name] and count <= budget:
            chosen[name] = tuple(i for i, ax in enumerate(axes[name]) if ax not in parallel)
            budget -= count
    return chosen


def _load_param_registers(chosen: dict[str, tuple[int, ...]], kernels, pr: CPrinter) -> list[str]:
    """Declarations and loads of the register copies `param_registers` chose."""
    axes = {a.name: a.axes for k in kernels for a in k.arrays if a.role == "param"}
    lines = []
    for name, positions in chosen.items():
        local = [axes[name][i] for i in positions]
        lines.append(f"F rp_{name}" + "".join(f"[{size_var(a)}]" for a in local) + ";  // loaded once")
        index = tuple(f"i_{ax}" if i in positions else f"p_{ax}" for i, ax in enumerate(axes[name]))
        loops = "".join(f"for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a}) " for a in local)
        target = f"rp_{name}" + "".join(f"[i_{a}]" for a in local)
        if local:
            lines.append("#pragma unroll")
        lines.append(f"{loops}{target} = F(to_f({c_array(name)}[{pr.index(Load(name, index))}]));")
    return lines


def _at_t(array) -> Load:
    """`array` (axes "t" then parallel axes) at step t of this thread's recurrence."""
    return Load(array.name, ("t", *(f"p_{a}" for a in array.axes[1:])))


def _stageable(arrays, kernels, parallel: set[str]) -> frozenset[str]:
    """Sequences and outputs among `arrays` with one value per step of a recurrence, only ever
    accessed at step t by `kernels`' steps: the warp kernels move them through shared memory, so
    that the lanes' global reads and writes of a round are coalesced (lane j touches step j, j + 32,
    ...), whatever the steps per lane."""
    candidates = {a.name: a for a in arrays
                  if a.role in ("seq", "out") and a.axes[:1] == ("t",) and set(a.axes[1:]) <= parallel}
    for k in kernels:
        for e in _loads(k.step):
            if e.array in candidates and e != _at_t(candidates[e.array]):
                del candidates[e.array]
    return frozenset(candidates)


def _within(staged: frozenset[str], per_array: int, room: int) -> frozenset[str]:
    """The first of `staged` (by name) whose `per_array` bytes of shared memory each fit `room`; the
    others are read and written in place (uncoalesced, but the kernel compiles: a float64 scan of 11
    sequences staged 26 arrays of 5 KiB and stopped at ptxas' "too much shared data", 2026-11-26)."""
    return frozenset(sorted(staged)[:max(0, room // max(1, per_array))])


def _store(dtype: str, value: str) -> str:
    ctype = C_TYPES[dtype]
    return f"from_f<{ctype}>({value})" if ctype not in ("float", "double") else f"({ctype})({value})"


def _template() -> jinja2.Template:
    return environment().get_template("module.cu.j2")


@cache
def math_header() -> str:
    return resources.files("ssmc").joinpath("templates", "ssmc_math.cuh").read_text()


# C++'s keywords and the names ssmc's headers define: never an array's name in a kernel
_CPP_WORDS = """
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t char32_t char8_t class
    compl concept const consteval constexpr constinit const_cast continue co_await co_return co_yield decltype
    default delete do double dynamic_cast else enum explicit export extern false float for friend goto if inline
    int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected public register
    reinterpret_cast requires return short signed sizeof static static_assert static_cast struct switch template
    this thread_local throw true try typedef typeid typename union unsigned using virtual void volatile wchar_t
    while xor xor_eq SSMC_HALF
"""
CPP_KEYWORDS = frozenset(_CPP_WORDS.split())

# The name each kernel array is printed by while a module is built (`with_free_array_names`)
_ARRAY_NAMES: ContextVar[dict[str, str] | None] = ContextVar("ssmc_cuda_array_names", default=None)


def c_array(name: str) -> str:
    """How kernel array `name` is printed in the module being built."""
    names = _ARRAY_NAMES.get()
    return name if names is None else names.get(name, name)


def with_free_array_names(arrays: set[str], build) -> str:
    """`build()`, a module's source, with each kernel array printed by a name its kernels use for
    nothing else: its own, or with underscores appended where a kernel also declares that name
    (a warp's index `w`, the length `L`, the compute type `F`, a state's registers `st_h`). Built
    once with every array's name marked; C++'s keywords and the kernels' identifiers outside
    comments and members, marks excluded, are taken (the helpers before the kernels have scopes of
    their own). Kernels take
    their arrays by position, so nothing else changes; a spec without such names gets the same
    text as before."""
    token = _ARRAY_NAMES.set({name: ARRAY_MARK + name for name in arrays})
    try:
        text = build()
    finally:
        _ARRAY_NAMES.reset(token)
    kernels = re.sub(r"//[^\n]*|/\*.*?\*/", "", text[text.find("__global__"):], flags=re.S)
    # identifiers, not members (blockIdx.x does not take x)
    taken = {word for word in re.findall(r"(?<![.\w])(?<!->)[A-Za-z_]\w*", kernels) if not word.startswith(ARRAY_MARK)}
    taken |= CPP_KEYWORDS
    names = free_names(arrays, taken)
    return re.sub(r"(?<!\w)" + ARRAY_MARK + r"(\w+)", lambda m: names.get(m.group(1), m.group(0)), text)


def render(program_name: str, strategy: str, ctype: str, contexts: list[dict], half: bool,
           exact: bool = False) -> str:
    """The CUDA module of the kernels' template `contexts`: the math header, the helpers they use (row
    combines, the lanes kernel's reduce-scatter), one kernel per context; `half` where an array is
    fp16 / bf16 (their headers); `exact` where it must be built without FMA contraction
    (`exact_products`, `compile_options`)."""
    return _template().render(version=__version__, program_name=program_name, strategy=strategy, ctype=ctype,
                              math_header=math_header(), block=BLOCK, kernels=contexts, half=half, warp=WARP,
                              exact=exact,
                              rows=any(c.get("row") or c.get("row_recurrence") for c in contexts),
                              lanes=any(c.get("lanes") or c.get("lanes_backward") for c in contexts))


def bounded_blocks(block: int) -> int:
    """Blocks of `block` threads an SM holds at BOUNDED_REGISTERS a thread (a `__launch_bounds__` minimum)."""
    return SM_REGISTERS // (block * BOUNDED_REGISTERS)


def exact_products(program) -> bool:
    """Whether `program` takes a max over an axis or compares computed values for equality: a max's
    gradient asks which values equal it (`x == max(x)`, ties by construction), each recomputed in
    whichever kernel needs it. nvcc contracts a * b + c into one FMA (one rounding) where the code
    lets it, which differs from kernel to kernel: a value recomputed one way missed its max computed
    the other, and its gradient was lost (a random spec's float64 gradients off by 0.2-0.4, H100 and
    H200, 2026-11-27). Such programs' kernels are built without contraction (`compile_options`), every
    product rounded as the interpreter rounds it; the comparisons of iotas and constants (a select's
    gradient) are exact either way."""
    nodes = getattr(program, "nodes", None)
    return nodes is not None and any(
        n.op is Op.REDUCE_MAX or (n.op in (Op.EQ, Op.NE) and not all(a.op in LEAVES for a in n.args))
        for n in nodes())


def compile_options(source: str) -> tuple[str, ...]:
    """NVRTC's options for a generated module beyond the architecture, the same for the GPU's build
    (runner) and the CPU's (report, the CI's spill checks): C++17; subnormal floats flushed to zero,
    because CuPy's `RawModule` appends ``-ftz=true`` to whatever it is given (NVRTC takes the last),
    so a CPU build without it compiled other code than the GPU ran (exp2f one instruction, not four;
    other registers, and spills in the lanes backward that the CPU build did not show); no FMA
    contraction where `render` marked the module exact."""
    exact = ("--fmad=false",) if "#define SSMC_NO_CONTRACTION" in source else ()
    return ("--std=c++17", "-ftz=true", *exact)


def has_half(arrays: dict[str, ArraySpec]) -> bool:
    """Whether any of the arrays is fp16 or bf16."""
    return any(spec.dtype in ("float16", "bfloat16") for spec in arrays.values())


def module_source(lowered: Lowered, ctype: str, kernels: list[tuple[Kernel, dict[str, ArraySpec]]],
                  sizes: dict[str, int], warp: tuple[Kernel, int] | None = None,
                  threads: dict[str, Threads] | None = None, round_steps: int = 0, ragged: bool = True) -> str:
    """CUDA C for the given kernels of `lowered`, each with the layouts of its arrays and its thread
    mapping (`threads`, by kernel name; default: `Threads()`); with `warp` (the summary step, steps
    per lane), the one kernel given as the warp kernel's step instead (`round_steps`: see
    `warp_kernel_context`; `ragged`: its last round may be partial, `_state_major_lines`)."""
    def build():
        if warp is not None:
            (k, specs), = kernels
            warps = (threads or {}).get(k.name, ONE_GROUP).warps
            contexts = [warp_kernel_context(k, warp[0], specs, sizes, warp[1], round_steps, ragged, warps)]
        else:
            contexts = [kernel_context(k, specs, sizes, (threads or {}).get(k.name, ONE_GROUP)) for k, specs in kernels]
        return render(lowered.program.name, lowered.strategy, ctype, contexts,
                      any(has_half(specs) for _, specs in kernels), exact_products(lowered.program))
    return with_free_array_names({name for _, specs in kernels for name in specs}, build)


def fused_backward_shared_bytes(fb: FusedBackward, value_bytes: int, steps_per_lane: int, state_major: bool) -> int:
    """Static shared memory the fused backward kernel declares (`fused_backward_context`): each staged
    sequence and output, a round of 32 K steps (and a pad word every K) per warp; where it runs
    state-major and adds float32 terms atomically, two copies of the warps' terms of each summed
    array (the block sums; counted wherever they may run, so an upper bound)."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    staged = len(_stageable(fb.arrays, kernels, set(fb.parallel)))
    warps = BLOCK // WARP
    total = staged * warps * WARP * (steps_per_lane + 1)
    if state_major and value_bytes == 4 and fb.partials.atomic and fused_state_major(fb) is not None:
        total += 2 * len(fb.partials.atomic) * warps * WARP * steps_per_lane
    return total * value_bytes


def fused_backward_source(fb: FusedBackward, ctype: str, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                          steps_per_lane: int, state_major: bool = False) -> str:
    """CUDA C of the fused backward kernel (lowering/reverse_warp.py) for these array layouts
    (`state_major`: see `fused_backward_context`)."""
    def build():
        context = fused_backward_context(fb, arrays, sizes, steps_per_lane, state_major)
        return render(fb.backward.adjoint.name, "fused backward", ctype, [context], has_half(arrays),
                      exact_products(fb.backward.adjoint))
    return with_free_array_names(set(arrays), build)
