"""CUDA C of the persistent kernel: one cooperative launch for the whole sequence, a forward or an
adjoint (the same code: `Cell` says which product; REVERSE, the time order).

Block x owns units k in [x KU, x KU + KU) of the split axis, all rows and all local (gate) columns of
them, so the cell's element-wise math is local; its slice of U sits in shared memory for the whole
call. Thread pair q owns one (row r, unit k) for the whole call (carries in registers). As a plain
loop (e: the flat contracted index, j in the forward, (g, k') in the adjoint; D its size):

    su[e][u][c] = U[e, c, x KU + u]                      once (zero past the axes' ends)
    st[q] = initial states at (r, k)
    for s in range(L):  t = s (L - 1 - s where reversed)
        seq[q] = sequences at (t, r, k)                  issued first (latency hidden)
        xo[s % 2][r][e(k, g)] = op at (r, k, g)          the forward: h; the adjoint: dz, from the
                                                         carries and seq (the cell's nodes it needs)
        grid barrier                                     every block's operand written before any reads it
        acc[q][c] = sum_e xo[s % 2][r][e] su[e][u][c]    xo staged [rows][JC + 1] a chunk at a time,
                                                         the next chunk's loads in flight meanwhile
        cell(acc, seq, st, params) -> outputs at t, the new states st

The exchange buffer xo is double-buffered by step parity: a block writing step s + 1's operand cannot
overwrite what a slower block still reads at step s (that block has not yet passed barrier s + 1,
which the writer needs to reach step s + 2's write to the same half). xo is read through L2 only
(`ld_l2`: a stale L1 line of two steps before would be read otherwise).

The cell is printed from the IR node by node (`CellPrinter`), each node's value one register per index
of its local (gate) axes, its expressions through the printer's `CPrinter.expr` (the math header's
functions). Off the GPU (the emulator: one block at a time) the barrier is compiled out; the host
launches one block there.
"""

from __future__ import annotations

import itertools
import math

from .....ir.node import Node
from .....ir.ops import BINARY, UNARY, Op
from .....lowering.loops import Bin, Call, Num, Select, Var
from .....lowering.step import BINOPS, CALLS
from ...printer import CPrinter
from ...source import math_header
from .analysis import Cell, Plan

# cycles a block waits at a barrier before it flags a failure in bar[1] (and goes on): a bug then
# shows as a BarrierTimeout at the runner's next call, not a hang
BARRIER_TIMEOUT = 1 << 33


class _Exprs:
    """The printer's rendering of scalar expressions (numbers, variables, calls, operators, selects)."""

    def __init__(self):
        self.views = {}

    expr = CPrinter.expr


def kernel_name(cell: Cell) -> str:
    return f"{cell.program.name}_persistent"


def contiguous_index(axes: tuple[str, ...], sizes: dict[str, int], at: dict[str, str]) -> str:
    """The offset of `at` (axis -> C index text) in a contiguous array of `axes`."""
    terms, stride = [], 1
    for a in reversed(axes):
        terms.append(at[a] if stride == 1 else f"({at[a]}) * {stride}")
        stride *= sizes[a]
    return " + ".join(reversed(terms)) or "0"


def _contiguous(shape: list[int]) -> tuple[int, ...]:
    out, stride = [], 1
    for n in reversed(shape):
        out.append(stride)
        stride *= n
    return tuple(reversed(out))


def combos(axes: tuple[str, ...], sizes: dict[str, int]):
    """Every assignment of the local `axes` (axis -> index), in row-major order."""
    for values in itertools.product(*(range(sizes[a]) for a in axes)):
        yield dict(zip(axes, values))


def flat(axes: tuple[str, ...], sizes: dict[str, int], assign: dict[str, int]) -> int:
    """The row-major position of `assign` restricted to `axes`."""
    i = 0
    for a in axes:
        i = i * sizes[a] + assign[a]
    return i


