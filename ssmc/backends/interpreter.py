"""The reference interpreter: runs any ssmc program in float64 NumPy. It is the ground truth.

Values are NumPy arrays paired with their axis names. Besides a node's own axes, a value may lead
with "loop" axes (``~t`` for time, ``~q`` / ``~k`` for attention's query / key positions) when
it was computed for every step at once; elementwise ops broadcast them like any other axis.

`run_recurrence` is the plain loop of `Recurrence`'s docstring. As an optimisation that keeps it
obviously equivalent, the nodes that depend on no state are evaluated once for all steps (with
``~t`` as an extra axis) and sliced per step; only the state-dependent nodes run inside the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import numpy as np

from ..ir.axes import TIME
from ..ir.node import Node, depending_on, toposort
from ..ir.ops import Op
from ..ir.program import Attention, Recurrence

LOOP_AXES = ("~t", "~q", "~k")  # canonical order of the loop axes a value may lead with

Value = tuple[np.ndarray, tuple[str, ...]]


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


_erf = np.vectorize(math.erf, otypes=[np.float64])

UNARY = {
    Op.NEG: np.negative,
    Op.EXP: np.exp,
    Op.LOG: np.log,
    Op.SQRT: np.sqrt,
    Op.RSQRT: lambda x: 1.0 / np.sqrt(x),
    Op.ABS: np.abs,
    Op.SIGMOID: _sigmoid,
    Op.TANH: np.tanh,
    Op.SOFTPLUS: lambda x: np.logaddexp(0.0, x),
    Op.SILU: lambda x: x * _sigmoid(x),
    Op.GELU: lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    Op.RELU: lambda x: np.maximum(x, 0.0),
    Op.ERF: _erf,
    Op.SIN: np.sin,
    Op.COS: np.cos,
    Op.TAN: np.tan,
    Op.LOG1P: np.log1p,
    Op.EXPM1: np.expm1,
    Op.SIGN: np.sign,
    Op.NOT: np.logical_not,
}

BINARY = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide, Op.POW: np.power,
    Op.MAX: np.maximum, Op.MIN: np.minimum, Op.LT: np.less, Op.LE: np.less_equal, Op.GT: np.greater,
    Op.GE: np.greater_equal, Op.EQ: np.equal, Op.NE: np.not_equal, Op.AND: np.logical_and,
    Op.OR: np.logical_or, Op.ATAN2: np.arctan2,
}


def align(value: Value, target: tuple[str, ...]) -> np.ndarray:
    """View `value` with axes ordered as `target`, size-1 axes where it lacks one (for broadcasting)."""
    arr, axes = value
    present = [a for a in target if a in axes]
    if tuple(present) != axes:
        arr = arr.transpose([axes.index(a) for a in present])
    if len(present) != len(target):
        arr = arr.reshape([arr.shape[present.index(a)] if a in axes else 1 for a in target])
    return arr


def _loop_axes(values) -> tuple[str, ...]:
    found = {a for _, axes in values for a in axes if a.startswith("~")}
    return tuple(a for a in LOOP_AXES if a in found)


def _contiguous(arr) -> np.ndarray:
    """A C-contiguous array, keeping 0-d values 0-d (np.ascontiguousarray makes them 1-d)."""
    return np.require(arr, requirements="C")


def _full(arr: np.ndarray, axes: tuple[str, ...], sizes: dict[str, int], loops: dict[str, int]) -> np.ndarray:
    shape = tuple(loops[a] if a.startswith("~") else sizes[a] for a in axes)
    return np.broadcast_to(arr, shape)


# a function called with (node, its arguments' values) before each node the interpreter evaluates: how a
# test learns what a run computes (`tests/strategies.near_ties`: whether it passes near a kink)
_OBSERVER: ContextVar[Callable | None] = ContextVar("ssmc_interpreter_observer", default=None)


@contextmanager
def observing(observe: Callable[[Node, list], None]) -> Iterator[None]:
    """Within the block, the interpreter calls ``observe(node, args)`` before evaluating each node (its
    arguments' values as (array, axes) pairs), in this thread and context alone."""
    token = _OBSERVER.set(observe)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


class Evaluator:
    """Evaluates nodes given the values of INPUT leaves, the axis sizes and the loop lengths."""

    def __init__(self, sizes: dict[str, int], loops: dict[str, int] | None = None):
        self.sizes = sizes
        self.loops = loops or {}

    def run(self, roots, env: dict[str, Value], memo: dict[Node, Value] | None = None) -> list[Value]:
        memo = {} if memo is None else memo
        for node in toposort(roots):
            if node not in memo:
                memo[node] = self.eval_node(node, [memo[a] for a in node.args], env)
        return [memo[r] for r in roots]

    def eval_node(self, node: Node, args: list[Value], env: dict[str, Value]) -> Value:
        observe = _OBSERVER.get()
        if observe is not None:
            observe(node, args)
        op, sizes = node.op, self.sizes
        if op is Op.INPUT:
            return env[node.arg]
        if op is Op.CONST:
            return np.float64(node.arg), ()
        if op is Op.IOTA:
            return np.arange(sizes[node.arg], dtype=np.float64), node.axes
        if op is Op.SIZE:
            return np.float64(sizes[node.arg]), ()
        if op in UNARY or op in BINARY or op is Op.WHERE:
            axes = _loop_axes(args) + node.axes
            arrs = [align(v, axes) for v in args]
            with np.errstate(all="ignore"):
                if op in UNARY:
                    out = UNARY[op](arrs[0])
                elif op in BINARY:
                    out = BINARY[op](*arrs)
                else:
                    out = np.where(*arrs)
            # broadcasting may leave size-1 axes: give every value its full shape
            return _contiguous(_full(out, axes, sizes, self.loops)), axes
        if op is Op.GATHER:
            return _gather(node, args, sizes)
        (x,) = args
        arr, axes = x
        if op is Op.SUM or op is Op.REDUCE_MAX:
            i = axes.index(node.arg)
            fn = np.sum if op is Op.SUM else np.max
            return fn(arr, axis=i), axes[:i] + axes[i + 1:]
        if op is Op.RENAME:
            mapping = dict(node.arg)
            return arr, tuple(mapping.get(a, a) for a in axes)
        if op is Op.SELECT:
            axis, index = node.arg
            i = axes.index(axis)
            return np.take(arr, index, axis=i), axes[:i] + axes[i + 1:]
        if op is Op.SLICE:
            axis, new_axis, parts, index = node.arg
            start, stop = _block(sizes, axis, parts, index)
            i = axes.index(axis)
            sl = [slice(None)] * arr.ndim
            sl[i] = slice(start, stop)
            return arr[tuple(sl)], tuple(new_axis if a == axis else a for a in axes)
        if op is Op.PAD:
            axis, new_axis, parts, index = node.arg
            start, stop = _block(sizes, axis, parts, index)
            i = axes.index(new_axis)
            shape = list(arr.shape)
            shape[i] = sizes[axis]
            out = np.zeros(shape, dtype=arr.dtype)
            sl = [slice(None)] * arr.ndim
            sl[i] = slice(start, stop)
            out[tuple(sl)] = arr
            return out, tuple(axis if a == new_axis else a for a in axes)
        if op is Op.EXPAND:
            target = _loop_axes([x]) + node.axes
            return _contiguous(_full(align(x, target), target, sizes, self.loops)), target
        raise NotImplementedError(f"interpreter: no rule for {op}")


def _gather(node: Node, args: list[Value], sizes: dict[str, int]) -> Value:
    """``source[..., clamp(index, 0, n - 1), ...]`` along `node.arg`, per value of the index's loop axes
    (which lead the result, then the source's other axes)."""
    (arr, axes), (index, index_axes) = args
    if any(a.startswith("~") for a in axes):
        raise NotImplementedError("interpreter: a gather's source varies over the loops")
    i = axes.index(node.arg)
    n = arr.shape[i]
    pos = np.clip(np.rint(np.asarray(index, dtype=np.float64)), 0, n - 1).astype(np.int64)
    out = np.moveaxis(arr, i, 0)[pos]  # index's shape, then the source's other axes
    return _contiguous(out), index_axes + axes[:i] + axes[i + 1:]


def _block(sizes: dict[str, int], axis: str, parts: tuple[str, ...], index: int) -> tuple[int, int]:
    """[start, stop) of block `index` when `axis` is cut into blocks sized like `parts`."""
    total = sum(sizes[p] for p in parts)
    if total != sizes[axis]:
        raise ValueError(f"axis {axis!r} has size {sizes[axis]} but is split into {list(parts)} "
                         f"of total size {total}")
    start = sum(sizes[p] for p in parts[:index])
    return start, start + sizes[parts[index]]


def _at(value: Value, t: int) -> Value:
    arr, axes = value
    if axes and axes[0] == "~t":
        return arr[t], axes[1:]
    return value


def run_recurrence(program: Recurrence, seqs: dict[str, np.ndarray], params: dict[str, np.ndarray],
                   initial: dict[str, np.ndarray], sizes: dict[str, int], length: int
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Run `program` over `length` steps.

    seqs[name]: (L, *decl.axes); params[name]: decl.axes; initial[name]: state axes (float64).
    Returns (outputs: name -> (L, *node.axes), final states: name -> state axes).
    """
    ev = Evaluator(sizes, {"~t": length})
    nodes = program.nodes()
    state_names = {s.name for s in program.states}
    stateful = depending_on(nodes, state_names)
    free = [n for n in nodes if n not in stateful]

    env: dict[str, Value] = {d.name: (seqs[d.name], ("~t", *d.axes)) for d in program.seqs}
    env.update({d.name: (params[d.name], d.axes) for d in program.params})
    hoisted = dict(zip(free, ev.run(free, env)))
    frontier = {a for n in stateful for a in n.args if a not in stateful}
    frontier.update(r for r in program.roots if r not in stateful)

    carry = {s.name: (initial[s.name], s.axes) for s in program.states}
    outs = {name: np.empty((length, *(sizes[a] for a in y.axes))) for name, y in program.outputs}
    steps = range(length - 1, -1, -1) if program.reverse else range(length)
    step_nodes = [n for n in nodes if n in stateful]  # topological order
    for t in steps:
        memo = {n: _at(hoisted[n], t) for n in frontier}
        for n in step_nodes:
            memo[n] = ev.eval_node(n, [memo[a] for a in n.args], carry)
        values = [memo[r] for r in program.roots]
        for (name, y), v in zip(program.outputs, values[len(program.updates):]):
            outs[name][t] = align(v, y.axes)
        carry = {s.name: (align(v, s.axes), s.axes) for s, v in zip(program.states, values)}
    finals = {name: _contiguous(_full(v[0], v[1], sizes, {})) for name, v in carry.items()}
    return outs, finals


def _inputs(program: Attention, params: dict[str, np.ndarray], lq: int, lk: int) -> dict[str, Value]:
    """The params by their axes and the sequences (L, *axes) as (t, *axes), of q's and k's length."""
    env = {d.name: (params[d.name], d.axes) for d in program.params}
    for d in program.seqs:
        arr = np.asarray(params[d.name], dtype=np.float64)
        if arr.shape[0] != lq or lq != lk:
            raise ValueError(f"sequence {d.name!r} has {arr.shape[0]} positions; it takes one per position of "
                             f"q and k, which need the same length (here {lq} and {lk})")
        env[d.name] = (arr, (TIME, *d.axes))
    return env


def run_attention(program: Attention, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  params: dict[str, np.ndarray], sizes: dict[str, int],
                  q_offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """q: (Lq, *batch, d), k: (Lk, *batch, d), v: (Lk, *batch, e), float64; `params` also holds the
    sequences, (L, *decl.axes) (L = Lq = Lk); the queries' positions
    (q_idx) start at `q_offset` (a decode step's one query sits at the cache's length).

    Returns (out: (Lq, *batch, e), lse: (Lq, *batch)), the log-sum-exp of each row's scores
    (-inf for a row whose keys are all masked; its output is 0).
    """
    lq, lk = q.shape[0], k.shape[0]
    batch = program.batch_axes
    scale = program.scale if program.scale is not None else 1.0 / math.sqrt(sizes[program.head_dim])
    scores = scale * np.einsum("i...d,j...d->ij...", q, k)  # (~q, ~k, *batch)
    ev = Evaluator(sizes, {"~q": lq, "~k": lk})
    env: dict[str, Value] = {
        "score": (scores, ("~q", "~k", *batch)),
        "q_idx": (np.arange(q_offset, q_offset + lq, dtype=np.float64), ("~q",)),
        "kv_idx": (np.arange(lk, dtype=np.float64), ("~k",)),
    }
    env.update(_inputs(program, params, lq, lk))
    target = ("~q", "~k", *batch)
    if program.score is not None:
        (s,) = ev.run([program.score], env)
        scores = np.broadcast_to(align(s, target), scores.shape)
    if program.mask is not None:
        (m,) = ev.run([program.mask], env)
        scores = np.where(np.broadcast_to(align(m, target), scores.shape), scores, -np.inf)
    row_max = scores.max(axis=1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(scores - row_max)
    denom = p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.log(denom[:, 0]) + row_max[:, 0]
        p = np.where(denom > 0, p / np.where(denom > 0, denom, 1.0), 0.0)
    out = np.einsum("ij...,j...e->i...e", p, v)
    return out, lse


def run_attention_backward(backward, q: np.ndarray, k: np.ndarray, v: np.ndarray, params: dict[str, np.ndarray],
                           sizes: dict[str, int], d_out: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of q, k, v and the params (FlashAttention's backward; see passes/attention_grad).

    Shapes as in `run_attention`; d_out: (Lq, *batch, e). Returns {"q", "k", "v", param names}.
    """
    program = backward.forward
    batch = program.batch_axes
    lq, lk = q.shape[0], k.shape[0]
    scale = program.scale if program.scale is not None else 1.0 / math.sqrt(sizes[program.head_dim])
    out, lse = run_attention(program, q, k, v, params, sizes)
    raw = scale * np.einsum("i...d,j...d->ij...", q, k)
    ev = Evaluator(sizes, {"~q": lq, "~k": lk})
    target = ("~q", "~k", *batch)
    env: dict[str, Value] = {
        "score": (raw, target),
        "q_idx": (np.arange(lq, dtype=np.float64), ("~q",)),
        "kv_idx": (np.arange(lk, dtype=np.float64), ("~k",)),
    }
    env.update(_inputs(program, params, lq, lk))
    mod = raw if program.score is None else np.broadcast_to(align(ev.run([program.score], env)[0], target), raw.shape)
    visible = np.ones(raw.shape, bool)
    if program.mask is not None:
        visible = np.broadcast_to(align(ev.run([program.mask], env)[0], target), raw.shape)
    finite = np.isfinite(lse)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(visible & finite, np.exp(mod - np.where(finite, lse[:, None], 0.0)), 0.0)
    d_v = np.einsum("ij...,i...e->j...e", p, d_out)
    d_p = np.einsum("i...e,j...e->ij...", d_out, v)
    d_mod = p * (d_p - np.einsum("i...e,i...e->i...", d_out, out)[:, None])
    env["grad_score"] = (d_mod, target)
    roots = [backward.d_score] + [g for _, g in backward.param_grads]
    values = ev.run(roots, env)
    d_s = np.broadcast_to(align(values[0], target), raw.shape)
    grads = {
        "q": scale * np.einsum("ij...,j...d->i...d", d_s, k),
        "k": scale * np.einsum("ij...,i...d->j...d", d_s, q),
        "v": d_v,
    }
    for (name, _), (arr, axes), d in zip(backward.param_grads, values[1:], program.params):
        for loop, n in (("~q", lq), ("~k", lk)):  # sum over (i, j); constant along a missing one
            if loop in axes:
                arr, axes = arr.sum(axis=axes.index(loop)), tuple(a for a in axes if a != loop)
            else:
                arr = arr * n
        grads[name] = _contiguous(np.broadcast_to(align((arr, axes), d.axes), [sizes[a] for a in d.axes]))
    return grads
