"""Loop nests -> CUDA C (one thread per parallel index; sizes and strides baked in as constants).

A kernel is specialised to one shape: sizes become ``constexpr`` so per-thread buffers (a state
row of N values) are fixed-size arrays the compiler keeps in registers when loops over them are
unrolled; strides become constants so any layout (time contiguous or not) is read in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from importlib import resources

import jinja2

from ... import __version__
from ...lowering.loops import Assign, Bin, Buffer, Call, InRange, Load, Loop, Num, Select, Var, loads, walk
from ...lowering.plan import Kernel, Lowered, size_var
from ...lowering.split_sum import row_accumulators, split_axis
from ...lowering.time_blocks import TimeBlocks, partial_name, product_name

BLOCK = 128
WARP = 32
UNROLL_LIMIT = 64  # loop nests of at most this many iterations are unrolled (buffers stay in registers)
SUM_UNROLL = 4     # a long loop accumulating into scalars runs this many iterations' loads at once
MAX_GROUPS = 16    # split-K (lowering/split_sum.py): at most this many groups of threads per sum...
GROUP_STEPS = 64   # ...each with at least this many terms
ROW_THREADS = 512  # a row kernel's block (lowering/split_sum.py, cooperative rows): ROW_THREADS / G rows of G threads

C_TYPES = {"float32": "float", "float64": "double", "float16": "__half", "bfloat16": "__nv_bfloat16"}
_FUNCS = {"exp": "exp_", "log": "log_", "sqrt": "sqrt_", "rsqrt": "rsqrt_", "abs": "abs_", "tanh": "tanh_",
          "erf": "erf_", "max": "max_", "min": "min_", "pow": "pow_"}
_OPS = {"and": "&&", "or": "||"}


@dataclass(frozen=True)
class ArraySpec:
    """How one global array is laid out: element type and element strides per (kernel) axis."""

    dtype: str                     # float32 | float64 | float16 | bfloat16
    strides: tuple[int, ...]
    group_stride: int = 0          # split-K partials: the offset between groups' copies (0: one copy)


@dataclass(frozen=True)
class Threads:
    """How a time-blocked kernel maps its threads: `time_fastest` puts consecutive blocks of time on
    consecutive threads (for arrays with time contiguous; a sum over time then takes every nblk-th
    step, so that lanes read neighbouring steps), `groups` divide the sum over `split` (split-K).
    With `row`, the groups are threads of one block sharing each row of a map kernel along `split`
    (cooperative rows, lowering/split_sum.py): their partial sums are combined in shared memory and
    every group goes on with the row's total; nothing is left for the runner to add."""

    time_fastest: bool = False
    groups: int = 1
    split: str | None = None
    row: bool = False

    @property
    def rows_per_block(self) -> int:
        return max(1, ROW_THREADS // self.groups)

    def describe(self) -> str:
        """What `ssmc inspect` adds to the kernel's strategy ("" for the default mapping)."""
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
                 threads: Threads = ONE_GROUP):
        self.k = k
        self.arrays = arrays
        self.sizes = sizes
        self.staged = staged
        self.split = threads.split if threads.groups > 1 else None
        self.groups = threads.groups
        self.buffers = {s.name for s in walk(k.setup + k.step + k.finish) if isinstance(s, Buffer)}
        # a row kernel: after each top-level loop over the row axis, its accumulators combined
        self.row = threads.row and self.split is not None
        self.combine = row_accumulators(k, self.split) if self.row else {}
        if self.row and self.combine is None:
            raise ValueError(f"{k.name}: rows along {self.split} cannot be shared (lowering/split_sum.py)")
        row_extent = size_var(self.split) if self.row else None
        # a row kernel's buffer along the row axis holds its group's indices only: [i / G]
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
            if e.array in self.compact:
                return e.array + "".join(f"[({i}) / {self.groups}]" if c else f"[{i}]"
                                         for i, c in zip(e.index, self.compact[e.array]))
            if e.array in self.buffers:
                return e.array + "".join(f"[{i}]" for i in e.index)
            if e.array in self.staged:
                return f"sm_{e.array}[w][slot]"
            return f"F(to_f({e.array}[{self.index(e)}]))"
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
        if isinstance(t, Var) or t.array in self.buffers or t.array in self.staged:
            return self.expr(t)
        return f"{t.array}[{self.index(t)}]"

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
                for name, op in self.combine.get(id(s), ()):  # the groups' partials: the row's total
                    fn = "row_sum" if op == "+=" else "row_max"
                    out.append(f"{pad}{name} = {fn}<{self.groups}>({name}, ssmc_part, ssmc_first, ssmc_stride);")
            elif isinstance(s, Buffer):
                shape = [f"(({d}) + {self.groups - 1}) / {self.groups}" if c else d
                         for d, c in zip(s.shape, self.compact.get(s.name, [False] * len(s.shape)))]
                out.append(f"{pad}F {s.name}" + "".join(f"[{d}]" for d in shape) + ";")
            elif isinstance(s, Assign):
                value = self.expr(s.value)
                target = self.target(s.target)
                global_store = (isinstance(s.target, Load) and s.target.array not in self.buffers
                                and s.target.array not in self.staged)
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
    writes are coalesced (a thread writing its own steps would touch a line per lane and step)."""
    if k.time_blocks:
        return []
    parallel = set(k.parallel)
    return [a.name for a in k.arrays if a.role == "prev" and set(a.axes[1:]) <= parallel
            and arrays[a.name].strides[0] == 1 and len(a.axes) > 1]


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
                f"for (int s = lane; s < count; s += nact) {name}[o_{name} + ({step})] = {value};"]
    return out


def kernel_context(k: Kernel, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                   threads: Threads = ONE_GROUP) -> dict:
    staged = _staged_prev(k, arrays)
    pr = CPrinter(k, arrays, sizes, frozenset(staged), threads=threads)
    params = []
    for a in k.arrays:
        ctype = C_TYPES[arrays[a.name].dtype]
        const = "const " if a.role in ("seq", "param", "init") else ""
        params.append(f"{const}{ctype}* __restrict__ {a.name}")
    constants = [f"constexpr int {size_var(a)} = {sizes[a]};" for a in k.sizes]
    total = " * ".join(str(sizes[a]) for a in k.parallel) or "1"
    constants.append(f"constexpr long long total = {total};")
    unflatten, rest = [], "p"
    for a in reversed(k.parallel):
        unflatten.append(f"const int p_{a} = (int)({rest} % {size_var(a)});")
        unflatten.append(f"const long long rest_{a} = {rest} / {size_var(a)};")
        rest = f"rest_{a}"
    par = " ".join(k.parallel) or "-"
    comment = f"{k.program.name}: one thread per [{par}]" + (" and block of time" if k.time_blocks else "")
    if threads.row and threads.groups > 1:
        comment = (f"{k.program.name}: a row per [{par}] and step, {threads.groups} threads per row, each taking "
                   f"every {threads.groups}-th {threads.split}; {threads.rows_per_block} rows per block")
    elif threads.groups > 1:
        comment += f" and group of {threads.split} ({threads.groups} groups, partial sums)"
    if threads.time_fastest:
        comment += ", consecutive threads along time"
    return {
        "name": k.name,
        "comment": comment,
        "time_fastest": threads.time_fastest,
        "interleaved": threads.time_fastest and k.sum_over_time,
        "groups": threads.groups,
        "row": threads.row and threads.groups > 1,
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


def warp_kernel_context(tb: TimeBlocks, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                        steps_per_lane: int) -> dict:
    """The warp kernel of `tb` (lowering/time_blocks.py): the summary and the program's step spliced
    around a scan of the (product, partial) pairs across the warp's lanes."""
    k, summary = tb.lane_rescan, tb.lane_summary
    staged = _stageable(k, summary)
    ctx = kernel_context(k, arrays, sizes)
    ps = CPrinter(summary, arrays, sizes, staged)
    pr = CPrinter(k, arrays, sizes, staged)
    stage_len = WARP * (steps_per_lane + 1)  # a slot skipped after each lane's steps: no bank conflicts
    ctx["shared"] = [f"__shared__ F sm_{a}[{BLOCK // WARP}][{stage_len}];" for a in sorted(staged)]
    index = {a.name: a for a in k.arrays}
    ctx["stage_in"] = [f"sm_{a}[w][slot] = valid ? F(to_f({a}[{pr.index(_at_t(index[a]))}])) : F(0);"
                       for a in sorted(staged) if index[a].role == "seq"]
    ctx["stage_out"] = [f"if (valid) {a}[{pr.index(_at_t(index[a]))}] = {_store(arrays[a].dtype, f'sm_{a}[w][slot]')};"
                        for a in sorted(staged) if index[a].role == "out"]
    declared = set(ctx["declarations"])
    ctx["declarations"] += [d for d in ps.scalars() if d not in declared]
    ctx["comment"] = (f"{tb.program.name}: one warp per [{' '.join(k.parallel) or '-'}], its lanes over blocks "
                      f"of {steps_per_lane} steps")
    ctx["steps_per_lane"] = steps_per_lane
    ctx["summary_setup"] = "\n".join(ps.stmts(summary.setup, 1))
    ctx["summary_step"] = "\n".join(ps.stmts(summary.step, 3))
    ctx["step"] = "\n".join(pr.stmts(k.step, 3))
    ctx["finish"] = "\n".join(CPrinter(k, arrays, sizes).stmts(k.finish, 2))
    carry, reset, combine, final = [], [], [], []
    parallel = set(k.parallel)
    for s in tb.program.states:
        local = [a for a in s.axes if a not in parallel]
        idx = "".join(f"[i_{a}]" for a in local)
        loops = [f"for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a})" for a in local]
        head = "".join(f"{loop} " for loop in loops)
        carry.append(f"F cr_{s.name}{''.join(f'[{size_var(a)}]' for a in local)};")
        carry.append(f"{head}cr_{s.name}{idx} = st_{s.name}{idx};")
        prod, part = f"st_{product_name(s.name)}{idx}", f"st_{partial_name(s.name)}{idx}"
        reset.append(f"{head}{{ {prod} = F(1); {part} = F(0); }}")
        combine += [
            f"{head}{{",
            f"    F P = {prod}, H = {part};",
            "    #pragma unroll",
            f"    for (int off = 1; off < {WARP}; off <<= 1) {{  // inclusive scan: lanes before compose first",
            "        const F Pb = __shfl_up_sync(0xffffffffu, P, off), Hb = __shfl_up_sync(0xffffffffu, H, off);",
            "        if (lane >= off) { H = P * Hb + H; P = P * Pb; }",
            "    }",
            "    F Pe = __shfl_up_sync(0xffffffffu, P, 1), He = __shfl_up_sync(0xffffffffu, H, 1);",
            "    if (lane == 0) { Pe = F(1); He = F(0); }",
            f"    st_{s.name}{idx} = Pe * cr_{s.name}{idx} + He;  // the carry into this lane's steps",
            f"    cr_{s.name}{idx} = __shfl_sync(0xffffffffu, P, {WARP - 1}) * cr_{s.name}{idx}"
            f" + __shfl_sync(0xffffffffu, H, {WARP - 1});",
            "}",
        ]
        final.append(f"{head}st_{s.name}{idx} = cr_{s.name}{idx};")
    pad = "    "
    ctx["carry"] = "\n".join(pad + line for line in carry)
    ctx["reset"] = "\n".join(2 * pad + line for line in reset)
    ctx["combine"] = "\n".join(2 * pad + line for line in combine)
    ctx["final_carry"] = "\n".join(pad + line for line in final)
    return ctx


