"""Which hoisted programs the persistent kernel takes, and how a shape is split over blocks.

`analyse(program)` reads a program the step loop takes (`passes/recurrent_products.py`) and returns a
`Cell` or a one-line refusal. The kernel needs one recurrent product, in one of two forms:

    forward:  P[rows, cols, s] = sum over j of op[rows, j] U[j, cols, s],     op = rename(h, s -> j)
    adjoint:  P[rows, j] = sum over g, s of dz[g, rows, s] U[j, g, s],        the cell reads rename(P, j -> s)

and everything else element-wise along rows and the units s (the gate axis g stays whole in a
thread), so a thread owning (row, unit s) computes the cell at that index from P[row, :, s], its
own carries and the step's sequences; the data blocks exchange is the operand (h, or dz at all
gates) and the sums over the units s of the cell's reductions (a LayerNorm's mean and variance:
`Cell.reductions`, ordered into levels by `reduction_levels`; a sum over a gate axis is a loop in the
thread). As a plain loop, for the LSTM after hoisting (hz0 = x W):

    for t: P[b, g, k] = sum_j h[b, j] U[j, g, k]
           z = hz0[t] + P + bias;  c = sig(z[1]) c + sig(z[0]) tanh(z[2]);  h = sig(z[3]) tanh(c)

and for its adjoint (reverse time; hz0 + hz1 = x W + h U recomputed before the loop):

    for t: dz[g, b, k] = cell'(grad_h, grad_c, hz[t], c[t], ...)      (local at (b, k))
           grad_h[b, k] = sum_{g, k'} dz[g, b, k'] U[k, g, k'];  grad_c = ...

`plan(cell, sizes, sm_count)` picks the split of a shape: batch tiles of rows, KU units a block (one
block an SM at most, so a cooperative grid is co-resident), the block's U slice resident in shared
memory, its tile's operand staged in a ring of chunks of contracted indices; or a refusal (the step
loop runs the shape).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .....ir.node import Node, depending_on, toposort
from .....ir.ops import ELEMENTWISE, Op
from .....passes.recurrent_products import recurrent_products

BLOCK_SHARED = 227 * 1024   # bytes of dynamic shared memory a block may take after the opt-in (sm_90)
STAGE_BYTES = 36 * 1024     # at most this much for one staged chunk of the operand [rows][chunk + 4]
MAX_THREADS = 256           # threads a block (one block an SM: 256 threads leave 255 registers each)
MAX_PAIRS = 8               # (row, unit) pairs a thread owns at most: its accumulators are registers
CHUNKS = (128, 64, 32, 16, 8, 4)  # contracted indices a staged chunk: whole 16-byte copies of a row
STAGES = (3, 2)             # chunks in the ring: STAGES - 1 in flight while the block multiplies one
# the tensor-core adjoints' rings: the chunk and depth that keep the most bytes in flight (what bounds a block's
# staging of its operand from L2 where it waits on the latency: B256 H1024's adjoint stages 512 KiB a block a
# step) are taken
DEEP_STAGES = (8, 7, 6, 5, 4, 3, 2)
MMA_CHUNKS = (128, 64, 32, 16)  # the tensor-core form's chunks: whole k16 steps of mma.sync


@dataclass(frozen=True)
class Cell:
    """A program the persistent kernel runs. Its product, as a plain loop over the block's units u:

        P[rows, cols, u] = sum over contracted of op[rows, contracted] * U[contracted, cols, u]

    op is `operand` (the forward: rename(h, split -> j); the adjoint: dz[g, rows, split], contracted
    (g, split)); `unit` is the contracted axis that is the operand's own unit (j, resp. split), the
    others (`op_local`: g in the adjoint) stay whole in a thread; `out_unit` is P's unit axis (split in
    the forward; j in the adjoint, where the cell reads rename(P, j -> split)); `cols` are U's other
    axes (g in the forward). `local` = cols + op_local: the axes a thread holds whole. `nodes`: the
    cell's nodes in evaluation order (the product node, `product`, stands for the accumulators);
    `publish`: the node whose value a thread publishes at its (row, unit) (the operand before a
    rename along the units); `state`: the state it reads (describe only). `heads`: the row axes U has
    too (the first rows: a block-diagonal U, one recurrence a head, each block within one head)."""

    program: object
    product: Node
    state: str
    weight: str
    contracted: tuple[str, ...]
    split: str
    rows: tuple[str, ...]
    local: tuple[str, ...]
    nodes: tuple[Node, ...]
    unit: str = ""
    out_unit: str = ""
    cols: tuple[str, ...] = ()
    op_local: tuple[str, ...] = ()
    publish: Node | None = None
    heads: tuple[str, ...] = ()
    reductions: tuple[Node, ...] = ()

    @property
    def phases(self) -> tuple[tuple[tuple[Node, ...], ...], tuple[tuple[Node, ...], ...]]:
        """The reductions over the units (`reductions`) in the order the kernel takes them: (the publish's
        levels, the cell's levels after the product), a level the reductions that read none of the level's
        own or later ones (`reduction_levels`): one exchange among a tile's blocks each."""
        return reduction_levels(self)

    def describe(self) -> str:
        w_axes = " ".join(next(d.axes for d in self.program.params if d.name == self.weight))
        heads = f", heads {' '.join(self.heads)}" if self.heads else ""
        pub, body = self.phases
        levels = len(pub) + len(body)
        reductions = (f"; {len(self.reductions)} reductions over the units {self.split} in {levels} levels "
                      f"({len(pub)} before the product, {len(body)} after: an exchange among a tile's blocks each)"
                      if self.reductions else "")
        return (f"recurrent product sum over {' '.join(self.contracted)} of {self.state}"
                f"[{' '.join((*self.rows, *self.contracted))}] {self.weight}[{w_axes}]{heads}{reductions}")


def closure(targets, stop=frozenset()) -> set:
    """The nodes `targets` read, themselves included, not looking past the nodes in `stop` (kept)."""
    seen, todo = set(), list(targets)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            if n not in stop:
                todo.extend(n.args)
    return seen


def reduction_levels(cell: Cell) -> tuple[tuple[tuple[Node, ...], ...], tuple[tuple[Node, ...], ...]]:
    """The cell's reductions over the units (a LayerNorm's mean, then its variance of the centred values) as
    levels: (before the product: those the operand needs, and those that read no product and fit in the levels
    these take; after it: the rest). A reduction's level is one more than the highest level of the reductions
    of its section that its summand reads (the publish's are known after the product): the reductions of a
    level are summed together (one block reduction, one exchange among the tile's blocks). As a plain loop, a
    step:

        for level in publish levels: sums[level] = sum over units of summands(sums of the levels before)
        operand published; barrier; product
        for level in cell levels: likewise, from the product too"""
    if not cell.reductions:
        return (), ()
    reds = set(cell.reductions)
    p = cell.program
    below = {r: closure(r.args, reds) & reds for r in cell.reductions}  # the reductions r's summand reads
    needs_product = {r for r in cell.reductions if cell.product in closure(r.args)}
    publish = closure([cell.publish], {cell.product}) & reds
    body_targets = [y for _, y in p.outputs] + list(p.updates)
    body = (closure(body_targets, {cell.product}) & reds) - publish

    def levels(section: set, done: set) -> dict:
        level: dict = {}
        for r in cell.reductions:  # (in evaluation order: a reduction's inputs come first)
            if r in section:
                level[r] = 1 + max((level[b] for b in below[r] if b not in done), default=0)
        return level

    first = levels(publish, set())
    top = max(first.values(), default=0)
    for r in cell.reductions:  # a reduction the cell needs, reading no product: along with the publish's
        if r in body and r not in needs_product and all(b in first for b in below[r]):
            at = 1 + max((first[b] for b in below[r]), default=0)
            if at <= top:
                first[r] = at
    second = levels(body - set(first), set(first))

    def grouped(level: dict) -> tuple[tuple[Node, ...], ...]:
        top = max(level.values(), default=0)
        return tuple(tuple(r for r in cell.reductions if level.get(r) == i) for i in range(1, top + 1))

    return grouped(first), grouped(second)


def _consumers(nodes) -> dict:
    out: dict = {}
    for n in nodes:
        for a in n.args:
            out.setdefault(a, []).append(n)
    return out


def analyse(program) -> Cell | str:
    """The `Cell` of `program` (module docstring), or why the persistent kernel does not take it."""
    if not program.states:
        return "no states"
    products = recurrent_products(program)
    if len(products) != 1:
        return f"{len(products)} recurrent products (one is supported)"
    nodes = toposort(program.roots)
    users = _consumers(nodes)
    # the product as a chain of sums over one multiply (the adjoint's sum over g, then over k)
    chain = [products[0]]
    while len(users.get(chain[-1], [])) == 1 and users[chain[-1]][0].op is Op.SUM:
        chain.append(users[chain[-1]][0])
    p = chain[-1]
    contracted = tuple(n.arg for n in chain)
    mul = chain[0].args[0]
    state_names = {s.name for s in program.states}
    roles = {d.name: d.role.name for d in program.decls}
    stateful = depending_on(nodes, state_names)
    a, w = mul.args if mul.args[0] in stateful else reversed(mul.args)
    if not (w.op is Op.INPUT and roles.get(w.arg) == "PARAM"):
        return "the recurrent product's weight is not a param (a computed weight)"
    if any(x not in w.axes or x not in a.axes for x in contracted):
        return f"a contracted axis ({' '.join(contracted)}) the weight or the operand lacks"
    rows = tuple(x for x in a.axes if x not in contracted)
    # heads: row axes the weight has too (a block-diagonal U: each head its own recurrence, its own U);
    # first among the rows, so that a head's rows are consecutive
    heads = tuple(x for x in rows if x in w.axes)
    rows = heads + tuple(x for x in rows if x not in heads)
    state_axes = [set(s.axes) for s in program.states]
    if a.op is Op.RENAME and len(a.arg) == 1 and a.arg[0][1] in contracted:
        split, unit = a.arg[0]
        publish = a.args[0]
    else:
        units = [x for x in contracted if all(x in sa for sa in state_axes)]
        if len(units) != 1:
            return ("the recurrent product's operand is neither a state renamed along the contracted axis "
                    "(rename(h, k->j)) nor contracted along one axis of every state")
        split = unit = units[0]
        publish = a
    op_local = tuple(x for x in contracted if x != unit)
    free = tuple(x for x in w.axes if x not in contracted and x not in heads)
    if split in free:
        out_unit = split
    else:
        renames = users.get(p, [])
        pairs = {r.arg for r in renames if r.op is Op.RENAME}
        if not renames or len(pairs) != 1 or len(renames) != sum(r.op is Op.RENAME for r in renames):
            return f"the weight {w.arg} lacks the state's axis {split} and the product is not renamed onto it"
        (pair,) = pairs
        if len(pair) != 1 or pair[0][1] != split or pair[0][0] not in free:
            return f"the product is renamed {pair}, not onto the state's axis {split}"
        out_unit = pair[0][0]
    cols = tuple(x for x in free if x != out_unit)
    local = cols + tuple(x for x in op_local if x not in cols)
    allowed = set(rows) | set(local) | {split}
    skip = {mul, w, *chain[:-1]}
    if publish is not a:
        skip.add(a)
    # a param's or sequence's own axis that the cell only selects at fixed indices (an LSTM's peepholes p[g3, k],
    # unbound along g3): held whole by a thread, as the gates are
    for n in nodes:
        if n.op is Op.INPUT and roles.get(n.arg) in ("PARAM", "SEQ") and n not in skip:
            for x in n.axes:
                if x not in allowed and all(u.op is Op.SELECT and u.arg[0] == x for u in users.get(n, [])):
                    local += (x,)
                    allowed.add(x)
    reductions = []
    for n in nodes:
        if n not in chain and n.op in (Op.SUM, Op.REDUCE_MAX) and n not in skip:
            what = "sum" if n.op is Op.SUM else "max"
            if n.arg == split:  # across the units (a LayerNorm's): an exchange among a tile's blocks
                reductions.append(n)
            elif n.arg not in local:
                return (f"a {what} over {n.arg} in the cell besides the recurrent product (a product not hoisted, "
                        "or a reduction across the rows)")
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
        elif n.op is Op.IOTA:
            if n.arg not in local:
                return f"iota along {n.arg} (only along a gate axis)"
        elif n.op is Op.RENAME:
            if n.args[0] is not p:
                return "a rename in the cell other than the product's onto the units"
        elif n.op in (Op.SUM, Op.REDUCE_MAX):
            pass  # over the units (`reductions`) or a gate axis (a loop in the thread)
        elif n.op not in (Op.CONST, Op.SIZE) and n.op not in ELEMENTWISE:
            return f"{n.op.name.lower()} in the cell (not element-wise along the units {split})"
        cell.append(n)
    for s in program.states:
        if not set(rows) | {split} <= set(s.axes) or not set(s.axes) <= allowed:
            return f"state {s.name}[{' '.join(s.axes)}] is not along the rows and units [{' '.join((*rows, split))}]"
    if publish.op is Op.INPUT:
        decl = next((s for s in program.states if s.name == publish.arg), None)
        if decl is not None and tuple(publish.axes) != tuple(decl.axes):
            return "the operand state's axes differ from its declaration"
    state = publish.arg if publish.op is Op.INPUT else "dz"
    if reductions and heads:
        return "a reduction across the units with heads (not supported yet)"
    return Cell(program, p, state, w.arg, contracted, split, rows, local, tuple(cell), unit, out_unit, cols,
                op_local, publish, heads, tuple(r for r in cell if r in set(reductions)))


@dataclass(frozen=True)
class Plan:
    """A shape's split: the rows in `tiles` batch tiles of `trows` rows, each tile's recurrences run
    by `blocks / tiles` blocks of `threads`, each owning `units` consecutive indices of the split axis
    (the tile's rows, all local columns): its U slice in shared memory (jpad: the contracted indices,
    `depth` = their product, padded to a whole chunk), the tile's operand staged in a ring of `stages`
    buffers [trows][chunk + 4], a chunk of the contracted indices each, `stages - 1` of them loading
    (cp.async) while the block multiplies one; `pairs` (row, unit) pairs a thread. The blocks of a tile
    meet at their own barrier; a block reads only its tile's rows of the exchange buffer (the L2
    traffic of a step is blocks x trows x depth, not blocks x rows x depth). All of the shared memory
    is dynamic (`shared_bytes`, past the 48 KiB a block gets without the opt-in). The exchange buffer's
    rows are `jpad` long (16-byte copies; its pad columns are zero), tiles x trows of them."""

    rows: int
    size: int        # the split axis' size (the units)
    cols: int        # product of the product's column axes' sizes (G in the forward, 1 in the adjoint)
    units: int
    blocks: int
    threads: int
    pairs: int
    chunk: int
    jpad: int
    depth: int = 0   # product of the contracted axes' sizes (H in the forward, G H in the adjoint)
    cpad: int = 0    # a unit's columns in shared memory: 4 for 3 (one 16-byte load a contracted index)
    vec: bool = False  # one column (the adjoint): su[units][jpad + 4], read 4 contracted indices a 16-byte
                       # load, as the staged rows are (1 shared load for 2 FMAs, not 2 for 1)
    stages: int = 2
    tiles: int = 1
    trows: int = 0   # rows a batch tile (the rows where 0)
    heads: int = 1   # the heads (`Cell.heads`): tiles / heads batch tiles a head, of rows / heads rows
    mma: bool = False  # 16-bit inputs: U and the operand in bf16 / fp16 on chip, the product on tensor cores
                       # (mma.sync m16n8k16, fp32 accumulators; the cell and its carries stay fp32)
    ksplit: int = 1  # the tensor-core form's split of the contracted indices (`split`): the blocks of a tile as
                     # ksplit K groups x jsplit J groups
    tf32: int = 0    # the tensor-core form of fp32 inputs (with `mma`): U and the operand fp32 on chip, the product
                     # mma.sync m16n8k8 tf32, each fp32 value split in registers into hi = tf32(x) and
                     # lo = tf32(x - hi): 3 (3xTF32: hi hi + hi lo + lo hi, about fp32's accuracy) or 1 (hi hi only,
                     # TF32's 10 bits of mantissa); 0: 16-bit inputs (m16n8k16)
    rvals: int = 0   # the reductions over the units (`Cell.reductions`): the most values a level sums a row (their
    rlevels: int = 0  # block sums rs[rvals][trows][units] and totals rt[rvals][trows] in shared memory), the levels
    streamed: bool = False  # the tensor-core form with U not resident (`plan`'s `streamed`): the block's slice kept
                            # in global memory ug [npad][jpad] (written by the block once a call, read through L2
                            # each step), staged a chunk at a time beside the operand's chunk in the same ring
    reason: str = field(default="", compare=False)  # why this form (`describe`; the streamed form: why not resident)

    def __post_init__(self):
        if not self.trows:
            object.__setattr__(self, "trows", self.rows)

    # the tensor-core form (`mma`): the block's product P[mpad][npad] = op[mpad][jpad] U[jpad][npad], its
    # columns n = u * cols + c; U as sub[npad][jpad + 8] (k contiguous; + 8: rows 16-byte aligned, the 8 rows an
    # ldmatrix tile reads in different banks), the ring's rows so too, and
    # the result through sp[mpad][npad + 4] fp32 to the threads owning (row, unit) pairs
    @property
    def elem(self) -> int:
        """Bytes of a value of U and of the operand on chip: 2 in the 16-bit tensor-core form, else 4."""
        return 2 if self.mma and not self.tf32 else 4

    @property
    def epad(self) -> int:
        """The tensor-core form's pad of a row of U and of the staged operand, in values: 16 bytes (the 8 rows
        of a fragment's load in different banks)."""
        return 16 // self.elem

    @property
    def xrows(self) -> int:
        """Rows of the exchange buffer: the tiles' (past a head's last row a tile reads the next head's,
        or the slack after the last head's, and leaves them unused)."""
        return self.tiles * self.trows if self.heads == 1 else self.rows + self.trows

    @property
    def mpad(self) -> int:
        return -(-self.trows // 16) * 16

    @property
    def jsplit(self) -> int:
        """J groups a tile (`ksplit`): the tile's blocks are ksplit x jsplit."""
        return self.blocks // self.tiles // self.ksplit

    @property
    def nunits(self) -> int:
        """Units of the block's product (its N / cols): its own `units` x ksplit (its J group's)."""
        return self.units * self.ksplit

    @property
    def munits(self) -> int:
        """The unit axis' length in a K group's slice of the operand (the size where not split)."""
        return self.size if self.ksplit == 1 else self.jsplit * self.units

    @property
    def xcols(self) -> int:
        """The exchange buffer's row: ksplit slices of jpad."""
        return self.ksplit * self.jpad

    @property
    def npad(self) -> int:
        return -(-self.nunits * self.cols // 8) * 8

    @property
    def u_bytes(self) -> int:
        """Bytes of the block's U slice in shared memory (the start of the staging ring, a multiple of 16; 0 where
        U is streamed)."""
        if self.streamed:
            return 0
        if self.mma:
            return -(-self.elem * self.npad * (self.jpad + self.epad) // 16) * 16
        if self.vec:
            return 4 * self.units * (self.jpad + 4)
        return -(-4 * self.jpad * (self.cpad or self.cols) * self.units // 16) * 16

    @property
    def urows(self) -> int:
        """Rows of U a ring buffer holds after the operand's (streamed: the block's npad columns, a chunk of the
        contracted indices each; else none)."""
        return self.npad if self.streamed else 0

    @property
    def slice_elems(self) -> int:
        """Values of a block's U slice in global memory where streamed: ug [npad][jpad] (16-byte rows)."""
        return self.npad * self.jpad

    @property
    def slices(self) -> int:
        """U slices in global memory where streamed: one a block of a tile, a head's tiles sharing them (the same
        columns and contracted indices: one copy in L2 for all the tiles)."""
        return self.heads * (self.blocks // self.tiles)

    @property
    def stage_bytes(self) -> int:
        if self.mma:
            return self.elem * (self.mpad + self.urows) * (self.chunk + self.epad)
        return 4 * self.trows * (self.chunk + 4)

    @property
    def sps(self) -> int:
        """A row of sp: the product's columns + 4 (split: the block's own units' sums of the partials)."""
        return (self.npad if self.ksplit == 1 else self.units * self.cols) + 4

    @property
    def sp_bytes(self) -> int:
        """Bytes of the tensor-core form's result tile sp [mpad][sps] fp32 (0 otherwise), which lies in the
        ring's memory (the ring is idle while it is used); the fp32 form's warps that split a chunk's
        contracted indices (`tf32_warp_grid`: GK of them) each their own tile, summed by the pairs."""
        gk = tf32_warp_grid(self)[2] if self.mma and self.tf32 else 1
        return 4 * self.mpad * self.sps * gk if self.mma else 0

    @property
    def step_bytes(self) -> int:
        """L2 bytes a step moves for the product: every block's staged operand (its tile's rows, its K
        group's jpad indices), and where split the fp32 partials written and read back."""
        staged = self.blocks * self.trows * self.jpad * self.elem
        partials = 2 * self.blocks * self.trows * self.nunits * self.cols * 4 if self.ksplit > 1 else 0
        streamed = self.blocks * self.slice_elems * self.elem if self.streamed else 0
        return staged + partials + streamed

    @property
    def red_bytes(self) -> int:
        """Bytes of the reductions' block sums rs [rvals][trows][units] and totals rt [rvals][trows] (fp32),
        after the ring."""
        return -(-4 * self.rvals * self.trows * (self.units + 1) // 16) * 16

    @property
    def shared_bytes(self) -> int:
        return self.u_bytes + max(self.stages * self.stage_bytes, self.sp_bytes) + self.red_bytes

    def describe(self) -> str:
        if self.streamed:
            kind = (f"fp32, the product on tensor cores ({'3xTF32' if self.tf32 == 3 else 'TF32'}: mma.sync m16n8k8)"
                    if self.tf32 else "in 16 bits, the product on tensor cores (mma.sync m16n8k16)")
            form = (f"U streamed (not resident: {self.slices} slices of {self.slice_elems * self.elem // 1024} KiB "
                    f"in global memory, {self.slices * self.slice_elems * self.elem / 2**20:.1f} MiB, read "
                    f"from L2 each step a chunk at a time beside the operand's) {kind}")
        elif self.mma and self.tf32:
            form = (f"U slice {self.u_bytes // 1024} KiB fp32 resident in shared memory, the product on tensor cores "
                    f"({'3xTF32' if self.tf32 == 3 else 'TF32'}: mma.sync m16n8k8)")
        elif self.mma:
            form = (f"U slice {self.u_bytes // 1024} KiB in 16 bits resident in shared memory, the product on tensor "
                    "cores (mma.sync m16n8k16)")
        else:
            form = f"U slice {self.u_bytes // 1024} KiB resident in shared memory, the product in fp32 FMAs"
        split = (f", the contracted indices in {self.ksplit} groups (a tile's blocks {self.ksplit} x {self.jsplit}: a "
                 f"block multiplies its group's slice into fp32 partials of {self.nunits} units, 2 barriers a step)"
                 if self.ksplit > 1 else "")
        nbt = self.blocks // self.tiles
        reduce = (f", {self.rlevels} levels of sums over the units a step (at most {self.rvals} "
                  f"value{'s' if self.rvals > 1 else ''} a row a level: the "
                  "block's sums in shared memory, "
                  + (f"then exchanged among the tile's {nbt} blocks, a barrier a level)" if nbt > 1
                     else "the tile's units all in the block: no barrier among blocks)")
                  if self.rlevels else "")
        reason = f"; {self.reason}" if self.reason else ""
        return (f"{self.blocks} blocks x {self.threads} threads: {self.tiles} batch tiles of {self.trows} rows, "
                f"{self.units} units x {self.cols} columns a block, {form}, the operand staged {self.chunk} "
                f"contracted indices a chunk, {self.stages} chunks a ring{split}{reduce}{reason}")


# a block gets at least this many (row, unit) pairs where the shape has few: a small shape's step is bound
# by its latency (the grid barrier, the staging through L2), not by the FMAs, and a thread's share is one
# pair either way; fewer, fuller blocks arrive at a barrier with fewer atomics and read fewer bytes of L2
MIN_BLOCK_PAIRS = 128
TILES = (8, 4, 2, 1)  # batch tiles tried, most first: each halving of a block's rows halves its L2 reads
MIN_TILE_ROWS = 8     # rows a tile has at least (a warp spans 8 rows x 4 units)
# the tensor-core form splits a one-column product's contracted indices (`plan`) where a block would stage at
# least this many bytes of the operand a step; into these many K groups, most first
SPLIT_BYTES = 512 * 1024
SPLITS = (4, 2)
# fp32 accumulators a thread may hold for a split product where it owns MAX_PAIRS pairs (their cells keep most
# of the registers): B256 H1024's adjoint in 4 K groups needs 32 (about 240 / 254 registers for sm_90 / sm_80,
# no spills), in 2 needs 16
SPLIT_ACCUMULATORS = 32


# the fp32 tensor-core form's batch tiles have at least this many rows where the shape has them (one whole m16
# tile: fewer rows multiply padding rows of zeros; the FMA form's MIN_TILE_ROWS stays its own)
MIN_TF32_TILE_ROWS = 16
# clocks a dependent mma.sync waits for the one before it on the same accumulators (an estimate: the fp32 form
# keeps several accumulator sets a tile so that a warp's chain of k steps is not bound by it)
MMA_LATENCY = 32
# clocks an SM sub-partition takes per mma.sync m16n8k8 tf32 (as the 16-bit m16n8k16: the same tensor-core
# cycles, half the products), against one clock per 128-byte shared-memory wavefront of the SM
TF32_MMA_CLOCKS = 6


def tf32_sets(passes: int) -> int:
    """Accumulator sets a tile in the fp32 tensor-core form: 3xTF32 one a term (hi hi, hi lo, lo hi: three
    independent chains), TF32 two (even and odd k8 steps)."""
    return 3 if passes == 3 else 2


def tf32_warp_grid(plan: Plan) -> tuple[int, int, int, int, int]:
    """The fp32 tensor-core form's split of the block's product tiles (16 x 8: MPAD / 16 x NPAD / 8 of them)
    and of each chunk's contracted indices over its warps: (GM, GN, GK, WM, WN), warp w = (wk GM GN + wn GM
    + wm) owning the WM x WN tiles at m-tile wm WM + i, n-tile wn WN + n of the chunk's k8 steps
    [wk, wk + 1) CHUNK / GK (GK warps' tiles summed by the pairs, in warp order). A chunk costs the block the
    most of: its fragments' shared loads (4 wavefronts an m-tile, 2 an n-tile a warp and k8 step), the mma
    issue of the busiest sub-partition (`plan.tf32` mma a tile and k8 step), a warp's chain of dependent mma
    (MMA_LATENCY a k8 step and accumulator set, or its own issue where longer); the least, at most the
    accumulators `warp_grid` allows (x the sets), no K split where the blocks split K (`ksplit`)."""
    mt, nt, warps = plan.mpad // 16, plan.npad // 8, plan.threads // 32
    ksteps = plan.chunk // 8
    sets = tf32_sets(plan.tf32)
    most = 64 if plan.pairs < 8 else 32 if plan.cols > 1 else 16
    best = None
    for gk in (1, 2, 4, 8):
        # (TF32: two k8 steps an iteration, one a set)
        if gk > warps or ksteps % gk or (gk > 1 and plan.ksplit > 1) or (ksteps // gk) % (2 if sets == 2 else 1):
            continue
        steps = ksteps // gk
        for gm in range(1, min(warps // gk, mt) + 1):
            for gn in range(1, min(warps // (gk * gm), nt) + 1):
                wm, wn = -(-mt // gm), -(-nt // gn)
                if wm * wn * 4 * sets > max(most, 4 * sets):
                    continue
                used = gm * gn * gk
                loads = gm * gn * ksteps * (4 * wm + 2 * wn)
                issue = -(-used // 4) * steps * wm * wn * plan.tf32 * TF32_MMA_CLOCKS
                chain = steps * max(MMA_LATENCY * plan.tf32 // sets, wm * wn * plan.tf32 * TF32_MMA_CLOCKS)
                cost = (max(loads, issue, chain), loads, -used)
                if best is None or cost < best[0]:
                    best = (cost, (gm, gn, gk, wm, wn))
    if best is None:  # more tiles than the warps hold: the largest grid, wide tiles
        gm = min(warps, mt)
        gn = max(1, min(warps // gm, nt))
        return gm, gn, 1, -(-mt // gm), -(-nt // gn)
    return best[1]


def plan(cell: Cell, sizes: dict[str, int], sm_count: int, blocks: int | None = None,
         shared_limit: int = BLOCK_SHARED, tiles: int | None = None, mma: bool = False,
         max_blocks: int | None = None, ksplit: int | None = None, tf32: int = 0,
         ring: tuple[int | None, int | None] | None = None,
         deep_ring: tuple[int | None, int | None] | None = None, streamed: bool = False) -> Plan | str:
    """The split of `cell` at `sizes` over at most `sm_count` blocks (`blocks`: exactly that many, as
    the emulator's one; `tiles`: exactly that many batch tiles), within `shared_limit` bytes of shared
    memory a block, or why none fits. Preferred, in order: GRU's three columns padded to four, the most
    batch tiles whose U slices fit (U is spread over a tile's blocks: more tiles, larger slices), the
    largest chunk (at most the depth, at most STAGE_BYTES a buffer; 128 at 64 rows is 33 KiB, whose
    loads take about as long as its products), the deepest ring (the tensor-core adjoints: the chunk and ring of
    the most bytes in flight, DEEP_STAGES). `mma`: the tensor-core form (16-bit U
    and operand on chip, `Plan.mma`): no column padding, chunks of whole k16 steps; with `tf32` (3 or 1:
    `Plan.tf32`) its fp32 form (U and the operand fp32 on chip, mma.sync m16n8k8), whose batch tiles have
    MIN_TF32_TILE_ROWS rows at least where the shape has them. The grid: at most
    `sm_count` blocks (one an SM), at most `max_blocks`, and at most one per MIN_BLOCK_PAIRS pairs of the
    shape (a small shape: fewer, fuller blocks); `tiles` counts a head's batch tiles where there are heads.

    Split (`Plan.ksplit`, the tensor-core form of a one-column product: the adjoints): where a block would
    stage at least SPLIT_BYTES of the operand a step (B256 H1024's adjoint: 128 rows x 4096 indices, 1 MiB a
    block, 128 MiB a step over the grid), the tile's blocks are KS K groups x JS J groups: a block multiplies
    the operand's K group slice (1/KS of the indices) by its U slice [its J group's KS x units units][that
    slice] into fp32 partials, which the J group's blocks sum; the same U bytes a block, KS x fewer staged
    (partials add 2 x rows x H x 4 bytes a K group). `ksplit`: exactly that split (1: none). `ring`: (chunk,
    buffers) of a tensor-core forward's staging where they fit (None in either: the deepest ring of the chunk
    given, the largest chunk of the buffers given; CudaOptions.persistent_forward_chunk / _stages), else the
    rule above; `deep_ring` the same for the one-column products that take the deepest ring (the adjoints:
    persistent_adjoint_chunk / _stages).

    `streamed` (the tensor-core form only; `Plan.streamed`): U not resident. The same split by columns, but a
    block's U slice lies in global memory (all slices together U's size once a head: they stay in L2 across the
    steps) and each ring buffer holds a chunk of it [npad][chunk] beside the operand's chunk, so shared memory
    bounds only the ring: the plan for a U larger than the grid's shared memory. Batch tiles fewest first there:
    each tile's blocks read all of U a step (tiles x U bytes from L2), so one tile moves the least, the pairs a
    thread permitting."""
    if streamed and not mma:
        return "the streamed form needs the tensor-core form (SSMC_CUDA_PERSISTENT_MMA=0 keeps U resident)"
    rows = math.prod(sizes[a] for a in cell.rows)
    nheads = math.prod(sizes[a] for a in cell.heads)
    size = sizes[cell.split]
    budget = min(sm_count, max_blocks or sm_count, max(1, rows * size // MIN_BLOCK_PAIRS))
    for axis in (cell.unit, cell.out_unit):
        if sizes.get(axis, size) != size:
            return f"the axis {axis} and the units {cell.split} differ in size"
    depth = math.prod(sizes.get(a, size) for a in cell.contracted)
    cols = math.prod(sizes[a] for a in cell.cols)
    vec = cols == 1
    cpad = 4 if cols == 3 else cols
    levels = [lv for section in cell.phases for lv in section]
    rvals = max((sum(math.prod(sizes[a] for a in r.axes if a in cell.local) for r in lv) for lv in levels), default=0)
    rlevels = len(levels)
    why = None
    elem, epad = (4, 4) if tf32 or not mma else (2, 8)
    min_rows = MIN_TF32_TILE_ROWS if mma and tf32 else MIN_TILE_ROWS
    if mma:
        cpad = cols  # the columns of all units are one flat axis n there
    for pad in ((cpad, cols) if cpad != cols else (cols,)):  # GRU's 3 gates padded to 4 where it fits
        for per_head in ((tiles,) if tiles else TILES[::-1] if streamed else TILES):
            ntiles = nheads * per_head
            trows = -(-(rows // nheads) // per_head)
            if tiles is None and per_head > 1 and trows < min_rows:
                continue
            per_tile = max(1, (blocks or budget) // ntiles)
            units = -(-size // per_tile)
            nbt = -(-size // units)
            if blocks is not None and nbt * ntiles != blocks:
                why = why or f"{size} units x {ntiles} tiles do not split into {blocks} blocks"
                continue
            pairs_total = trows * units
            threads = min(MAX_THREADS, -(-pairs_total // 32) * 32)
            pairs = -(-pairs_total // threads)
            if pairs > MAX_PAIRS:
                why = why or f"{pairs} (row, unit) pairs a thread (more than {MAX_PAIRS}: rows x units = {pairs_total})"
                continue
            mpad = -(-trows // 16) * 16
            if cell.reductions:  # (the reductions exchange among all of a tile's blocks: no K groups)
                splits = (1,)
            elif ksplit is not None:
                splits = (ksplit,)
            elif mma and cols == 1 and elem * trows * depth >= SPLIT_BYTES:
                splits = (*SPLITS, 1)
            else:
                splits = (1,)
            for ks in splits:
                js = -(-size // (ks * units))
                nb = nbt if ks == 1 else ks * js
                # split: the block's product tiles (mpad x ks units) in the accumulators a thread may hold
                most = 64 if pairs < MAX_PAIRS else SPLIT_ACCUMULATORS
                if ks > 1 and (not mma or js < 1 or nb * ntiles > (blocks or budget)
                               or (mpad // 16) * -(-ks * units * cols // 8) * 4 > most * (threads // 32)):
                    why = why or f"no split of the contracted indices in {ks} groups"
                    continue
                if blocks is not None and nb * ntiles != blocks:
                    why = why or f"{size} units x {ntiles} tiles do not split into {blocks} blocks"
                    continue
                kd = depth if ks == 1 else depth // size * js * units  # the block's K group: js x units units
                if mma:
                    # (streamed: a buffer holds the chunk's U rows, the block's product columns, too)
                    urows = -(-ks * units * cols // 8) * 8 if streamed else 0
                    chunks = [c for c in MMA_CHUNKS if c <= max(-(-kd // 16) * 16, 16)
                              and elem * (mpad + urows) * (c + epad) <= STAGE_BYTES]
                else:
                    chunks = [c for c in CHUNKS if c <= max(-(-kd // 4) * 4, CHUNKS[-1])
                              and 4 * trows * (c + 4) <= STAGE_BYTES]
                if not chunks:
                    why = why or f"{trows} rows: a staged chunk of the operand exceeds {STAGE_BYTES} bytes"
                    continue
                # the tensor-core adjoints (one column): the ring of the most bytes in flight; the forwards: the
                # largest chunk's ring of STAGES, which the GPU sweep found faster for them than the deepest ring
                # (docs/design/persistent-rnn.md, "Deeper rings"); streamed forwards too (their staging is U's slice
                # besides the operand: the ring of STAGES measured faster there as well)
                deepest = mma and cols == 1
                forced = (deep_ring if cols == 1 else ring) if mma else None
                if forced and any(forced):
                    for chunk in (c for c in chunks if forced[0] in (None, c)):
                        jpad = -(-kd // chunk) * chunk
                        for stages in ((forced[1],) if forced[1] else DEEP_STAGES):
                            candidate = Plan(rows, size, cols, units, nb * ntiles, threads, pairs, chunk, jpad, kd,
                                             pad, vec, stages, ntiles, trows, nheads, mma, ks, tf32 if mma else 0,
                                             rvals, rlevels, streamed)
                            if stages >= 2 and candidate.shared_bytes <= shared_limit:
                                return candidate
                deep = []  # (bytes in flight, chunk, plan) of each chunk's deepest ring
                for chunk in chunks:
                    jpad = -(-kd // chunk) * chunk
                    for stages in (DEEP_STAGES if deepest else STAGES):
                        candidate = Plan(rows, size, cols, units, nb * ntiles, threads, pairs, chunk, jpad, kd,
                                         pad, vec, stages, ntiles, trows, nheads, mma, ks, tf32 if mma else 0,
                                         rvals, rlevels, streamed)
                        if candidate.shared_bytes <= shared_limit:
                            if not deepest:
                                return candidate
                            deep.append(((stages - 1) * candidate.stage_bytes, chunk, candidate))
                            break
                if deep:  # the most bytes in flight, in 16 KiB; of equals the smallest chunk (fewer registers live
                    # in its unrolled loop: B256 H1024's adjoint keeps 8 pairs a thread)
                    return max(deep, key=lambda d: (d[0] // 16384, -d[1]))[2]
                if why is None or "exceed" not in why:
                    why = (f"U slice and staging {candidate.shared_bytes} bytes a block exceed {shared_limit} "
                           f"({units} units x {cols} columns x {depth}) over {nb * ntiles} blocks")
    return why or "no split fits"
