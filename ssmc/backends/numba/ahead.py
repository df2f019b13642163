"""State-free work of a step computed ahead, a tile of steps at a time, in loops the compiler vectorises.

A kernel's step mixes work that reads the recurring state with work that does not: Mamba-1's
``dt = softplus(delta[t] + delta_bias)`` and ``silu(z[t])`` need no state. Inside the sequential
time loop each is a chain of dependent scalar operations (a polynomial, a division) that the CPU
runs one step after the other. `split_ahead` moves that work into a loop over a tile of `TILE`
steps, run before the tile's sequential steps:

    for each tile [c0, c1) of the block's steps (in the kernel's direction):
        for t in range(c0, c1):                    # steps independent of each other: vectorised
            m0 = softplus(delta[t, b, d] + delta_bias[d]);  ah_m0[t - c0] = m0;  ...
        for t in the tile (in the kernel's direction):
            <the step, reading ah_m0[t - c0] where it read m0>

What moves: the step's top-level scalar assignments that read only sequences, params and values
that moved; and, inside the other top-level statements, each largest state-free subexpression
that calls a math function (``silu(z[t])`` in ``y = (acc + D u) * silu(z[t])``). The split is
made when something that calls a math function moves. Nothing is reordered within a step, so
the results are the same bit for bit. The split made Mamba-1's fp32 forward faster on two cores
(with the vectorisable fp32 math of the module template); see
bench/results/2026-11-27-from-code-comments.md.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...lowering.kernel import Kernel
from ...lowering.loops import Assign, Bin, Call, Load, Loop, Num, Select, Var, map_children, subexpressions, walk
from ...lowering.plan import size_var

TILE = 64  # steps per tile: the tile's buffers stay in L1


@dataclass
class Ahead:
    """A kernel's step split in two (module docstring)."""

    ahead: list          # statements of one step, run for every t of a tile first (scalar assigns)
    buffers: list[str]   # ah_<name>: TILE values each, read by the step
    step: list           # the step, reading the buffers


def split_ahead(k: Kernel) -> Ahead | None:
    """The step of `k` with its state-free work moved ahead; None when no math call would move."""
    if k.time_blocks and k.sum_over_time:
        return None  # an epilogue over time blocks: every step is already independent
    inputs = {a.name for a in k.arrays if a.role in ("seq", "param")}
    allowed = {"t", *(f"p_{a}" for a in k.parallel), *(size_var(a) for a in k.sizes)}
    assigns = [s for part in (k.setup, k.step) for s in walk(part)
               if isinstance(s, Assign) and isinstance(s.target, Var)]
    assigned = {s.target.name for s in assigns}
    once = {name for name in assigned if sum(s.target.name == name for s in assigns) == 1}  # not accumulators
    split = _Split(inputs, allowed, assigned)
    step = []
    for s in k.step:
        if (isinstance(s, Assign) and isinstance(s.target, Var) and s.op == "=" and s.target.name in once
                and split.free(s.value)):
            split.ahead.append(s)
            split.moved.add(s.target.name)
            continue
        step.append(split.stmt(s))
    if not any(_calls(s.value) for s in split.ahead):
        return None
    used = {name for s in step for name in _names(s)}
    keep = [s.target.name for s in split.ahead if s.target.name in used]
    stores = [Assign(Load(f"ah_{name}", ("t - c0",)), Var(name)) for name in keep]
    return Ahead(split.ahead + stores, [f"ah_{name}" for name in keep], [_read_buffers(s, set(keep)) for s in step])


class _Split:
    def __init__(self, inputs: set[str], allowed: set[str], assigned: set[str]):
        self.inputs, self.allowed, self.assigned = inputs, allowed, assigned
        self.moved: set[str] = set()
        self.ahead: list[Assign] = []

    def free(self, e) -> bool:
        """Whether `e` reads no state: only inputs at this step, indices, sizes and moved values."""
        if isinstance(e, Num):
            return True
        if isinstance(e, Var):
            return e.name in self.moved or (e.name not in self.assigned and e.name in self.allowed)
        if isinstance(e, Load):
            return e.array in self.inputs and all(_tokens(i) <= self.allowed for i in e.index)
        if isinstance(e, Call):
            return all(self.free(a) for a in e.args)
        if isinstance(e, Bin):
            return self.free(e.a) and self.free(e.b)
        if isinstance(e, Select):
            return self.free(e.cond) and self.free(e.a) and self.free(e.b)
        return False  # InRange: split blocks, left alone

    def expr(self, e):
        """`e` with its largest state-free subexpressions that call a math function moved ahead."""
        if isinstance(e, (Call, Bin, Select)) and _calls(e) and self.free(e):
            name = f"ahx{len(self.ahead)}"
            self.ahead.append(Assign(Var(name), e))
            self.moved.add(name)
            return Var(name)
        if isinstance(e, Call):
            return Call(e.fn, tuple(self.expr(a) for a in e.args))
        if isinstance(e, Bin):
            return Bin(e.op, self.expr(e.a), self.expr(e.b))
        if isinstance(e, Select):
            return Select(self.expr(e.cond), self.expr(e.a), self.expr(e.b))
        return e

    def stmt(self, s):
        if isinstance(s, Assign):
            return Assign(s.target, self.expr(s.value), s.op)
        return s  # loops over other axes: their values depend on the loop's index


def _tokens(index: str) -> set[str]:
    return {tok for tok in re.findall(r"[A-Za-z_]\w*", index)}


def _calls(e) -> bool:
    return any(isinstance(x, Call) for x in subexpressions(e))


def _names(s):
    """Names of the scalar variables a statement reads."""
    for x in walk([s]):
        if isinstance(x, Assign):
            yield from _vars(x.value)


def _vars(e):
    return (x.name for x in subexpressions(e) if isinstance(x, Var))


def _read_buffers(s, keep: set[str]):
    """Statement `s` reading ah_<name>[t - c0] for every moved value `name` in `keep`."""
    def expr(e):
        if isinstance(e, Var) and e.name in keep:
            return Load(f"ah_{e.name}", ("t - c0",))
        return map_children(e, expr)  # Num, Load, InRange as they are

    if isinstance(s, Loop):
        return Loop(s.var, s.extent, [_read_buffers(x, keep) for x in s.body], s.reverse)
    if isinstance(s, Assign):
        return Assign(s.target, expr(s.value), s.op)
    return s

