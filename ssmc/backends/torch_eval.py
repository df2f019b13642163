"""IR nodes evaluated as torch expressions, on any device: the score modifiers and masks of attention.

    ev = TorchEvaluator(sizes, dtype=torch.float32, device=q.device)
    (mod,) = ev.run([program.score], {"score": (s, ("b", "h", "~q", "~k")), "q_idx": ..., ...})
    ev.aligned(mod, ("b", "h", "~q", "~k"))      # a tensor with those dims (size 1 where constant)

The interpreter's evaluation (backends/interpreter.py) in torch: a value is a tensor paired with its
axis names, the node's own axes then the "loop" axes it was computed for (``~q``, ``~k``, in that
order, last; ``~t``: a recurrence's steps); elementwise ops broadcast by name. Unlike the interpreter a
value keeps size-1 dims where it is constant along an axis (an ALiBi bias ``slope[h] * (i - j)``
stays [1, h, bq, bk], not [b, h, bq, bk]); reductions over such a dim account for its size. Numbers
are in `dtype` (float32 or float64), booleans as torch bools.

`UNARY` and `BINARY` are the op table: every elementwise op of `ir/ops.py` has its torch function
here (tests/test_attention_torch.py checks that none is missing).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ir.node import Node
from ..ir.ops import Op
from .interpreter import Evaluator

LOOP_AXES = ("~q", "~k")
TIME = "~t"  # a recurrence's steps, for values computed for all of them at once (kernels/step_loop.py)

Value = tuple[torch.Tensor, tuple[str, ...]]


def _softplus(x):
    return torch.logaddexp(x, torch.zeros((), dtype=x.dtype, device=x.device))


UNARY = {
    Op.NEG: torch.neg, Op.EXP: torch.exp, Op.LOG: torch.log, Op.SQRT: torch.sqrt, Op.RSQRT: torch.rsqrt,
    Op.ABS: torch.abs, Op.SIGMOID: torch.sigmoid, Op.TANH: torch.tanh, Op.SOFTPLUS: _softplus,
    Op.SILU: F.silu, Op.GELU: F.gelu, Op.RELU: torch.relu, Op.ERF: torch.erf, Op.SIN: torch.sin,
    Op.COS: torch.cos, Op.TAN: torch.tan, Op.LOG1P: torch.log1p, Op.EXPM1: torch.expm1, Op.SIGN: torch.sign,
    Op.NOT: torch.logical_not,
}

BINARY = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.div, Op.POW: torch.pow,
    Op.MAX: torch.maximum, Op.MIN: torch.minimum, Op.LT: torch.lt, Op.LE: torch.le, Op.GT: torch.gt,
    Op.GE: torch.ge, Op.EQ: torch.eq, Op.NE: torch.ne, Op.AND: torch.logical_and, Op.OR: torch.logical_or,
    Op.ATAN2: torch.atan2,
}


def align(value: Value, target: tuple[str, ...]) -> torch.Tensor:
    """`value`'s tensor with dims ordered as `target`, size 1 where it lacks an axis (a view)."""
    t, axes = value
    present = [a for a in target if a in axes]
    if tuple(present) != axes:
        t = t.permute(*[axes.index(a) for a in present])
    if len(present) != len(target):
        t = t.reshape([t.shape[present.index(a)] if a in axes else 1 for a in target])
    return t


def _loops(values) -> tuple[str, ...]:
    found = {a for _, axes in values for a in axes}
    return tuple(a for a in (*LOOP_AXES, TIME) if a in found)


