"""Random inputs for any program: used by `ssmc check`, the property tests and the benchmarks."""

from __future__ import annotations

import numpy as np

from ..ir.node import toposort
from ..ir.ops import Op
from ..ir.program import Attention, Recurrence


def axis_sizes(program: Recurrence | Attention, rng: np.random.Generator, low: int = 2, high: int = 5,
               given: dict[str, int] | None = None) -> dict[str, int]:
    """A size for every axis: static sizes as declared, `given` ones as given, others random.

    An axis cut by `split` gets the total size of its parts.
    """
    sizes = {**program.static_sizes, **(given or {})}
    axes: list[str] = []
    decls = program.decls if isinstance(program, Recurrence) else program.params
    for d in decls:
        axes.extend(a for a in d.axes if a not in axes)
    if isinstance(program, Attention):
        axes.extend(a for a in (*program.batch_axes, program.head_dim, program.value_dim) if a not in axes)
    roots = program.roots if isinstance(program, Recurrence) else [n for n in (program.score, program.mask) if n]
    splits = {n.arg[0]: n.arg[2] for n in toposort(roots) if n.op is Op.SLICE}
    group: dict[str, str] = {}  # union-find: a renamed axis has the size of the axis it renames

    def find(a: str) -> str:
        while group.setdefault(a, a) != a:
            a = group[a]
        return a

    for node in toposort(roots):
        if node.op is Op.RENAME:
            for old, new in node.arg:
                group[find(old)] = find(new)
    for a in axes:
        root = find(a)
        if root not in sizes and a in sizes:
            sizes[root] = sizes[a]
    for a in axes:
        root = find(a)
        if root not in sizes and a not in splits:
            sizes[root] = int(rng.integers(low, high + 1))
        if root in sizes:
            sizes[a] = sizes[root]
    for axis, parts in splits.items():
        for p in parts:
            sizes.setdefault(p, int(rng.integers(low, high + 1)))
        sizes.setdefault(axis, sum(sizes[p] for p in parts))
    return sizes


DEFAULT_SIZE = 16  # an axis neither given nor declared static, where a command needs one size


def default_sizes(program: Recurrence | Attention, given: dict[str, int] | None = None) -> dict[str, int]:
    """Every axis `DEFAULT_SIZE` unless `given` or declared static (renamed axes share a size)."""
    return axis_sizes(program, np.random.default_rng(0), DEFAULT_SIZE, DEFAULT_SIZE, given)


def random_recurrence_inputs(program: Recurrence, length: int, rng: np.random.Generator,
                             sizes: dict[str, int] | None = None, with_initial: bool = True,
                             scale: float = 0.5) -> dict[str, np.ndarray]:
    """Keyword arguments for calling `program` with layout "t ...": inputs and initial states."""
    sizes = sizes or axis_sizes(program, rng)
    kwargs = {}
    for d in program.decls:
        shape = [sizes[a] for a in d.axes]
        if d.role.value == "seq":
            shape = [length, *shape]
        elif d.role.value == "state" and not with_initial:
            continue
        kwargs[d.name] = scale * rng.standard_normal(shape)
    return kwargs
