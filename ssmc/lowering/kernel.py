"""What a lowering is made of: the arrays and loop-nest kernels of a program (`Kernel`), the kernels
of one program and how they connect (`Lowered`), and the axes along which a program is a family of
independent recurrences (`independent_axes`: its kernels' parallel axes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.node import Node, toposort
from ..ir.ops import Op
from ..ir.program import Recurrence


def touched_axes(node: Node) -> set[str]:
    """Axes `node` reduces, renames, unbinds or splits: along those, values mix across indices."""
    if node.op in (Op.SUM, Op.REDUCE_MAX):
        return {node.arg}
    if node.op is Op.RENAME:
        return {a for pair in node.arg for a in pair}
    if node.op is Op.SELECT:
        return {node.arg[0]}
    if node.op in (Op.SLICE, Op.PAD):
        return {node.arg[0], node.arg[1]}
    return set()


def independent_axes(program: Recurrence) -> tuple[str, ...]:
    """Axes along which `program` is a family of independent recurrences (see module docstring)."""
    roots = program.roots
    if not roots:
        return ()
    common = [a for a in roots[0].axes]
    for r in roots[1:]:
        common = [a for a in common if a in r.axes]
    for s in program.states:
        common = [a for a in common if a in s.axes]
    for n in toposort(roots):
        touched = touched_axes(n)
        common = [a for a in common if a not in touched]
    order = program.states[0].axes if program.states else roots[0].axes
    return tuple(a for a in order if a in common)


@dataclass
class Array:
    """An array a kernel reads or writes: its name, what it is, and its axes ("t" for time)."""

    name: str
    role: str          # seq | param | init | final | out | prev
    axes: tuple[str, ...]


@dataclass
class Kernel:
    """One loop-nest kernel (module docstring): parallel over `parallel`, time inside."""

    name: str
    program: Recurrence
    parallel: tuple[str, ...]
    time_blocks: bool = False         # also parallel over blocks of time (states are sums over time)
    blocked_init: bool = False        # with time_blocks: each block starts from its own carry init[blk]
    sum_over_time: bool = False       # with time_blocks: states are plain sums over time (any steps, any order)
    store_prev: tuple[str, ...] = ()  # states written out before each step ("prev_<name>")
    arrays: list[Array] = field(default_factory=list)
    setup: list = field(default_factory=list)
    step: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    sizes: tuple[str, ...] = ()       # axes whose sizes the kernel takes

    @property
    def reverse(self) -> bool:
        return self.program.reverse


@dataclass
class Lowered:
    """The kernels for a program and how they connect: one fused kernel, or a core and an epilogue."""

    program: Recurrence
    strategy: str                     # "fused" | "split" | "map" (no states: per-output kernels)
    kernels: list[Kernel]
    core_states: tuple[str, ...] = ()
    accumulators: tuple[str, ...] = ()
    # accumulators that are sums of an output (map/reduce only): (accumulator, output, axes summed
    # besides time); the runner sums the output instead of launching a kernel (`_sums_of_outputs`)
    from_outputs: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    reason: str = ""                  # why this strategy (`ssmc inspect` prints it)

    def describe(self) -> str:
        lines = [f"strategy: {self.strategy}"]
        for k in self.kernels:
            par = " ".join(k.parallel) or "-"
            tb = " + blocks of time" if k.time_blocks else ""
            lines.append(f"  kernel {k.name}: parallel over [{par}]{tb}, time {'reversed' if k.reverse else 'forward'}")
        return "\n".join(lines)
