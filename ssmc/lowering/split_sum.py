"""Splitting a kernel's long reduction across groups of threads (split-K), backend-neutral analysis.

A map/reduce epilogue kernel (`plan.lower(map_reduce=True)`) whose one root is a sum over a local
axis ``s`` (an output ``y[t, p] = sum_s f[t, p, s]``, or an accumulator ``g[p] += sum_s f[t, p, s]``)
can give each of G groups of threads the indices ``s = grp, grp + G, ...``: every group computes a
partial sum and the partials are added afterwards, as plain loops

    for grp in range(G):                       # parallel, as the kernel's other indices
        part[grp, t, p] = sum(f[t, p, s] for s in range(grp, n_s, G))
    y[t, p] = sum(part[grp, t, p] for grp in range(G))

This is valid when nothing but that sum depends on ``s``: every value with axis ``s`` is read only
inside the sum (so a group computes, and reads, only its own indices of any buffer along ``s``),
no view renames, selects or slices ``s``, and no other reduction runs over ``s``.

Cooperative rows (`row_axis`). A map kernel (a state-free program, one step per thread: a fusion
stage's norm) whose step reduces over a long local axis ``r`` and uses the result again along
``r`` (``y[t, p, r] = x[t, p, r] * rsqrt(mean_r x[t, p, r]**2 + eps)``) can give each row
``(t, p)`` G cooperating threads, every loop over ``r`` taking the indices ``r = grp, grp + G, ...``,
as plain loops

    for (t, p) in rows:                                    # parallel
        for grp in range(G):                               # parallel, threads of one CUDA block
            part[grp] = sum(x[t, p, r] ** 2 for r in range(grp, n_r, G))
        for grp in range(G):                               # after a barrier: every group the same total
            s = sum(part[g] for g in range(G))
            for r in range(grp, n_r, G):
                y[t, p, r] = x[t, p, r] * rsqrt(s / n_r + eps)

This is valid when every value with axis ``r`` is indexed by ``r`` itself (no view renames,
selects, slices or pads ``r``), so a group reads and writes only its own indices of any scratch
buffer along ``r``; when every loop over ``r`` is a top-level statement of the kernel (so all the
block's threads reach each combine, once); and when what such a loop accumulates across its
iterations is a scalar (a sum or a max, combined across the groups right after the loop).

Rows of a recurrence (`recurrence_row_axis`). The same holds for a recurrence that runs a thread
per row with time inside (a layer's scan and the norm over its channels as one kernel, or a norm
inside the state update): the G threads of a row each own the indices ``r = grp, grp + G, ...``
of every state and buffer along ``r``, for the whole sequence, as plain loops

    for p in rows:                                         # parallel
        for grp in range(G):                               # parallel, threads of one CUDA block
            h = init[p, grp::G]                            # this group's part of the state
        for t in range(L):
            for grp in range(G):
                part[grp] = sum(y(h[r], x[t, p, r]) ** 2 for r in range(grp, n_r, G))
            for grp in range(G):                           # after the combine: one total per row
                s = sum(part[g] for g in range(G))
                h[grp::G], out[t, p, grp::G] = ...(s)

under the conditions above: nothing moves ``r``, every loop over it is top-level in the setup,
the step and the finish, and what one accumulates is a scalar.
"""

from __future__ import annotations

from ..ir.node import Node, toposort
from ..ir.ops import Op
from .kernel import Kernel, touched_axes
from .loops import Assign, Buffer, Loop, Var, loads, walk
from .plan import size_var

MIN_SPLIT = 128  # a reduced axis shorter than this stays in one thread (it unrolls into registers)


def summand(k: Kernel) -> Node | None:
    """The sum a split would divide: the kernel's one output, or its one accumulator's increment."""
    p = k.program
    if len(p.roots) != 1 or not k.sum_over_time:
        return None
    root = _strip(p.roots[0])
    if p.states:
        state = p.states[0].name
        if root.op is not Op.ADD:
            return None
        others = [a for a in root.args if not (a.op is Op.INPUT and a.arg == state)]
        if len(others) != 1:
            return None
        root = _strip(others[0])
    return root if root.op is Op.SUM else None


