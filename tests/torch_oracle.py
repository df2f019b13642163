"""An independent PyTorch evaluation of a recurrence's IR, so torch.autograd can check ssmc's gradients.

It shares nothing with ssmc's interpreter or autodiff: a plain loop over time, each node computed
with torch ops on tensors whose dimensions follow the node's axes.
"""

from __future__ import annotations

import math

import torch

from ssmc.ir.node import toposort
from ssmc.ir.ops import Op

UNARY = {
    Op.NEG: torch.neg, Op.EXP: torch.exp, Op.LOG: torch.log, Op.SQRT: torch.sqrt, Op.RSQRT: torch.rsqrt,
    Op.ABS: torch.abs, Op.SIGMOID: torch.sigmoid, Op.TANH: torch.tanh, Op.SOFTPLUS: torch.nn.functional.softplus,
    Op.SILU: torch.nn.functional.silu, Op.GELU: torch.nn.functional.gelu, Op.RELU: torch.relu,
    Op.ERF: torch.erf, Op.SIN: torch.sin, Op.COS: torch.cos, Op.TAN: torch.tan, Op.LOG1P: torch.log1p,
    Op.EXPM1: torch.expm1, Op.SIGN: torch.sign, Op.NOT: torch.logical_not,
}
BINARY = {
    Op.ADD: torch.add, Op.SUB: torch.sub, Op.MUL: torch.mul, Op.DIV: torch.div, Op.POW: torch.pow,
    Op.MAX: torch.maximum, Op.MIN: torch.minimum, Op.LT: torch.lt, Op.LE: torch.le, Op.GT: torch.gt,
    Op.GE: torch.ge, Op.EQ: torch.eq, Op.NE: torch.ne, Op.AND: torch.logical_and, Op.OR: torch.logical_or,
    Op.ATAN2: torch.atan2,
}


def _to(t: torch.Tensor, axes: tuple[str, ...], target: tuple[str, ...]) -> torch.Tensor:
    """`t` (dims named `axes`) permuted to `target` order with size-1 dims for missing axes."""
    present = [a for a in target if a in axes]
    t = t.permute(*[axes.index(a) for a in present]) if present else t
    shape = [t.shape[present.index(a)] if a in axes else 1 for a in target]
    return t.reshape(shape)


def _node(node, args, env, sizes):
    op = node.op
    if op is Op.INPUT:
        return env[node.arg]
    if op is Op.CONST:
        return torch.tensor(node.arg, dtype=torch.float64)
    if op is Op.IOTA:
        return torch.arange(sizes[node.arg], dtype=torch.float64)
    if op is Op.SIZE:
        return torch.tensor(float(sizes[node.arg]), dtype=torch.float64)
    if op in UNARY or op in BINARY or op is Op.WHERE:
        xs = [_to(x, a.axes, node.axes) for x, a in zip(args, node.args)]
        if op in UNARY:
            out = UNARY[op](xs[0])
        elif op in BINARY:
            out = BINARY[op](*xs)
        else:
            out = torch.where(*xs)
        return out.expand(torch.Size([sizes[a] for a in node.axes])) if node.axes else out
    (x,) = args
    axes = node.args[0].axes
    if op is Op.SUM:
        return x.sum(axes.index(node.arg))
    if op is Op.REDUCE_MAX:
        return x.amax(axes.index(node.arg))  # amax splits the gradient at ties, like ssmc
    if op is Op.RENAME:
        return x
    if op is Op.SELECT:
        return x.select(axes.index(node.arg[0]), node.arg[1])
    if op in (Op.SLICE, Op.PAD):
        axis, new_axis, parts, index = node.arg
        start = sum(sizes[p] for p in parts[:index])
        if op is Op.SLICE:
            return x.narrow(axes.index(axis), start, sizes[new_axis])
        dim = axes.index(new_axis)
        before = [0, 0] * (x.dim() - 1 - dim) + [start, sizes[axis] - start - sizes[new_axis]]
        return torch.nn.functional.pad(x, before)
    if op is Op.EXPAND:
        return _to(x, axes, node.axes).expand(torch.Size([sizes[a] for a in node.axes]))
    raise NotImplementedError(op)


def run(program, seqs: dict, params: dict, initial: dict, sizes: dict, length: int):
    """Outputs {name: (L, *axes)} and final states, as torch tensors (autograd-able)."""
    nodes = toposort(program.roots)
    carry = dict(initial)
    ys = {name: [] for name, _ in program.outputs}
    for t in range(length):
        env = {**carry, **params, **{k: v[t] for k, v in seqs.items()}}
        vals = {}
        for n in nodes:
            vals[n] = _node(n, [vals[a] for a in n.args], env, sizes)
        for name, y in program.outputs:
            ys[name].append(vals[y])
        carry = {s.name: _to(vals[u], u.axes, s.axes).expand(torch.Size([sizes[a] for a in s.axes]))
                 for s, u in zip(program.states, program.updates)}
    return {k: torch.stack(v) for k, v in ys.items()}, carry


def _evaluate(root, env: dict, sizes: dict) -> torch.Tensor:
    vals = {}
    for n in toposort([root]):
        vals[n] = _node(n, [vals[a] for a in n.args], env, sizes)
    return vals[root]


def attention(program, q, k, v, params: dict, sizes: dict):
    """Softmax attention with the program's score_mod / mask, one (query, key) pair at a time.

    q, k: (L, *batch, d), v: (L, *batch, e), time first. Small L only: it is a double loop.
    """
    batch = program.batch_axes
    scale = program.scale if program.scale is not None else 1.0 / math.sqrt(sizes[program.head_dim])
    rows = []
    for i in range(q.shape[0]):
        scores = []
        for j in range(k.shape[0]):
            s = scale * (q[i] * k[j]).sum(-1)  # batch axes
            env = {"score": s, "q_idx": torch.tensor(float(i), dtype=torch.float64),
                   "kv_idx": torch.tensor(float(j), dtype=torch.float64), **params}
            if program.score is not None:
                s = _to(_evaluate(program.score, env, sizes), program.score.axes, batch).expand(s.shape)
            if program.mask is not None:
                visible = _to(_evaluate(program.mask, env, sizes), program.mask.axes, batch).expand(s.shape)
                s = torch.where(visible, s, torch.tensor(float("-inf"), dtype=torch.float64))
            scores.append(s)
        p = torch.softmax(torch.stack(scores), dim=0)  # over keys
        rows.append(torch.einsum("j...,j...e->...e", p, v))
    return torch.stack(rows)
