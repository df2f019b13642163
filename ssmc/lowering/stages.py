"""The fusion stage: a layer's step cut into kernels only where it needs a whole row of a step.

A layer written as one step (scan, skip, gate, a norm over the channels, a residual add) mixes
two kinds of work. The scan runs each channel as an independent recurrence (a thread or a warp
per (b, d)); a norm needs every channel of a step at once. Everything elementwise already fuses
into the recurrence's kernel (plan.py): the prologue (softplus, the skip) is inlined into its
loads, the epilogue (the gate) into its stores. What cannot be is a *row statistic*: a reduction
over an axis ``a`` whose result is broadcast back along ``a`` (the norm's ``mean_d(y**2)``,
multiplied into ``y``). This pass moves row statistics out of the recurrence:

    pre   row statistics that read no state (in an adjoint the forward's values are sequences):
          a state-free program computes them for every step, the recurrence reads them as new
          sequences ``row<k>`` [t, the statistic's axes]
    core  the recurrence with everything else fused in; it also writes the values the rows
          need (``cut<k>``: the norm's input y, [t b d]) as extra outputs
    post  the outputs that take row statistics of state-dependent values (the forward's norm
          and the residual add after it): a state-free program over the cut values

Pre and post programs have no states: each backend runs them parallel over time as well as over
their own independent axes (on CUDA a thread per (b, t) row; `plan.lower`). A row statistic
inside a state update (a norm inside the recurrence) stays: that recurrence then runs per row (b)
rather than per (b, d); on CUDA a block of threads shares each row along the normalised axis
(`Fused.shared_row_axis`, split_sum.py), which also runs a staged layer as the program written,
one kernel, where that pays (backends/cuda/runner.py, `one_kernel`).

As a plain loop the staged program is the original: pre for all t, then the recurrence over t,
then post for all t; `fuse` only decides where values are stored between kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..ir.node import BOOL, Node, depending_on, input_names, substitute, toposort
from ..ir.ops import ELEMENTWISE, LEAVES, REDUCTIONS, STRUCTURAL, Op
from ..ir.program import Recurrence
from .plan import lower
from .split_sum import recurrence_row_axis

_INTRODUCES_AXIS = (Op.RENAME, Op.SLICE, Op.PAD)   # ops whose result can name an axis its operand lacks


@dataclass(frozen=True)
class Stage:
    """One program of a staged run: "pre", "core" or "post", and the intermediates it writes."""

    kind: str
    program: Recurrence
    writes: tuple[str, ...] = ()      # outputs that are sequences of a later stage, not results


@dataclass(frozen=True)
class Fused:
    """`program` as stages run in order; one "core" stage when nothing needed moving."""

    program: Recurrence
    stages: tuple[Stage, ...]
    left_in: tuple[Node, ...] = ()    # row statistics inside state updates, left in the recurrence
    row_axes: tuple[str, ...] = ()    # the axes of the row statistics of states and sequences, if any

    @property
    def staged(self) -> bool:
        return len(self.stages) > 1

    @property
    def core(self) -> Stage:
        return next(st for st in self.stages if st.kind == "core")

    def describe(self) -> str:
        """Each stage: its kernels (`plan.lower` as the CUDA backend lowers), and the ops fused into
        them; then the kernel count against running the layer op by op (module docstring)."""
        lines = []
        total = 0
        for st in self.stages:
            p = st.program
            kernels = lower(p, map_reduce=True).kernels
            total += len(kernels)
            head = f"  {st.kind:<5} {p.name}: {len(kernels)} kernel{'s' * (len(kernels) != 1)}"
            outs = [n for n, _ in p.outputs if n not in st.writes]
            head += f"; outputs {', '.join(outs) or '-'}"
            if st.writes:
                head += "; writes " + ", ".join(f"{n} [{' '.join(('t', *dict(p.outputs)[n].axes))}]"
                                                for n in st.writes)
            reads = [d.name for d in p.seqs if d.name not in {x.name for x in self.program.decls}]
            if reads:
                head += f"; reads {', '.join(reads)}"
            lines.append(head)
            for what, ops in _fused_ops(p):
                if ops:
                    lines.append(f"        {what}: {', '.join(ops)}")
        shared = self.shared_row_axis()
        for r in self.left_in:
            lines.append(f"  left in the recurrence (inside a state update): {_name(r)}; the recurrence"
                         f" runs without {r.arg} among its parallel axes"
                         + (f" (on CUDA a block of threads shares each row along {shared})" if shared else ""))
        lines.append(f"  kernels: {total} (op by op: {op_by_op_kernels(self.program)})")
        if shared and self.staged:
            lines.append(f"  or on CUDA 1 kernel, the layer as written, where a block of threads owns each row"
                         f" along {shared} and the scan would run a thread per recurrence anyway (many rows, time"
                         " outermost; `ssmc inspect` tells which runs)")
        return "\n".join(lines)

    def shared_row_axis(self) -> str | None:
        """The axis along which a block of threads may share each row of the program as written (one
        kernel, time inside: lowering/split_sum.py, `recurrence_row_axis`), if any."""
        if not self.row_axes:
            return None
        low = lower(self.program, map_reduce=True)
        return recurrence_row_axis(low.kernels[0], self.row_axes) if low.strategy == "fused" else None


def _name(node: Node) -> str:
    if node.op in REDUCTIONS:
        return f"{node.op.value} over {node.arg}"
    return node.op.value


def _ops(nodes) -> list[str]:
    return [_name(n) for n in nodes if n.op not in LEAVES and n.op not in STRUCTURAL]


def _fused_ops(program: Recurrence) -> list[tuple[str, list[str]]]:
    """The ops of each part of a stage: the prologue (what reads no state), the scan (the updates),
    the epilogue (outputs computed from the states)."""
    nodes = toposort(program.roots)
    if not program.states:
        return [("ops", _ops(nodes))]
    stateful, scan = _scan(program, nodes)
    prologue = [n for n in nodes if n not in stateful]
    epilogue = [n for n in nodes if n in stateful and n not in scan]
    return [("prologue, inlined into the loads", _ops(prologue)), ("scan", _ops([n for n in nodes if n in scan])),
            ("epilogue, inlined into the stores", _ops(epilogue))]


def op_by_op_kernels(program: Recurrence) -> int:
    """Kernels if the layer ran op by op (as eager PyTorch): one for the scan, one per other op."""
    nodes = toposort(program.roots)
    _, scan = _scan(program, nodes)
    return bool(scan) + len(_ops([n for n in nodes if n not in scan]))


def _scan(program: Recurrence, nodes: list[Node]) -> tuple[set[Node], set[Node]]:
    """(the nodes that read a state, those of them the updates use: the scan proper)."""
    stateful = depending_on(nodes, {s.name for s in program.states})
    return stateful, stateful & set(toposort(program.updates))


def _users(nodes: list[Node]) -> dict[Node, list[Node]]:
    users: dict[Node, list[Node]] = {n: [] for n in nodes}
    for n in nodes:
        for a in set(n.args):
            users[a].append(n)
    return users


def _broadcast_back(node: Node, users: dict[Node, list[Node]]) -> bool:
    """Does the reduction `node` (over axis a) meet axis a again above it, not through a rename?"""
    axis = node.arg
    seen: set[Node] = set()
    stack = list(users[node])
    while stack:
        u = stack.pop()
        if u in seen:
            continue
        seen.add(u)
        if axis in u.axes:
            if u.op not in _INTRODUCES_AXIS:
                return True
            continue  # another axis renamed or cut into that name: a different index
        stack.extend(users[u])
    return False


def row_statistics(program: Recurrence) -> list[Node]:
    """Reductions whose result is broadcast back along the reduced axis (module docstring)."""
    nodes = toposort(program.roots)
    users = _users(nodes)
    return [n for n in nodes if n.op in REDUCTIONS and _broadcast_back(n, users)]


def _recurrence_axes(program: Recurrence) -> set[str]:
    """Axes every state that feeds back has (accumulators, sums over time, aside): the axes along
    which the recurrences could be independent. A statistic over any other axis (an adjoint's
    ``x W`` summed over the input axis, then transposed back) costs the recurrence no parallelism."""
    feeding = [s for s, u in zip(program.states, program.updates) if not _accumulates(program, s.name, u)]
    feeding = feeding or list(program.states)
    common = set(feeding[0].axes)
    for s in feeding[1:]:
        common &= set(s.axes)
    return common


def _accumulates(program: Recurrence, state: str, update: Node) -> bool:
    """Is `update` ``state + b`` with nothing else reading `state` (b included)? The adjoint's
    param-gradient accumulators: a write-only state, as classify says, read off the structure."""
    while update.op is Op.EXPAND:
        update = update.args[0]

    def is_carry(n: Node) -> bool:
        return n.op is Op.INPUT and n.arg == state

    if is_carry(update):
        increment: list[Node] = []     # nothing added: a zero gradient
    elif update.op is Op.ADD and any(is_carry(a) for a in update.args):
        increment = [a for a in update.args if not is_carry(a)][:1]
    else:
        return False
    others = [r for r in program.roots if r is not update] + increment
    return not any(is_carry(n) for n in toposort(others))


def _frontier(roots: tuple[Node, ...], stateful: set[Node], stats: set[Node]) -> list[Node]:
    """The state-dependent values a post program needs from the recurrence (as few as it can).

    A node is *moved* when it contains a statistic in `stats`; the frontier is the state-dependent
    nodes that are not moved and have a moved user. A frontier value computed elementwise from
    other frontier values (``y * y`` next to ``y``) is recomputed in post instead of stored.
    """
    nodes = toposort(roots)
    moved: set[Node] = set()
    for n in nodes:
        if n in stats or any(a in moved for a in n.args):
            moved.add(n)
    cut: list[Node] = []
    for n in nodes:
        if n in moved:
            cut += [a for a in n.args if a in stateful and a not in moved and a not in cut]
    changed = True
    while changed:
        changed = False
        for f in list(cut):
            if f.op in LEAVES or not (f.op in ELEMENTWISE or f.op in STRUCTURAL):
                continue
            deps = [a for a in f.args if a in stateful]
            if f.dtype == BOOL or all(a in cut for a in deps):  # booleans are not stored: recompute them
                cut.remove(f)
                cut += [a for a in deps if a not in cut]
                changed = True
    return [f for f in nodes if f in cut]


@lru_cache(maxsize=256)
def fuse(program: Recurrence) -> Fused:
    """Stage `program` (module docstring): pre, core and post programs, or the core alone.
    Cached: every compiled call asks (`registry.runner`)."""
    nodes = toposort(program.roots)
    state_names = {s.name for s in program.states}
    stateful = depending_on(nodes, state_names)
    timed = depending_on(nodes, state_names | {d.name for d in program.seqs})
    stats = [r for r in row_statistics(program) if r in timed]  # param-only ones run once, before time
    if stats and program.states:
        recurrence_axes = _recurrence_axes(program)
        stats = [r for r in stats if r.arg in recurrence_axes]
    if not program.states or not stats:
        return Fused(program, (Stage("core", program),))
    row_axes = tuple(sorted({r.arg for r in stats}))
    in_updates = set(toposort(program.updates))
    post_stats = {r for r in stats if r in stateful and r not in in_updates}
    left_in = tuple(r for r in stats if r in stateful and r in in_updates)

    # post: outputs reading a row statistic of a state-dependent value, over values cut from the core
    moved = [(n, y) for n, y in program.outputs if any(x in post_stats for x in toposort([y]))]
    kept = [(n, y) for n, y in program.outputs if (n, y) not in moved]
    cuts = _frontier(tuple(y for _, y in moved), stateful, post_stats)
    taken = {n for n, _ in program.outputs}
    cut_names = _fresh("cut", len(cuts), taken | {d.name for d in program.decls})
    cut_inputs = {f: Node.make(Op.INPUT, (), name, f.axes) for f, name in zip(cuts, cut_names)}

    # pre: state-free row statistics the core still reads, as sequences
    core_roots = program.updates + tuple(y for _, y in kept) + tuple(cuts)
    reachable = set(toposort(core_roots))
    pre_stats = [r for r in stats if r not in stateful and r in reachable]
    row_names = _fresh("row", len(pre_stats), taken | set(cut_names) | {d.name for d in program.decls})
    row_inputs = {r: Node.make(Op.INPUT, (), name, r.axes) for r, name in zip(pre_stats, row_names)}
    new_roots = substitute(core_roots, row_inputs)
    k = len(program.updates)
    updates, outs = new_roots[:k], new_roots[k:]
    core_outputs = [(n, y) for (n, _), y in zip(kept, outs)] + list(zip(cut_names, outs[len(kept):]))
    read = {n.arg for n in toposort(new_roots) if n.op is Op.INPUT}
    rows = {name: r for r, name in zip(pre_stats, row_names) if name in read}

    stages = []
    if rows:
        pre = program.with_roots((), list(rows.items()), states=(), name=f"{program.name}_pre")
        stages.append(Stage("pre", pre, tuple(rows)))
    core = program.with_roots(updates, core_outputs, [(n, r.axes) for n, r in rows.items()])
    stages.append(Stage("core", core, tuple(cut_names)))
    if moved:
        post_roots = substitute(tuple(y for _, y in moved), cut_inputs)
        read_post = input_names(post_roots)
        post = program.with_roots((), list(zip((n for n, _ in moved), post_roots)),
                                  [(name, f.axes) for f, name in zip(cuts, cut_names) if name in read_post],
                                  states=(), name=f"{program.name}_post")
        assert not (input_names(post.roots) & state_names), "post reads a state: the frontier is incomplete"
        stages.append(Stage("post", post))
    if len(stages) == 1:
        return Fused(program, (Stage("core", program),), left_in, row_axes)
    return Fused(program, tuple(stages), left_in, row_axes)


def _fresh(prefix: str, count: int, taken: set[str]) -> list[str]:
    names, i = [], 0
    while len(names) < count:
        if f"{prefix}{i}" not in taken:
            names.append(f"{prefix}{i}")
        i += 1
    return names
