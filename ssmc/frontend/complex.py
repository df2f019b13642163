"""Complex values in a spec, traced as pairs of real values.

    @ssmc.recurrence
    def lru(h: ssmc.State["b n", complex], x: ssmc.Seq["b n"], nu: ssmc.Param["n"], theta: ssmc.Param["n"]):
        lam = ssmc.exp(ssmc.complex(-ssmc.exp(nu), ssmc.exp(theta)))
        h = lam * h + x
        return h, h.real

A complex value is a `ComplexTensor`: two real `Tensor`s (re, im). Every complex operation is
written out in real operations as the step is traced, so the IR, autodiff, the interpreter and every
backend see real programs only: a complex state ``h`` is the two real states ``h_re`` and ``h_im``,
a complex input the two real inputs ``x_re`` and ``x_im``, a complex output ``y`` the real outputs
``y_re`` and ``y_im`` (`ComplexSignature` keeps the pairing; api.py and torch.py join them again at
the call). A complex diagonal recurrence becomes two real states whose updates are the parts of a
complex product; classification (passes/classify.py) pairs them up again as a complex diagonal
recurrence, which the scans combine with complex products.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from ..errors import SpecError, user_loc
from ..ir.ops import Op
from . import tensor
from .tensor import Tensor, _axes_arg, as_tensor, make

RE, IM = "_re", "_im"  # suffixes of the real inputs, states and outputs a complex one becomes


def part_names(name: str) -> tuple[str, str]:
    """The names of the real pair a complex input, state or output `name` becomes."""
    return name + RE, name + IM


def is_complex(value) -> bool:
    """Whether `value` is complex in the spec language: a `ComplexTensor` or a complex number."""
    return isinstance(value, ComplexTensor) or (
        isinstance(value, (numbers.Complex, np.complexfloating)) and not isinstance(value, numbers.Real))


def _split(value) -> tuple[Tensor, Tensor | None]:
    """(re, im) of a spec value; im None for a real one (so a real operand costs no extra ops)."""
    if isinstance(value, ComplexTensor):
        return value.re, value.im
    if is_complex(value):
        value = complex(value)
        return as_tensor(value.real), (as_tensor(value.imag) if value.imag else None)
    return as_tensor(value), None


def promote(value) -> ComplexTensor:
    """`value` as a complex tensor (a real one with zero imaginary part)."""
    if isinstance(value, ComplexTensor):
        return value
    re, im = _split(value)
    return ComplexTensor(re, im if im is not None else as_tensor(0.0))


tensor.promote_complex = promote  # what Tensor's operators call for a complex operand


def _add(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def _sub(a, b):
    if b is None:
        return a
    return -b if a is None else a - b


def _mul(a, b):
    return None if a is None or b is None else a * b


class ComplexTensor:
    """A complex value in a spec being traced: real part `re` and imaginary part `im` (`Tensor`s)."""

    __slots__ = ("im", "re")
    __array_priority__ = 1001  # above Tensor's: NumPy scalars defer to our operators
    _is_complex_tensor = True  # what tensor.as_tensor checks (it cannot import this module)

    def __init__(self, re: Tensor, im: Tensor):
        self.re, self.im = re, im

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes of either part, the real part's first."""
        return self.re.axes + tuple(a for a in self.im.axes if a not in self.re.axes)

    def __repr__(self) -> str:
        return f"ssmc.ComplexTensor(axes={' '.join(self.axes) or '()'})"

    @property
    def real(self) -> Tensor:
        return self.re

    @property
    def imag(self) -> Tensor:
        return self.im

    def conj(self) -> ComplexTensor:
        """The complex conjugate: re - i im."""
        return ComplexTensor(self.re, -self.im)

    # -- arithmetic: (a + ib) op (c + id), written out in real operations ------------------------
    def __add__(self, o):
        c, d = _split(o)
        return ComplexTensor(self.re + c, _add(self.im, d))

    def __radd__(self, o):
        c, d = _split(o)
        return ComplexTensor(c + self.re, _add(d, self.im))

    def __sub__(self, o):
        c, d = _split(o)
        return ComplexTensor(self.re - c, _sub(self.im, d))

    def __rsub__(self, o):
        c, d = _split(o)
        return ComplexTensor(c - self.re, _sub(d, self.im))

    def __mul__(self, o):
        c, d = _split(o)
        a, b = self.re, self.im
        if d is None:
            return ComplexTensor(a * c, b * c)
        return ComplexTensor(a * c - b * d, a * d + b * c)

    __rmul__ = __mul__  # the product commutes

    def __truediv__(self, o):
        c, d = _split(o)
        a, b = self.re, self.im
        if d is None:
            return ComplexTensor(a / c, b / c)
        den = c * c + d * d
        return ComplexTensor((a * c + b * d) / den, (b * c - a * d) / den)

    def __rtruediv__(self, o):
        return promote(o) / self

    def __neg__(self):
        return ComplexTensor(-self.re, -self.im)

    def __pos__(self):
        return self

    def __abs__(self) -> Tensor:
        return abs_(self)

    def __pow__(self, exponent):
        """Integer powers only (repeated products): ``z ** 2``, ``z ** -1``."""
        if isinstance(exponent, bool) or not isinstance(exponent, numbers.Integral):
            raise SpecError(f"a complex value to the power {exponent!r}: only integer powers are supported "
                            "(write exp(w * log(z)) for others)", user_loc(2))
        n, result, base = abs(int(exponent)), None, self
        while n:
            if n & 1:
                result = base if result is None else result * base
            n >>= 1
            if n:
                base = base * base
        if result is None:
            return promote(1.0)
        return result if exponent > 0 else 1.0 / result

    # -- what a complex value cannot do -------------------------------------------------------
    def _no_order(self, *_):
        raise SpecError("comparing a complex value: complex numbers have no order, and == on traced values "
                        "builds a mask; compare z.real, z.imag or abs(z)", user_loc(2))

    __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _no_order  # type: ignore[assignment]
    __hash__ = object.__hash__

    def __bool__(self):
        raise SpecError("Python control flow on a complex tensor value: the step is traced once, not run "
                        "per element", user_loc(2))

    def _no_scalar(self, *_):
        raise SpecError("converting a complex tensor to a Python number: values exist only when it runs",
                        user_loc(2))

    __float__ = __int__ = __index__ = __complex__ = _no_scalar

    def __array__(self, *_, **__):
        raise SpecError("NumPy on an ssmc complex tensor: use ssmc's ops (ssmc.exp, abs, z.conj(), ...)",
                        user_loc(2))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        raise SpecError(f"NumPy function {ufunc.__name__} on an ssmc complex tensor: use ssmc's ops "
                        "(ssmc.exp, abs, z.conj(), ...)", user_loc(2))

    def __iter__(self):
        raise SpecError("iterating over a tensor: use z.unbind('axis')", user_loc(2))

    # -- axes: each part alike -------------------------------------------------------------------
    def _each(self, method: str, *args) -> ComplexTensor:
        return ComplexTensor(getattr(self.re, method)(*args), getattr(self.im, method)(*args))

    def sum(self, axes=None) -> ComplexTensor:
        """Sum over the named axes (all axes when None); a part without an axis is scaled by its size."""
        names = self.axes if axes is None else _axes_arg(axes)
        return ComplexTensor(*(_sum_over(p, names) for p in (self.re, self.im)))

    def mean(self, axes=None) -> ComplexTensor:
        names = self.axes if axes is None else _axes_arg(axes)
        total = self.sum(names)
        for a in names:
            total = total / make(Op.SIZE, (), a, ())
        return total

    def shift(self, k: int = 1) -> ComplexTensor:
        """This value `k` steps earlier (`Tensor.shift`), each part alike."""
        return self._each("shift", k)

    def rename(self, mapping: dict[str, str] | None = None, **kw: str) -> ComplexTensor:
        pairs = {**(mapping or {}), **kw}
        return ComplexTensor(*(p.rename({a: b for a, b in pairs.items() if a in p.axes}) for p in (self.re, self.im)))

    def broadcast(self, axes) -> ComplexTensor:
        return self._each("broadcast", axes)

    def unbind(self, axis: str) -> tuple[ComplexTensor, ...]:
        full = self.aligned()
        return tuple(ComplexTensor(r, i) for r, i in zip(full.re.unbind(axis), full.im.unbind(axis)))

    def split(self, axis: str, into) -> tuple[ComplexTensor, ...]:
        full = self.aligned()
        return tuple(ComplexTensor(r, i) for r, i in zip(full.re.split(axis, into), full.im.split(axis, into)))

    def aligned(self) -> ComplexTensor:
        """Both parts over the same axes in the same order (``complex(x, 0.0)`` has an imaginary part of
        no axes; a product's parts may order theirs differently): one complex array."""
        axes = self.axes
        return ComplexTensor(*(p if p.axes == axes else p.broadcast(axes) for p in (self.re, self.im)))


