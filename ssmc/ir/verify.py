"""The verifier: invariants every program must hold, checked after tracing and after every pass.

A violation is a `SpecError` at the line that built the offending node: `locs` (from the frontend)
maps nodes to the lines of the spec being defined, since an interned node's own `loc` is the line
of its first build, which may belong to another spec.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import Loc, SpecError
from .axes import TIME, format_axes
from .node import BOOL, Node, toposort
from .ops import LOGICAL, Op
from .program import Decl, Recurrence, Role


def verify(program: Recurrence, locs: Mapping[Node, Loc] | None = None) -> None:
    decls = {d.name: d for d in program.decls}
    if len(decls) != len(program.decls):
        raise SpecError(f"{program.name}: two inputs share a name", program.loc)
    if len(program.updates) != len(program.states):
        raise SpecError(f"{program.name}: {len(program.updates)} updates for {len(program.states)} states",
                        program.loc)
    names = [n for n, _ in program.outputs]
    if len(set(names)) != len(names):
        raise SpecError(f"{program.name}: two outputs share a name ({names})", program.loc)
    for state, update in zip(program.states, program.updates):
        if not set(update.axes) <= set(state.axes):
            raise SpecError(f"new value of state {state.name!r} has axes {format_axes(update.axes)} outside "
                            f"{format_axes(state.axes)}", _loc(update, locs) or program.loc)
    for node in program.nodes():
        if node.op is Op.GATHER:
            raise SpecError("indexing a tensor (x[i], x.take) is for ssmc.attention's score_mod / mask_mod only",
                            _loc(node, locs) or program.loc)
    verify_nodes(program.roots, decls, set(program.static_sizes), program, locs)


def _loc(node: Node, locs: Mapping[Node, Loc] | None) -> Loc | None:
    return (locs or {}).get(node) or node.loc


def verify_nodes(roots, decls: dict[str, Decl], static: set[str], where,
                 locs: Mapping[Node, Loc] | None = None) -> None:
    """Node-level checks shared by every program kind."""
    bound = set(static) | {TIME}  # only attention's sequence leaves have the time axis
    for d in decls.values():
        bound.update(d.axes)
    nodes = toposort(roots)
    for node in nodes:  # a renamed axis has the size of the axis it renames
        if node.op is Op.RENAME:
            bound.update(new for old, new in node.arg if old in bound)
    for node in nodes:
        loc = _loc(node, locs) or getattr(where, "loc", None)
        if node.op is Op.INPUT:
            d = decls.get(node.arg)
            if d is None:
                raise SpecError(f"input {node.arg!r} is not declared", loc)
            if d.axes != node.axes and not (d.role is Role.SEQ and node.axes == (TIME, *d.axes)):
                raise SpecError(f"input {node.arg!r} used with axes {format_axes(node.axes)}, declared "
                                f"{format_axes(d.axes)}", loc)
        unbound = [a for a in _axes_needing_size(node) if a not in bound]
        if unbound:
            raise SpecError(f"axis {unbound[0]!r} is not an axis of any input, so its size is unknown "
                            f"(in the {node.op.value} node {format_axes(node.axes)})", loc)
        _check_types(node, loc)


def _axes_needing_size(node: Node):
    yield from node.axes
    if node.op in (Op.SLICE, Op.PAD):
        yield from node.arg[2]


# ops an integer index may be built with (values stay whole numbers), besides where and the views
_INTEGER_OPS = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.NEG, Op.ABS, Op.MAX, Op.MIN, Op.SIGN})


def _integer(node: Node) -> str | None:
    """None where `node` takes only whole-number values (an expression of q_idx, kv_idx, sequence reads,
    whole constants, sizes and positions by + - * abs min max sign where); else what makes it not so."""
    memo: dict[Node, str | None] = {}
    for n in toposort([node]):
        if n.dtype == BOOL:
            memo[n] = None  # a where's condition: any comparison
        elif n.op is Op.INPUT:
            memo[n] = None if n.arg in ("q_idx", "kv_idx") else f"input {n.arg!r} (a float)"
        elif n.op is Op.CONST:
            memo[n] = None if float(n.arg).is_integer() else f"the constant {n.arg!r}"
        elif n.op in (Op.SIZE, Op.IOTA):
            memo[n] = None
        elif n.op is Op.GATHER:  # a sequence's ids are whole numbers; a table's entries are floats
            memo[n] = None if n.arg == TIME else f"an entry of table {getattr(n.args[0], 'arg', '?')!r}"
        elif n.op in _INTEGER_OPS or n.op in (Op.WHERE, Op.RENAME, Op.EXPAND):
            memo[n] = next((memo[a] for a in n.args if memo[a] is not None), None)
        else:
            memo[n] = f"a {n.op.value}"
    return memo[node]


def _check_gather(node: Node, loc) -> None:
    source, index = node.args
    if source.op is not Op.INPUT:
        raise SpecError("only a declared input can be indexed (an ssmc.Param table, or an ssmc.Seq at q_idx or "
                        f"kv_idx), not a computed {source.op.value} value", loc)
    if node.arg == TIME:
        if not (index.op is Op.INPUT and index.arg in ("q_idx", "kv_idx")):
            raise SpecError(f"sequence {source.arg!r} is read at a query's or a key's own position: index it "
                            "with q_idx or kv_idx itself", loc)
        return
    why = _integer(index)
    if why is not None:
        raise SpecError(f"the index into {source.arg!r} must be an integer expression of q_idx and kv_idx "
                        f"(whole numbers, + - * abs min max clamp where), but it uses {why}", loc)


def _check_types(node: Node, loc) -> None:
    if node.op is Op.GATHER:
        _check_gather(node, loc)
    if node.op is Op.POW and node.args[1].op is not Op.CONST:
        raise SpecError("power by a tensor is not supported: the exponent must be a constant", loc)
    if node.op is Op.WHERE and node.args[0].dtype != BOOL:
        raise SpecError("the condition of where(cond, a, b) must be boolean (a comparison like x > 0)", loc)
    if node.op in LOGICAL and any(a.dtype != BOOL for a in node.args):
        raise SpecError(f"logical {node.op.value} needs boolean operands (comparisons)", loc)