class CellPrinter:
    """The cell's C statements for pair q (module docstring): node values as registers ``v<n>_<c>``."""

    def __init__(self, cell: Cell, sizes: dict[str, int]):
        self.cell, self.sizes = cell, sizes
        p = cell.program
        self.index = {n: i for i, n in enumerate(cell.nodes)}
        self.states = {s.name: i for i, s in enumerate(p.states)}
        self.seqs = {d.name: i for i, d in enumerate(p.seqs)}
        self.params = {d.name: i for i, d in enumerate(p.params)}
        self.at = {a: f"ri_{a}" for a in cell.rows} | {cell.split: "k"}
        self.printer = _Exprs()
        self.weight_axes = next(d.axes for d in p.params if d.name == cell.weight)

    def own(self, n: Node) -> tuple[str, ...]:
        return tuple(a for a in n.axes if a in self.cell.local)

    def count(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.sizes[a] for a in axes)

    def ref(self, n: Node, assign: dict[str, int]):
        """The expression of node `n` at the local indices `assign`."""
        own = self.own(n)
        c = flat(own, self.sizes, assign)
        if n.op is Op.CONST:
            return Num(float(n.arg))
        if n.op is Op.INPUT:
            if n.arg in self.states:
                return Var(f"st{self.states[n.arg]}[q][{c}]")
            if n.arg in self.seqs:
                return Var(f"sv{self.seqs[n.arg]}[q][{c}]")
            return Var(f"pv{self.params[n.arg]}[q][{c}]")
        if n.op is Op.IOTA:
            return Num(float(assign[n.arg]))
        if n is self.cell.product:
            return Var(f"acc[q][{flat(self.cell.cols, self.sizes, assign)}]")
        if n.op is Op.RENAME:  # the adjoint's rename(P, j -> k): the pair's own unit
            return self.ref(n.args[0], assign)
        return Var(f"v{self.index[n]}_{c}")

    def node(self, n: Node, assign: dict[str, int]):
        """The expression computing node `n` at `assign` from its arguments' registers."""
        if n.op is Op.SELECT:
            axis, i = n.arg
            return self.ref(n.args[0], {**assign, axis: i})
        args = [self.ref(a, assign) for a in n.args]
        if n.op is Op.WHERE:
            return Select(*args)
        if n.op in BINOPS:
            return Bin(BINOPS[n.op], *args)
        if n.op in UNARY or n.op in BINARY:
            return Call(CALLS[n.op], tuple(args))
        raise TypeError(f"{n.op} in the cell")

    def values(self, nodes) -> list[str]:
        """The registers of `nodes` (cell nodes, in order) for pair q."""
        out = []
        for n in nodes:
            if n.op in (Op.INPUT, Op.CONST, Op.IOTA, Op.RENAME) or n is self.cell.product:
                continue
            ctype = "bool" if n.dtype == "bool" else "F"
            for assign in combos(self.own(n), self.sizes):
                value = self.printer.expr(self.node(n, assign))
                out.append(f"const {ctype} v{self.index[n]}_{flat(self.own(n), self.sizes, assign)} = {value};")
        return out

    def publish(self) -> list[str]:
        """Statements for pair q before the product: the values the operand needs, and the operand at
        (r, k) and every index of its local axes written to the exchange buffer xw [ROWS][DEPTH] (the
        contracted axes flat in the weight's order)."""
        cell = self.cell
        needed, todo = set(), [cell.publish]
        while todo:
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(n.args)
        out = self.values([n for n in cell.nodes if n in needed])
        order = tuple(a for a in self.weight_axes if a in cell.contracted)
        own = tuple(a for a in cell.publish.axes if a in cell.local)
        for assign in combos(own, self.sizes):
            at = {cell.unit: "k"} | {a: str(v) for a, v in assign.items()}
            out.append(f"xw[(long long)r * DEPTH + {contiguous_index(order, self.sizes, at)}] = "
                       f"{self.printer.expr(self.ref(cell.publish, assign))};")
        return out

    def body(self) -> list[str]:
        """Statements of the cell for pair q after the product: every node (those before the product
        recomputed: cheaper than keeping them in registers across the barrier), then the outputs at t
        and the new carries."""
        out = self.values(self.cell.nodes)
        p = self.cell.program
        for i, (_, y) in enumerate(p.outputs):
            axes = y.axes
            step = math.prod(self.sizes[a] for a in axes)
            for assign in combos(tuple(a for a in axes if a in self.cell.local), self.sizes):
                at = self.at | {a: str(v) for a, v in assign.items()}
                out.append(f"o{i}[(long long)t * {step} + {contiguous_index(axes, self.sizes, at)}] = "
                           f"{self.printer.expr(self.ref(y, assign))};")
        for s, u in zip(p.states, p.updates):
            i = self.states[s.name]
            for assign in combos(self.own_of(s.axes), self.sizes):
                c = flat(self.own_of(s.axes), self.sizes, assign)
                out.append(f"const F n{i}_{c} = {self.printer.expr(self.ref(u, assign))};")
        for s in p.states:
            i = self.states[s.name]
            for c in range(self.count(self.own_of(s.axes))):
                out.append(f"st{i}[q][{c}] = n{i}_{c};")
        return out

    def own_of(self, axes) -> tuple[str, ...]:
        return tuple(a for a in axes if a in self.cell.local)


