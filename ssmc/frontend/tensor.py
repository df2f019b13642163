"""The spec language's tensors: named-axis values that record IR nodes as a step is traced.

Arithmetic broadcasts by axis name (``h * A`` with h ``[b d n]`` and A ``[d n]`` is ``[b d n]``);
reductions and contractions name their axes (``x.sum("n")``, ``ssmc.dot(x, W, over="i")``).
Every operation records the user's line, so errors can point at it.
"""

from __future__ import annotations

import contextvars
import numbers

import numpy as np

from ..errors import Loc, SpecError, user_loc
from ..ir.axes import TIME, format_axes
from ..ir.node import FLOAT, AxisError, Node
from ..ir.ops import Op
from . import shifts

# Static axis sizes of the spec being traced ("g=4"), for unbind.
_static_sizes: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("ssmc_static_sizes",
                                                                                   default=None)

# Where each node was built in the spec being traced. Nodes are interned, so `Node.loc` is the
# line of the first build anywhere (maybe another spec); errors about this spec use this map.
_trace_locs: contextvars.ContextVar[dict[Node, Loc] | None] = contextvars.ContextVar("ssmc_trace_locs",
                                                                                     default=None)


def _record(node: Node, loc: Loc | None) -> Node:
    locs = _trace_locs.get()
    if locs is not None and loc is not None:
        locs.setdefault(node, loc)
    return node


def make(op: Op, args=(), arg=None, axes=None, dtype=None) -> Tensor:
    """Record one node, turning axis problems into a SpecError at the user's line."""
    loc = user_loc(2)
    try:
        return Tensor(_record(Node.make(op, tuple(a.node for a in args), arg, axes, dtype, loc), loc))
    except AxisError as err:
        raise SpecError(str(err), loc) from None


