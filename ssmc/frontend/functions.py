"""The spec language's functions: ``ssmc.exp(x)``, ``ssmc.dot(x, W, over="i")``, ...

Each is a pointwise function of its (broadcast) arguments unless it names axes.
"""

from __future__ import annotations

from ..errors import SpecError, user_loc
from ..ir.ops import Op
from .tensor import Tensor, _axes_arg, as_tensor, make


def _unary(op: Op, doc: str):
    def fn(x) -> Tensor:
        return make(op, (as_tensor(x),))
    fn.__name__ = op.value
    fn.__doc__ = doc
    return fn


exp = _unary(Op.EXP, "e ** x")
log = _unary(Op.LOG, "natural logarithm")
sqrt = _unary(Op.SQRT, "square root")
rsqrt = _unary(Op.RSQRT, "1 / sqrt(x)")
abs = _unary(Op.ABS, "|x|")  # shadows the builtin: the spec language's name
sigmoid = _unary(Op.SIGMOID, "1 / (1 + exp(-x))")
tanh = _unary(Op.TANH, "hyperbolic tangent")
softplus = _unary(Op.SOFTPLUS, "log(1 + exp(x)), computed stably")
silu = _unary(Op.SILU, "x * sigmoid(x)")
gelu = _unary(Op.GELU, "x * Phi(x) with Phi the standard normal CDF (exact, erf-based)")
relu = _unary(Op.RELU, "max(x, 0)")
erf = _unary(Op.ERF, "the error function")


def maximum(a, b) -> Tensor:
    """Pointwise max; at ties the gradient is split evenly (as in PyTorch)."""
    return make(Op.MAX, (as_tensor(a), as_tensor(b)))


def minimum(a, b) -> Tensor:
    """Pointwise min; at ties the gradient is split evenly (as in PyTorch)."""
    return make(Op.MIN, (as_tensor(a), as_tensor(b)))


def where(cond, if_true, if_false) -> Tensor:
    """``if_true`` where ``cond`` holds, else ``if_false`` (pointwise)."""
    return make(Op.WHERE, (as_tensor(cond), as_tensor(if_true), as_tensor(if_false)))


def dot(x, y, over) -> Tensor:
    """Contract x and y over the named axes: ``sum(x * y, over)``."""
    x, y = as_tensor(x), as_tensor(y)
    names = _axes_arg(over)
    for a in names:
        if a not in x.axes or a not in y.axes:
            side = "first" if a not in x.axes else "second"
            raise SpecError(f"dot over axis {a!r}: the {side} operand lacks it "
                            f"(axes {list(x.axes)} and {list(y.axes)})", user_loc(2))
    return (x * y).sum(names)


def sum(x, axes=None) -> Tensor:
    return as_tensor(x).sum(axes)


def mean(x, axes=None) -> Tensor:
    return as_tensor(x).mean(axes)


def max(x, axes=None) -> Tensor:
    return as_tensor(x).max(axes)
