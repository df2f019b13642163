"""The elementwise math of a program as C statements, after SymPy common-subexpression elimination.

One statement per value the step must materialise (a reduction, rename, unbind or split, and
each update and output); the elementwise region feeding it is one C expression. Reductions are
written as calls like ``sum_over_n(r3)``: they are loops in a kernel, not scalar C.
"""

from __future__ import annotations

import sympy as sp

from ..ir.node import Node, toposort
from ..ir.ops import ELEMENTWISE, Op
from .symbolic import to_sympy


def _structural_call(node: Node, arg: str) -> str:
    op = node.op
    if op is Op.SUM:
        return f"sum_over_{node.arg}({arg})"
    if op is Op.REDUCE_MAX:
        return f"max_over_{node.arg}({arg})"
    if op is Op.RENAME:
        return f"rename_{'_'.join(f'{o}_to_{n}' for o, n in node.arg)}({arg})"
    if op is Op.SELECT:
        return f"{arg}[{node.arg[0]}={node.arg[1]}]"
    if op is Op.SLICE:
        return f"block_{node.arg[3]}_of_{node.arg[0]}({arg})"
    if op is Op.PAD:
        return f"pad_into_{node.arg[0]}({arg})"
    if op is Op.EXPAND:
        return arg
    raise TypeError(op)


def c_statements(named_roots: list[tuple[str, Node]]) -> str:
    """C for `named_roots` (name, node): statements in dependency order, common parts hoisted."""
    roots = [n for _, n in named_roots]
    symbols: dict[Node, sp.Symbol] = {}

    def leaf(node: Node):
        if node in symbols:
            return symbols[node]
        if node.op is Op.INPUT:
            return sp.Symbol(node.arg, real=True)
        if node.op is Op.IOTA:
            return sp.Symbol(f"index_{node.arg}", real=True)
        if node.op is Op.SIZE:
            return sp.Symbol(f"size_{node.arg}", real=True)
        return None

    statements: list[tuple[str, sp.Basic | str]] = []
    for node in toposort(roots):
        if node.op in ELEMENTWISE or node.op in (Op.INPUT, Op.CONST, Op.IOTA, Op.SIZE):
            continue
        (arg,) = node.args
        arg_expr = to_sympy([arg], leaf)[0]
        if isinstance(arg_expr, sp.Symbol):
            arg_name = str(arg_expr)
        else:
            arg_name = f"r{len(statements)}"
            statements.append((arg_name, arg_expr))
        name = f"r{len(statements)}"
        statements.append((name, _structural_call(node, arg_name)))
        symbols[node] = sp.Symbol(name, real=True)
    for name, node in named_roots:
        statements.append((name, to_sympy([node], leaf)[0]))

    exprs = [e for _, e in statements if not isinstance(e, str)]
    replacements, reduced = sp.cse(exprs, symbols=sp.numbered_symbols("c"))
    reduced_iter = iter(reduced)
    pending = dict(replacements)
    order = [s for s, _ in replacements]
    lines: list[str] = []

    def emit_needed(expr: sp.Basic):
        needed = {s for s in expr.free_symbols if s in pending}
        for s in order:  # cse gives replacements in dependency order
            if s in needed and s in pending:
                value = pending.pop(s)
                emit_needed(value)
                lines.append(f"float {s} = {_ccode(value)};")

    for name, e in statements:
        if isinstance(e, str):
            lines.append(f"float {name} = {e};")
            continue
        r = next(reduced_iter)
        emit_needed(r)
        lines.append(f"float {name} = {_ccode(r)};")
    return "\n".join(lines)


def _ccode(e: sp.Basic) -> str:
    return sp.ccode(e, allow_unknown_functions=True, standard="c99")