def _loads(stmts):
    """Every global or buffer access in `stmts` (reads and write targets)."""
    for s in walk(stmts):
        if isinstance(s, Assign):
            yield from loads(s.target)
            yield from loads(s.value)


def _at_t(array) -> Load:
    """`array` (axes "t" then parallel axes) at step t of this thread's recurrence."""
    return Load(array.name, ("t", *(f"p_{a}" for a in array.axes[1:])))


def _stageable(k: Kernel, summary: Kernel) -> frozenset[str]:
    """Sequences and outputs with one value per step of a recurrence, only ever accessed at step t:
    the warp kernel moves them through shared memory, so that the lanes' global reads and writes of
    a round are coalesced (lane j touches step j, j + 32, ...), whatever the steps per lane."""
    parallel = set(k.parallel)
    candidates = {a.name: a for a in k.arrays
                  if a.role in ("seq", "out") and a.axes[:1] == ("t",) and set(a.axes[1:]) <= parallel}
    for e in _loads(summary.step + k.step):
        if e.array in candidates and e != _at_t(candidates[e.array]):
            del candidates[e.array]
    return frozenset(candidates)


def _store(dtype: str, value: str) -> str:
    ctype = C_TYPES[dtype]
    return f"from_f<{ctype}>({value})" if ctype not in ("float", "double") else f"({ctype})({value})"


@cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.PackageLoader("ssmc", "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template("cuda_module.cu.j2")


@cache
def math_header() -> str:
    return resources.files("ssmc").joinpath("templates", "ssmc_math.cuh").read_text()


def module_source(lowered: Lowered, ctype: str, kernels: list[tuple[Kernel, dict[str, ArraySpec]]],
                  sizes: dict[str, int], warp: tuple[TimeBlocks, int] | None = None,
                  threads: dict[str, Threads] | None = None) -> str:
    """CUDA C for the given kernels of `lowered`, each with the layouts of its arrays and its thread
    mapping (`threads`, by kernel name; default: `Threads()`); with `warp` (time blocks, steps per
    lane), the warp kernel instead (its arrays: the one kernel's)."""
    if warp is not None:
        (_, specs), = kernels
        contexts = [warp_kernel_context(warp[0], specs, sizes, warp[1])]
    else:
        threads = threads or {}
        contexts = [kernel_context(k, specs, sizes, threads.get(k.name, ONE_GROUP)) for k, specs in kernels]
    half = any(spec.dtype in ("float16", "bfloat16") for _, specs in kernels for spec in specs.values())
    return _template().render(version=__version__, program_name=lowered.program.name, strategy=lowered.strategy,
                              ctype=ctype, math_header=math_header(), block=BLOCK, kernels=contexts, half=half,
                              warp=WARP, rows=any(c.get("row") for c in contexts))