def as_tensor(value) -> Tensor:
    """Tensors pass through; Python and NumPy real scalars become constants."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value[()]
    if isinstance(value, (bool, np.bool_)):
        value = float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, np.ndarray):
        loc = user_loc(2)
        return Tensor(_record(Node.make(Op.CONST, (), float(value), (), FLOAT, loc), loc))
    if _is_complex(value):
        what = f"complex constant {value!r}" if isinstance(value, numbers.Number) else "a complex value"
        raise SpecError(f"{what} where a real value is required: take z.real, z.imag or abs(z) first "
                        "(complex arithmetic, ssmc.exp, abs, sums and states take complex values)", user_loc(2))
    if isinstance(value, np.ndarray):
        raise SpecError(f"a NumPy array of shape {value.shape} inside a spec: declare it as an input "
                        "(ssmc.Param[...]) and pass it when calling", user_loc(2))
    raise SpecError(f"cannot use a value of type {type(value).__name__} in a spec "
                    "(only ssmc tensors and real numbers)", user_loc(2))


def _axes_arg(axes) -> tuple[str, ...]:
    if isinstance(axes, str):
        return tuple(axes.split())
    return tuple(axes)


def _new_axes(names, what: str) -> tuple[str, ...]:
    """Axis names a spec introduces (rename targets, split parts, broadcast axes), checked."""
    names = _axes_arg(names)
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"{what}: axis name {name!r} is not an identifier", user_loc(2))
        if name == TIME:
            raise SpecError(f"{what}: axis name 't' is reserved for the implicit time axis", user_loc(2))
    return names


def _is_complex(value) -> bool:
    """A complex tensor (frontend/complex.py, which imports this module) or a complex number."""
    return getattr(type(value), "_is_complex_tensor", False) or (
        isinstance(value, (numbers.Complex, np.complexfloating)) and not isinstance(value, numbers.Real))


def promote_complex(x):
    """`x` as a complex value: frontend/complex.py installs its `promote` here (it imports this module)."""
    raise SpecError("complex values need ssmc.frontend.complex", user_loc(2))


def _binary(op: Op, method: str, x: Tensor, other, reflected: bool = False):
    """``x <method> other``: `op` of (x, other), or (other, x) where `reflected`; with a complex
    `other`, the complex operation (frontend/complex.py, on x as a complex value)."""
    if _is_complex(other):
        return getattr(promote_complex(x), method)(other)
    other = as_tensor(other)
    return make(op, (other, x) if reflected else (x, other))


class Tensor:
    """A value in a spec being traced: an IR node plus the arithmetic of the spec language."""

    __slots__ = ("node",)
    __array_priority__ = 1000  # NumPy scalars defer to our operators

    def __init__(self, node: Node):
        self.node = node

    @property
    def axes(self) -> tuple[str, ...]:
        return self.node.axes

    def __repr__(self) -> str:
        return f"ssmc.Tensor({self.node.op.value}, axes={format_axes(self.axes)})"

    # -- arithmetic ----------------------------------------------------------------------------
    def __add__(self, o): return _binary(Op.ADD, '__add__', self, o)
    def __radd__(self, o): return _binary(Op.ADD, '__radd__', self, o, True)
    def __sub__(self, o): return _binary(Op.SUB, '__sub__', self, o)
    def __rsub__(self, o): return _binary(Op.SUB, '__rsub__', self, o, True)
    def __mul__(self, o): return _binary(Op.MUL, '__mul__', self, o)
    def __rmul__(self, o): return _binary(Op.MUL, '__rmul__', self, o, True)
    def __truediv__(self, o): return _binary(Op.DIV, '__truediv__', self, o)
    def __rtruediv__(self, o): return _binary(Op.DIV, '__rtruediv__', self, o, True)
    def __neg__(self): return make(Op.NEG, (self,))
    def __abs__(self): return make(Op.ABS, (self,))
    def __pos__(self): return self

    def __pow__(self, exponent):
        if isinstance(exponent, Tensor) or not isinstance(exponent, numbers.Real):
            raise SpecError("power by a tensor is not supported: the exponent must be a constant number "
                            "(write exp(y * log(x)) for x ** y)", user_loc(2))
        return make(Op.POW, (self, as_tensor(exponent)))

    def __rpow__(self, base):
        raise SpecError("a tensor exponent is not supported: write exp(x * log(base))", user_loc(2))

    def __lt__(self, o): return make(Op.LT, (self, as_tensor(o)))
    def __le__(self, o): return make(Op.LE, (self, as_tensor(o)))
    def __gt__(self, o): return make(Op.GT, (self, as_tensor(o)))
    def __ge__(self, o): return make(Op.GE, (self, as_tensor(o)))
    def __eq__(self, o): return make(Op.EQ, (self, as_tensor(o)))  # type: ignore[override]
    def __ne__(self, o): return make(Op.NE, (self, as_tensor(o)))  # type: ignore[override]
    __hash__ = object.__hash__

    def __and__(self, o): return make(Op.AND, (self, as_tensor(o)))
    def __rand__(self, o): return make(Op.AND, (as_tensor(o), self))
    def __or__(self, o): return make(Op.OR, (self, as_tensor(o)))
    def __ror__(self, o): return make(Op.OR, (as_tensor(o), self))
    def __invert__(self): return make(Op.NOT, (self,))

    # -- Python control flow on traced values cannot work: say so ------------------------------
    def __bool__(self):
        raise SpecError("Python control flow on a tensor value (if / while / and / or / not): "
                        "the step is traced once, not run per element; use ssmc.where(cond, a, b) "
                        "and & | ~ for logic",
                        user_loc(2))

    def __iter__(self):
        raise SpecError("iterating over a tensor: use x.unbind('axis') to take it apart along a named axis",
                        user_loc(2))

    def __len__(self):
        raise SpecError("len() of a tensor: axes are named, not counted; use x.axes", user_loc(2))

    def _no_scalar(self, *_):
        raise SpecError("converting a tensor to a Python number: the step is traced once, "
                        "values exist only when it runs", user_loc(2))

    __float__ = __int__ = __index__ = __complex__ = _no_scalar

    def __array__(self, *_, **__):
        raise SpecError("NumPy on an ssmc tensor: use ssmc's ops (ssmc.exp, ssmc.tanh, ...)", user_loc(2))

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        op = _UFUNCS.get(ufunc)
        if op is None or method != "__call__" or kwargs:
            raise SpecError(f"NumPy function {ufunc.__name__} on an ssmc tensor: use ssmc's ops "
                            "(ssmc.exp, ssmc.tanh, ...)", user_loc(2))
        if op is Op.POW and isinstance(inputs[1], Tensor):
            raise SpecError("power by a tensor is not supported", user_loc(2))
        return make(op, tuple(as_tensor(x) for x in inputs))

    # -- indexed reads (attention's modifiers) ------------------------------------------------
    def __getitem__(self, index) -> Tensor:
        """``table[i]``: the entry at position `i` along the table's last axis; ``doc[q_idx]``: a sequence
        (``ssmc.Seq`` in a modifier) at a query's or key's position. Attention modifiers only (the index an
        integer expression of q_idx and kv_idx: ir/verify.py); `take` names the axis."""
        if isinstance(index, (tuple, slice, type(Ellipsis))) or index is None:
            raise SpecError(f"tensor[{index!r}]: index with one position (an integer expression of q_idx and "
                            "kv_idx), or name the axis with x.take(axis, index)", user_loc(2))
        axis = TIME if TIME in self.axes else (self.axes[-1] if self.axes else None)
        if axis is None:
            raise SpecError("indexing a value with no axes", user_loc(2))
        return self._take(axis, index, user_loc(2))

    def take(self, axis: str, index) -> Tensor:
        """The entry at position `index` along `axis`: ``out[...] = x[..., clamp(index, 0, n - 1), ...]``, the
        index clamped into the axis (n its size; T5's bucketed distances saturate so). As a plain loop, for
        each (query i, key j) of attention: ``out = x[axis=min(max(index(i, j), 0), n - 1)]``."""
        return self._take(axis, index, user_loc(2))

    def _take(self, axis: str, index, loc) -> Tensor:
        if isinstance(index, bool) or not isinstance(index, (Tensor, numbers.Integral)):
            raise SpecError(f"index {index!r}: an index is an integer expression of q_idx and kv_idx "
                            f"(or a whole number), not a {type(index).__name__}", loc)
        if axis not in self.axes:
            raise SpecError(f"cannot index along axis {axis!r}: the tensor has axes {format_axes(self.axes)}", loc)
        index = as_tensor(int(index) if isinstance(index, numbers.Integral) else index)
        try:
            node = Node.make(Op.GATHER, (self.node, index.node), axis, loc=loc)
        except AxisError as err:
            raise SpecError(str(err), loc) from None
        return Tensor(_record(node, loc))

    # -- axes ----------------------------------------------------------------------------------
    def sum(self, axes=None) -> Tensor:
        """Sum over the named axes (all axes when None)."""
        return _reduce(self, Op.SUM, axes)

    def max(self, axes=None) -> Tensor:
        return _reduce(self, Op.REDUCE_MAX, axes)

    def mean(self, axes=None) -> Tensor:
        names = self.axes if axes is None else _axes_arg(axes)
        total = _reduce(self, Op.SUM, names)
        for a in names:
            total = total / make(Op.SIZE, (), a, ())
        return total

    def shift(self, k: int = 1) -> Tensor:
        """This value `k` steps earlier: at step t, the value it had at step t - k; 0 while t < k.

        As a plain loop over the steps: ``out[t] = x[t - k] if t >= k else 0``, where ``x[s]`` is
        this expression evaluated at step s (of the inputs and the carry of that step). The compiler
        carries the last `k` values as states of its own (frontend/shifts.py: named ``x_shift1`` ...
        ``x_shiftk`` after an input ``x``), which start at zero unless given and come back among the
        final states. `k` is an integer >= 0 (``shift(0)`` is the value itself).
        """
        loc = user_loc(2)
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise SpecError(f"shift by {k!r}: the number of steps must be an integer >= 0", loc)
        if k < 0:
            raise SpecError(f"shift by {k}: a negative shift would read a later step; steps run in order, "
                            "so only earlier values (k >= 0) can be read", loc)
        if k == 0:
            return self
        registers = shifts.current.get()
        if registers is None:
            raise SpecError("shift outside a recurrence's step: only a recurrence has earlier steps", loc)
        return Tensor(_record(registers.shifted(self.node, int(k), loc), loc))

    def rename(self, mapping: dict[str, str] | None = None, **kw: str) -> Tensor:
        """Rename axes: ``h.rename(k="j")``."""
        pairs = {**(mapping or {}), **kw}
        _new_axes(tuple(pairs.values()), "rename")
        return make(Op.RENAME, (self,), tuple(sorted(pairs.items())))

    def unbind(self, axis: str) -> tuple[Tensor, ...]:
        """Take apart along `axis`, which needs a static size (declare it as ``"g=4"``)."""
        if axis not in self.axes:
            raise SpecError(f"cannot unbind axis {axis!r}: the tensor has axes {format_axes(self.axes)}",
                            user_loc(2))
        size = (_static_sizes.get() or {}).get(axis)
        if size is None:
            raise SpecError(f"unbind needs a static size for axis {axis!r}: declare it as '{axis}=N' "
                            "in an input's axes", user_loc(2))
        return tuple(make(Op.SELECT, (self,), (axis, i)) for i in range(size))

    def split(self, axis: str, into) -> tuple[Tensor, ...]:
        """Cut `axis` into consecutive blocks, block i renamed ``into[i]`` and sized like that axis.

        ``x, z = xz.split("e", into=("d", "d"))`` needs size(e) == 2 * size(d), checked at call time.
        """
        parts = _new_axes(into, "split")
        if not parts:
            raise SpecError("split needs at least one part", user_loc(2))
        return tuple(make(Op.SLICE, (self,), (axis, new, parts, i)) for i, new in enumerate(parts))

    def broadcast(self, axes) -> Tensor:
        """Repeat along the named axes: the result has them first, in that order, then this
        tensor's other axes (naming an axis it already has is fine).

        A state's new value must have all of its state's axes, so a value that is meant to be
        the same along some of them says so: ``return y.broadcast("n"), out`` for ``h [b d n]``
        and ``y [b d]``. Every axis named must get its size from some declared input.
        """
        return make(Op.EXPAND, (self,), _new_axes(axes, "broadcast"))


def _reduce(x: Tensor, op: Op, axes) -> Tensor:
    names = x.axes if axes is None else _axes_arg(axes)
    for a in names:
        x = make(op, (x,), a)
    return x


_UFUNCS = {
    np.add: Op.ADD, np.subtract: Op.SUB, np.multiply: Op.MUL, np.true_divide: Op.DIV, np.power: Op.POW,
    np.negative: Op.NEG, np.exp: Op.EXP, np.log: Op.LOG, np.sqrt: Op.SQRT, np.abs: Op.ABS,
    np.tanh: Op.TANH, np.maximum: Op.MAX, np.minimum: Op.MIN, np.less: Op.LT, np.less_equal: Op.LE,
    np.greater: Op.GT, np.greater_equal: Op.GE, np.equal: Op.EQ, np.not_equal: Op.NE,
    np.sin: Op.SIN, np.cos: Op.COS, np.tan: Op.TAN, np.arctan2: Op.ATAN2, np.log1p: Op.LOG1P,
    np.expm1: Op.EXPM1, np.sign: Op.SIGN,
}
