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

from ...lowering.kernel import Kernel
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
from ...lowering.plan import size_var
from ...lowering.split_sum import row_accumulators, split_axis

BLOCK = 128


UNROLL_LIMIT = 64  # loop nests of at most this many iterations are unrolled (buffers stay in registers)


PARAM_REGISTERS = 64  # param values a warp kernel's thread may load once, before time, into registers


# A warp kernel whose states hold at most STATE_REGISTERS values per lane is built for MIN_BLOCKS blocks
# per SM (launch bounds: at most 65536 / (MIN_BLOCKS * BLOCK) = 128 registers). Left to itself ptxas gave
# the Mamba-1 forward (16 states a lane) 168 registers, 3 blocks per SM, and it ran slower than bounded
# (see bench/results/2026-11-27-from-code-comments.md).
STATE_REGISTERS = 16


MIN_BLOCKS = 4


SUM_UNROLL = 4     # a long loop accumulating into scalars runs this many iterations' loads at once


MAX_GROUPS = 16    # split-K (lowering/split_sum.py): at most this many groups of threads per sum...


GROUP_STEPS = 64   # ...each with at least this many terms


ROW_THREADS = 512  # a row kernel's block (lowering/split_sum.py, cooperative rows): ROW_THREADS / G rows of G threads


RECURRENCE_ROW_THREADS = 128  # a recurrence's rows (time inside): at least this many threads per block


ROW_UNROLL = 8     # a recurrence row's thread unrolls its loops over the row axis up to this many indices


C_TYPES = {"float32": "float", "float64": "double", "float16": "__half", "bfloat16": "__nv_bfloat16"}


_FUNCS = {"exp": "exp_", "exp2": "exp2_", "log": "log_", "sqrt": "sqrt_", "rsqrt": "rsqrt_", "abs": "abs_",
          "tanh": "tanh_", "erf": "erf_", "max": "max_", "min": "min_", "pow": "pow_", "sin": "sin_",
          "cos": "cos_", "tan": "tan_", "log1p": "log1p_", "expm1": "expm1_", "sign": "sign_", "atan2": "atan2_"}


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


def _scalar_names(stmts) -> list[str]:
    """The scalars `stmts` assign, in order of first assignment."""
    names = []
    for s in walk(stmts):
        if isinstance(s, Assign) and isinstance(s.target, Var) and s.target.name not in names:
            names.append(s.target.name)
    return names


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
    sequences staged 26 arrays of 5 KiB and stopped at ptxas' "too much shared data")."""
    return frozenset(sorted(staged)[:max(0, room // max(1, per_array))])


def _store(dtype: str, value: str) -> str:
    ctype = C_TYPES[dtype]
    return f"from_f<{ctype}>({value})" if ctype not in ("float", "double") else f"({ctype})({value})"


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
