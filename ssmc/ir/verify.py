"""The verifier: invariants every program must hold, checked after tracing and after every pass.

A violation is a `SpecError` at the line that built the offending node: `locs` (from the frontend)
maps nodes to the lines of the spec being defined, since an interned node's own `loc` is the line
of its first build, which may belong to another spec.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import Loc, SpecError
from .axes import format_axes
from .node import BOOL, Node, toposort
from .ops import LOGICAL, Op
from .program import Decl, Recurrence


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
    verify_nodes(program.roots, decls, set(program.static_sizes), program, locs)


def _loc(node: Node, locs: Mapping[Node, Loc] | None) -> Loc | None:
    return (locs or {}).get(node) or node.loc


def verify_nodes(roots, decls: dict[str, Decl], static: set[str], where,
                 locs: Mapping[Node, Loc] | None = None) -> None:
    """Node-level checks shared by every program kind."""
    bound = set(static)
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
            if d.axes != node.axes:
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


def _check_types(node: Node, loc) -> None:
    if node.op is Op.POW and node.args[1].op is not Op.CONST:
        raise SpecError("power by a tensor is not supported: the exponent must be a constant", loc)
    if node.op is Op.WHERE and node.args[0].dtype != BOOL:
        raise SpecError("the condition of where(cond, a, b) must be boolean (a comparison like x > 0)", loc)
    if node.op in LOGICAL and any(a.dtype != BOOL for a in node.args):
        raise SpecError(f"logical {node.op.value} needs boolean operands (comparisons)", loc)