class TorchEvaluator(Evaluator):
    """Evaluates nodes given the values of INPUT leaves and the axis sizes (module docstring); `run` is
    the interpreter's, over this `eval_node`."""

    def __init__(self, sizes: dict[str, int], dtype: torch.dtype, device):
        super().__init__(sizes)
        self.dtype, self.device = dtype, device

    def _scalar(self, x: float) -> torch.Tensor:
        return torch.full((), x, dtype=self.dtype, device=self.device)

    def eval_node(self, node: Node, args: list[Value], env: dict[str, Value]) -> Value:
        op, sizes = node.op, self.sizes
        if op is Op.INPUT:
            return env[node.arg]
        if op is Op.CONST:
            return self._scalar(node.arg), ()
        if op is Op.IOTA:
            return torch.arange(sizes[node.arg], dtype=self.dtype, device=self.device), node.axes
        if op is Op.SIZE:
            return self._scalar(float(sizes[node.arg])), ()
        if op in UNARY or op in BINARY or op is Op.WHERE:
            axes = node.axes + _loops(args)
            xs = [align(v, axes) for v in args]
            if op in UNARY:
                return UNARY[op](xs[0]), axes
            if op in BINARY:
                return BINARY[op](*xs), axes
            return torch.where(*xs), axes
        if op is Op.GATHER:
            return _gather(node, args)
        (x,) = args
        t, axes = x
        if op is Op.SUM or op is Op.REDUCE_MAX:
            i = axes.index(node.arg)
            rest = axes[:i] + axes[i + 1:]
            if t.shape[i] == 1:  # constant along the axis
                t = t.squeeze(i)
                return (t * float(sizes[node.arg]) if op is Op.SUM else t), rest
            return (t.sum(i) if op is Op.SUM else t.amax(i)), rest
        if op is Op.RENAME:
            mapping = dict(node.arg)
            return t, tuple(mapping.get(a, a) for a in axes)
        if op is Op.SELECT:
            axis, index = node.arg
            i = axes.index(axis)
            return t.select(i, 0 if t.shape[i] == 1 else index), axes[:i] + axes[i + 1:]
        if op is Op.SLICE:
            axis, new_axis, parts, index = node.arg
            start, stop = _block(sizes, axis, parts, index)
            i = axes.index(axis)
            if t.shape[i] != 1:
                t = t.narrow(i, start, stop - start)
            return t, tuple(new_axis if a == axis else a for a in axes)
        if op is Op.PAD:
            axis, new_axis, parts, index = node.arg
            start, stop = _block(sizes, axis, parts, index)
            i = axes.index(new_axis)
            shape = list(t.shape)
            shape[i] = stop - start
            t = t.expand(shape)
            pad = [0, 0] * (t.dim() - 1 - i) + [start, sizes[axis] - stop]
            return F.pad(t, pad), tuple(axis if a == new_axis else a for a in axes)
        if op is Op.EXPAND:
            target = tuple(node.axes) + _loops([x])
            return align(x, target), target
        raise NotImplementedError(f"torch evaluation: no rule for {op}")


def _gather(node: Node, args: list[Value]) -> Value:
    """``source[..., clamp(index, 0, n - 1), ...]`` along `node.arg` (`interpreter._gather`), the index's loop
    axes last; a source constant along the axis (a size-1 dim) reads its one entry."""
    (t, axes), (index, index_axes) = args
    i = axes.index(node.arg)
    n = t.shape[i]
    pos = torch.clamp(torch.round(index), 0, n - 1).to(torch.long)
    moved = t.movedim(i, -1)  # [*other axes, n]
    return moved[..., pos], axes[:i] + axes[i + 1:] + index_axes


def _block(sizes: dict[str, int], axis: str, parts: tuple[str, ...], index: int) -> tuple[int, int]:
    """[start, stop) of block `index` when `axis` is cut into blocks sized like `parts`."""
    start = sum(sizes[p] for p in parts[:index])
    return start, start + sizes[parts[index]]


def loop_sum(value: Value, target: tuple[str, ...], counts: dict[str, int]) -> torch.Tensor:
    """`value` summed over its loop axes (``~q``, ``~k``), as a tensor with dims `target` (size 1 where
    constant): a loop axis it lacks, or has as a size-1 dim, counts `counts[axis]` times."""
    t, axes = value
    for loop in LOOP_AXES:
        if loop in axes:
            i = axes.index(loop)
            t = t.sum(i) if t.shape[i] != 1 else t.squeeze(i) * float(counts[loop])
            axes = axes[:i] + axes[i + 1:]
        else:
            t = t * float(counts[loop])
    return align((t, axes), target)