def split_axis(k: Kernel, sizes: dict[str, int]) -> str | None:
    """The axis of `k`'s sum that groups of threads may divide (module docstring), if any."""
    total = summand(k)
    if total is None:
        return None
    axis = total.arg
    if axis in k.parallel or sizes.get(axis, 0) < MIN_SPLIT:
        return None
    inside = set(toposort([total]))
    for n in toposort(list(k.program.roots)):
        if n is total:
            continue
        if n not in inside and axis in n.axes:
            return None  # read outside the sum: every group would need all of it
        if n.op in (Op.SUM, Op.REDUCE_MAX) and n.arg == axis:
            return None
        if n.op is Op.RENAME and any(axis in pair for pair in n.arg):
            return None
        if n.op in (Op.SELECT, Op.SLICE, Op.PAD) and axis in (n.arg[0], n.arg[1]):
            return None
    return axis


def row_axis(k: Kernel, sizes: dict[str, int]) -> str | None:
    """The axis whose rows a map kernel's threads may share (module docstring, cooperative rows):
    the longest local axis, of at least MIN_SPLIT, that its step reduces; None if there is none or
    the kernel's loops do not allow it."""
    p = k.program
    if p.states or not k.time_blocks:
        return None
    nodes = toposort(list(p.roots))
    reduced = {n.arg for n in nodes if n.op in (Op.SUM, Op.REDUCE_MAX)}
    moved = set().union(*(touched_axes(n) for n in nodes if n.op not in (Op.SUM, Op.REDUCE_MAX)))
    candidates = [a for a in reduced if a not in k.parallel and a not in moved and sizes.get(a, 0) >= MIN_SPLIT]
    if not candidates:
        return None
    axis = max(candidates, key=lambda a: (sizes[a], a))
    return axis if row_accumulators(k, axis) is not None else None


def recurrence_row_axis(k: Kernel, axes: tuple[str, ...]) -> str | None:
    """The axis among `axes` (the row statistics' axes: `stages.Fused.row_axes`) whose indices the
    threads of a thread-per-row recurrence kernel may share (module docstring), if any."""
    p = k.program
    if not p.states or k.time_blocks or k.sum_over_time:
        return None
    nodes = toposort(list(p.roots))
    moved = set().union(*(touched_axes(n) for n in nodes if n.op not in (Op.SUM, Op.REDUCE_MAX)))
    for axis in axes:
        if axis not in k.parallel and axis not in moved and row_accumulators(k, axis) is not None:
            return axis
    return None


def row_accumulators(k: Kernel, axis: str) -> dict[int, tuple[tuple[str, str], ...]] | None:
    """For each top-level loop over `axis` in `k`'s setup and step (by `id`), the scalars it
    accumulates and how (``(name, "+=" | "max=")``: combined across the groups after the loop);
    None if a group could not run its share alone (module docstring)."""
    var, extent = f"i_{axis}", size_var(axis)
    along = {s.name for s in walk(k.setup + k.step + k.finish) if isinstance(s, Buffer) and extent in s.shape}
    out: dict[int, tuple[tuple[str, str], ...]] = {}
    for top in k.setup + k.step + k.finish:
        inner = [s for s in walk([top]) if isinstance(s, Loop) and s.var == var]
        if not isinstance(top, Loop) or top.var != var:
            if inner:
                return None  # a loop over the axis nested in another loop
            if any(e.array in along for s in walk([top]) if isinstance(s, Assign)
                   for e in (*loads(s.target), *loads(s.value))):
                return None  # a buffer along the axis read outside a loop over it
            continue
        if len(inner) > 1:
            return None
        acc: dict[str, str] = {}
        lets: set[str] = set()
        for s in walk(top.body):
            if not isinstance(s, Assign):
                continue
            for e in (*loads(s.target), *loads(s.value)):
                if e.array in along and var not in e.index:
                    return None  # a group would read another's indices of its buffer
            if isinstance(s.target, Var):
                if s.op == "=":
                    lets.add(s.target.name)  # a scalar of one iteration
                elif acc.setdefault(s.target.name, s.op) != s.op:
                    return None
            elif var not in s.target.index:
                return None  # an accumulation into an array across the axis
        if lets & set(acc):
            return None
        out[id(top)] = tuple(acc.items())
    return out


def _strip(n: Node) -> Node:
    while n.op is Op.EXPAND:
        n = n.args[0]
    return n
