"""A readable listing of a program: one line per node, SSA style, with axes.

    recurrence hgrn (examples/hgrn.py:14)
      state h [b d]
      seq   x [b d], f [b d]
      %0 [b d] = sigmoid f
      %1 [b d] = %0 * h
      ...
      h <- %4
      y  = %4
"""

from __future__ import annotations

from .axes import TIME, format_axes
from .node import Node, toposort
from .ops import INFIX, Op
from .program import Attention, Recurrence, Role


def _operand(node: Node, names: dict[Node, str]) -> str:
    return names[node]


def _leaf_name(node: Node) -> str | None:
    if node.op is Op.INPUT:
        return node.arg
    if node.op is Op.CONST:
        v = node.arg
        return repr(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)
    return None


def _describe(node: Node, names: dict[Node, str]) -> str:
    a = [_operand(x, names) for x in node.args]
    op = node.op
    if op in INFIX:
        return f"{a[0]} {INFIX[op]} {a[1]}"
    if op is Op.IOTA:
        return f"iota {node.arg}"
    if op is Op.SIZE:
        return f"size {node.arg}"
    if op in (Op.SUM, Op.REDUCE_MAX):
        return f"{'sum' if op is Op.SUM else 'max'} {a[0]} over {node.arg}"
    if op is Op.RENAME:
        return f"rename {a[0]} " + ", ".join(f"{o}->{n}" for o, n in node.arg)
    if op is Op.SELECT:
        return f"{a[0]}[{node.arg[0]}={node.arg[1]}]"
    if op is Op.SLICE:
        axis, new, parts, i = node.arg
        return f"split {a[0]} {axis} into {' '.join(parts)} #{i} as {new}"
    if op is Op.PAD:
        axis, new, parts, i = node.arg
        return f"pad {a[0]} {new} as block #{i} of {axis} ({' '.join(parts)})"
    if op is Op.EXPAND:
        return f"broadcast {a[0]} to {format_axes(node.arg)}"
    if op is Op.GATHER:
        return f"{a[0]}[{node.arg}={a[1]}]" + ("" if node.arg == TIME else " (clamped)")
    return f"{op.value} " + " ".join(a)


def format_nodes(roots, indent: str = "  ") -> tuple[list[str], dict[Node, str]]:
    """Lines for every interior node reachable from `roots`, and the name given to each node."""
    names: dict[Node, str] = {}
    lines: list[str] = []
    for node in toposort(roots):
        leaf = _leaf_name(node)
        if leaf is not None:
            names[node] = leaf
            continue
        names[node] = f"%{len(lines)}"
        lines.append(f"{indent}{names[node]:>4} {format_axes(node.axes):<12} = {_describe(node, names)}")
    return lines, names


def format_recurrence(p: Recurrence) -> str:
    head = f"recurrence {p.name}" + (" (reverse time)" if p.reverse else "") + (f"  ({p.loc})" if p.loc else "")
    out = [head]
    for role in (Role.STATE, Role.SEQ, Role.PARAM):
        ds = [d for d in p.decls if d.role is role]
        if ds:
            out.append(f"  {role.value:<6}" + ", ".join(f"{d.name} {format_axes(d.axes)}" for d in ds))
    if p.sizes:
        out.append("  sizes " + ", ".join(f"{a}={n}" for a, n in p.sizes))
    lines, names = format_nodes(p.roots)
    out.extend(lines)
    for s, u in zip(p.states, p.updates):
        out.append(f"  {s.name} <- {names[u]}")
    for name, y in p.outputs:
        out.append(f"  {name} = {names[y]}")
    return "\n".join(out)


def format_attention(p: Attention) -> str:
    out = [f"attention {p.name}" + (f"  ({p.loc})" if p.loc else ""),
           f"  q, k {format_axes(p.q_axes)} + time;  v {format_axes(p.v_axes)} + time",
           f"  scale {'1/sqrt(' + p.head_dim + ')' if p.scale is None else p.scale}"]
    if p.params:
        out.append("  param " + ", ".join(f"{d.name} {format_axes(d.axes)}" for d in p.params))
    if p.seqs:
        out.append("  seq   " + ", ".join(f"{d.name} {format_axes(d.axes)} + time" for d in p.seqs))
    roots = [n for n in (p.score, p.mask) if n is not None]
    lines, names = format_nodes(roots)
    out.extend(lines)
    out.append(f"  score = {names[p.score] if p.score is not None else 'score (unmodified)'}")
    out.append(f"  mask  = {names[p.mask] if p.mask is not None else 'none'}")
    return "\n".join(out)


def format_program(p) -> str:
    return format_attention(p) if isinstance(p, Attention) else format_recurrence(p)
