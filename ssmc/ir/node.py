"""The one node type of the IR.

A `Node` is immutable and interned: building the same (op, args, arg, axes) twice returns the
same object, so equal subtrees are one node (structural hashing) and identity is equality.
Each node knows the names of its axes (its "shape" without sizes; sizes are bound when a program
runs) and whether it holds floats or booleans.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

from ..errors import Loc
from .axes import format_axes
from .ops import BINARY, BOOL_RESULT, ELEMENTWISE, LEAVES, REDUCTIONS, Op

FLOAT = "float"
BOOL = "bool"


class AxisError(ValueError):
    """A node whose axes do not work out (unknown axis, clash); the frontend adds the location."""


class Node:
    __slots__ = ("__weakref__", "arg", "args", "axes", "dtype", "loc", "op")

    op: Op
    args: tuple[Node, ...]
    arg: object
    axes: tuple[str, ...]
    dtype: str
    loc: Loc | None

    _interned: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()

    def __new__(cls, *a, **k):  # pragma: no cover - guard
        raise TypeError("build nodes with Node.make")

    @classmethod
    def make(cls, op: Op, args: Iterable[Node] = (), arg: object = None, axes: tuple[str, ...] | None = None,
             dtype: str | None = None, loc: Loc | None = None) -> Node:
        args = tuple(args)
        if op in LEAVES:
            if axes is None:
                raise AxisError(f"leaf {op.name} needs its axes")
            axes = tuple(axes)
            dtype = dtype or FLOAT
        else:
            axes, dtype = _infer(op, args, arg)
        if op is Op.CONST:
            arg = float(arg)
        key = (op, args, _key_arg(op, arg), axes, dtype)
        hit = cls._interned.get(key)
        if hit is not None:
            return hit
        node = object.__new__(cls)
        node.op, node.args, node.arg, node.axes, node.dtype, node.loc = op, args, arg, axes, dtype, loc
        cls._interned[key] = node
        return node

    def __repr__(self) -> str:
        arg = "" if self.arg is None else f" {self.arg!r}"
        return f"<{self.op.name}{arg} {format_axes(self.axes)}>"

    # -- convenience used by passes --------------------------------------------------------
    def replace(self, args: Iterable[Node]) -> Node:
        """The same op and arg over new arguments (the result is interned too)."""
        args = tuple(args)
        if args == self.args:
            return self
        return Node.make(self.op, args, self.arg, self.axes if self.op in LEAVES else None, self.dtype, self.loc)


def _key_arg(op: Op, arg: object) -> object:
    """`arg` as an intern key: constants by their exact float text, so that 0.0 and -0.0 (equal,
    with one hash) stay two nodes and a NaN constant (unequal to itself) is still one node."""
    return repr(arg) if op is Op.CONST else arg


def _union(axes_list: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    out: list[str] = []
    for axes in axes_list:
        out.extend(a for a in axes if a not in out)
    return tuple(out)


def _infer(op: Op, args: tuple[Node, ...], arg: object) -> tuple[tuple[str, ...], str]:
    """Axes and dtype of a non-leaf node; raises AxisError on an impossible combination."""
    if op in ELEMENTWISE:
        if op is Op.WHERE:
            if len(args) != 3:
                raise AxisError("where takes (condition, if_true, if_false)")
        elif len(args) != (2 if op in BINARY else 1):
            raise AxisError(f"{op.value} takes {2 if op in BINARY else 1} arguments")
        return _union(a.axes for a in args), BOOL if op in BOOL_RESULT else FLOAT
    if op is Op.GATHER:
        return _gather(args, arg)
    (x,) = args
    if op in REDUCTIONS:
        if arg not in x.axes:
            raise AxisError(f"cannot reduce over axis {arg!r}: the operand has axes {format_axes(x.axes)}")
        return tuple(a for a in x.axes if a != arg), FLOAT
    if op is Op.RENAME:
        mapping = dict(arg)
        for old in mapping:
            if old not in x.axes:
                raise AxisError(f"cannot rename axis {old!r}: the operand has axes {format_axes(x.axes)}")
        new = tuple(mapping.get(a, a) for a in x.axes)
        if len(set(new)) != len(new):
            raise AxisError(f"renaming {format_axes(x.axes)} by {mapping} gives a repeated axis")
        return new, x.dtype
    if op is Op.SELECT:
        axis, _ = arg
        if axis not in x.axes:
            raise AxisError(f"cannot take along axis {axis!r}: the operand has axes {format_axes(x.axes)}")
        return tuple(a for a in x.axes if a != axis), x.dtype
    if op is Op.SLICE:
        axis, new_axis, _, _ = arg
        if axis not in x.axes:
            raise AxisError(f"cannot split axis {axis!r}: the operand has axes {format_axes(x.axes)}")
        if new_axis != axis and new_axis in x.axes:
            raise AxisError(f"splitting {axis!r} into {new_axis!r}: the operand already has axis {new_axis!r}")
        return tuple(new_axis if a == axis else a for a in x.axes), x.dtype
    if op is Op.PAD:
        axis, new_axis, _, _ = arg
        if new_axis not in x.axes:
            raise AxisError(f"pad: operand lacks axis {new_axis!r}")
        return tuple(axis if a == new_axis else a for a in x.axes), x.dtype
    if op is Op.EXPAND:  # the named axes in their order, then any others of the operand
        return _union([tuple(arg), x.axes]), x.dtype
    raise AxisError(f"unknown op {op}")


def _gather(args: tuple[Node, ...], axis: object) -> tuple[tuple[str, ...], str]:
    if len(args) != 2:
        raise AxisError("gather takes (source, index)")
    source, index = args
    if axis not in source.axes:
        raise AxisError(f"cannot index along axis {axis!r}: the operand has axes {format_axes(source.axes)}")
    if index.axes:
        raise AxisError(f"the index has axes {format_axes(index.axes)}: an index is one position per (query, key) "
                        "(an expression of q_idx and kv_idx, no axes)")
    return tuple(a for a in source.axes if a != axis), source.dtype


# -- graph helpers ----------------------------------------------------------------------------

def toposort(roots: Iterable[Node]) -> list[Node]:
    """Every node reachable from `roots`, each after its arguments (iterative: specs can be deep)."""
    order: list[Node] = []
    seen: set[int] = set()
    for root in roots:
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((a, False) for a in reversed(node.args) if id(a) not in seen)
    return order


def leaves(roots: Iterable[Node]) -> Iterator[Node]:
    return (n for n in toposort(roots) if n.op in LEAVES)


def input_names(roots: Iterable[Node]) -> set[str]:
    return {n.arg for n in leaves(roots) if n.op is Op.INPUT}


def depending_on(nodes: Iterable[Node], names: set[str]) -> set[Node]:
    """The nodes of `nodes` (in topological order) that depend on an input named in `names`."""
    out: set[Node] = set()
    for n in nodes:
        if (n.op is Op.INPUT and n.arg in names) or any(a in out for a in n.args):
            out.add(n)
    return out


def substitute(roots: tuple[Node, ...], mapping: dict[Node, Node],
               rewrite: Callable[[Node], Node] | None = None) -> tuple[Node, ...]:
    """Rebuild `roots` with nodes replaced per `mapping` (then `rewrite` applied bottom-up)."""
    memo: dict[Node, Node] = {}
    for node in toposort(roots):
        if node in mapping:
            new = mapping[node]
        else:
            new = node.replace(memo[a] for a in node.args)
            if rewrite is not None:
                new = rewrite(new)
        memo[node] = new
    return tuple(memo[r] for r in roots)