def _sum_over(part: Tensor, names) -> Tensor:
    for a in names:
        part = part.sum(a) if a in part.axes else part * make(Op.SIZE, (), a, ())
    return part


# -- the functions (ssmc.complex, ssmc.exp of a complex value, ...) -------------------------------

def complex_(re, im=0.0) -> ComplexTensor:
    """``re + i im`` from real values (tensors or numbers)."""
    for name, part in (("re", re), ("im", im)):
        if is_complex(part):
            raise SpecError(f"ssmc.complex(re, im): {name} is complex; both parts must be real", user_loc(2))
    return ComplexTensor(as_tensor(re), as_tensor(im))


def real(z) -> Tensor:
    """The real part (a real value is its own real part)."""
    return _split(z)[0]


def imag(z) -> Tensor:
    """The imaginary part (0 for a real value)."""
    im = _split(z)[1]
    return im if im is not None else as_tensor(0.0)


def conj(z):
    """The complex conjugate (a real value is its own)."""
    return promote(z).conj() if is_complex(z) else as_tensor(z)


def abs_(z: ComplexTensor) -> Tensor:
    """|z| = sqrt(re**2 + im**2), with gradient 0 at z = 0 (as torch's): sqrt's derivative is infinite
    at 0, so it is taken of a value kept away from 0 there (the `where` picks 0 back)."""
    sq = z.re * z.re + z.im * z.im
    zero = sq == 0.0
    return make(Op.WHERE, (zero, as_tensor(0.0), make(Op.SQRT, (make(Op.WHERE, (zero, as_tensor(1.0), sq)),))))


