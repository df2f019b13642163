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
"""

from __future__ import annotations

from ..ir.node import Node, toposort
from ..ir.ops import Op
from .plan import Kernel

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


def _strip(n: Node) -> Node:
    while n.op is Op.EXPAND:
        n = n.args[0]
    return n
