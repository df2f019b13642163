"""The spec language's functions: ``ssmc.exp(x)``, ``ssmc.dot(x, W, over="i")``, ...

Each is a pointwise function of its (broadcast) arguments unless it names axes.
"""

from __future__ import annotations

import numbers

from ..errors import SpecError, user_loc
from ..ir.ops import Op
from . import complex as cx
from .tensor import Tensor, _axes_arg, _static_sizes, as_tensor, make


def _unary(op: Op, doc: str, of_complex=None):
    """``ssmc.<op>(x)``; `of_complex`, where given, computes it of a complex value (frontend/complex.py),
    else a complex value is a SpecError naming the function."""
    def fn(x) -> Tensor:
        if cx.is_complex(x):
            if of_complex is None:
                cx.real_required(x, f"ssmc.{op.value}")
            return of_complex(cx.promote(x))
        return make(op, (as_tensor(x),))
    fn.__name__ = op.value
    fn.__doc__ = doc
    return fn


exp = _unary(Op.EXP, "e ** x (of a complex z: e ** re (cos im + i sin im))", cx.exp)
log = _unary(Op.LOG, "natural logarithm (of a complex z: the principal one, log|z| + i atan2(im, re))", cx.log)
sqrt = _unary(Op.SQRT, "square root")
rsqrt = _unary(Op.RSQRT, "1 / sqrt(x)")
abs = _unary(Op.ABS, "|x| (of a complex z: sqrt(re**2 + im**2), gradient 0 at 0 as torch's)",
             cx.abs_)  # shadows the builtin: the spec language's name
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


complex = cx.complex_  # the spec language's name: ssmc.complex(re, im)
real, imag, conj, angle = cx.real, cx.imag, cx.conj, cx.angle


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
    """``if_true`` where ``cond`` holds, else ``if_false`` (pointwise; the branches may be complex)."""
    if cx.is_complex(if_true) or cx.is_complex(if_false):
        return cx.where(cond, if_true, if_false)
    return make(Op.WHERE, (as_tensor(cond), as_tensor(if_true), as_tensor(if_false)))


def dot(x, y, over) -> Tensor:
    """Contract x and y over the named axes: ``sum(x * y, over)`` (no conjugation of complex values)."""
    x, y = (cx.promote(v) if cx.is_complex(v) else as_tensor(v) for v in (x, y))
    names = _axes_arg(over)
    for a in names:
        if a not in x.axes or a not in y.axes:
            side = "first" if a not in x.axes else "second"
            raise SpecError(f"dot over axis {a!r}: the {side} operand lacks it "
                            f"(axes {list(x.axes)} and {list(y.axes)})", user_loc(2))
    return (x * y).sum(names)


def causal_conv(x, w, width: int | None = None) -> Tensor:
    """Depthwise causal convolution over time (torch's ``conv1d(x, w, groups=channels,
    padding=width - 1)`` cut to the first L outputs, as Mamba's conv1d).

    `w` has the channel axes of `x` it varies over (``[d]``) and one axis of its own, the taps, whose
    size is static and is the width (``w: ssmc.Param["d w=4"]``). As a plain loop over the steps:
        y[t, d] = sum_{j < width} w[d, j] * x[t - (width - 1) + j, d]     (x before step 0 is 0)
    that is ``sum_j w[.., j] * x.shift(width - 1 - j)``: the last tap multiplies the current step.
    `width`, when given, must equal the taps axis' size.
    """
    x, w = as_tensor(x), as_tensor(w)
    loc = user_loc(2)
    taps = [a for a in w.axes if a not in x.axes]
    if len(taps) != 1:
        raise SpecError(f"causal_conv: the weight needs exactly one axis the value lacks, its taps "
                        f"(weight axes {list(w.axes)}, value axes {list(x.axes)})", loc)
    (tap,) = taps
    size = (_static_sizes.get() or {}).get(tap)
    if size is None:
        raise SpecError(f"causal_conv: the taps axis {tap!r} needs a static size, the width: declare it "
                        f"as '{tap}=N' in the weight's axes", loc)
    if width is not None and (isinstance(width, bool) or not isinstance(width, numbers.Integral)):
        raise SpecError(f"causal_conv: width must be an integer, not {width!r}", loc)
    if width is not None and width < 1:
        raise SpecError(f"causal_conv: width {width} < 1 (a convolution has at least one tap)", loc)
    if width is not None and width != size:
        raise SpecError(f"causal_conv: width {width} but the taps axis {tap!r} has size {size}", loc)
    out = None
    for j in range(size):
        term = x.shift(size - 1 - j) * make(Op.SELECT, (w,), (tap, j))
        out = term if out is None else out + term
    return out


def sum(x, axes=None) -> Tensor:
    return (cx.promote(x) if cx.is_complex(x) else as_tensor(x)).sum(axes)


def mean(x, axes=None) -> Tensor:
    return (cx.promote(x) if cx.is_complex(x) else as_tensor(x)).mean(axes)


def max(x, axes=None) -> Tensor:
    return as_tensor(x).max(axes)


# -- layer functions: norms and softmax over named feature axes ------------------------------------
# Written with the ops above, so autodiff, the interpreter and every backend see plain IR: a
# statistic over several axes is a chain of one-axis reductions (``x.mean("g k")`` sums over g,
# then over k). The fusion stage (lowering/stages.py) recognises a reduction over feature axes and
# gives it its own row kernel when the recurrences run along those axes.


def _feature_axes(x: Tensor, over, fn: str) -> tuple[str, ...]:
    """The axes `over` names, each once and each an axis of `x`."""
    names = _axes_arg(over)
    if not names or not all(isinstance(a, str) for a in names):
        raise SpecError(f"{fn} needs the axes to normalise over as a string of names (over=\"d\" or "
                        f"over=\"g k\"), got {over!r}", user_loc(3))
    if len(set(names)) != len(names):
        raise SpecError(f"{fn} over {over!r}: an axis is named twice", user_loc(3))
    for a in names:
        if a not in x.axes:
            raise SpecError(f"{fn} over axis {a!r}: the value has axes {list(x.axes)}", user_loc(3))
    return names


def _scale_axes(param, axes: tuple[str, ...], what: str, fn: str) -> None:
    if param is None:
        return
    got = as_tensor(param).axes
    if not got or any(a not in axes for a in got):
        which = f"axis [{axes[0]}]" if len(axes) == 1 else f"axes [{' '.join(axes)}] (all or some of them)"
        raise SpecError(f"{fn}: {what} must be a param over the normalised {which}, got axes {list(got)}",
                        user_loc(3))


def rmsnorm(x, over, weight=None, eps: float = 1e-6) -> Tensor:
    """RMSNorm over the feature axes `over` (one or several): ``x / sqrt(mean(x**2, over) + eps) * weight``.

    As a plain loop, for every index r of x's other axes, i running over every index of the axes
    `over` together (n of them):
        rstd = 1 / sqrt(sum_i x[r, i]**2 / n + eps);   y[r, i] = x[r, i] * rstd * weight[i]
    `weight` (optional) is a param over the axes `over` (or some of them: it broadcasts along the rest).
    """
    x = as_tensor(x)
    axes = _feature_axes(x, over, "rmsnorm")
    _scale_axes(weight, axes, "weight", "rmsnorm")
    y = x * rsqrt((x * x).mean(axes) + float(eps))
    return y if weight is None else y * weight


def layernorm(x, over, weight=None, bias=None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the feature axes `over` (one or several, as torch's normalized_shape):
    ``(x - mean) / sqrt(var + eps) * weight + bias``.

    As a plain loop, for every index r of x's other axes, i running over every index of the axes
    `over` together (n of them; biased variance, as torch):
        mu = sum_i x[r, i] / n;   var = sum_i (x[r, i] - mu)**2 / n
        y[r, i] = (x[r, i] - mu) / sqrt(var + eps) * weight[i] + bias[i]
    `weight` and `bias` (optional) are params over the axes `over` (or some of them).
    """
    x = as_tensor(x)
    axes = _feature_axes(x, over, "layernorm")
    _scale_axes(weight, axes, "weight", "layernorm")
    _scale_axes(bias, axes, "bias", "layernorm")
    centred = x - x.mean(axes)
    y = centred * rsqrt((centred * centred).mean(axes) + float(eps))
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


def softmax(x, over) -> Tensor:
    """Softmax over the axes `over` (one or several), computed stably (the maximum subtracted first).

    As a plain loop, for every index r of x's other axes, i and j running over every index of the
    axes `over` together:
        m = max_j x[r, j];   y[r, i] = exp(x[r, i] - m) / sum_j exp(x[r, j] - m)
    """
    x = as_tensor(x)
    axes = _feature_axes(x, over, "softmax")
    e = exp(x - x.max(axes))
    return e / e.sum(axes)