def exp(z: ComplexTensor) -> ComplexTensor:
    """e ** z = e ** re (cos im + i sin im)."""
    r = make(Op.EXP, (z.re,))
    return ComplexTensor(r * make(Op.COS, (z.im,)), r * make(Op.SIN, (z.im,)))


def log(z: ComplexTensor) -> ComplexTensor:
    """The principal logarithm: log|z| + i atan2(im, re) (imaginary part in (-pi, pi])."""
    sq = z.re * z.re + z.im * z.im
    return ComplexTensor(0.5 * make(Op.LOG, (sq,)), make(Op.ATAN2, (z.im, z.re)))


def angle(z) -> Tensor:
    """The argument atan2(im, re), in (-pi, pi]."""
    re, im = _split(z)
    return make(Op.ATAN2, (im if im is not None else as_tensor(0.0), re))


def where(cond, if_true, if_false) -> ComplexTensor:
    a, b = promote(if_true), promote(if_false)
    cond = as_tensor(cond)
    return ComplexTensor(make(Op.WHERE, (cond, a.re, b.re)), make(Op.WHERE, (cond, a.im, b.im)))


def binary(op: str, a, b):
    """``a op b`` where `a` is real and `b` complex (what Tensor's operators hand over)."""
    return getattr(promote(a), op)(b)


def real_required(value, what: str):
    """The SpecError for a complex value where `what` takes real ones."""
    raise SpecError(f"{what} of a complex value: it takes real values; take z.real, z.imag or abs(z) first",
                    user_loc(3))


# -- the signature: which real inputs, states and outputs pair up ----------------------------------

@dataclass(frozen=True)
class ComplexSignature:
    """A spec's inputs, states and outputs as the user wrote them, each with the names of its real
    pair when complex (None when real). The IR program has the pairs; api.py / torch.py use this to
    split complex arguments and join complex results."""

    name: str
    inputs: tuple[tuple[str, tuple[str, str] | None], ...]   # sequences and params, signature order
    states: tuple[tuple[str, tuple[str, str] | None], ...]   # declared states, then the shift registers
    outputs: tuple[tuple[str, tuple[str, str] | None], ...]

    @property
    def any_complex(self) -> bool:
        return any(parts for group in (self.inputs, self.states, self.outputs) for _, parts in group)

    def parts(self) -> dict[str, tuple[str, str]]:
        """User name -> its real pair, for every complex input, state and output."""
        return {n: p for group in (self.inputs, self.states, self.outputs) for n, p in group if p}
