"""CUDA C of the persistent kernel: one cooperative launch for the whole sequence, a forward or an
adjoint (the same code: `Cell` says which product; REVERSE, the time order).

The rows are cut into batch tiles (`Plan.tiles` of `trows` rows: independent recurrences); block x
owns tile x / NBT and units k in [k0, k0 + KU) of the split axis (k0 = (x % NBT) KU), all local
(gate) columns of them, so the cell's element-wise math is local; its slice of U sits in shared
memory for the whole call. Thread pair q owns one (row r, unit k) of its tile for the whole call
(carries in registers). As a plain loop (e: the flat contracted index, j in the forward, (g, k') in
the adjoint; D its size, padded to JPAD):

    su[e][u][c] = U[e, c, k0 + u]                        once (zero past the axes' ends)
    st[q] = initial states at (r, k)
    for s in range(L):  t = s (L - 1 - s where reversed)
        seq[q] = sequences at (t, r, k)                  issued first (latency hidden)
        xo[s % 2][r][e(k, g)] = op at (r, k, g)          the forward: h; the adjoint: dz, from the
                                                         carries and seq (the cell's nodes it needs)
        tile barrier                                     the tile's blocks' operands written before any reads them
        acc[q][c] = sum_e xo[s % 2][r][e] su[e][u][c]    the tile's rows of xo staged a chunk of CHUNK
                                                         contracted indices at a time through a ring of
                                                         NSTAGE buffers, NSTAGE - 1 chunks in flight (16-byte
                                                         cp.async through L2) while the block multiplies one
        cell(acc, seq, st, params) -> outputs at t (and the product itself, `record`), the new states st

The exchange buffer xo is double-buffered by step parity: a block writing step s + 1's operand cannot
overwrite what a slower block still reads at step s (that block has not yet passed barrier s + 1,
which the writer needs to reach step s + 2's write to the same half). xo is read through L2 only
(cp.async.cg: a stale L1 line of two steps before would be read otherwise). Its rows are JPAD long,
the pad columns zeroed once by block 0 (U is zero there, but uninitialised memory may hold a NaN).

Split (`Plan.ksplit` KS > 1, the tensor-core form: an adjoint's long operand): a tile's blocks are KS K groups
x JS J groups; block (kg, jg) owns the units k = jg JU + kg UNITS + u (JU = KS UNITS) and, a step:

        xo[s % 2][r][kg JPAD + e(m, g)] = op at (r, k, g)     m = jg UNITS + u: the K group's units in order
        K group barrier                                       (its JS blocks)
        pb[s % 2][kg][r][jg JU + n] = sum over the group's e of xo[s % 2][r][kg JPAD + e] su[e][n]
        J group barrier                                       (its KS blocks)
        acc[q] = sum over kg' in order of pb[s % 2][kg'][r][k]

Reductions over the units (`Cell.reductions`, a LayerNorm's; `analysis.reduction_levels`): each level, before
the publish or after the product, a step:

        rs[v][lr][u] = summand v at (r, k)                     each pair (shared memory)
        part[v][lr] = sum over u in order of rs[v][lr][u]      a thread a (value, row)
        NBT > 1: rx[level][x][lr][v] = part; tile barrier; rt[v][lr] = sum over the tile's blocks in order of rx
        NBT = 1: rt[v][lr] = part                              (the tile's units all in the block)
        rv<n>[q] = rt[v][lr]                                   each pair: what the later nodes read

The cell is printed from the IR node by node (`CellPrinter`), each node's value one register per index
of its local (gate) axes, its expressions through the printer's `CPrinter.expr` (the math header's
functions). Off the GPU (the emulator: one block at a time) the barrier is a block barrier; the
host launches one block there, and all shared memory is a function static.
"""

from __future__ import annotations

import itertools
import math
import re

from .....ir.node import Node
from .....ir.ops import BINARY, UNARY, Op
from .....lowering.loops import Bin, Call, Num, Select, Var
from .....lowering.step import BINOPS, CALLS
from ...printer import CPrinter
from ...source import math_header, mma_header
from . import analysis
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


