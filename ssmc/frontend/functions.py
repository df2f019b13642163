"""The spec language's functions: ``ssmc.exp(x)``, ``ssmc.dot(x, W, over="i")``, ...

Each is a pointwise function of its (broadcast) arguments unless it names axes.
"""

from __future__ import annotations

import numbers

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
sin = _unary(Op.SIN, "sine (radians)")
cos = _unary(Op.COS, "cosine (radians)")
tan = _unary(Op.TAN, "tangent (radians)")
log1p = _unary(Op.LOG1P, "log(1 + x), accurate for small x")
expm1 = _unary(Op.EXPM1, "exp(x) - 1, accurate for small x")
sign = _unary(Op.SIGN, "-1, 0 or 1 by the sign of x (NaN for NaN); its gradient is zero")


def atan2(y, x) -> Tensor:
    """The angle of the point (x, y) in (-pi, pi], by the signs of both (as ``np.arctan2(y, x)``)."""
    return make(Op.ATAN2, (as_tensor(y), as_tensor(x)))


def clamp(x, lo, hi) -> Tensor:
    """``x`` limited to ``[lo, hi]`` (``lo``, ``hi`` numbers, ``lo <= hi``); the gradient is 1 where
    ``lo <= x <= hi`` and 0 outside, as torch.clamp's. Written as ``where``, so NaN passes through."""
    for name, bound in (("lo", lo), ("hi", hi)):
        if isinstance(bound, bool) or not isinstance(bound, numbers.Real) or bound != bound:
            raise SpecError(f"clamp's {name} must be a real number, not {type(bound).__name__} "
                            f"{bound!r}", user_loc(2))
    if lo > hi:
        raise SpecError(f"clamp with lo = {lo!r} above hi = {hi!r}", user_loc(2))
    x = as_tensor(x)
    return where(x < lo, float(lo), where(x > hi, float(hi), x))


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


# -- layer functions: norms over a named feature axis --------------------------------------------
# Written with the ops above, so autodiff, the interpreter and every backend see plain IR; the
# fusion stage (lowering/stages.py) recognises the reduction over a feature axis and gives it
# its own row kernel when the recurrences run along that axis.


def _feature_axis(x: Tensor, over, fn: str) -> str:
    names = _axes_arg(over)
    if len(names) != 1:
        raise SpecError(f"{fn} normalises over one named axis, got {over!r}", user_loc(3))
    if names[0] not in x.axes:
        raise SpecError(f"{fn} over axis {names[0]!r}: the value has axes {list(x.axes)}", user_loc(3))
    return names[0]


def _scale_axes(param, axis: str, what: str, fn: str) -> None:
    if param is not None and tuple(as_tensor(param).axes) != (axis,):
        raise SpecError(f"{fn}: {what} must be a param over the normalised axis [{axis}], "
                        f"got axes {list(as_tensor(param).axes)}", user_loc(3))


def rmsnorm(x, over, weight=None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the feature axis `over`: ``x / sqrt(mean(x**2, over) + eps) * weight``.

    As a plain loop, for every index r of x's other axes:
        rstd = 1 / sqrt(sum_i x[r, i]**2 / n + eps);   y[r, i] = x[r, i] * rstd * weight[i]
    `weight` (optional) is a param with the one axis `over`.
    """
    x = as_tensor(x)
    axis = _feature_axis(x, over, "rmsnorm")
    _scale_axes(weight, axis, "weight", "rmsnorm")
    y = x * rsqrt((x * x).mean(axis) + float(eps))
    return y if weight is None else y * weight


def layernorm(x, over, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the feature axis `over`: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    As a plain loop, for every index r of x's other axes (biased variance, as torch):
        mu = sum_i x[r, i] / n;   var = sum_i (x[r, i] - mu)**2 / n
        y[r, i] = (x[r, i] - mu) / sqrt(var + eps) * weight[i] + bias[i]
    """
    x = as_tensor(x)
    axis = _feature_axis(x, over, "layernorm")
    _scale_axes(weight, axis, "weight", "layernorm")
    _scale_axes(bias, axis, "bias", "layernorm")
    centred = x - x.mean(axis)
    y = centred * rsqrt((centred * centred).mean(axis) + float(eps))
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias
