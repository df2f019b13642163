"""Which hoisted programs the persistent forward kernel takes, and how a shape is split over blocks.

`analyse(program)` reads a program the step loop takes (`passes/recurrent_products.py`) and returns a
`Cell` or a one-line refusal. The kernel needs:

    P[rows, cols, s] = sum over j of op[rows, j] * U[j, cols, s]     one recurrent product
    op = rename(h, s -> j)                                            of one state h[rows, s]
    everything else element-wise along rows and s (`cols`, the gate axis g, stays whole in a thread)

so a thread owning (row, unit s) computes all of the cell's values at that index from P[row, :, s],
its own carries and the step's sequences, and the only data blocks exchange is the new h. As a plain
loop, for the LSTM after hoisting (hz0 = x W):

    for t: P[b, g, k] = sum_j h[b, j] U[j, g, k]
           z = hz0[t] + P + bias;  c = sig(z[1]) c + sig(z[0]) tanh(z[2]);  h = sig(z[3]) tanh(c)

`plan(cell, sizes, sm_count)` picks the split of a shape: KU units a block (one block an SM at most,
so a cooperative grid is co-resident), the block's U slice resident in shared memory, h staged in
chunks of JC contracted indices; or a refusal (the step loop runs the shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .....ir.node import Node, depending_on, toposort
from .....ir.ops import ELEMENTWISE, Op
from .....passes.recurrent_products import recurrent_products

STATIC_SHARED = 48 * 1024   # bytes of static shared memory a block may declare (no opt-in needed)
STAGE_BYTES = 16 * 1024     # at most this much of it for the staged chunk of h [rows][JC + 1]
MAX_THREADS = 256           # threads a block (one block an SM: 256 threads leave 255 registers each)
MAX_PAIRS = 8               # (row, unit) pairs a thread owns at most: its accumulators are registers
CHUNKS = (32, 16, 8, 4, 2, 1)


@dataclass(frozen=True)
class Cell:
    """A program the persistent kernel runs: its product ``sum over contracted of op * weight`` with
    op = rename(state, split -> contracted), the row axes (the state's others), the local axes (the
    weight's others: g), and the cell's nodes in evaluation order (everything but the product's
    operand, weight and multiply; the product itself is the kernel's accumulators)."""

    program: object
    product: Node
    state: str
    weight: str
    contracted: str
    split: str
    rows: tuple[str, ...]
    local: tuple[str, ...]
    nodes: tuple[Node, ...]

    def describe(self) -> str:
        cols = " ".join(self.local)
        return (f"recurrent product sum over {self.contracted} of {self.state}[{' '.join(self.rows)} "
                f"{self.contracted}] {self.weight}[{self.contracted} {cols} {self.split}]")


def analyse(program) -> Cell | str:
    """The `Cell` of `program` (module docstring), or why the persistent kernel does not take it."""
    if not program.states:
        return "no states"
    products = recurrent_products(program)
    if len(products) != 1:
        return f"{len(products)} recurrent products (one is supported)"
    p = products[0]
    mul = p.args[0]
    state_names = {s.name for s in program.states}
    roles = {d.name: d.role.name for d in program.decls}
    nodes = toposort(program.roots)
    stateful = depending_on(nodes, state_names)
    a, w = mul.args if mul.args[0] in stateful else reversed(mul.args)
    if not (w.op is Op.INPUT and roles.get(w.arg) == "PARAM"):
        return "the recurrent product's weight is not a param (a computed weight)"
    if not (a.op is Op.RENAME and a.args[0].op is Op.INPUT and a.args[0].arg in state_names
            and len(a.arg) == 1 and a.arg[0][1] == p.arg):
        return "the recurrent product's operand is not a state renamed along the contracted axis (rename(h, k->j))"
    state = a.args[0]
    split = a.arg[0][0]
    rows = tuple(x for x in state.axes if x != split)
    if p.arg not in w.axes or split not in w.axes:
        return f"the weight {w.arg} lacks the contracted axis {p.arg} or the state's axis {split}"
    if set(rows) & set(w.axes):
        return f"the weight {w.arg} shares a row axis with the state (heads are not supported)"
    local = tuple(x for x in w.axes if x not in (p.arg, split))
    allowed = set(rows) | set(local) | {split}
    skip = {mul, a, w}
    for n in nodes:
        if n is not p and n is not mul and n.op in (Op.SUM, Op.REDUCE_MAX):
            what = "sum" if n.op is Op.SUM else "max"
            return (f"a {what} over {n.arg} in the cell besides the recurrent product (a product not hoisted, or "
                    "a reduction such as LayerNorm's across the units: not supported yet)")
    cell = []
    for n in nodes:
        if n in skip and not any(n in u.args for u in nodes if u not in skip and u is not p):
            continue
        if n is p:
            cell.append(n)
            continue
        extra = set(n.axes) - allowed
        if extra:
            return (f"{n.op.name.lower()} node with axes {' '.join(n.axes)}: {' '.join(sorted(extra))} is not a "
                    "row, unit or gate axis")
        if n.op is Op.INPUT:
            if roles.get(n.arg) not in ("STATE", "SEQ", "PARAM"):
                return f"input {n.arg} of role {roles.get(n.arg)}"
        elif n.op is Op.SELECT:
            axis, index = n.arg
            if axis not in local or not isinstance(index, int):
                return f"select along {axis} (only along a gate axis {' '.join(local)} at a fixed index)"
        elif n.op is not Op.CONST and n.op not in ELEMENTWISE:
            return f"{n.op.name.lower()} in the cell (not element-wise along the units {split})"
        cell.append(n)
    for s in program.states:
        if not set(rows) | {split} <= set(s.axes) or not set(s.axes) <= allowed:
            return f"state {s.name}[{' '.join(s.axes)}] is not along the rows and units [{' '.join((*rows, split))}]"
    if tuple(state.axes) != tuple(next(s for s in program.states if s.name == state.arg).axes):
        return "the operand state's axes differ from its declaration"
    return Cell(program, p, state.arg, w.arg, p.arg, split, rows, local, tuple(cell))


@dataclass(frozen=True)
class Plan:
    """A shape's split: `blocks` blocks of `threads`, each owning `units` consecutive indices of the
    split axis (all rows, all local columns): its U slice su[jpad][cols][units] in shared memory, the
    operand staged [rows][chunk + 1] a chunk of the contracted axis at a time; `pairs` (row, unit)
    pairs a thread."""

    rows: int
    size: int        # the split axis' size (= the contracted axis')
    cols: int        # product of the local axes' sizes (G)
    units: int
    blocks: int
    threads: int
    pairs: int
    chunk: int
    jpad: int

    @property
    def shared_bytes(self) -> int:
        return 4 * (self.jpad * self.cols * self.units + self.rows * (self.chunk + 1))

    def describe(self) -> str:
        return (f"{self.blocks} blocks x {self.threads} threads, {self.units} units x {self.cols} columns a block, "
                f"U slice {self.jpad * self.cols * self.units * 4 // 1024} KiB resident in shared memory")


def plan(cell: Cell, sizes: dict[str, int], sm_count: int, blocks: int | None = None) -> Plan | str:
    """The split of `cell` at `sizes` over at most `sm_count` blocks (`blocks`: exactly that many, as
    the emulator's one), or why none fits."""
    rows = math.prod(sizes[a] for a in cell.rows)
    size = sizes[cell.split]
    if sizes.get(cell.contracted, size) != size:
        return f"the contracted axis {cell.contracted} and the units {cell.split} differ in size"
    cols = math.prod(sizes[a] for a in cell.local)
    chunk = next((c for c in CHUNKS if rows * (c + 1) * 4 <= STAGE_BYTES), None)
    if chunk is None:
        return f"{rows} rows: a staged chunk of the operand exceeds {STAGE_BYTES} bytes"
    units = -(-size // max(1, blocks or sm_count))
    nblocks = -(-size // units)
    if blocks is not None and nblocks != blocks:
        return f"{size} units do not split into {blocks} blocks"
    pairs_total = rows * units
    threads = min(MAX_THREADS, -(-pairs_total // 32) * 32)
    pairs = -(-pairs_total // threads)
    if pairs > MAX_PAIRS:
        return f"{pairs} (row, unit) pairs a thread (more than {MAX_PAIRS}: rows x units = {pairs_total})"
    jpad = -(-size // chunk) * chunk
    result = Plan(rows, size, cols, units, nblocks, threads, pairs, chunk, jpad)
    if result.shared_bytes > STATIC_SHARED:
        return (f"U slice and staging {result.shared_bytes} bytes a block exceed {STATIC_SHARED} "
                f"({units} units x {cols} columns x {size}) over {nblocks} blocks")
    return result