def time_offset(axes, strides, at: dict[str, str], time: str = "t") -> str:
    """``time * strides[0] + sum of at[a] * stride`` for an array [L, *axes] at element `strides`, in 64 bits
    (`time`: the C variable of the step's time index)."""
    terms = [f"(long long){time} * {strides[0]}"]
    terms += [f"(long long)({at[a]}) * {st}" for a, st in zip(axes, strides[1:]) if st]
    return " + ".join(terms)


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
        self.reductions = frozenset(cell.reductions)  # over the units: their values rv<n>[q] (`reduction_code`)

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
        if n.op is Op.SIZE:
            return Num(float(self.sizes[n.arg]))
        if n in self.reductions:
            return Var(f"rv{self.index[n]}[q][{c}]")
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
        if n.op in (Op.SUM, Op.REDUCE_MAX):  # over a gate axis, which the thread holds whole: in order
            terms = [self.ref(n.args[0], {**assign, n.arg: i}) for i in range(self.sizes[n.arg])]
            out = terms[0]
            for term in terms[1:]:
                out = Bin("+", out, term) if n.op is Op.SUM else Call("max", (out, term))
            return out
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
            if n.op in (Op.INPUT, Op.CONST, Op.IOTA, Op.RENAME, Op.SIZE) or n is self.cell.product:
                continue
            if n in self.reductions:
                continue
            ctype = "bool" if n.dtype == "bool" else "F"
            for assign in combos(self.own(n), self.sizes):
                value = self.printer.expr(self.node(n, assign))
                out.append(f"const {ctype} v{self.index[n]}_{flat(self.own(n), self.sizes, assign)} = {value};")
        return out

    def needs_product(self, n: Node) -> bool:
        """Whether node `n`'s value depends on the step's recurrent product."""
        seen, todo = set(), [n]
        while todo:
            m = todo.pop()
            if m is self.cell.product:
                return True
            if m not in seen:
                seen.add(m)
                todo.extend(m.args)
        return False

    def output_slots(self, out_strides: dict | None = None, record: tuple[int, ...] | None = None,
                     half_outs: frozenset = frozenset(), half_record: bool = False) -> list[tuple]:
        """Every value pair q writes a step, in `body`'s order: (early, node, assign, array, strides, axes, half),
        `early` where the value does not need the step's product (the publish can compute it: the late stores,
        `kernel_source`), the record (rp) last."""
        p, out = self.cell.program, []
        for i, (name, y) in enumerate(p.outputs):
            for assign in combos(self.own_of(y.axes), self.sizes):
                out.append((not self.needs_product(y), y, assign, f"o{i}", (out_strides or {}).get(name), y.axes,
                            name in half_outs))
        if record is not None:
            axes = self.cell.product.axes
            for assign in combos(self.own_of(axes), self.sizes):
                out.append((False, self.cell.product, assign, "rp", record, axes, half_record))
        return out

    def late_stores(self, slots: list[tuple]) -> tuple[list[str], list[str]]:
        """The late stores' statements for pair q (`kernel_source`'s `late`): the early values from ev[q] at the
        step's time t, the others from dv[q] at the time tp of the step before (`slots`: `output_slots`)."""
        early, late = [], []
        for is_early, _, assign, array, strides, axes, half in slots:
            where, reg = (early, "ev") if is_early else (late, "dv")
            value = f"{reg}[q][{len(where)}]"
            value = f"ssmc_mma::float_half<BF16>({value})" if half else value
            offset = self.strided(axes, strides, assign, "t" if is_early else "tp")
            where.append(f"{array}[{offset}] = {value};")
        return early, late

    def publish(self, half: bool = False, munits: int | None = None, early: list[tuple] | None = None) -> list[str]:
        """Statements for pair q before the product: the values the operand needs, and the operand at
        (r, k) and every index of its local axes written to the exchange buffer xw [ROWS][XST]: at the
        block's K group's slice (kg JPAD), the contracted axes flat in the weight's order, the unit axis
        as the pair's index km among the group's `munits` (the columns past DEPTH stay zero). `early`: the
        output slots (`output_slots`) whose values the publish also computes, into ev[q] in order."""
        cell = self.cell
        late = early is not None
        early = [slot for slot in early or [] if slot[0]]
        updates = self.early_updates() if late else []
        needed = analysis.closure([cell.publish, *(slot[1] for slot in early), *(u for _, _, u in updates)],
                                  self.reductions)
        out = self.values([n for n in cell.nodes if n in needed])
        order = tuple(a for a in self.weight_axes if a in cell.contracted)
        own = tuple(a for a in cell.publish.axes if a in cell.local)
        sizes = self.sizes | {cell.unit: munits or self.sizes[cell.unit]}
        for assign in combos(own, self.sizes):
            at = {cell.unit: "km"} | {a: str(v) for a, v in assign.items()}
            value = self.printer.expr(self.ref(cell.publish, assign))
            out.append(f"xw[(long long)r * XST + kg * JPAD + {contiguous_index(order, sizes, at)}] = "
                       + (f"ssmc_mma::float_half<BF16>({value});" if half else f"{value};"))
        for n, slot in enumerate(early):
            out.append(f"ev[q][{n}] = {self.printer.expr(self.ref(slot[1], slot[2]))};")
        for i, s, u in updates:
            for assign in combos(self.own_of(s.axes), self.sizes):
                c = flat(self.own_of(s.axes), self.sizes, assign)
                out.append(f"nu{i}[q][{c}] = {self.printer.expr(self.ref(u, assign))};")
        return out

    def reduction_level(self, level: tuple[Node, ...]) -> tuple[list[str], list[str], list[int]]:
        """A level of reductions over the units (`analysis.reduction_levels`) for pair q: (the statements
        writing its summands to the block's rs[v][lr][u], v the level's value, the statements reading the
        level's totals rt[v][lr] into rv<n>[q], the values v that are maxima, not sums)."""
        needed = analysis.closure([r.args[0] for r in level], self.reductions | {self.cell.product})
        write = self.values([n for n in self.cell.nodes if n in needed])
        read, maxima, v = [], [], 0
        for r in level:
            own = self.own(r)
            for assign in combos(own, self.sizes):
                value = self.printer.expr(self.ref(r.args[0], assign))
                write.append(f"rs[({v} * TROWS + lr) * UNITS + u] = {value};")
                read.append(f"rv{self.index[r]}[q][{flat(own, self.sizes, assign)}] = rt[{v} * TROWS + lr];")
                if r.op is Op.REDUCE_MAX:
                    maxima.append(v)
                v += 1
        return write, read, maxima

    def early_updates(self) -> list[tuple]:
        """(index, state, update) of the carries whose update does not need the step's product (an adjoint's
        dc): with the late stores the publish computes them into nu<i>[q] (the sequences they read then need
        no registers across the product) and the cell takes them from there."""
        p = self.cell.program
        return [(self.states[s.name], s, u) for s, u in zip(p.states, p.updates) if not self.needs_product(u)]

    def strided(self, axes: tuple[str, ...], strides: tuple[int, ...] | None, assign: dict[str, int],
                time: str = "t") -> str:
        """The offset of step `time` (a C variable) and the pair's indices (`assign`: the local axes') in an
        array [L, *axes] at element `strides` (time first; None: contiguous)."""
        if strides is None:
            strides = (math.prod(self.sizes[a] for a in axes), *_contiguous([self.sizes[a] for a in axes]))
        at = self.at | {a: str(v) for a, v in assign.items()}
        return time_offset(axes, strides, at, time)

    def body(self, out_strides: dict | None = None, record: tuple[int, ...] | None = None,
             half_outs: frozenset = frozenset(), half_record: bool = False, late: bool = False) -> list[str]:
        """Statements of the cell for pair q after the product: every node (those before the product
        recomputed: cheaper than keeping them in registers across the barrier), then the outputs at t
        (at `out_strides`: name -> element strides of time and each axis; default contiguous), the
        product itself where `record` gives its array's strides (rp [L, *product axes]), and the new
        carries. The outputs named in `half_outs`, and rp where `half_record`, are stored rounded to the
        16-bit type (the values computed in fp32 all the same). `late`: no stores; the values that need the
        product kept in dv[q] (in `output_slots` order) for the next step's late stores, the others left to
        the publish (`late_stores`)."""
        p = self.cell.program
        slots = self.output_slots(out_strides, record, half_outs, half_record)
        deferred = [slot for slot in slots if not slot[0]] if late else slots
        nodes = self.cell.nodes
        if late:  # only what the deferred values and the carries of the product need
            needed = set()
            early_states = {i for i, _, _ in self.early_updates()}
            todo = [*(slot[1] for slot in deferred),
                    *(u for s, u in zip(p.states, p.updates) if self.states[s.name] not in early_states)]
            while todo:
                n = todo.pop()
                if n not in needed:
                    needed.add(n)
                    if n is not self.cell.product:  # (its value is acc: not its chain's nodes)
                        todo.extend(n.args)
            nodes = [n for n in nodes if n in needed]
        early_states = {i for i, _, _ in self.early_updates()} if late else set()
        out = self.values(nodes)
        for n, (_, node, assign, array, strides, axes, half) in enumerate(deferred):
            value = self.printer.expr(self.ref(node, assign))
            if late:
                out.append(f"dv[q][{n}] = {value};")
            else:
                value = f"ssmc_mma::float_half<BF16>({value})" if half else value
                out.append(f"{array}[{self.strided(axes, strides, assign)}] = {value};")
        for s, u in zip(p.states, p.updates):
            i = self.states[s.name]
            early = late and i in early_states  # the publish computed it (`early_updates`)
            for assign in combos(self.own_of(s.axes), self.sizes):
                c = flat(self.own_of(s.axes), self.sizes, assign)
                value = f"nu{i}[q][{c}]" if early else self.printer.expr(self.ref(u, assign))
                out.append(f"const F n{i}_{c} = {value};")
        for s in p.states:
            i = self.states[s.name]
            for c in range(self.count(self.own_of(s.axes))):
                out.append(f"st{i}[q][{c}] = n{i}_{c};")
        return out

    def own_of(self, axes) -> tuple[str, ...]:
        return tuple(a for a in axes if a in self.cell.local)


# clocks an SM sub-partition (a quarter of the SM's warps) takes per mma.sync m16n8k16, against one clock
# per 128-byte shared-memory wavefront of the SM (one 32-bit load a lane): the ratio the split weighs
MMA_CLOCKS = 6


