"""Local derivatives of elementwise ops, derived by SymPy.

`partials(node)` gives, for each argument of an elementwise node, the IR of d node / d arg (or
None where it is identically zero). Each rule comes from differentiating the op's SymPy meaning
and simplifying; results are cached per op (and per constant operand, so ``x ** 3`` differentiates
to ``3 * x ** 2``, not to a symbolic power).

Conventions at non-smooth points, matching PyTorch: maximum / minimum split the gradient evenly
at ties, relu'(0) = 0, abs'(0) = 0; comparisons and logic have zero derivative; `where` routes
the gradient to the branch taken (structural rule in `autodiff`).
"""

from __future__ import annotations

from functools import cache

import sympy as sp

from ..ir.node import Node
from ..ir.ops import BOOL_RESULT, ELEMENTWISE, Op
from .symbolic import from_sympy, to_sympy

_ARGS = sp.symbols("x0 x1 x2", real=True)


@cache
def _rule(op: Op, consts: tuple[float | None, ...]) -> tuple[sp.Basic, ...]:
    """SymPy partials of `op` w.r.t. each argument; `consts[i]` fixes argument i to a number."""
    syms = [sp.Float(c) if c is not None and not float(c).is_integer() else
            (sp.Integer(int(c)) if c is not None else s) for s, c in zip(_ARGS, consts)]
    leaves = {}
    probe = [Node.make(Op.INPUT, (), f"x{i}", ()) for i in range(len(consts))]
    for node, s in zip(probe, syms):
        leaves[node] = s
    (expr,) = to_sympy([Node.make(op, probe)], leaves.get)
    out = []
    for s, c in zip(_ARGS, consts):
        out.append(sp.Integer(0) if c is not None else sp.simplify(sp.diff(expr, s)))
    return tuple(out)


def partials(node: Node) -> list[Node | None]:
    """IR of d node / d arg_i for each argument (None: zero) of an elementwise float node."""
    if node.op not in ELEMENTWISE or node.op is Op.WHERE:
        raise TypeError(f"partials: {node.op} has a structural rule")
    if node.op in BOOL_RESULT:
        return [None] * len(node.args)
    consts = tuple(a.arg if a.op is Op.CONST else None for a in node.args)
    rules = _rule(node.op, consts)
    symbols = {s: a for s, a in zip(_ARGS, node.args)}
    return [None if r == 0 else from_sympy(r, symbols) for r in rules]