def kernel_source(cell: Cell, plan: Plan, sizes: dict[str, int],
                  seq_strides: dict[str, tuple[int, ...]] | None = None) -> str:
    """The CUDA module (math header and the kernel) of `cell` at `sizes`, split as `plan`.

    Arguments: (length, nblk, sequences [L, axes...], params, initial states, outputs [L, axes...],
    final states, xo [2][rows][units], bar [3] (counter, failed, step)); fp32 arrays, contiguous in
    their declaration's axis order but for the sequences, read in place at `seq_strides` (name ->
    element strides of time and each axis; 0 along a broadcast axis; default contiguous)."""
    p = cell.program
    pr = CellPrinter(cell, sizes)
    name = kernel_name(cell)
    args = ["int length", "int nblk"]
    args += [f"const float* __restrict__ s{i}" for i, _ in enumerate(p.seqs)]
    args += [f"const float* __restrict__ w{i}" for i, _ in enumerate(p.params)]
    args += [f"const float* __restrict__ i{i}" for i, _ in enumerate(p.states)]
    args += [f"float* __restrict__ o{i}" for i, _ in enumerate(p.outputs)]
    args += [f"float* __restrict__ f{i}" for i, _ in enumerate(p.states)]
    args += ["float* xo", "unsigned int* bar"]
    weight = pr.params[cell.weight]
    order = tuple(a for a in pr.weight_axes if a in cell.contracted)  # the flat contracted index's order
    wat = {a: f"e_{a}" for a in order} | {cell.out_unit: "kk"} | {a: f"c_{a}" for a in cell.cols}
    rsz = [sizes[a] for a in cell.rows]

    def full(axes) -> list[int]:
        return [sizes[a] for a in axes]

    def rows_of(var: str) -> list[str]:
        out = []
        for i, a in enumerate(cell.rows):
            inner = math.prod(rsz[i + 1:])
            out.append(f"const int ri_{a} = ({var} / {inner}) % {rsz[i]};")
        return out

    def pair_head() -> list[str]:
        return ["const int pq = threadIdx.x + q * THREADS;", "const int r = pq / UNITS;",
                "const int k = k0 + pq % UNITS;", "const bool on = r < ROWS && k < SIZE;",
                "const int rr = on ? r : 0;", "const int kc = on ? k : 0;", *rows_of("rr")]

    def at_pair(axes, assign) -> str:
        at = {a: f"ri_{a}" for a in cell.rows} | {cell.split: "kc"} | {a: str(v) for a, v in assign.items()}
        return contiguous_index(axes, sizes, at)

    # U slice: su[j][u][c], c flat over the product's columns in the weight's order, padded to CPAD
    # (a unit's columns adjacent: one wide shared load where CPAD is 2 or 4)
    local_decode = []
    for i, a in enumerate(cell.cols):
        inner = math.prod(sizes[b] for b in cell.cols[i + 1:])
        local_decode.append(f"const int c_{a} = (c / {inner}) % {sizes[a]};")
    for i, a in enumerate(order):
        inner = math.prod(sizes[b] for b in order[i + 1:])
        local_decode.append(f"const int e_{a} = (j / {inner}) % {sizes[a]};")
    u_index = contiguous_index(p.params[weight].axes, sizes, wat)
    if plan.vec:  # su[u][j]: j fastest (the adjoint's U[j-unit, (g, k)] is contiguous along it)
        load_u = [
            "for (int e = threadIdx.x; e < JPAD * UNITS; e += THREADS) {",
            "    const int j = e % JPAD, u = e / JPAD, kk = k0 + u;",
            *("    " + line for line in local_decode),
            f"    su[u][j] = (j < DEPTH && kk < SIZE) ? w{weight}[{u_index}] : F(0);",
            "}",
        ]
    else:
        load_u = [
            "for (int e = threadIdx.x; e < JPAD * CPAD * UNITS; e += THREADS) {",
            "    const int j = e / (CPAD * UNITS), c = (e / UNITS) % CPAD, u = e % UNITS, kk = k0 + u;",
            *("    " + line for line in local_decode),
            f"    su[j][u][c] = (c < COLS && j < DEPTH && kk < SIZE) ? w{weight}[{u_index}] : F(0);",
            "}",
        ]
    # registers: carries, params, the step's sequences
    decl = ["F acc[PAIRS][COLS];"]
    prologue = []
    for s in p.states:
        i = pr.states[s.name]
        n = pr.count(pr.own_of(s.axes))
        decl.append(f"F st{i}[PAIRS][{n}];")
        for assign in combos(pr.own_of(s.axes), sizes):
            prologue.append(f"st{i}[q][{flat(pr.own_of(s.axes), sizes, assign)}] = i{i}[{at_pair(s.axes, assign)}];")
    read = {n.arg for n in cell.nodes if n.op is Op.INPUT}
    params = [d for d in p.params if d.name in read]
    for d in params:
        i = pr.params[d.name]
        decl.append(f"F pv{i}[PAIRS][{pr.count(pr.own_of(d.axes))}];")
        for assign in combos(pr.own_of(d.axes), sizes):
            prologue.append(f"pv{i}[q][{flat(pr.own_of(d.axes), sizes, assign)}] = w{i}[{at_pair(d.axes, assign)}];")
    seq_loads = []
    for d in p.seqs:
        if d.name not in read:
            continue
        i = pr.seqs[d.name]
        decl.append(f"F sv{i}[PAIRS][{pr.count(pr.own_of(d.axes))}];")
        strides = (seq_strides or {}).get(d.name) or (math.prod(full(d.axes)), *_contiguous(full(d.axes)))
        for assign in combos(pr.own_of(d.axes), sizes):
            at = {a: f"ri_{a}" for a in cell.rows} | {cell.split: "kc"} | {a: str(v) for a, v in assign.items()}
            terms = [f"(long long)t * {strides[0]}"]
            terms += [f"(long long)({at[a]}) * {st}" for a, st in zip(d.axes, strides[1:]) if st]
            seq_loads.append(f"sv{i}[q][{flat(pr.own_of(d.axes), sizes, assign)}] = s{i}[{' + '.join(terms)}];")
    finals = []
    for s in p.states:
        i = pr.states[s.name]
        for assign in combos(pr.own_of(s.axes), sizes):
            finals.append(f"f{i}[{at_pair(s.axes, assign)}] = st{i}[q][{flat(pr.own_of(s.axes), sizes, assign)}];")

    def per_pair(lines: list[str], guard: str = "on", depth: int = 1) -> str:
        pad = "    " * depth
        inner = "\n".join(pad + "        " + line for line in lines)
        head = "\n".join(pad + "    " + line for line in pair_head())
        return (f"{pad}#pragma unroll\n{pad}for (int q = 0; q < PAIRS; ++q) {{\n{head}\n"
                f"{pad}    if ({guard}) {{\n{inner}\n{pad}    }}\n{pad}}}")

    cell_lines = pr.body()
    publish_lines = pr.publish()
    product = [
        "#if VEC",
        "#pragma unroll",
        "for (int jj = 0; jj < CHUNK; jj += 4) {",
        "    const float4 h4 = *reinterpret_cast<const float4*>(&sh[r][jj]);",
        "    const float4 w4 = *reinterpret_cast<const float4*>(&su[pq % UNITS][j0 + jj]);",
        "    acc[q][0] = fmaf(h4.x, w4.x, acc[q][0]);",
        "    acc[q][0] = fmaf(h4.y, w4.y, acc[q][0]);",
        "    acc[q][0] = fmaf(h4.z, w4.z, acc[q][0]);",
        "    acc[q][0] = fmaf(h4.w, w4.w, acc[q][0]);",
        "}",
        "#else",
        "#pragma unroll 4",
        "for (int jj = 0; jj < CHUNK; ++jj) {",
        "    const F hv = sh[r][jj];",
        "#if CPAD == 4",
        "    const float4 w4 = *reinterpret_cast<const float4*>(&su[j0 + jj][pq % UNITS][0]);",
        "    const F wv[4] = {w4.x, w4.y, w4.z, w4.w};",
        "#else",
        "    const F* wv = &su[j0 + jj][pq % UNITS][0];",
        "#endif",
        "    #pragma unroll",
        "    for (int c = 0; c < COLS; ++c) acc[q][c] = fmaf(hv, wv[c], acc[q][c]);",
        "}",
        "#endif",
    ]
    src = f"""{math_header()}
using namespace ssmc;
typedef float F;

#define ROWS {plan.rows}
#define SIZE {plan.size}
#define COLS {plan.cols}
#define CPAD {plan.cpad or plan.cols}
#define VEC {int(plan.vec)}
#define SHS {plan.chunk + (4 if plan.vec else 1)}
#define UNITS {plan.units}
#define THREADS {plan.threads}
#define PAIRS {plan.pairs}
#define CHUNK {plan.chunk}
#define JPAD {plan.jpad}
#define DEPTH {plan.depth}
#define STAGED {-(-plan.rows * plan.chunk // plan.threads)}
#define REVERSE {int(p.reverse)}

#ifdef __CUDA_ARCH__
__device__ __forceinline__ float ld_l2(const float* p) {{ return __ldcg(p); }}
// Every block of the grid arrives (counter += 1) and waits until all have: target = steps x blocks,
// the counter never reset within a launch. The fences order the block's stores before its arrival
// and the others' stores before its reads.
__device__ __forceinline__ void grid_barrier(unsigned int* bar, unsigned int target, int step)
{{
    __syncthreads();
    if (threadIdx.x == 0) {{
        __threadfence();
        atomicAdd(bar, 1u);
        const long long start = clock64();
        while (*(volatile unsigned int*)bar < target) {{
            __nanosleep(20);
            if (clock64() - start > {BARRIER_TIMEOUT}LL) {{
                atomicExch(bar + 1, 1u);
                atomicMax(bar + 2, (unsigned int)step);
                break;
            }}
        }}
        __threadfence();
    }}
    __syncthreads();
}}
#else
inline float ld_l2(const float* p) {{ return *p; }}
inline void grid_barrier(unsigned int*, unsigned int, int) {{}}  // the emulator runs one block
#endif

// The values of the operand op[r][j0 .. j0 + CHUNK) this thread stages (element e = threadIdx.x + i THREADS of the
// [ROWS][CHUNK] chunk), zero past the axis' end.
__device__ __forceinline__ void stage(F* staged, const F* hin, int j0)
{{
    #pragma unroll
    for (int i = 0; i < STAGED; ++i) {{
        const int e = threadIdx.x + i * THREADS, r = e / CHUNK, j = j0 + e % CHUNK;
        staged[i] = (e < ROWS * CHUNK && j < DEPTH) ? ld_l2(hin + (long long)r * DEPTH + j) : F(0);
    }}
}}

extern "C" __global__ void __launch_bounds__(THREADS, 1) {name}({", ".join(args)})
{{
#if VEC
    __shared__ __align__(16) F su[UNITS][JPAD + 4];  // + 4: the units' rows start in different banks
#else
    __shared__ __align__(16) F su[JPAD][UNITS][CPAD];
#endif
    __shared__ __align__(16) F sh[ROWS][SHS];
    const int k0 = blockIdx.x * UNITS;
{chr(10).join("    " + line for line in load_u)}
{chr(10).join("    " + line for line in decl)}
{per_pair(prologue)}
    for (int s = 0; s < length; ++s) {{
        const int t = REVERSE ? length - 1 - s : s;
        F* xw = xo + (s & 1) * (ROWS * DEPTH);
{per_pair(seq_loads, depth=2)}
{per_pair(publish_lines, depth=2)}
        // every block's operand of this step written before any block stages it
        if (gridDim.x > 1) grid_barrier(bar, (unsigned int)(s + 1) * gridDim.x, s);
        else __syncthreads();
        #pragma unroll
        for (int q = 0; q < PAIRS; ++q)
            #pragma unroll
            for (int c = 0; c < COLS; ++c) acc[q][c] = F(0);
        F staged[STAGED];  // this thread's values of the next chunk, loaded while the block multiplies
        stage(staged, xw, 0);
        for (int j0 = 0; j0 < JPAD; j0 += CHUNK) {{
            __syncthreads();  // every thread done with the previous chunk
            #pragma unroll
            for (int i = 0; i < STAGED; ++i) {{
                const int e = threadIdx.x + i * THREADS;
                if (e < ROWS * CHUNK) sh[e / CHUNK][e % CHUNK] = staged[i];
            }}
            __syncthreads();
            if (j0 + CHUNK < JPAD) stage(staged, xw, j0 + CHUNK);
{per_pair(product, guard="r < ROWS", depth=3)}
        }}
{per_pair(cell_lines, depth=2)}
    }}
{per_pair(finals)}
}}
"""
    return src