def warp_grid(plan: Plan) -> tuple[int, int, int, int]:
    """The tensor-core form's split of the block's product tiles (16 x 8: MPAD / 16 x NPAD / 8 of them)
    over its warps: (GM, GN, WM, WN), warp w owning the WM x WN tiles at m-tile (w % GM) WM + i, n-tile
    (w / GM) WN + n (those past the ends skipped). A k16 step costs the block its fragments' shared loads
    (4 wavefronts a warp's row of tiles, 2 a column: GN x MT x 4 + GM x NT x 2 in all) or its mma issue
    (the busiest sub-partition's warps' tiles), whichever is longer; the least of that, at most 64
    accumulators a thread; fewer where a thread owns 8 pairs (their carries and cells need the registers:
    32, and 16 in an adjoint, whose cell keeps every gate's derivative)."""
    mt, nt, warps = plan.mpad // 16, plan.npad // 8, plan.threads // 32
    most = 64 if plan.pairs < 8 else 32 if plan.cols > 1 else 16
    if plan.ksplit > 1 and plan.pairs >= 8:  # as many as the split's tiles need over all warps, within the plan's
        most = min(analysis.SPLIT_ACCUMULATORS, max(16, 4 * -(-mt * nt // warps)))
    best = None
    for gm in range(1, min(warps, mt) + 1):
        for gn in range(1, min(warps // gm, nt) + 1):
            wm, wn = -(-mt // gm), -(-nt // gn)
            if wm * wn * 4 > most:
                continue
            loads = gm * gn * (4 * wm + 2 * wn)
            issue = -(-gm * gn // 4) * wm * wn * MMA_CLOCKS
            cost = (max(loads, issue), loads, -gm * gn)
            if best is None or cost < best[0]:
                best = (cost, (gm, gn, wm, wn))
    if best is None:  # more tiles than the warps hold in 64 accumulators: the largest grid, wide tiles
        gm = min(warps, mt)
        gn = max(1, min(warps // gm, nt))
        return gm, gn, -(-mt // gm), -(-nt // gn)
    return best[1]


def _fragment_rows(ctype: str, per16: int) -> list[str]:
    """The lines giving each lane its ldmatrix row addresses, `sa[i]` in the staged chunk (A, m-tile i) and `sb[n / 2]`
    in the chunk's U rows `ub` (B, n-tiles n and n + 1; rows UPITCH apart: sub at the chunk's first index where U
    is resident, the ring buffer's U rows where it is streamed), of values of `ctype`, `per16` of them in 16
    bytes (8: the 16-bit form; 4: the tf32 form, whose fp32 values ldmatrix moves as pairs of 16 bits): a
    register plus a constant for each tile and k step of the chunk; the tiles past the ends clamped to the last
    (a valid address; their products are skipped). A (x4: rows 0-7, 8-15 at the first 16 bytes, then the next):
    lane l at row l % 16, column per16 (l / 16). B (x4: the k rows of tile n's first 16 bytes, its next, then
    tile n + 1's; an odd last tile's x4 reads the tile past it, clamped): lane l at row 8 (n + l / 16) + l % 8,
    column per16 ((l / 8) % 2)."""
    return [
        "    const int ln = threadIdx.x % 32;",
        f"    const {ctype}* sa[WM];",
        f"    const {ctype}* sb[(WN + 1) / 2];",
        "    #pragma unroll",
        "    for (int i = 0; i < WM; ++i)",
        f"        sa[i] = &sh[(MFULL ? wm0 + i : min(wm0 + i, MT - 1)) * 16 + ln % 16][{per16} * (ln / 16)];",
        "    #pragma unroll",
        "    for (int n = 0; n < WN; n += 2) {",
        "        const int nt = NFULL && n + 1 < WN ? wn0 + n + ln / 16 : min(wn0 + n + ln / 16, NT - 1);",
        f"        sb[n / 2] = ub + (nt * 8 + ln % 8) * UPITCH + {per16} * ((ln / 8) % 2);",
        "    }",
    ]


def kernel_source(cell: Cell, plan: Plan, sizes: dict[str, int],
                  seq_strides: dict[str, tuple[int, ...]] | None = None,
                  out_strides: dict[str, tuple[int, ...]] | None = None,
                  record: tuple[int, ...] | None = None, bf16: bool = True,
                  half_seqs: frozenset = frozenset(), half_outs: frozenset = frozenset(),
                  half_record: bool = False, late: bool = False, prefetch: bool = False,
                  phases: bool = False, reload: bool = False, early_loads: bool = False) -> str:
    """The CUDA module (math header and the kernel) of `cell` at `sizes`, split as `plan`.

    Arguments: (length, nblk, sequences [L, axes...], params, initial states, outputs [L, axes...],
    final states, [rp [L, product axes...] where `record`,] xo [2][rows][ksplit jpad], bar [3 + tiles]
    (unused, failed, step, a counter a tile; split: [3 + tiles (ksplit + jsplit)], a counter a K group and
    one a J group of each tile), [pb [2][ksplit][rows][jsplit nunits cols] where split]); fp32 arrays,
    contiguous in their declaration's axis order but for the sequences, read in place at `seq_strides`
    (name -> element strides of time and each axis; 0 along a broadcast axis; default contiguous), and the
    outputs, written at `out_strides` (the same form).
    `record`: the strides of rp, where the kernel writes its recurrent product of every step (the
    forward's h U, which the adjoint would otherwise compute again as a matrix product).

    The tensor-core form (`plan.mma`): xo holds 16-bit values (bf16 where `bf16`, else fp16), U is
    converted to them once into shared memory, and the product is mma.sync tiles with fp32
    accumulators; the sequences named in `half_seqs` are read as 16-bit arrays (the rest fp32), the
    outputs named in `half_outs` (an adjoint's dz, which only the post products read, in 16 bits) and
    rp where `half_record` written as 16-bit arrays.

    Options (`CudaOptions`; each off keeps the kernel of before):
    `late` (persistent_late_stores): the barrier after the publish split into its arrival and its wait, the
    step's stores between them: the outputs that do not need the product, computed by the publish (ev), at t;
    the others and rp, kept in registers by the step before's cell (dv), at that step's time tp (the last step's
    after the loop). The arrival's fence then waits for no output store, and the stores issue while the block
    waits; the wait reads the counter with ld.acquire (no trailing fence, which would wait for them).
    `prefetch` (persistent_prefetch): the next step's sequences prefetched into L2 after this step's loads
    (a lane in four, one prefetch a value).
    `phases` (persistent_phases): thread 0 counts the block's clocks by phase of the step in shared memory and
    writes them at the end to bar[PHASE_AT + 8 blockIdx.x + i] (i: sequences and publish, the barrier, the
    product, the product's result to the pairs (split: the partials, their barrier, the sums), the cell; 5: all
    of the loop), clamped to 32 bits.
    `reload` (persistent_reload_index; `late` needs it at B256 H1024's adjoint): each phase's pairs read their
    thread's index through an opaque instruction, so that the compiler recomputes their indices and the
    sequences' addresses where they are used rather than keeping them (8 pairs x 10 addresses in the adjoint)
    in registers across the step's product (B256 H1024's adjoint: 254 registers to 219, sm_90).
    `early_loads` (persistent_early_loads, with `late`, where the cell after the product then reads no sequence:
    an adjoint, whose dz and dc the publish computes): the next step's sequences loaded into their registers once
    the step's product is done (split: past its second barrier, whose fence would wait for them), not at the top
    of the next step, whose publish needs them before its barrier."""
    if (half_outs or half_record) and not plan.mma:
        raise ValueError("16-bit outputs are written only in the tensor-core form")
    p = cell.program
    pr = CellPrinter(cell, sizes)
    name = kernel_name(cell)
    if cell.reductions:  # (the late stores and the next step's early loads assume one barrier a step)
        late = early_loads = False
    args = ["int length", "int nblk"]
    args += [f"const {'H' if d.name in half_seqs else 'float'}* __restrict__ s{i}" for i, d in enumerate(p.seqs)]
    args += [f"const float* __restrict__ w{i}" for i, _ in enumerate(p.params)]
    args += [f"const float* __restrict__ i{i}" for i, _ in enumerate(p.states)]
    args += [f"{'H' if name in half_outs else 'float'}* __restrict__ o{i}" for i, (name, _) in enumerate(p.outputs)]
    args += [f"float* __restrict__ f{i}" for i, _ in enumerate(p.states)]
    if record is not None:
        args.append(f"{'H' if half_record else 'float'}* __restrict__ rp")
    args += ["X* xo", "unsigned int* bar"]
    split = plan.ksplit > 1
    if split:
        args.append("float* __restrict__ pb")
    if cell.reductions:
        args.append("float* __restrict__ rx")
    if plan.streamed:
        args.append("X* __restrict__ ug")
    weight = pr.params[cell.weight]
    order = tuple(a for a in pr.weight_axes if a in cell.contracted)  # the flat contracted index's order
    wat = ({a: f"e_{a}" for a in order} | {cell.out_unit: "kk"} | {a: f"c_{a}" for a in cell.cols}
           | {a: f"hd_{a}" for a in cell.heads})
    head_decode = []  # the block's head (its tile's), each head axis' index
    for i, a in enumerate(cell.heads):
        inner = math.prod(sizes[b] for b in cell.heads[i + 1:])
        head_decode.append(f"const int hd_{a} = (tile / TPH / {inner}) % {sizes[a]};")
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
        # pair pq -> (its row lr of the block's tile, its unit u): a warp spans 8 rows x 4 units where the
        # tile has 8 rows or more and the units come in fours (one 16-byte shared load of the staged
        # rows and one of U serve the warp); else the units fastest
        if plan.units % 4 == 0 and plan.units > 4 and plan.trows >= 8:
            decode = ["const int lr = (pq / 4) % TROWS;", "const int u = 4 * (pq / (4 * TROWS)) + pq % 4;"]
        else:
            decode = ["const int lr = pq / UNITS;", "const int u = pq % UNITS;"]
        first = "thread_index()" if reload else "threadIdx.x"
        return [f"const int pq = {first} + q * THREADS;", *decode, "const int r = row0 + lr;",
                "const int k = k0 + u;", "const int km = jg * UNITS + u;",
                # (u < UNITS: past a tile's pairs the warp decode's u runs past the block's units, onto units of
                # the next block, which are < SIZE but not this block's)
                "const bool on = lr < TLIM && u < UNITS && r < ROWS && k < SIZE;",
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
    msizes = sizes | {cell.unit: plan.munits}
    for i, a in enumerate(order):
        inner = math.prod(msizes[b] for b in order[i + 1:])
        if a == cell.unit and split:  # the index among the K group's units -> the unit
            local_decode.append(f"const int m_{a} = (j / {inner}) % {msizes[a]};")
            local_decode.append(f"const int e_{a} = (m_{a} / UNITS) * JU + kg * UNITS + m_{a} % UNITS;")
        else:
            local_decode.append(f"const int e_{a} = (j / {inner}) % {msizes[a]};")
    u_index = contiguous_index(p.params[weight].axes, sizes, wat)
    tf = plan.mma and plan.tf32 > 0  # the fp32 tensor-core form
    if plan.mma:  # sub[n][j], n = u * COLS + c: j fastest (a B fragment's k pair one 32-bit load; tf32: its value)
        unit_in = f" && e_{cell.unit} < SIZE" if split else ""
        u_value = f"w{weight}[{u_index}]" if tf else f"ssmc_mma::float_half<BF16>(w{weight}[{u_index}])"
        # (streamed: into the block's slice of ug [NPAD][JPAD] in global memory, staged a chunk at a time each step)
        target = "ugw[(long long)n * JPAD + j]" if plan.streamed else "sub[(long long)n * UST + j]"
        load_u = [
            "for (int e = threadIdx.x; e < NPAD * JPAD; e += THREADS) {",
            "    const int j = e % JPAD, n = e / JPAD, u = n / COLS, c = n % COLS, kk = n0 + u;",
            *("    " + line for line in local_decode),
            f"    {target} = (u < JU && j < DEPTH && kk < SIZE{unit_in}) ? {u_value} : (X)0;",
            "}",
        ]
    elif plan.vec:  # su[u][j]: j fastest (the adjoint's U[j-unit, (g, k)] is contiguous along it)
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
    seq_loads, prefetches, next_loads, raw_loads, first_loads, raw_decl = [], [], [], [], [], []
    for d in p.seqs:
        if d.name not in read:
            continue
        i = pr.seqs[d.name]
        decl.append(f"F sv{i}[PAIRS][{pr.count(pr.own_of(d.axes))}];")
        strides = (seq_strides or {}).get(d.name) or (math.prod(full(d.axes)), *_contiguous(full(d.axes)))
        for assign in combos(pr.own_of(d.axes), sizes):
            at = {a: f"ri_{a}" for a in cell.rows} | {cell.split: "kc"} | {a: str(v) for a, v in assign.items()}
            offset = time_offset(d.axes, strides, at)
            value = f"s{i}[{offset}]"
            if d.name in half_seqs:
                value = f"ssmc_mma::half_float<BF16>({value})"
            seq_loads.append(f"sv{i}[q][{flat(pr.own_of(d.axes), sizes, assign)}] = {value};")
            prefetches.append(f"prefetch_l2(&s{i}[{time_offset(d.axes, strides, at, 'tn')}]);")
            # (early_loads: the values as stored, svr, converted at the next step's top: a conversion right after
            # the load would wait for it there; every pair loads, at its clamped indices where it is off: a load
            # under `on` would keep the register's old value alive across the whole step)
            c = flat(pr.own_of(d.axes), sizes, assign)
            raw_loads.append(f"svr{i}[q][{c}] = s{i}[{time_offset(d.axes, strides, at, 'tn')}];")
            first_loads.append(f"svr{i}[q][{c}] = s{i}[{offset}];")
            next_loads.append(f"sv{i}[q][{c}] = " + (f"ssmc_mma::half_float<BF16>(svr{i}[q][{c}]);"
                                                     if d.name in half_seqs else f"svr{i}[q][{c}];"))
        raw_decl.append(f"{'H' if d.name in half_seqs else 'F'} svr{i}[PAIRS][{pr.count(pr.own_of(d.axes))}];")
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

    half_record = half_record and record is not None
    slots = pr.output_slots(out_strides, record, half_outs, half_record)
    cell_lines = pr.body(out_strides, record, half_outs, half_record, late=late)
    publish_lines = pr.publish(plan.mma and not tf, plan.munits, early=slots if late else None)
    early_stores, late_stores = pr.late_stores(slots) if late else ([], [])
    # the next step's sequences loaded at the end of this one's product: where the cell after it reads none
    early_loads = early_loads and late and not re.search(r"\bsv\d+\[", "\n".join(cell_lines))
    if early_loads:
        decl.extend(raw_decl)
    if early_stores:
        decl.append(f"F ev[PAIRS][{len(early_stores)}];")
    if late_stores:
        decl.append(f"F dv[PAIRS][{len(late_stores)}];")
    for i, st, _ in pr.early_updates() if late else []:
        decl.append(f"F nu{i}[PAIRS][{pr.count(pr.own_of(st.axes))}];")
    for r in cell.reductions:
        decl.append(f"F rv{pr.index[r]}[PAIRS][{pr.count(pr.own(r))}];")
    pub_levels, body_levels = cell.phases

    def reduction_code(levels, first: int, barrier: int) -> str:
        """The levels of reductions over the units (`analysis.reduction_levels`), the first the step's level
        `first` (its rx slice) and barrier `barrier` (1: the step's first; the operand's is NPUB + 1). A
        level: each pair's summands into rs[v][lr][u]; the block's sums a row, u in order, to rx[level][block]
        [lr][v] (one block a tile: to rt); the tile's blocks meet; each row's total over the tile's blocks, in
        block order (deterministic), to rt[v][lr]; each pair's into its registers rv<n>[q]."""
        out = []
        for i, level in enumerate(levels):
            write, read, maxima = pr.reduction_level(level)
            nv = len(read)
            mx = " || ".join(f"v == {m}" for m in maxima) or "false"
            out.append(f"""        // reductions over the units, level {first + i}: {nv} values a row
{per_pair(write, depth=2)}
        __syncthreads();
        for (int e = threadIdx.x; e < {nv} * TROWS; e += THREADS) {{
            const int v = e / TROWS, lr = e % TROWS;
            const bool mx = {mx};
            const F* x = rs + (v * TROWS + lr) * UNITS;
            F a = x[0];
            for (int u = 1; u < min(UNITS, SIZE - k0); ++u) a = mx ? fmaxf(a, x[u]) : a + x[u];
            if (NBT > 1) rx[((long long)({first + i} * BLOCKS + blockIdx.x) * TROWS + lr) * RVALS + v] = a;
            else rt[v * TROWS + lr] = a;
        }}
        if (NBT > 1) {{
            grid_barrier(bar + 3 + tile, (unsigned int)(s * BPS + {barrier + i}) * NBT, s, bar);
            for (int e = threadIdx.x; e < {nv} * TROWS; e += THREADS) {{
                const int v = e / TROWS, lr = e % TROWS;
                const bool mx = {mx};
                const F* x = rx + ((long long)({first + i} * BLOCKS + tile * NBT) * TROWS + lr) * RVALS + v;
                F a = load_cg(x);
                for (int b = 1; b < NBT; ++b) {{
                    const F y = load_cg(x + (long long)b * TROWS * RVALS);
                    a = mx ? fmaxf(a, y) : a + y;
                }}
                rt[v * TROWS + lr] = a;
            }}
        }}
        __syncthreads();
{per_pair(read, guard="on", depth=2)}""")
        return "\n".join(out)

    pub_reductions = reduction_code(pub_levels, 0, 1)
    body_reductions = reduction_code(body_levels, len(pub_levels), len(pub_levels) + 2)
    product = [
        "#if VEC",
        "#pragma unroll 8",
        "for (int jj = 0; jj < CHUNK; jj += 4) {",
        "    const float4 h4 = *reinterpret_cast<const float4*>(&sh[lr][jj]);",
        "    const float4 w4 = *reinterpret_cast<const float4*>(&su[u][j0 + jj]);",
        "    acc[q][0] = fmaf(h4.x, w4.x, acc[q][0]);",
        "    acc[q][0] = fmaf(h4.y, w4.y, acc[q][0]);",
        "    acc[q][0] = fmaf(h4.z, w4.z, acc[q][0]);",
        "    acc[q][0] = fmaf(h4.w, w4.w, acc[q][0]);",
        "}",
        "#else",
        "#pragma unroll 2",
        "for (int jj = 0; jj < CHUNK; jj += 4) {",
        "    const float4 h4 = *reinterpret_cast<const float4*>(&sh[lr][jj]);",
        "    const F hv[4] = {h4.x, h4.y, h4.z, h4.w};",
        "    #pragma unroll",
        "    for (int i = 0; i < 4; ++i) {",
        "#if CPAD == 4",
        "        const float4 w4 = *reinterpret_cast<const float4*>(&su[j0 + jj + i][u][0]);",
        "        const F wv[4] = {w4.x, w4.y, w4.z, w4.w};",
        "#else",
        "        const F* wv = &su[j0 + jj + i][u][0];",
        "#endif",
        "        #pragma unroll",
        "        for (int c = 0; c < COLS; ++c) acc[q][c] = fmaf(hv[i], wv[c], acc[q][c]);",
        "    }",
        "}",
        "#endif",
    ]
    if tf:
        gm, gn, gk, wm, wn = analysis.tf32_warp_grid(plan)
    else:
        gm, gn, wm, wn = warp_grid(plan) if plan.mma else (1, 1, 1, 1)
        gk = 1
    mma_product = [
        "// the warp's WM x WN tiles of P += sh[rows][j0 .. j0 + CHUNK) sub[n][j0 ..], a k16 step at a time: A",
        "// fragments an m-tile one ldmatrix.x4, B fragments two n-tiles one (an odd last: the second unused)",
        "if (GM * GN == THREADS / 32 || warp < GM * GN) {",
        *_fragment_rows("X", 8),
        "    // k16 step ks + 1's fragments loaded while step ks multiplies (a buffer each)",
        "    unsigned a[2][WM][4], b[2][WN][2];",
        "    fragments(a[0], b[0], sa, sb, 0);",
        "    #pragma unroll 2",  # (the buffers' indices constants; a whole chunk's: registers the adjoint lacks)
        "    for (int ks = 0; ks < CHUNK / 16; ++ks) {",
        "        if (ks + 1 < CHUNK / 16) fragments(a[(ks + 1) % 2], b[(ks + 1) % 2], sa, sb, 16 * (ks + 1));",
        "        #pragma unroll",
        "        for (int i = 0; i < WM; ++i)",
        "            #pragma unroll",
        "            for (int n = 0; n < WN; ++n)",
        "                if ((MFULL || wm0 + i < MT) && (NFULL || wn0 + n < NT))",
        "                    ssmc_mma::mma_16816<BF16>(d[i][n], a[ks % 2][i], b[ks % 2][n]);",
        "    }",
        "}",
    ]
    if tf:
        # the warp's tiles over its k8 steps of the chunk: each fp32 value of the staged operand (A) and of U (B)
        # split into tf32 hi and lo in registers (3xTF32; TF32: hi only), the products into their accumulator
        # sets (3xTF32: a term each, lo hi and hi lo first; TF32: even and odd k8 steps) (KSUB: k8 steps an
        # iteration, the set a compile-time index)
        # (ldmatrix on the fp32 values: an 8x8 tile of 16-bit values is 8 rows of 4 fp32, lane (g, q) getting row g's
        # value q, as the tf32 fragments want it; the lane's rows as in the 16-bit form, 4 values a 16-byte column.
        # tf32 rounding (to nearest, ties away) on the bits: cvt.rna's result for finite values in 2 instructions,
        # not 3; an inf stays inf, a NaN gives NaN through its lo term)
        mma_product = [
            "// the warp's WM x WN tiles of P += sh[rows][its k8 steps] sub[n][j0 + its k8 steps] (m16n8k8 tf32): A",
            "// fragments an m-tile one ldmatrix.x4, B two n-tiles one (an odd last: the second unused)",
            "if (GM * GN * GK == THREADS / 32 || warp < GM * GN * GK) {",
            *_fragment_rows("F", 4),
            "    #pragma unroll 2",
            "    for (int k2 = wk * (CHUNK / GK); k2 < (wk + 1) * (CHUNK / GK); k2 += 8 * KSUB) {",
            "        #pragma unroll",
            "        for (int h = 0; h < KSUB; ++h) {",
            "            const int kk = k2 + 8 * h;",
            "            unsigned ah[WM][4], bh[WN][2];",
            "#if TF32 == 3",
            "            unsigned al[WM][4], bl[WN][2];",
            "#endif",
            "            #pragma unroll",
            "            for (int i = 0; i < WM; ++i) {",
            "                unsigned v[4];",
            "                ssmc_mma::ldsm<4, false>(v, reinterpret_cast<const H*>(sa[i] + kk));",
            "                #pragma unroll",
            "                for (int x = 0; x < 4; ++x) {",
            "                    ah[i][x] = tf32_round(v[x]);",
            "#if TF32 == 3",
            "                    al[i][x] = tf32_rest(v[x], ah[i][x]);",
            "#endif",
            "                }",
            "            }",
            "            #pragma unroll",
            "            for (int n = 0; n < WN; n += 2) {",
            "                unsigned v[4];",
            "                ssmc_mma::ldsm<4, false>(v, reinterpret_cast<const H*>(sb[n / 2] + kk));",
            "                #pragma unroll",
            "                for (int x = 0; x < (n + 1 < WN ? 4 : 2); ++x) {",
            "                    bh[n + x / 2][x % 2] = tf32_round(v[x]);",
            "#if TF32 == 3",
            "                    bl[n + x / 2][x % 2] = tf32_rest(v[x], bh[n + x / 2][x % 2]);",
            "#endif",
            "                }",
            "            }",
            "            #pragma unroll",
            "            for (int i = 0; i < WM; ++i)",
            "                #pragma unroll",
            "                for (int n = 0; n < WN; ++n)",
            "                    if ((MFULL || wm0 + i < MT) && (NFULL || wn0 + n < NT)) {",
            "#if TF32 == 3",
            "                        ssmc_mma::mma_1688(dx[2][i][n], al[i], bh[n]);",
            "                        ssmc_mma::mma_1688(dx[1][i][n], ah[i], bl[n]);",
            "                        ssmc_mma::mma_1688(dx[0][i][n], ah[i], bh[n]);",
            "#else",
            "                        ssmc_mma::mma_1688(dx[h][i][n], ah[i], bh[n]);",
            "#endif",
            "                    }",
            "        }",
            "    }",
            "}",
        ]
    # the pairs' columns from sp (GK > 1: the K-splitting warps' tiles, summed in warp order)
    from_sp = ["#pragma unroll", "for (int c = 0; c < COLS; ++c) {",
               "    F v = sp[lr * SPS + u * COLS + c];",
               "    #pragma unroll",
               "    for (int g = 1; g < GK; ++g) v += sp[g * (RROWS * SPS) + lr * SPS + u * COLS + c];",
               "    acc[q][c] = v;", "}"]
    vr = 4 if plan.units * plan.cols % 4 == 0 else 1  # split: the partials summed 4 units a 16-byte load
    src = f"""{math_header()}
{mma_header() if plan.mma else ""}
using namespace ssmc;
typedef float F;
typedef unsigned short H;  // a bf16 / fp16 value's bits
typedef {"H" if plan.mma and not tf else "F"} X;  // the exchange buffer's and the staged operand's element

#define ROWS {plan.rows}
#define TROWS {plan.trows}
#define XROWS {plan.xrows}
#define HB {plan.rows // plan.heads}
#define TPH {plan.tiles // plan.heads}
#define NBT {plan.blocks // plan.tiles}
#define SIZE {plan.size}
#define COLS {plan.cols}
#define CPAD {plan.cpad or plan.cols}
#define VEC {int(plan.vec)}
#define MMA {int(plan.mma)}
#define TF32 {plan.tf32 if tf else 0}
#define NACC {analysis.tf32_sets(plan.tf32) if tf else 1}
#define KSUB {2 if tf and plan.tf32 == 1 else 1}
#define BF16 {"true" if bf16 else "false"}
#define EPC {16 // plan.elem}
#define SHS {plan.chunk + plan.epad}
#define RROWS {plan.mpad if plan.mma else plan.trows}
#define NPAD {plan.npad}
#define UST {plan.jpad + plan.epad}
#define SPS {plan.sps}
#define MT {plan.mpad // 16}
#define NT {plan.npad // 8}
#define GM {gm}
#define GN {gn}
#define WM {wm}
#define WN {wn}
#define GK {gk}
#define MFULL (GM * WM <= MT)  // every warp's m-tiles within the product (no tile past the end to skip)
#define NFULL (GN * WN <= NT)
#define UNITS {plan.units}
#define KS {plan.ksplit}
#define JS {plan.jsplit}
#define JU {plan.nunits}
#define SPLIT {int(split)}
#define XST {plan.xcols}
#define PBW {plan.jsplit * plan.nunits * plan.cols}
#define VR {vr}
#define REDUCE {-(-plan.trows * plan.units * plan.cols // (plan.threads * vr))}
#define THREADS {plan.threads}
#define PAIRS {plan.pairs}
#define CHUNK {plan.chunk}
#define NCHUNK {plan.jpad // plan.chunk}
#define NSTAGE {plan.stages}
#define JPAD {plan.jpad}
#define DEPTH {plan.depth}
#define U_BYTES {plan.u_bytes}
#define STREAMED {int(plan.streamed)}
#define UROWS {plan.urows}  // a ring buffer's rows of U after the operand's RROWS (streamed: NPAD)
#define UPITCH {"SHS" if plan.streamed else "UST"}  // values between two rows of U where the product reads them
#define UCOPIES {-(-plan.urows * (plan.chunk // (16 // plan.elem)) // plan.threads)}  // a thread's copies of a U chunk
#define SHARED_BYTES {plan.shared_bytes}
#define COPIES {-(-plan.trows * plan.chunk // (16 // plan.elem) // plan.threads)}
#define CPR (CHUNK / EPC)  // 16-byte copies a staged row
#define REVERSE {int(p.reverse)}
#define LATE {int(late)}
#define PREFETCH {int(prefetch)}
#define PHASES {int(phases)}
#define NEXT_LOADS {int(early_loads)}
#define PHASE_AT {3 + plan.tiles * (plan.ksplit + plan.jsplit if split else 1)}
#define BLOCKS {plan.blocks}
#define NPUB {len(pub_levels)}  // levels of reductions over the units before the product, then after it
#define BPS {1 + len(pub_levels) + len(body_levels)}  // a tile's barriers a step
#define RVALS {max(plan.rvals, 1)}
#define RED_BYTES {plan.red_bytes}
static_assert(CHUNK % EPC == 0 && JPAD % CHUNK == 0 && U_BYTES % 16 == 0, "16-byte copies and loads");

#ifdef __CUDA_ARCH__
// Every block of a batch tile arrives (its counter += 1) and waits until all have: target = steps x the
// tile's blocks, the counter never reset within a launch. The fences order the block's stores before
// its arrival and the others' stores before its reads. A wait past the timeout sets flags[1] and
// flags[2] = the step (PersistentLoop.status, BarrierTimeout) and goes on.
__device__ __forceinline__ void grid_barrier(unsigned int* bar, unsigned int target, int step, unsigned int* flags)
{{
    __syncthreads();
    if (threadIdx.x == 0) {{
        __threadfence();
        atomicAdd(bar, 1u);
        const long long start = clock64();
        while (*(volatile unsigned int*)bar < target) {{
            __nanosleep(20);
            if (clock64() - start > {BARRIER_TIMEOUT}LL) {{
                atomicExch(flags + 1, 1u);
                atomicMax(flags + 2, (unsigned int)step);
                break;
            }}
        }}
        __threadfence();
    }}
    __syncthreads();
}}
// grid_barrier in two halves (LATE): the arrival, then the wait; the wait reads the counter with ld.acquire, so
// that no fence waits for the stores the block issued between them
__device__ __forceinline__ void grid_arrive(unsigned int* bar)
{{
    __syncthreads();
    if (threadIdx.x == 0) {{
        __threadfence();
        atomicAdd(bar, 1u);
    }}
}}
__device__ __forceinline__ void grid_wait(unsigned int* bar, unsigned int target, int step, unsigned int* flags)
{{
    if (threadIdx.x == 0) {{
        const long long start = clock64();
        for (;;) {{
            unsigned int seen;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(bar) : "memory");
            if (seen >= target) break;
            __nanosleep(20);
            if (clock64() - start > {BARRIER_TIMEOUT}LL) {{
                atomicExch(flags + 1, 1u);
                atomicMax(flags + 2, (unsigned int)step);
                break;
            }}
        }}
    }}
    __syncthreads();
}}
// threadIdx.x, read by an instruction the compiler neither moves nor merges (`reload`): what the pairs compute
// from it is computed again in each phase of a step, not kept in registers across the product
__device__ __forceinline__ int thread_index()
{{
    unsigned x;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(x));
    return (int)x;
}}
// an L2 prefetch of the line at p (PREFETCH)
__device__ __forceinline__ void prefetch_l2(const void* p)
{{
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}}
#else
// the emulator runs a block at a time (a multi-block launch computes one step from a buffer an earlier
// launch filled: tests/test_persistent_backward.py)
inline void grid_barrier(unsigned int*, unsigned int, int, unsigned int*) {{ __syncthreads(); }}
inline void grid_arrive(unsigned int*) {{ __syncthreads(); }}
inline void grid_wait(unsigned int*, unsigned int, int, unsigned int*) {{ __syncthreads(); }}
inline void prefetch_l2(const void*) {{}}
inline int thread_index() {{ return threadIdx.x; }}
#endif
#if PHASES && defined(__CUDA_ARCH__)
// thread 0 adds the clocks since the last mark to phase i (phase_clocks[7]: the last mark)
#define PHASE(i) do {{ if (threadIdx.x == 0) {{ const long long now_ = clock64(); \
    phase_clocks[i] += now_ - phase_clocks[7]; phase_clocks[7] = now_; }} }} while (0)
#else
#define PHASE(i) do {{}} while (0)
#endif

// 16 bytes of the exchange buffer into shared memory through L2 only (another block wrote them this
// step: an L1 line of two steps before would be stale): cp.async.cg on sm_80 and later (complete at
// `copies_wait`), a load through L2 and a store before; a plain copy in the emulator.
__device__ __forceinline__ void copy16(X* dst, const X* src)
{{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n"
                 :: "r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src) : "memory");
#elif defined(__CUDA_ARCH__)
    *reinterpret_cast<float4*>(dst) = __ldcg(reinterpret_cast<const float4*>(src));
#else
    *reinterpret_cast<float4*>(dst) = *reinterpret_cast<const float4*>(src);
#endif
}}
// a float another block wrote this step, through L2 only (as copy16)
__device__ __forceinline__ float load_cg(const float* p)
{{
#ifdef __CUDA_ARCH__
    return __ldcg(p);
#else
    return *p;
#endif
}}
__device__ __forceinline__ float4 load_cg4(const float* p)
{{
#ifdef __CUDA_ARCH__
    return __ldcg(reinterpret_cast<const float4*>(p));
#else
    return *reinterpret_cast<const float4*>(p);
#endif
}}
__device__ __forceinline__ void copies_commit()
{{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\\n" ::: "memory");
#endif
}}
// until at most NSTAGE - 2 of this thread's newest groups are in flight
__device__ __forceinline__ void copies_wait()
{{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\\n" :: "n"(NSTAGE - 2) : "memory");
#endif
}}

// chunk c of the tile's operand, op[r][c CHUNK .. c CHUNK + CHUNK), into the ring buffer `sh` (one group
// of copies, 16 bytes (EPC elements) each). Where CPR divides THREADS, thread x copies column EPC (x % CPR) of
// the COPIES rows from (x / CPR) COPIES on: one address a thread, the others small constant offsets (and no bound
// to test where the copies fill the chunk exactly); else element e = threadIdx.x + i THREADS of [TROWS][CPR]
__device__ __forceinline__ void stage(X (*sh)[SHS], const X* hin, int c)
{{
    if (THREADS % CPR == 0) {{
        const int r = (threadIdx.x / CPR) * COPIES, j = EPC * (threadIdx.x % CPR);
        const X* src = hin + (r * XST + c * CHUNK + j);  // (within a tile's rows: 32-bit offsets)
        X* dst = &sh[r][j];
        #pragma unroll
        for (int i = 0; i < COPIES; ++i)
            if (TROWS * CPR == COPIES * THREADS || r + i < TROWS) copy16(dst + i * SHS, src + i * XST);
    }} else {{
        #pragma unroll
        for (int i = 0; i < COPIES; ++i) {{
            const int e = threadIdx.x + i * THREADS, r = e / CPR, j = EPC * (e % CPR);
            if (e < TROWS * CPR) copy16(&sh[r][j], hin + (long long)r * XST + c * CHUNK + j);
        }}
    }}
}}

#if STREAMED
// chunk c of the block's U slice ugs [NPAD][JPAD] (global, the on-chip type: the prologue wrote it) into the U rows
// of the ring buffer `sh` (rows RROWS + n), in the same group of copies as the operand's chunk: from L2, where the
// slices of all the blocks (U's size once) stay across the steps
__device__ __forceinline__ void stage_u(X (*sh)[SHS], const X* ugs, int c)
{{
    #pragma unroll
    for (int i = 0; i < UCOPIES; ++i) {{
        const int e = threadIdx.x + i * THREADS, n = e / CPR, j = EPC * (e % CPR);
        if (NPAD * CPR == UCOPIES * THREADS || e < NPAD * CPR)
            copy16(&sh[RROWS + n][j], ugs + (long long)n * JPAD + c * CHUNK + j);
    }}
}}
#endif
#if TF32
// x's bits rounded to tf32 (to nearest, ties away from zero; cvt.rna.tf32.f32 for finite x), the lower 13 bits zero
__device__ __forceinline__ unsigned tf32_round(unsigned x) {{ return (x + 0x1000u) & 0xffffe000u; }}
// 3xTF32's lo term: x - hi (exact in fp32) rounded to tf32, as bits
__device__ __forceinline__ unsigned tf32_rest(unsigned x, unsigned hi)
{{
    return tf32_round(__float_as_uint(__uint_as_float(x) - __uint_as_float(hi)));
}}
#endif
#if MMA && !TF32
// a k16 step's fragments of the warp's tiles at contracted offset kk: A an m-tile one ldmatrix.x4 (sa[i]: the lane's
// row of m-tile i), B two n-tiles one (sb[n / 2]: the lane's row of n-tiles n, n + 1; an odd last's second unused)
__device__ __forceinline__ void fragments(unsigned (&a)[WM][4], unsigned (&b)[WN][2], const X* const (&sa)[WM],
                                          const X* const (&sb)[(WN + 1) / 2], int kk)
{{
    #pragma unroll
    for (int i = 0; i < WM; ++i) ssmc_mma::ldsm<4, false>(a[i], sa[i] + kk);
    #pragma unroll
    for (int n = 0; n < WN; n += 2) {{
        unsigned r[4];
        ssmc_mma::ldsm<4, false>(r, sb[n / 2] + kk);
        b[n][0] = r[0];
        b[n][1] = r[1];
        if (n + 1 < WN) {{
            b[n + 1][0] = r[2];
            b[n + 1][1] = r[3];
        }}
    }}
}}
#endif

extern "C" __global__ void __launch_bounds__(THREADS, 1) {name}({", ".join(args)})
{{
    // dynamic shared memory (SHARED_BYTES, past the 48 KiB of static shared memory at H 512); the emulator
    // has none: a function static there
#ifdef __CUDA_ARCH__
    extern __shared__ __align__(16) unsigned char smem[];
#else
    __shared__ __align__(16) unsigned char smem[SHARED_BYTES];
#endif
#if MMA && !STREAMED
    X* sub = reinterpret_cast<X*>(smem);  // [NPAD][UST]: U slice, 16-bit (tf32: fp32), the contracted index fastest
#elif STREAMED
    // the block's U slice in global memory [NPAD][JPAD]: a head's tiles' blocks of the same columns share one
    X* const ugw = ug + (long long)((blockIdx.x / NBT) / TPH * NBT + blockIdx.x % NBT) * (NPAD * JPAD);
#endif
#if MMA
    // the product's result [MPAD][SPS] fp32, read by the threads owning the pairs: in the ring's memory (idle
    // from the step's last chunk to the next step's first staging, with block barriers between)
    F* sp = reinterpret_cast<F*>(smem + U_BYTES);
    const int warp = threadIdx.x / 32, lg = (threadIdx.x % 32) / 4, lq = threadIdx.x % 4;
    // the warp's first m-tile and n-tile, its share wk of a chunk's k steps (GK: 1 but in the fp32 form)
    const int wmn = GK == 1 ? warp : warp % (GM * GN), wk = GK == 1 ? 0 : warp / (GM * GN);
    const int wm0 = (wmn % GM) * WM, wn0 = (wmn / GM) * WN;
    F d[WM][WN][4];
#if TF32
    F dx[NACC][WM][WN][4];  // the accumulator sets, summed into d after the step's last chunk
#endif
#elif VEC
    F (*su)[JPAD + 4] = reinterpret_cast<F (*)[JPAD + 4]>(smem);  // + 4: the units' rows start in different banks
#else
    F (*su)[UNITS][CPAD] = reinterpret_cast<F (*)[UNITS][CPAD]>(smem);
#endif
    // the ring of staged chunks [NSTAGE][RROWS + UROWS][SHS] (SHS past the chunk: a warp's rows in different banks;
    // RROWS: the tile's rows, rounded up to whole m16 tiles in the tensor-core form, the pad rows zero; streamed,
    // the chunk's UROWS rows of U after them)
    X (*ring)[RROWS + UROWS][SHS] = reinterpret_cast<X (*)[RROWS + UROWS][SHS]>(smem + U_BYTES);
#if RED_BYTES
    // the reductions over the units: a level's pairs' summands rs[v][lr][u], its totals a row rt[v][lr]
    F* const rs = reinterpret_cast<F*>(smem + SHARED_BYTES - RED_BYTES);
    F* const rt = rs + RVALS * TROWS * UNITS;
#endif
    // block x: the tile x / NBT of TROWS rows (TPH tiles a head of HB rows: TLIM of them in the tile); within
    // it, K group kg and J group jg (KS x JS blocks: 1 x NBT where not split); the product's units [n0, n0 + JU)
    // (its J group's), the cell's [k0, k0 + UNITS) (its own); the operand's slice kg (JPAD indices)
    const int tile = blockIdx.x / NBT, kg = (blockIdx.x % NBT) % KS, jg = (blockIdx.x % NBT) / KS;
    const int n0 = jg * JU, k0 = n0 + kg * UNITS;
    const int row0 = (tile / TPH) * HB + (tile % TPH) * TROWS, TLIM = min(TROWS, HB - (tile % TPH) * TROWS);
{chr(10).join("    " + line for line in head_decode)}
{chr(10).join("    " + line for line in load_u)}
#if STREAMED
    __threadfence();  // the slice written before the block's copies read it through L2
    __syncthreads();
#endif
    // the exchange buffer's pad columns [DEPTH, JPAD): zero, and never written again (U is zero there too,
    // but a NaN of uninitialised memory times zero is not)
    // (split: the host zeroes xo, whose pad columns lie within each K group's slice)
    if (!SPLIT && blockIdx.x == 0 && JPAD > DEPTH)
        for (int e = threadIdx.x; e < 2 * XROWS * (JPAD - DEPTH); e += THREADS)
            xo[(long long)(e / (JPAD - DEPTH)) * JPAD + DEPTH + e % (JPAD - DEPTH)] = (X)0;
#if MMA
    for (int e = threadIdx.x; e < NSTAGE * (RROWS - TROWS) * SHS; e += THREADS)
        ring[e / ((RROWS - TROWS) * SHS)][TROWS + (e / SHS) % (RROWS - TROWS)][e % SHS] = (X)0;
#endif
{chr(10).join("    " + line for line in decl)}
{per_pair(prologue)}
#if PHASES
    __shared__ long long phase_clocks[8];
    if (threadIdx.x < 8) phase_clocks[threadIdx.x] = 0;
    __syncthreads();
#ifdef __CUDA_ARCH__
    if (threadIdx.x == 0) phase_clocks[7] = phase_clocks[6] = clock64();
#endif
#endif
#if NEXT_LOADS
    if (length > 0) {{  // the first step's sequences, as stored (the steps after it: loaded by the step before)
        const int t = REVERSE ? length - 1 : 0;
{per_pair(first_loads, guard="true", depth=2)}
    }}
#endif
    for (int s = 0; s < length; ++s) {{
        const int t = REVERSE ? length - 1 - s : s;
        X* xw = xo + (s & 1) * (XROWS * XST);
        const X* xt = xw + (long long)row0 * XST + kg * JPAD;  // the tile's rows, the block's K group
#if NEXT_LOADS
{per_pair(next_loads, guard="true", depth=2)}
#else
{per_pair(seq_loads, depth=2)}
#endif
#if PREFETCH
        if (s + 1 < length) {{  // the next step's sequences into L2 (its loads then hit there)
            const int tn = REVERSE ? t - 1 : t + 1;
{per_pair(prefetches, guard="on && threadIdx.x % 4 == 0", depth=3)}
        }}
#endif
{pub_reductions}
{per_pair(publish_lines, depth=2)}
        PHASE(0);
        // every block's operand of this step written before any block of its tile (its K group) stages it
#if LATE
        // (the step's stores between the arrival and the wait: the early values at t, the step before's at tp)
        unsigned int* const arrive_at = SPLIT ? bar + 3 + tile * (KS + JS) + kg : bar + 3 + tile;
        if (SPLIT || NBT > 1) grid_arrive(arrive_at);
{per_pair(early_stores, depth=2) if early_stores else ""}
        if (s > 0) {{
            const int tp = REVERSE ? t + 1 : t - 1;
{per_pair(late_stores, depth=3) if late_stores else ""}
        }}
        if (SPLIT || NBT > 1) grid_wait(arrive_at, (unsigned int)(s + 1) * (SPLIT ? JS : NBT), s, bar);
        else __syncthreads();
#else
        if (SPLIT) grid_barrier(bar + 3 + tile * (KS + JS) + kg, (unsigned int)(s + 1) * JS, s, bar);
        else if (NBT > 1) grid_barrier(bar + 3 + tile, (unsigned int)(s * BPS + NPUB + 1) * NBT, s, bar);
        else __syncthreads();
#endif
        PHASE(1);
#if TF32
        #pragma unroll
        for (int x = 0; x < NACC; ++x)
            #pragma unroll
            for (int i = 0; i < WM; ++i)
                #pragma unroll
                for (int n = 0; n < WN; ++n)
                    #pragma unroll
                    for (int v = 0; v < 4; ++v) dx[x][i][n][v] = F(0);
#elif MMA
        #pragma unroll
        for (int i = 0; i < WM; ++i)
            #pragma unroll
            for (int n = 0; n < WN; ++n)
                #pragma unroll
                for (int v = 0; v < 4; ++v) d[i][n][v] = F(0);
#else
        #pragma unroll
        for (int q = 0; q < PAIRS; ++q)
            #pragma unroll
            for (int c = 0; c < COLS; ++c) acc[q][c] = F(0);
#endif
        // the first NSTAGE - 1 chunks in flight; then at chunk c: wait for it, the block's barrier (every
        // thread's copies of it landed, every thread done with chunk c - 1), chunk c + NSTAGE - 1 into the
        // buffer chunk c - 1 left, the products of chunk c
        #pragma unroll
        for (int c = 0; c < NSTAGE - 1; ++c) {{
            if (c < NCHUNK) {{
                stage(ring[c], xt, c);
#if STREAMED
                stage_u(ring[c], ugw, c);
#endif
            }}
            copies_commit();
        }}
        for (int c = 0; c < NCHUNK; ++c) {{
            copies_wait();
            __syncthreads();
            if (c + NSTAGE - 1 < NCHUNK) {{
                stage(ring[(c + NSTAGE - 1) % NSTAGE], xt, c + NSTAGE - 1);
#if STREAMED
                stage_u(ring[(c + NSTAGE - 1) % NSTAGE], ugw, c + NSTAGE - 1);
#endif
            }}
            copies_commit();  // a group every chunk, empty ones included: the wait counts groups
            X (*sh)[SHS] = ring[c % NSTAGE];
            const int j0 = c * CHUNK;
#if STREAMED
            const X* const ub = &sh[RROWS][0];  // the chunk's U rows [NPAD][SHS]
#elif MMA
            const X* const ub = sub + j0;  // U's rows [NPAD][UST] at the chunk's first index
#endif
#if MMA
{chr(10).join("            " + line for line in mma_product)}
#else
{per_pair(product, guard="lr < TROWS", depth=3)}
#endif
        }}
#if TF32
        PHASE(2);
        // the accumulator sets summed (3xTF32: the small terms first)
        #pragma unroll
        for (int i = 0; i < WM; ++i)
            #pragma unroll
            for (int n = 0; n < WN; ++n)
                #pragma unroll
                for (int v = 0; v < 4; ++v)
                    d[i][n][v] = NACC == 3 ? (dx[2 % NACC][i][n][v] + dx[1][i][n][v]) + dx[0][i][n][v]
                                           : dx[0][i][n][v] + dx[1][i][n][v];
#else
        PHASE(2);
#endif
#if NEXT_LOADS && !SPLIT
        if (s + 1 < length) {{  // the next step's sequences (the cell reads none of this step's)
            const int tn = REVERSE ? t - 1 : t + 1;
{per_pair(raw_loads, guard="true", depth=3)}
        }}
#endif
#if MMA && SPLIT
        // the warp's tiles, the partial product over the K group, to pb[s % 2][kg][row][n0 COLS + n] (fp32);
        // the J group's blocks meet; each pair sums its KS partials. pb[s % 2] is written again at step s + 2,
        // after barrier s + 1 of the J group, which its readers reach after reading
        const F* pbs = pb + (long long)(s & 1) * (KS * XROWS * PBW);
        if (warp < GM * GN) {{
            F* pw = pb + (long long)(s & 1) * (KS * XROWS * PBW) + ((long long)kg * XROWS + row0) * PBW + n0 * COLS;
            #pragma unroll
            for (int i = 0; i < WM; ++i)
                #pragma unroll
                for (int n = 0; n < WN; ++n)
                    if (wm0 + i < MT && wn0 + n < NT) {{
                        #pragma unroll
                        for (int v = 0; v < 4; ++v) {{
                            const int m = (wm0 + i) * 16 + lg + (v / 2) * 8, nn = (wn0 + n) * 8 + 2 * lq + v % 2;
                            if (m < TLIM && nn < JU * COLS) pw[(long long)m * PBW + nn] = d[i][n][v];
                        }}
                    }}
        }}
        grid_barrier(bar + 3 + tile * (KS + JS) + KS + jg, (unsigned int)(s + 1) * KS, s, bar);
#if NEXT_LOADS && SPLIT
        if (s + 1 < length) {{  // the next step's sequences (the cell reads none of this step's)
            const int tn = REVERSE ? t - 1 : t + 1;
{per_pair(raw_loads, guard="true", depth=3)}
        }}
#endif
        // the block's rows x units of the product: its KS partials summed in group order (fixed: deterministic)
        // into sp, whence each pair's (here the accumulators are free: all the loads in flight at once)
        // (4 units a 16-byte load where a row's units come in fours)
        #pragma unroll
        for (int i = 0; i < REDUCE; ++i) {{
            const int e = VR * (threadIdx.x + i * THREADS), lr = e / (UNITS * COLS), n = e % (UNITS * COLS);
            if (lr < TLIM) {{
                const F* pr = pbs + (long long)(row0 + lr) * PBW + k0 * COLS + n;
#if VR == 4
                float4 sum = make_float4(F(0), F(0), F(0), F(0));
                #pragma unroll
                for (int g = 0; g < KS; ++g) {{
                    const float4 v = load_cg4(pr + (long long)g * XROWS * PBW);
                    sum.x += v.x;
                    sum.y += v.y;
                    sum.z += v.z;
                    sum.w += v.w;
                }}
                *reinterpret_cast<float4*>(sp + lr * SPS + n) = sum;
#else
                F sum = F(0);
                #pragma unroll
                for (int g = 0; g < KS; ++g) sum += load_cg(pr + (long long)g * XROWS * PBW);
                sp[lr * SPS + n] = sum;
#endif
            }}
        }}
        __syncthreads();
{per_pair(from_sp, guard="lr < TROWS", depth=2)}
#elif MMA
        // the warp's tiles to sp, then each pair's columns from it (sp lies in the ring: every warp done with
        // the last chunk first; sp is read before the next step stages into the ring: its barrier between)
        __syncthreads();
        if (warp < GM * GN * GK) {{
            #pragma unroll
            for (int i = 0; i < WM; ++i)
                #pragma unroll
                for (int n = 0; n < WN; ++n)
                    if (wm0 + i < MT && wn0 + n < NT) {{
                        F* o = sp + wk * (RROWS * SPS) + ((wm0 + i) * 16 + lg) * SPS + (wn0 + n) * 8 + 2 * lq;
                        o[0] = d[i][n][0];
                        o[1] = d[i][n][1];
                        o[8 * SPS] = d[i][n][2];
                        o[8 * SPS + 1] = d[i][n][3];
                    }}
        }}
        __syncthreads();
{per_pair(from_sp, guard="lr < TROWS", depth=2)}
#endif
        PHASE(3);
{body_reductions}
{per_pair(cell_lines, depth=2)}
        PHASE(4);
    }}
#if LATE
    if (length > 0) {{  // the last step's late stores
        const int tp = REVERSE ? 0 : length - 1;
{per_pair(late_stores, depth=2) if late_stores else ""}
    }}
#endif
#if PHASES
#ifdef __CUDA_ARCH__
    if (threadIdx.x == 0) phase_clocks[5] = clock64() - phase_clocks[6];
#endif
    __syncthreads();
    if (threadIdx.x < 6)
        bar[PHASE_AT + 8 * blockIdx.x + threadIdx.x] = (unsigned int)min(phase_clocks[threadIdx.x], 0xffffffffLL);
#endif
{per_pair(finals)}
}}
"""
    return src
