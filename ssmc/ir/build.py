"""Smart constructors for passes: build IR nodes, folding literal constants on the way.

Passes (autodiff, classification) generate many products with 0 and 1; folding them here keeps
the derived programs as small as a hand-written one. Only literal CONST operands are folded.
"""

from __future__ import annotations

from .node import Node
from .ops import Op


def const(value: float) -> Node:
    return Node.make(Op.CONST, (), float(value), ())


ZERO = const(0.0)
ONE = const(1.0)


def is_const(node: Node, value: float | None = None) -> bool:
    return node.op is Op.CONST and (value is None or node.arg == value)


def _fold(op: Op, a: Node, b: Node) -> Node | None:
    if is_const(a) and is_const(b) and op in _PY:
        return const(_PY[op](a.arg, b.arg))
    return None


_PY = {Op.ADD: lambda x, y: x + y, Op.SUB: lambda x, y: x - y, Op.MUL: lambda x, y: x * y}


def add(a: Node | None, b: Node | None) -> Node | None:
    """a + b; None stands for a symbolic zero (no contribution)."""
    if a is None or is_const(a, 0.0):
        return b
    if b is None or is_const(b, 0.0):
        return a
    return _fold(Op.ADD, a, b) or Node.make(Op.ADD, (a, b))


def sub(a: Node, b: Node) -> Node:
    if is_const(b, 0.0):
        return a
    if is_const(a, 0.0):
        return neg(b)
    return _fold(Op.SUB, a, b) or Node.make(Op.SUB, (a, b))


def mul(a: Node, b: Node) -> Node:
    if is_const(a, 1.0):
        return b
    if is_const(b, 1.0):
        return a
    if is_const(a, 0.0) or is_const(b, 0.0):
        return ZERO
    if is_const(a, -1.0):
        return neg(b)
    if is_const(b, -1.0):
        return neg(a)
    return _fold(Op.MUL, a, b) or Node.make(Op.MUL, (a, b))


def div(a: Node, b: Node) -> Node:
    if is_const(b, 1.0):
        return a
    if is_const(a, 0.0):
        return ZERO
    return Node.make(Op.DIV, (a, b))


def neg(a: Node) -> Node:
    if is_const(a):
        return const(-a.arg)
    if a.op is Op.NEG:
        return a.args[0]
    return Node.make(Op.NEG, (a,))


def where(cond: Node, a: Node, b: Node) -> Node:
    if a is b:
        return a
    return Node.make(Op.WHERE, (cond, a, b))


def unary(op: Op, a: Node) -> Node:
    return Node.make(op, (a,))


def binary(op: Op, a: Node, b: Node) -> Node:
    return {Op.ADD: add, Op.SUB: sub, Op.MUL: mul, Op.DIV: div}.get(op, lambda x, y: Node.make(op, (x, y)))(a, b)


def reduce_sum(x: Node, axis: str) -> Node:
    if is_const(x, 0.0):
        return ZERO
    return Node.make(Op.SUM, (x,), axis)


def size(axis: str) -> Node:
    return Node.make(Op.SIZE, (), axis, ())


def iota(axis: str) -> Node:
    return Node.make(Op.IOTA, (), axis, (axis,))


def expand(x: Node, axes: tuple[str, ...]) -> Node:
    """Broadcast `x` to exactly `axes`, in that order (`x` must not have other axes)."""
    if x.axes == tuple(axes):
        return x
    return Node.make(Op.EXPAND, (x,), tuple(axes))


def with_axis(x: Node, axis: str) -> Node:
    """`x`, broadcast along `axis` if it lacks it."""
    return x if axis in x.axes else expand(x, (*x.axes, axis))


def sum_to(x: Node, from_axes: tuple[str, ...], to_axes: tuple[str, ...]) -> Node:
    """Transpose of broadcasting `to_axes` -> `from_axes`: sum over the axes `to_axes` lacks.

    `x` stands for a value with axes `from_axes` that is constant along the axes it lacks, so
    summing over such an axis multiplies by its size.
    """
    for a in from_axes:
        if a in to_axes:
            continue
        x = reduce_sum(x, a) if a in x.axes else mul(x, size(a))
    return x
