"""Blocks of the innermost parallel axis per prange iteration, so a recurrent product reads its matrix once per block.

A kernel parallel over `b` does, per b and step, a product like an LSTM's ``m[g, k] = sum_j h[j]
U[j, g, k]``: every b streams all of U (1 MB at H=256) through the cache, 16 times per step at
B=16. `block_kernel` rewrites the kernel so one prange iteration owns a block of up to `BLOCK`
b's, as a plain loop:

    bs = max(1, min(BLOCK, ceil(n_b / threads)));  for blk in prange(ceil(n_b / bs)):  b0 = blk * bs ...
        for t:
            for j:                                # the summed loop stays outermost
                for q in range(b1 - b0):          # ... so U[j] is reused by every b of the block
                    for g, k:  m[q, g, k] += h[q, j] U[j, g, k]
            for q in range(b1 - b0):  <every other statement of the step, for b = b0 + q>

Every local buffer (and every scalar that lives from one statement to the next) gets a leading
block dimension; global arrays are indexed with ``b0 + q``. The axis is independent, so running
a statement for all b of the block before the next statement changes nothing. It is applied
(`wants_blocking`) when the step has such a product of a param (an accumulation nest whose
outer loop is summed and reads a param array), as in the LSTM / GRU forward, carries and adjoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...lowering.kernel import Kernel
from ...lowering.loops import Assign, Buffer, InRange, Load, Loop, Var, loads, map_children, walk
from ...lowering.plan import size_var

BLOCK = 8  # at most this many indices per block, and one block per thread where the axis allows
           # (the runner passes the thread count: numba.get_num_threads() in a kernel disables
           # its on-disk cache)


@dataclass
class BlockedKernel(Kernel):
    """A kernel whose prange iterations own blocks of the parallel axis `blocked` (module docstring)."""

    blocked: str = ""


def wants_blocking(k: Kernel) -> bool:
    """A parallel kernel whose step accumulates a product with a param (an ``m += h[j] U[j, ...]`` nest)."""
    if not k.parallel or k.time_blocks:
        return False
    params = {a.name for a in k.arrays if a.role == "param"}
    return any(isinstance(s, Loop) and _accumulates_param(s, params) for s in k.step)


def _accumulates_param(loop: Loop, params: set[str]) -> bool:
    for s in walk(loop.body):
        if isinstance(s, Assign) and s.op == "+=" and isinstance(s.target, Load):
            used = {tok for idx in s.target.index for tok in re.findall(r"\w+", idx)}
            if loop.var not in used and any(a in params for a in _arrays(s.value)):
                return True
    return False


def _arrays(e):
    return (x.array for x in loads(e))


def block_kernel(k: Kernel) -> BlockedKernel:
    """`k` with its innermost parallel axis in blocks (module docstring)."""
    axis = k.parallel[-1]
    q = f"q_{axis}"
    b0 = f"b0_{axis}"
    local = {s.name for s in walk(k.setup) if isinstance(s, Buffer)}
    scalars = {s.target.name for part in (k.setup, k.step, k.finish) for s in walk(part)
               if isinstance(s, Assign) and isinstance(s.target, Var)}
    rw = _Rewrite(f"p_{axis}", f"({b0} + {q})", q, local | scalars, scalars)
    per_block = f"bs_{axis}"

    def wrap(stmts):
        out = []
        for s in stmts:
            if isinstance(s, Buffer):
                out.append(Buffer(s.name, (per_block, *s.shape)))
            elif isinstance(s, Loop) and _summed_outer(s):
                # keep the summed loop outside, the block loop right inside it
                out.append(Loop(s.var, s.extent, [Loop(q, f"{b0}_end - {b0}", [rw.stmt(x) for x in s.body])],
                                s.reverse))
            else:
                out.append(Loop(q, f"{b0}_end - {b0}", [rw.stmt(s)]))
        return out

    setup = [Buffer(name, (per_block,)) for name in sorted(scalars)] + wrap(k.setup)
    blocked = BlockedKernel(k.name, k.program, k.parallel, time_blocks=k.time_blocks, store_prev=k.store_prev,
                            blocked_init=k.blocked_init, arrays=k.arrays, setup=setup, step=wrap(k.step),
                            finish=wrap(k.finish), sizes=k.sizes, blocked=axis)
    return blocked


def _summed_outer(loop: Loop) -> bool:
    """A nest ``for j: ... m[...] += ...`` whose outer loop is not an index of the target."""
    for s in walk(loop.body):
        if isinstance(s, Assign) and s.op == "+=" and isinstance(s.target, Load):
            used = {tok for idx in s.target.index for tok in re.findall(r"\w+", idx)}
            return loop.var not in used
    return False


class _Rewrite:
    """Index rewriting: the parallel index -> b0 + q; local buffers and scalars get q first."""

    def __init__(self, par: str, global_index: str, q: str, local: set[str], scalars: set[str]):
        self.pattern = re.compile(rf"\b{re.escape(par)}\b")
        self.global_index = global_index
        self.q = q
        self.local = local
        self.scalars = scalars

    def idx(self, s: str) -> str:
        return self.pattern.sub(self.global_index, s)

    def expr(self, e):
        if isinstance(e, Load):
            index = tuple(self.idx(i) for i in e.index)
            return Load(e.array, (self.q, *index) if e.array in self.local else index)
        if isinstance(e, Var):
            if e.name in self.scalars:
                return Load(e.name, (self.q,))
            return Var(self.idx(e.name))
        if isinstance(e, InRange):
            return InRange(self.idx(e.index), self.idx(e.lo), self.idx(e.hi))
        return map_children(e, self.expr)

    def stmt(self, s):
        if isinstance(s, Loop):
            return Loop(s.var, self.idx(s.extent), [self.stmt(x) for x in s.body], s.reverse)
        if isinstance(s, Assign):
            return Assign(self.expr(s.target), self.expr(s.value), s.op)
        raise TypeError(s)  # buffers only appear at the top of setup


def prelude(k: BlockedKernel) -> list[str]:
    """Lines before the prange: the block size of the blocked axis."""
    a = k.blocked
    n = size_var(a)
    return [f"bs_{a} = max(1, min({BLOCK}, -(-{n} // threads)))"]


def extent(k: BlockedKernel, axis: str) -> str:
    """The prange extent along `axis`: its size, or its number of blocks."""
    n = size_var(axis)
    return f"(({n} + bs_{axis} - 1) // bs_{axis})" if axis == k.blocked else n


def block_bounds(k: BlockedKernel) -> list[str]:
    """Lines after unflattening: the first index and the end of this iteration's block."""
    a = k.blocked
    return [f"b0_{a} = p_{a} * bs_{a}", f"b0_{a}_end = min({size_var(a)}, b0_{a} + bs_{a})"]
